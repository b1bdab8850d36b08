"""Python literals as call values ('text', True, None, [1, 'a'], {'key': 2}), as LFM2.5's template writes a call's
arguments: written from JSON values for the history, and read back into JSON as they are generated, a value's JSON
growing with its text (so that a stream's arguments only grow). JSON's own literals are read too (true, "text").
"""

from __future__ import annotations

import json
import re

from .tool_xml import NUMBER_START, skip_space

WORDS = {"True": "true", "False": "false", "None": "null", "true": "true", "false": "false", "null": "null"}
ESCAPES = {"\\": "\\", "'": "'", '"': '"', "n": "\n", "r": "\r", "t": "\t", "b": "\b", "f": "\f", "/": "/"}
HEX = {"x": 2, "u": 4}  # \xhh, \uhhhh
WRITTEN = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")


def python_text(value) -> str:
    """A JSON value as a Python literal: a string between single quotes (its quote, backslash and control characters
    escaped), True, False, None, lists and dicts of the same."""
    if isinstance(value, str):
        return "'" + "".join(WRITTEN.get(char, f"\\x{ord(char):02x}" if ord(char) < 32 else char)
                             for char in value) + "'"
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(python_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{python_text(key)}: {python_text(item)}" for key, item in value.items()) + "}"
    return json.dumps(value)


def read_value(text: str, position: int):
    """(end, JSON) of the literal at `position`: end the position after it, None while the text ends inside it (the
    JSON then the start of the value's), -1 where it is no literal."""
    out, stack = [], []  # stack: the opening ("[" or "{") of each open list or dict
    expect = "value"
    while True:
        position = skip_space(text, position)
        if position == len(text):
            return None, "".join(out)
        char = text[position]
        if expect == "colon":
            if char != ":":
                return -1, ""
            out.append(": ")
            position, expect = position + 1, "value"
            continue
        if expect == "next":
            if char == ",":
                out.append(", ")
                position, expect = position + 1, "value" if stack[-1] == "[" else "key"
                continue
            if char != "]}"[stack[-1] == "{"]:
                return -1, ""
        if char in "]}" and expect in ("next", "first"):
            if char != "]}"[stack[-1] == "{"]:
                return -1, ""
            out.append(char)
            stack.pop()
            position += 1
        elif expect in ("key", "first") and stack[-1] == "{" or char in "'\"":
            if char not in "'\"":
                return -1, ""
            end, piece = read_string(text, position)
            if end == -1:
                return -1, ""
            out.append(piece)
            if end is None:
                return None, "".join(out)
            position = end
            if expect in ("key", "first") and stack[-1] == "{":
                expect = "colon"
                continue
        elif char in "[{":
            out.append(char)
            stack.append(char)
            position, expect = position + 1, "first"
            continue
        elif char == "-" or char.isdigit():
            if NUMBER_START.fullmatch(text, position):
                return None, "".join(out)  # the number may go on ("1." to "1.5")
            match = NUMBER.match(text, position)
            if match is None:
                return -1, ""
            out.append(match.group())
            position = match.end()
        else:
            word = re.match(r"[A-Za-z]*", text[position:]).group()
            if position + len(word) == len(text) and any(name.startswith(word) for name in WORDS):
                return None, "".join(out)
            if word not in WORDS:
                return -1, ""
            out.append(WORDS[word])
            position += len(word)
        if not stack:
            return position, "".join(out)
        expect = "next"


def read_string(text: str, position: int):
    """(end, JSON) of the string whose quote is at `position`: end None while the text ends inside it (the JSON then
    lacks its closing quote), -1 where an escape is none."""
    quote, chars, index = text[position], [], position + 1
    while index < len(text):
        char = text[index]
        if char == quote:
            return index + 1, json.dumps("".join(chars), ensure_ascii=False)
        if char == "\\":
            if index + 1 == len(text):
                break
            code = text[index + 1]
            if code in HEX:
                digits = text[index + 2 : index + 2 + HEX[code]]
                if re.fullmatch(r"[0-9A-Fa-f]*", digits) is None:
                    return -1, ""
                if len(digits) < HEX[code]:
                    break
                if 0xD800 <= int(digits, 16) <= 0xDFFF:  # half a character: no JSON string could hold it alone
                    return -1, ""
                chars.append(chr(int(digits, 16)))
                index += 2 + HEX[code]
                continue
            if code not in ESCAPES:
                return -1, ""
            chars.append(ESCAPES[code])
            index += 2
            continue
        if char == "\n":
            return -1, ""
        chars.append(char)
        index += 1
    return None, json.dumps("".join(chars), ensure_ascii=False)[:-1]
