"""Gemma 4's tool calls (rungen/tool_formats.py's gemma format): `<|tool_call>call:name{key:value,...}<tool_call|>`.

A value is a string between <|"|> quotes (its text as it is: no escapes), a number, true, false, null, a list
`[a,b]` or a dict `{key:value}`, its keys written bare (quoted where they could not be read so) and, as the chat
template writes them, sorted. The reader turns a growing call into the JSON of its arguments, at every step a prefix
of the final JSON (a stream's arguments only grow). The grammar of the same calls is rungen/tool_schema.py's, in its
Gemma syntax.
"""

from __future__ import annotations

import json

from .tool_schema import GEMMA_KEY as KEY
from .tool_schema import GEMMA_QUOTE as QUOTE
from .tool_xml import NAME, NUMBER_START, SCALAR, WORDS, prefix_length, skip_space

OPEN = "call:"  # after <|tool_call>
CLOSE = "<tool_call|>"


# Reading


def read_call(text: str, position: int):
    """(end, call) of the call at `position` (after its <|tool_call>), as tool_xml.read_call: end the position after
    it, None while the text ends inside, -1 where it is no call; call (name or None while unread, arguments,
    complete)."""
    rest = text[position : position + len(OPEN)]
    if rest != OPEN:
        return (None, (None, "", False)) if OPEN.startswith(rest) else (-1, None)
    name = NAME.match(text, position + len(OPEN)).group()
    brace = position + len(OPEN) + len(name)
    if brace == len(text):
        return None, (None, "", False)
    if text[brace] != "{" or not name:
        return -1, None
    out = []
    end = read_value(text, brace, out)
    if end == -1:
        return -1, None
    call = (name, "".join(out), end is not None)
    if end is None:
        return None, call
    if text.startswith(CLOSE, end):
        return end + len(CLOSE), call
    return (None, call) if CLOSE.startswith(text[end:]) else (-1, None)


def read_value(text: str, position: int, out: list) -> int | None:
    """Appends the JSON of the value at `position` (as far as written) to `out`; returns where it ends, None if
    the text ends first, -1 if no value starts there."""
    if position == len(text) or QUOTE.startswith(text[position:]):
        return None
    if text.startswith(QUOTE, position):
        return read_string(text, position + len(QUOTE), out)
    if text[position] in "{[":
        return read_items(text, position, out)
    rest = text[position:]
    if NUMBER_START.fullmatch(rest) or any(word.startswith(rest) for word in WORDS):
        out.append(rest)  # a number or word on its way ("1." may go on to "1.5")
        return None
    match = SCALAR.match(text, position)
    if match is None:
        return -1
    out.append(match.group())
    return match.end()


def read_string(text, position, out):
    end = text.find(QUOTE, position)
    body = text[position:] if end == -1 else text[position:end]
    if end == -1:  # its closing quote may have begun
        body = body[: len(body) - prefix_length(body, (QUOTE,))]
    written = json.dumps(body, ensure_ascii=False)
    out.append(written if end != -1 else written[:-1])
    return end + len(QUOTE) if end != -1 else None


def read_items(text, position, out):
    """A dict's members or a list's items, as JSON's: ", " between them, ": " after a key."""
    keyed = text[position] == "{"
    closing = "}" if keyed else "]"
    out.append(text[position])
    position = skip_space(text, position + 1)
    if position < len(text) and text[position] == closing:
        out.append(closing)
        return position + 1
    while True:
        if position == len(text):
            return None
        if keyed:
            position = read_key(text, position, out)
            if position is None or position == -1:
                return position
        position = read_value(text, skip_space(text, position), out)
        if position is None or position == -1:
            return position
        position = skip_space(text, position)
        if position == len(text):
            return None
        if text[position] == closing:
            out.append(closing)
            return position + 1
        if text[position] != ",":
            return -1
        out.append(", ")
        position = skip_space(text, position + 1)


def read_key(text, position, out):
    """A bare key (or one in quotes) and its colon; returns the position after them."""
    if text.startswith(QUOTE, position) or QUOTE.startswith(text[position:]):
        key = []
        end = read_value(text, position, key)
        if end is None or end == -1:
            out.extend(key)
            return end
        out.append(key[0])
    else:
        key = KEY.match(text, position).group()
        end = position + len(key)
        if end == len(text):
            out.append(json.dumps(key, ensure_ascii=False)[:-1])
            return None
        if not key:
            return -1
        out.append(json.dumps(key, ensure_ascii=False))
    end = skip_space(text, end)
    if end == len(text):
        return None
    if text[end] != ":":
        return -1
    out.append(": ")
    return end + 1
