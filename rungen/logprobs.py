"""--logprobs: log-probabilities of generated tokens, and of a prompt's own tokens (scoring, --length 0).

Log-probabilities are log_softmax of the raw logits, before any logits processor (temperature, top-k...): what a
forward pass over the same tokens gives, whatever the sampling settings. The shape is OpenAI's chat completions':

    {"content": [{"token": " Paris", "id": 7042, "logprob": -0.31, "bytes": [32, 80, 97, 114, 105, 115],
                  "top_logprobs": [{"token": " Paris", "id": 7042, "logprob": -0.31, "bytes": [...]}, ...]}, ...]}
"""

from __future__ import annotations

import functools
import inspect
import math
import re

import torch

from .tool_xml import prefix_length

CONTEXT_TOKENS = 4  # ids decoded before a token to get its text in context (a leading space, a UTF-8 tail)


def decode_text(tokenizer, ids: list[int], kept: frozenset = frozenset()) -> str:
    """ids decoded without their special tokens, but for those in `kept` (a thinking block's delimiters where they are
    special tokens: without them the reply could not be split), each written as its name."""
    if kept.isdisjoint(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)
    parts, start = [], 0
    for end, token in enumerate(ids):
        if token in kept:
            parts += [tokenizer.decode(ids[start:end], skip_special_tokens=True),
                      tokenizer.decode([token], skip_special_tokens=False)]
            start = end + 1
    return "".join(parts) + tokenizer.decode(ids[start:], skip_special_tokens=True)


def first_stop(text: str, stops, markers=()) -> tuple[int, str] | None:
    """(where, which) of the earliest stop string in `text` (the first given of those found there), none that cuts
    into one of `markers`, the delimiters a chat reply's split drops ("final" is no stop in gpt-oss's final channel
    opening; "</think>" itself is one)."""
    spans = [(start, start + len(marker)) for marker in markers if marker for start in occurrences(text, marker)]
    for marker in markers:  # one the text may be writing: its start, at the end
        size = prefix_length(text, (marker,))
        if size:
            spans.append((len(text) - size, len(text) - size + len(marker)))
    best = None
    for stop in stops:
        for start in occurrences(text, stop):
            end = start + len(stop)
            if not any(left < end and start < right and not (start <= left and right <= end) for left, right in spans):
                if best is None or start < best[0]:
                    best = (start, stop)
                break
    return best


def occurrences(text: str, part: str):
    start = text.find(part)
    while start != -1:
        yield start
        start = text.find(part, start + 1)


def special_ids(tokenizer, texts) -> frozenset:
    """The special tokens among the tokens of `texts`: those a decode skipping special tokens drops (markers such as
    gpt-oss's <|channel|> or Mistral's [TOOL_CALLS], which the reply's text must keep to be read)."""
    ids = {token for text in texts if text for token in tokenizer.encode(text, add_special_tokens=False)}
    return frozenset(token for token in ids if not tokenizer.decode([token], skip_special_tokens=True)
                     and tokenizer.decode([token], skip_special_tokens=False))


def token_texts(tokenizer, ids) -> tuple[str, ...]:
    """Each token's text, special ones spelled (the markers a reply's text keeps)."""
    return tuple(sorted(tokenizer.decode([token], skip_special_tokens=False) for token in ids))


def from_a_character(tokenizer, ids: list[int], start: int, end: int, kept=frozenset()) -> tuple[int, str]:
    """(start, text): ids[start:end] decoded, `start` moved back by up to three tokens where the decoding would begin
    inside a character (SentencePiece's byte tokens: a run of them decoded from its middle is all U+FFFD, the valid
    bytes after the cut too)."""
    text = decode_text(tokenizer, ids[start:end], kept)
    for _ in range(3):
        if start == 0 or not text.startswith("\ufffd"):
            break
        start -= 1
        text = decode_text(tokenizer, ids[start:end], kept)
    return start, text


BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def mend_byte_end(tokenizer, ids: list[int], text: str, limit: int, kept: frozenset = frozenset()) -> str:
    """`text`, the decoding of `ids`, mended where SentencePiece byte tokens (among the last `limit`) hold invalid
    or unfinished UTF-8: tokenizers' ByteFallback makes such a run all U+FFFD, the valid bytes in it too (a
    newline's <0x0A> before an emoji's first bytes, a "7" after a stray byte); here each run's bytes decode as UTF-8
    does, a bad or unfinished sequence one U+FFFD. So a text reads the same whole as it did growing."""
    if "\ufffd" not in text or not limit:
        return text
    def byte_token(number):
        piece = tokenizer.convert_ids_to_tokens(ids[number])
        return isinstance(piece, str) and BYTE_TOKEN.fullmatch(piece) is not None

    first = len(ids) - limit
    runs, start = [], None
    for number in range(first, len(ids) + 1):
        if number < len(ids) and byte_token(number):
            start = number if start is None else start
        elif start is not None:
            while start > 0 and byte_token(start - 1):  # a run the decoder reads from before the mended ids
                start -= 1
            runs.append((start, number))
            start = None
    for start, end in reversed(runs):  # the text before a run is as decoded: mended after it
        head = decode_text(tokenizer, ids[:start], kept)
        raw = bytes(int(piece[3:5], 16) for piece in tokenizer.convert_ids_to_tokens(ids[start:end]))
        if text.startswith(head) and text[len(head) : len(head) + len(raw)] == "\ufffd" * len(raw):
            text = head + raw.decode("utf-8", "replace") + text[len(head) + len(raw) :]
    return text


def token_text(tokenizer, before: list[int], token_id: int, head: str | None = None,
               special: set[int] | None = None) -> str:
    """The text `token_id` adds after the ids `before`, decoded in context (SentencePiece drops a leading space at
    a text's start; a character's bytes may span tokens); a special token is its own name. `head`: the decoding
    of `before`; `special`: the tokenizer's special ids."""
    special = set(tokenizer.all_special_ids) if special is None else special
    if token_id in special or not before:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    head = tokenizer.decode(before, skip_special_tokens=True) if head is None else head
    whole = tokenizer.decode(list(before) + [token_id], skip_special_tokens=True)
    if "\ufffd" in whole:  # byte tokens: read as the reply's text reads them (mend_byte_end)
        head = mend_byte_end(tokenizer, list(before), tokenizer.decode(before, skip_special_tokens=True), len(before))
        whole = mend_byte_end(tokenizer, list(before) + [token_id], whole, len(before) + 1)
    if whole.startswith(head):
        return whole[len(head) :]
    return tokenizer.decode([token_id], skip_special_tokens=False)  # e.g. the end of a multi-byte character


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """The character byte-level BPE vocabularies write each byte as -> the byte (GPT-2's bytes_to_unicode, read
    back; imported only where a token holds part of a character)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer, token_id: int, text: str) -> list[int]:
    """The UTF-8 bytes of a token's `text`; where the token holds only part of a character (its text empty or
    the replacement character), the bytes it holds, so that a client joining them gets the character: its
    byte-level BPE piece read back, or SentencePiece's byte token <0xNN>."""
    if text and "\ufffd" not in text:
        return list(text.encode())
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and piece:
        byte = BYTE_TOKEN.fullmatch(piece)
        if byte:
            return [int(byte[1], 16)]
        alphabet = byte_level_alphabet()
        if all(char in alphabet for char in piece):
            return [alphabet[char] for char in piece]
    return list(text.encode())


def content(tokenizer, context: list[int], ids: list[int], logprobs: list[torch.Tensor], top_n: int) -> dict:
    """OpenAI's "content" list for `ids` (each the token after context + the ids before it), from
    `logprobs`: one row of log-probabilities over the vocabulary per id."""
    ids = list(ids)
    chosen = logprobs.gather(1, torch.tensor(ids, device=logprobs.device).view(-1, 1)).squeeze(1).tolist()
    top = logprobs.topk(min(top_n, logprobs.shape[1]), dim=1) if top_n else None  # sorted, most likely first
    top_ids = top.indices.tolist() if top is not None else [[] for _ in ids]
    top_values = top.values.tolist() if top is not None else [[] for _ in ids]
    return content_items(tokenizer, context, ids, chosen, top_ids, top_values)


def content_items(tokenizer, context: list[int], ids: list[int], chosen: list[float], top_ids: list[list[int]],
                  top_values: list[list[float]], kept: frozenset = frozenset()) -> list:
    """content()'s list from values already on the host: each id's log-probability, and its alternatives' ids and
    log-probabilities (most likely first). `kept`: special tokens the reply's text keeps (their names' bytes)."""
    sequence, offset = list(context) + list(ids), len(context)
    items, special = [], set(tokenizer.all_special_ids)

    def item(token, value, before, head):
        text = token_text(tokenizer, before, token, head, special)
        # A special token (the end of text) adds no text to the reply: no bytes; one the text keeps, its name's.
        return {"token": text, "id": token, "logprob": value,
                "bytes": [] if token in special and token not in kept else token_bytes(tokenizer, token, text)}

    for position, (token_id, logprob) in enumerate(zip(ids, chosen)):
        start, head = from_a_character(tokenizer, sequence, max(0, offset + position - CONTEXT_TOKENS),
                                       offset + position)
        before, head = sequence[start : offset + position], head or None
        alternatives = [item(alt_id, value, before, head)
                        for alt_id, value in zip(top_ids[position], top_values[position])]
        items.append({**item(token_id, logprob, before, head), "top_logprobs": alternatives})
    return items


def step_logits(logits: tuple[torch.Tensor, ...], beam_indices: torch.Tensor | None, row: int, step: int
                ) -> torch.Tensor:
    """The raw logits row that produced output row `row`'s token at `step` (`beam_indices`: beam search's
    reordering, as compute_transition_scores reads it)."""
    source = row if beam_indices is None else int(beam_indices[row, step])
    return logits[step][source]


def token_logprobs(tokenizer, prompt_ids: list[int], new: list[int], steps: list[torch.Tensor], top_n: int
                   ) -> dict:
    """The "logprobs" of one generated sequence's first len(steps) new tokens (not the padding after it)."""
    if not steps:
        return {"content": []}
    logprobs = torch.stack(steps).float().log_softmax(dim=-1)
    return {"content": content(tokenizer, prompt_ids, new[: len(steps)], logprobs, top_n)}


def score_prompts(loaded, batch: list, top_n: int) -> list[tuple[dict, float] | None]:
    """One forward pass over a left-padded batch: each prompt's ("content" list of its tokens 2..n, perplexity), or
    None for one token. Positions count from each prompt's first token, so it scores the same alone and batched."""
    model, tokenizer = loaded.model, loaded.tokenizer
    inputs = tokenizer.pad({"input_ids": [prompt.ids for prompt in batch]}, return_tensors="pt")
    inputs = inputs.to(loaded.input_device)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    kwargs = {"input_ids": ids, "attention_mask": mask}
    parameters = inspect.signature(model.forward).parameters
    if "position_ids" in parameters:
        kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    if "use_cache" in parameters:
        kwargs["use_cache"] = False
    with torch.inference_mode():
        logits = model(**kwargs).logits
    width, scores = ids.shape[1], []
    for row, prompt in enumerate(batch):
        start = width - len(prompt.ids)
        if len(prompt.ids) < 2:
            scores.append(None)
            continue
        logprobs = logits[row, start : width - 1].float().log_softmax(dim=-1)  # predicts tokens start+1 ..
        items = content(tokenizer, prompt.ids[:1], prompt.ids[1:], logprobs, top_n)
        mean = sum(item["logprob"] for item in items) / len(items)
        scores.append(({"content": items}, math.exp(-mean)))
    return scores
