"""Generation: settings -> generate() kwargs, batches of prompts, decoding each sequence, streaming."""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from .errors import GenerationError, PromptError, UsageError, one_line
from .logprobs import (
    decode_text,
    first_stop,
    mend_byte_end,
    score_prompts,
    step_logits,
    token_logprobs,
    token_texts,
)

if TYPE_CHECKING:
    from .loading import Loaded
    from .prompts import Prompt

# New tokens for --length -1 on a model without a fixed context: a bound, so that generation ends.
UNBOUNDED_LENGTH = 10000

# Their prepare_inputs_for_generation drops the attention mask, so padding would change the text: one at a time.
UNBATCHABLE_TYPES = {"xlnet", "xlm"}


# Settings fields whose flag (and the session's /set name) is the original script's shorter one.
FLAG_NAMES = {"top_k": "k", "top_p": "p"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """How to generate: the sampling flags and generation controls (frozen: dataclasses.replace)."""

    length: int = 20
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.9
    repetition_penalty: float = 1.0
    num_beams: int = 1
    num_return_sequences: int = 1
    stop_token: str | tuple[str, ...] | None = None  # several stop strings: a tuple (the earliest one cuts)
    chat: bool = False
    # Generation controls (rungen/controls.py)
    min_p: float | None = None
    typical_p: float | None = None
    no_repeat_ngram_size: int = 0
    logprobs: int | None = None  # top alternatives per token; None: no log-probabilities
    prompt_lookup_num_tokens: int | None = None
    thinking_budget: int | None = None  # a thinking reply's cap (rungen/reasoning.py Budget; the engine's only)
    generation_config: dict = dataclasses.field(default_factory=dict, hash=False)  # other generate() kwargs
    # --json_schema/--regex/--grammar compiled for the model's vocabulary (rungen/constrain.py); main() sets it.
    constraint: object = dataclasses.field(default=None, hash=False)

    def check(self) -> None:
        """Raises UsageError, named by the flag, for a setting out of range (the flags, or a session's /set)."""
        if self.top_k < 0:
            raise UsageError(f"--k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise UsageError(f"--temperature must be >= 0, got {self.temperature}")
        if self.num_return_sequences < 1:
            raise UsageError(f"--num_return_sequences must be >= 1, got {self.num_return_sequences}")
        if self.repetition_penalty <= 0:
            raise UsageError(f"--repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.num_beams < 1:
            raise UsageError(f"--num_beams must be >= 1, got {self.num_beams}")
        if self.num_beams > 1 and self.num_return_sequences > self.num_beams:
            raise UsageError("--num_return_sequences cannot exceed --num_beams in beam search")

    def fit_context(self, context: int) -> Settings:
        """These settings with --length clamped to a model's context (-1: as long as the context allows)."""
        return dataclasses.replace(self, length=adjust_length_to_model(self.length, max_sequence_length=context))


@dataclasses.dataclass
class Sequence:
    """One generated sequence; its fields (in this order) are the jsonl output's."""

    generated_text: str  # the continuation
    text: str  # what the text output prints: prompt + continuation (the reply alone with --chat)
    num_prompt_tokens: int
    num_generated_tokens: int
    finish_reason: str  # "length", "eos", "stop_token", "grammar" (a constrained sequence ended complete), or
    # "interrupted" (Ctrl-C)
    # Only with --logprobs (absent from the jsonl record otherwise): see rungen/logprobs.py.
    logprobs: dict | None = dataclasses.field(default=None, metadata={"omit_if_none": True})
    prompt_logprobs: dict | None = dataclasses.field(default=None, metadata={"omit_if_none": True})
    perplexity: float | None = dataclasses.field(default=None, metadata={"omit_if_none": True})


def adjust_length_to_model(length: int, max_sequence_length: int) -> int:
    """--length for a model of this context: at most the context, and -1 means all of it."""
    if length < 0 and max_sequence_length > 0:
        length = max_sequence_length
    elif 0 < max_sequence_length < length:
        length = max_sequence_length  # No generation bigger than model size
    elif length < 0:
        length = UNBOUNDED_LENGTH
    return length


def generation_kwargs(settings: Settings, tokenizer=None, pad_token_id: int | None = None) -> dict:
    """generate()'s keyword arguments for `settings`; `tokenizer` None: only `pad_token_id`, to check settings."""
    kwargs = dict(
        num_return_sequences=settings.num_return_sequences,
        repetition_penalty=settings.repetition_penalty,
        num_beams=settings.num_beams,
        pad_token_id=tokenizer.pad_token_id if tokenizer is not None else pad_token_id,
    )
    if settings.temperature == 0:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(do_sample=True, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
    if settings.stop_token:
        stops = settings.stop_token if isinstance(settings.stop_token, str) else list(settings.stop_token)
        kwargs.update(stop_strings=stops, tokenizer=tokenizer)
    kwargs.update(control_kwargs(settings))
    return {**settings.generation_config, **kwargs}  # the file's other keys; never one the tool sets


def control_kwargs(settings: Settings) -> dict:
    """generate() kwargs of the generation controls (samplers, n-gram blocking, prompt lookup, raw logits)."""
    kwargs = {}
    if settings.temperature != 0:  # sampling-only warpers (greedy would warn that they are unused)
        if settings.min_p is not None:
            kwargs.update(min_p=settings.min_p)
        if settings.typical_p is not None:
            kwargs.update(typical_p=settings.typical_p)
    if settings.no_repeat_ngram_size:
        kwargs.update(no_repeat_ngram_size=settings.no_repeat_ngram_size)
    if settings.prompt_lookup_num_tokens:
        kwargs.update(prompt_lookup_num_tokens=settings.prompt_lookup_num_tokens)
    if settings.logprobs is not None:
        kwargs.update(return_dict_in_generate=True, output_logits=True)
    return kwargs


def stop_strings(stop_token: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """--stop_token's value (None, one string, or several) as a tuple of non-empty strings."""
    stops = (stop_token,) if isinstance(stop_token, str) else tuple(stop_token or ())
    return tuple(stop for stop in stops if stop)


def one_at_a_time(settings: Settings, assistant_model) -> bool:
    """Modes transformers runs for one sequence only (assisted generation): then prompt by prompt."""
    extra = settings.generation_config
    return bool(assistant_model is not None or settings.prompt_lookup_num_tokens
                or extra.get("assistant_early_exit") or extra.get("use_mtp"))


def make_batches(prompts: list[Prompt], batch_size: int) -> Iterator[list[Prompt]]:
    """Batches of encoded prompts, similar lengths together within a window; windows keep input order."""
    window = batch_size * 4
    for start in range(0, len(prompts), window):
        chunk = sorted(prompts[start : start + window], key=lambda prompt: len(prompt.ids))
        for offset in range(0, len(chunk), batch_size):
            yield chunk[offset : offset + batch_size]


def generate_batch(loaded: Loaded, settings: Settings, batch: list[Prompt], streamer=None, stopping_criteria=None,
                   past_key_values=None) -> dict[int, list[Sequence]]:
    """Generates for a list of encoded Prompts; returns {prompt index: [Sequence, ...]} (--length 0: scores them).
    GenerationError when generate() refuses the settings. `past_key_values`, for one prompt: a cache of its first
    tokens, extended in place."""
    if settings.length == 0:
        return score_batch(loaded, settings, batch)
    assistant_model = getattr(loaded, "assistant_model", None)
    if len(batch) > 1 and one_at_a_time(settings, assistant_model):
        results = {}
        for prompt in batch:
            results.update(generate_batch(loaded, settings, [prompt], streamer, stopping_criteria))
        return results
    model, tokenizer = loaded.model, loaded.tokenizer
    inputs = tokenizer.pad({"input_ids": [prompt.ids for prompt in batch]}, return_tensors="pt")
    inputs = inputs.to(loaded.input_device)
    prompt_len = inputs["input_ids"].shape[1]
    new_tokens = settings.length if not loaded.context else min(settings.length, loaded.context - prompt_len)
    extra = {"assistant_model": assistant_model} if assistant_model is not None else {}
    if past_key_values is not None:
        extra["past_key_values"] = past_key_values
    if settings.constraint is not None:  # fresh per call: the processor follows these sequences
        from transformers import LogitsProcessorList, StoppingCriteriaList

        processor, grammar_stop = settings.constraint.processors()
        extra["logits_processor"] = LogitsProcessorList([processor])
        stopping_criteria = StoppingCriteriaList([*(stopping_criteria or []), grammar_stop])
    quiet_transformers_own_calls()
    try:
        with torch.inference_mode():
            output = model.generate(
                **inputs, max_new_tokens=new_tokens, streamer=streamer, stopping_criteria=stopping_criteria,
                **generation_kwargs(settings, tokenizer), **extra,
            )
    except ValueError as error:
        raise GenerationError(one_line(error)) from error
    except RuntimeError as error:  # the host's memory, or torch's limits, short of what the settings ask
        if not any(sign in str(error) for sign in CPU_OUT_OF_MEMORY):
            raise
        raise GenerationError(f"out of memory ({one_line(error)[:160]}); fit it with a smaller --batch_size, "
                              "--num_beams or --length") from error
    logits = getattr(output, "logits", None)  # with --logprobs, generate returns a ModelOutput
    if logits is not None:
        beam_indices, output = getattr(output, "beam_indices", None), output.sequences
    eos_ids = eos_token_ids(settings, model)

    results = {}
    for row, sequence in enumerate(output.tolist()):
        prompt = batch[row // settings.num_return_sequences]
        new = sequence[prompt_len:]
        try:
            described = describe_sequence(settings, tokenizer, prompt, new, eos_ids)
        except StuckError as error:  # that prompt fails (an error record), the others go on
            prompt.error = str(error)
            results[prompt.index] = []
            continue
        if prompt.error is not None:
            continue  # another sequence of this prompt was stuck
        if logits is not None:
            steps = [step_logits(logits, beam_indices, row, step) for step in range(described.num_generated_tokens)]
            described.logprobs = token_logprobs(tokenizer, prompt.ids, new, steps, settings.logprobs)
        results.setdefault(prompt.index, []).append(described)
    return results


def score_batch(loaded: Loaded, settings: Settings, batch: list[Prompt]) -> dict[int, list[Sequence]]:
    """--length 0: each prompt's tokens scored (a one-token prompt becomes an error record)."""
    if loaded.model_type in UNBATCHABLE_TYPES:
        raise GenerationError(f"--length 0: {loaded.model_type} does not predict tokens left to right; "
                              "scoring needs a causal LM")
    results = {}
    for prompt, score in zip(batch, score_prompts(loaded, batch, settings.logprobs)):
        if score is None:
            prompt.error = "the prompt is one token: nothing to score"
            results[prompt.index] = []
            continue
        text = "" if settings.chat or prompt.messages is not None else prompt.text  # as describe_sequence's
        sequence = Sequence("", text, len(prompt.ids), 0, "length", prompt_logprobs=score[0], perplexity=score[1])
        results[prompt.index] = [sequence]
    return results


class StuckError(PromptError):
    """A constrained sequence reached a point its vocabulary cannot spell (rungen/constrain.py)."""


# --generation_config keys that ban tokens outright, as --no_repeat_ngram_size does.
BANNING_KEYS = ("bad_words_ids", "suppress_tokens", "begin_suppress_tokens")


def stuck_error(settings: Settings, tokenizer, accepted: list[int]) -> StuckError:
    """The error of a constrained sequence whose grammar allows no token of the vocabulary after `accepted`."""
    spelled = tokenizer.decode(accepted, skip_special_tokens=True)
    banning = [f"--no_repeat_ngram_size {settings.no_repeat_ngram_size}"] if settings.no_repeat_ngram_size else []
    banning += [key for key in BANNING_KEYS if settings.generation_config.get(key)]
    if banning:  # a ban applied with the grammar's mask can leave nothing: the vocabulary is not to blame
        return StuckError(f"{settings.constraint.flag}: every token the grammar allows after {spelled!r} is banned by "
                          f"{' or '.join(banning)}, or the vocabulary has none")
    return StuckError(f"{settings.constraint.flag}: the model's vocabulary has no token to continue {spelled!r} "
                      "as the grammar requires")


def eos_token_ids(settings: Settings, model) -> set[int]:
    """The ids that end a sequence: the model's EOS (one or several), or --generation_config's."""
    eos_ids = settings.generation_config.get("eos_token_id", model.generation_config.eos_token_id)
    return set(eos_ids if isinstance(eos_ids, list) else [eos_ids] if eos_ids is not None else [])


def reply_kept(tokenizer, prompt: Prompt) -> frozenset:
    """The special tokens a chat reply's text keeps to be read: its thinking block's delimiters and its tool
    format's markers (rungen.reasoning, rungen.tools)."""
    kept = prompt.reply.kept if prompt.reply is not None else frozenset()
    return kept | prompt.tool_plan.kept(tokenizer) if prompt.tool_plan is not None else kept


def reply_markers(tokenizer, prompt: Prompt) -> tuple[str, ...]:
    """What a stop string may not cut into: the thinking block's delimiters and the tool format's special tokens
    (which other servers' text has not: a stop string is no piece of one)."""
    delimiters = prompt.reply.delimiters.texts if prompt.reply is not None else ()
    tools = token_texts(tokenizer, prompt.tool_plan.kept(tokenizer)) if prompt.tool_plan is not None else ()
    return delimiters + tools


def describe_sequence(settings: Settings, tokenizer, prompt: Prompt, new: list[int], eos_ids: set[int]) -> Sequence:
    """Decodes one sequence the way the original script does and says why it ended."""
    finish, produced = "length", len(new)
    for position, token in enumerate(new):
        if token in eos_ids:
            finish, produced = "eos", position + 1
            break
    if settings.constraint is not None:
        ended, stuck = settings.constraint.follow(new)
        if ended is not None:  # where the grammar ended: at EOS, or without one at completion (padding follows)
            finish, produced = "grammar", ended
        elif stuck is not None:
            raise stuck_error(settings, tokenizer, new[:stuck])
    # Decoded with the prompt, then cut: the continuation alone loses a SentencePiece leading space. The EOS that
    # ends it is none of its text (a file's end-of-turn token need not be a special one).
    shown = produced - 1 if produced and new[produced - 1] in eos_ids else produced
    kept = reply_kept(tokenizer, prompt)
    head = decode_text(tokenizer, prompt.ids, kept)
    whole = mend_byte_end(tokenizer, prompt.ids + new[:shown], decode_text(tokenizer, prompt.ids + new[:shown], kept),
                          shown, kept)
    continuation = whole[len(head) :] if whole.startswith(head) else decode_text(tokenizer, new[:shown], kept)
    found = first_stop(continuation, stop_strings(settings.stop_token), reply_markers(tokenizer, prompt))
    if found:
        continuation = continuation[: found[0]]  # the earliest stop string
        finish = "stop_token"
        while produced and new[produced - 1] == tokenizer.pad_token_id:
            produced -= 1  # a stop-string finish is padded afterwards
    # With a chat template the reply answers the prompt rather than continuing it.
    text = continuation if settings.chat or prompt.messages is not None else prompt.text + continuation
    return Sequence(continuation, text, len(prompt.ids), produced, finish)


# How torch says a CPU allocation, or a draw over more categories than it takes, could not be made.
CPU_OUT_OF_MEMORY = ("DefaultCPUAllocator: can't allocate memory", "alloc_cpu.cpp",
                     "number of categories cannot exceed")

# transformers' warnings about its own calls, not the user's, by the logger that writes each: assisted decoding
# passes the assistant model a generation_config beside arguments; XLNet's unbounded positions (-1) count as
# exceeded at every step; a tokenizer's model_max_length is not the context the tool checks prompts against.
TRANSFORMERS_OWN_CALLS = {
    "transformers.generation.utils": "Passing `generation_config` together with generation-related arguments",
    "transformers.generation.stopping_criteria": "This is a friendly reminder - the current text generation call "
                                                 "has exceeded the model's predefined maximum length (-1)",
    "transformers.tokenization_utils_base": "Token indices sequence length is longer than the specified maximum "
                                            "sequence length",
    # Llama 4 Scout's published llama3 rotary: a step at its original context (equal factors), computed as it says.
    "transformers.modeling_rope_utils": "`rope_parameters`'s high_freq_factor field must be greater than "
                                        "low_freq_factor, got high_freq_factor=1.0 and low_freq_factor=1.0",
}


class _OwnCall(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record):
        return not record.getMessage().startswith(self.prefix)


def quiet_transformers_own_calls() -> None:
    """Drops TRANSFORMERS_OWN_CALLS where they are logged (whichever handlers would show them; transformers need
    not be imported yet)."""
    for name, prefix in TRANSFORMERS_OWN_CALLS.items():
        library_logger = logging.getLogger(name)
        if not any(isinstance(existing, _OwnCall) for existing in library_logger.filters):
            library_logger.addFilter(_OwnCall(prefix))


def mark_interrupted(results: dict[int, list[Sequence]], length: int) -> None:
    """generate()'s sequences that Ctrl-C stopped (rungen/interrupt.py): those that would say "length" short of
    `length` new tokens say "interrupted"."""
    for sequences in results.values():
        for sequence in sequences:
            if sequence.finish_reason == "length" and sequence.num_generated_tokens < length:
                sequence.finish_reason = "interrupted"


def __getattr__(name: str):
    # Made on first use, so that importing this module does not import transformers.
    if name == "StopTokenStreamer":
        return _stop_token_streamer()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class KeptDecoder:
    """A tokenizer's decode for transformers' TextStreamer that keeps the special tokens `kept` (decode_text)."""

    def __init__(self, tokenizer, kept: frozenset):
        self.tokenizer, self.kept = tokenizer, kept

    def decode(self, ids, **_):
        return decode_text(self.tokenizer, list(ids), self.kept)


@functools.cache
def _stop_token_streamer() -> type:
    from transformers import TextStreamer

    class StopTokenStreamer(TextStreamer):
        """The library's streamer, writing to our stdout and cutting the text at the earliest --stop_token."""

        def __init__(self, tokenizer, stop_token: str | tuple[str, ...] | None, kept: frozenset = frozenset()):
            # `kept`: special tokens the text keeps (reply_kept), as the sequence's own text keeps them
            super().__init__(KeptDecoder(tokenizer, kept) if kept else tokenizer, skip_prompt=True,
                             skip_special_tokens=True)
            self.stop_token, self.text, self.stopped = stop_token, "", False

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if not self.stopped:
                printed = len(self.text)
                self.text += text
                cuts = [self.text.index(stop) for stop in stop_strings(self.stop_token) if stop in self.text]
                if cuts:
                    text = text[: max(0, min(cuts) - printed)]  # what is printed already stays printed
                    self.stopped = True
                sys.stdout.write(text)
            if stream_end:
                sys.stdout.write("\n")
            sys.stdout.flush()

    StopTokenStreamer.__module__ = __name__
    return StopTokenStreamer
