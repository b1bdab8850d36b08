"""JSON as RFC 8259 has it, for what users send (request bodies, jsonl lines): loads refuses what Python's json
takes beyond it (NaN, Infinity, numbers past a float's range, lone surrogates, unbounded nesting, a key given twice)
with a JSONError naming the top-level field."""

import itertools
import json
import math
import re

MAX_DEPTH = 64  # no request or input line of the tool nests past a dozen levels

JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")
BRACKET_STEPS = str.maketrans("[{]}", "\x01\x01\xff\xff")  # +1 and -1 as signed bytes
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class JSONError(ValueError):
    """Why a text is not strict JSON; `field` is the top-level key the problem is under, if any."""

    def __init__(self, message, field=None):
        super().__init__(message)
        self.message, self.field = message, field


class NotJSON:
    """The decoder's NaN, Infinity or out-of-range number, found after parsing so the error names its field."""

    def __init__(self, text):
        self.text = text


def loads(text: str, max_depth: int = MAX_DEPTH):
    """The value of a JSON text (a str), or JSONError."""
    depth = nesting_depth(text, max_depth)
    if depth > max_depth:
        raise JSONError(f"arrays and objects nest {depth} deep; at most {max_depth}")
    odd = []

    def constant(word):
        odd.append(word)
        return NotJSON(word)

    def real(word):
        value = float(word)
        if math.isfinite(value):
            return value
        odd.append(word)
        return NotJSON(word)

    twice = []

    def unique(pairs):  # a key given twice: which one the sender meant is not known (Python's json keeps the last)
        value = dict(pairs)
        if len(value) < len(pairs):
            seen = set()
            twice.append(next(key for key, _ in pairs if key in seen or seen.add(key)))
        return value

    try:
        value = json.loads(text, parse_constant=constant, parse_float=real, object_pairs_hook=unique)
    except json.JSONDecodeError as error:
        raise JSONError(f"not valid JSON ({error.msg} at line {error.lineno} column {error.colno})") from None
    except (ValueError, RecursionError) as error:  # an integer of over 4,300 digits (Python's limit)
        raise JSONError(f"not valid JSON ({error})") from None
    if odd or SURROGATE_ESCAPE.search(text):
        check_values(value)
    if twice:
        key = printable(twice[-1])  # the outermost object's comes last
        top = isinstance(value, dict) and key in value
        raise JSONError(f'the key "{key}" is given twice in one object', key if top else None)
    return value


def nesting_depth(text: str, limit: int) -> int:
    """How deep a JSON text nests (a number within `limit` when it cannot nest past it), in C loops without
    recursion; brackets in strings do not count, and a broken text fails to parse after."""
    brackets = NOT_A_BRACKET.sub("", JSON_STRING.sub("", text))
    if len(brackets) <= limit:
        return len(brackets)
    return max(itertools.accumulate(memoryview(brackets.translate(BRACKET_STEPS).encode("latin-1")).cast("b")))


def printable(key: str) -> str:
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def check_values(value) -> None:
    """JSONError for NaN, Infinity or a lone surrogate anywhere in `value` (iterative: no recursion)."""
    top = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    stack = [(item, printable(str(key)), printable(str(key)) if isinstance(value, dict) else None)
             for key, item in top]
    if isinstance(value, dict):
        stack += [(key, f"{printable(key)} (a key)", printable(key)) for key in value]
    if not isinstance(value, (dict, list)):
        stack.append((value, "the value", None))
    while stack:
        item, path, field = stack.pop()
        if isinstance(item, NotJSON):
            raise JSONError(f"{path}: {item.text} is not a JSON number (numbers must be finite)", field)
        if isinstance(item, str) and not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                raise JSONError(f"{path}: a string holds a lone UTF-16 surrogate ({item[error.start]!a}), which "
                                f"is not text", field) from None
        elif isinstance(item, dict):
            stack += [(inner, f"{path}.{printable(key)}", field) for key, inner in item.items()]
            stack += [(key, f"{path} (a key)", field) for key in item]
        elif isinstance(item, list):
            stack += [(inner, f"{path}[{index}]", field) for index, inner in enumerate(item)]
