"""Generation: settings -> generate() kwargs, batches of prompts, decoding each sequence, streaming."""

import dataclasses
import sys

import torch
from transformers import TextStreamer

MAX_LENGTH = 10000  # Hardcoded max length to avoid infinite loop

# Their prepare_inputs_for_generation drops the attention mask (and XLM the positions), so padding
# would change the text a prompt gets alone: they generate one prompt at a time.
UNBATCHABLE_TYPES = {"xlnet", "xlm"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """How to generate: the seed's sampling flags. Frozen, so a change is a new value (replace())."""

    length: int = 20
    temperature: float = 1.0
    k: int = 0
    p: float = 0.9
    repetition_penalty: float = 1.0
    num_beams: int = 1
    num_return_sequences: int = 1
    stop_token: str | None = None
    chat: bool = False

    @classmethod
    def from_args(cls, args, context):
        names = {field.name for field in dataclasses.fields(cls)}
        values = {name: getattr(args, name) for name in names}
        length = adjust_length_to_model(args.length, max_sequence_length=context)
        return cls(**dict(values, length=length, chat=bool(args.chat)))  # --chat's None (auto) is off here


@dataclasses.dataclass
class Sequence:
    """One generated sequence; its fields (in this order) are the jsonl output's."""

    generated_text: str  # the continuation
    text: str  # what the text output prints: prompt + continuation (the reply alone with --chat)
    num_prompt_tokens: int
    num_generated_tokens: int
    finish_reason: str  # "length", "eos" or "stop_token"


def adjust_length_to_model(length, max_sequence_length):
    if length < 0 and max_sequence_length > 0:
        length = max_sequence_length
    elif 0 < max_sequence_length < length:
        length = max_sequence_length  # No generation bigger than model size
    elif length < 0:
        length = MAX_LENGTH  # avoid infinite loop
    return length


def generation_kwargs(settings, tokenizer):
    kwargs = dict(
        num_return_sequences=settings.num_return_sequences,
        repetition_penalty=settings.repetition_penalty,
        num_beams=settings.num_beams,
        pad_token_id=tokenizer.pad_token_id,
    )
    if settings.temperature == 0:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(do_sample=True, temperature=settings.temperature, top_k=settings.k, top_p=settings.p)
    if settings.stop_token:
        # Stops each sequence as soon as it has produced the stop token, instead of running to --length.
        kwargs.update(stop_strings=settings.stop_token, tokenizer=tokenizer)
    return kwargs


def make_batches(prompts, batch_size):
    """Batches of encoded prompts. Inside a window, similar lengths go together so that batches
    carry little padding; windows keep input order so output can flow early."""
    window = batch_size * 4
    for start in range(0, len(prompts), window):
        chunk = sorted(prompts[start : start + window], key=lambda prompt: len(prompt.ids))
        for offset in range(0, len(chunk), batch_size):
            yield chunk[offset : offset + batch_size]


def generate_batch(loaded, settings, batch, streamer=None, stopping_criteria=None):
    """Generates for a list of encoded Prompts; returns {prompt index: [Sequence, ...]}."""
    model, tokenizer = loaded.model, loaded.tokenizer
    inputs = tokenizer.pad({"input_ids": [prompt.ids for prompt in batch]}, return_tensors="pt")
    inputs = inputs.to(loaded.input_device)
    prompt_len = inputs["input_ids"].shape[1]
    new_tokens = settings.length if not loaded.context else min(settings.length, loaded.context - prompt_len)
    with torch.inference_mode():
        output = model.generate(
            **inputs, max_new_tokens=new_tokens, streamer=streamer, stopping_criteria=stopping_criteria,
            **generation_kwargs(settings, tokenizer),
        )
    eos_ids = model.generation_config.eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids] if eos_ids is not None else [])

    results = {}
    for row, sequence in enumerate(output.tolist()):
        prompt = batch[row // settings.num_return_sequences]
        new = sequence[prompt_len:]
        results.setdefault(prompt.index, []).append(describe_sequence(settings, tokenizer, prompt, new, eos_ids))
    return results


def describe_sequence(settings, tokenizer, prompt, new, eos_ids):
    """Decodes one sequence the way the seed does and says why it ended."""
    finish, produced = "length", len(new)
    for position, token in enumerate(new):
        if token in eos_ids:
            finish, produced = "eos", position + 1
            break
    # Decode prompt and continuation together and cut the prompt's text off, as the seed does:
    # decoding the continuation alone loses a SentencePiece tokenizer's leading space.
    head = tokenizer.decode(prompt.ids, skip_special_tokens=True)
    whole = tokenizer.decode(prompt.ids + new[:produced], skip_special_tokens=True)
    continuation = whole[len(head) :] if whole.startswith(head) else tokenizer.decode(new, skip_special_tokens=True)
    if settings.stop_token and settings.stop_token in continuation:
        continuation = continuation[: continuation.index(settings.stop_token)]
        finish = "stop_token"
        while produced and new[produced - 1] == tokenizer.pad_token_id:
            produced -= 1  # a stop-string finish is padded afterwards
    # With a chat template the reply answers the prompt rather than continuing it.
    text = continuation if settings.chat or prompt.messages is not None else prompt.text + continuation
    return Sequence(continuation, text, len(prompt.ids), produced, finish)


class StopTokenStreamer(TextStreamer):
    """The library's streamer, writing to our stdout and cutting the text at --stop_token."""

    def __init__(self, tokenizer, stop_token):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.stop_token, self.text, self.stopped = stop_token, "", False

    def on_finalized_text(self, text, stream_end=False):
        if not self.stopped:
            self.text += text
            if self.stop_token and self.stop_token in self.text:
                cut = self.text.index(self.stop_token)
                text = text[: len(text) - (len(self.text) - cut)]
                self.stopped = True
            sys.stdout.write(text)
        if stream_end:
            sys.stdout.write("\n")
        sys.stdout.flush()
