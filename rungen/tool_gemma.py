"""Gemma 4's tool calls (rungen/tools.py's gemma format): `<|tool_call>call:name{key:value,...}<tool_call|>`.

A value is a string between <|"|> quotes (its text as it is: no escapes), a number, true, false, null, a list
`[a,b]` or a dict `{key:value}`, its keys written bare (quoted where they could not be read so) and, as the chat
template writes them, sorted. The reader
turns a growing call into the JSON of its arguments, at every step a prefix of the final JSON (a stream's arguments
only grow). xgrammar knows no such style, so the grammar is written here from the tool's schema: it holds a call to
the schema's keys in the template's order, the required ones, types, enums and consts, nesting, list lengths, string
lengths, patterns (alone, as xgrammar holds them), and numbers' bounds; a string's format is not held. A string's
text holds no quote and no Gemma control token (a string with a length bound or a pattern no "<" at all).
"""

from __future__ import annotations

import json
import math
import re

from .tool_xml import prefix_length, skip_space

QUOTE = '<|"|>'
OPEN = "call:"  # after <|tool_call>
CLOSE = "<tool_call|>"
NAME = re.compile(r"[A-Za-z0-9_.-]*")
KEY = re.compile(r"[^:{}\[\],<\n]*")
SCALAR = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?|true|false|null")
NUMBER_START = re.compile(r"-?(\d+(\.\d*)?([eE][-+]?\d*)?)?")  # a number the text may still be writing
WORDS = ("true", "false", "null")


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


# Writing: the grammar of a tool's arguments


# What a string's text never holds: the quote, and Gemma's control tokens (all of whose openings start "<|"), which the
# template would write back into the next prompt as the tokens themselves.
EXCLUDED = ("<|", "<tool_call|>", "<tool_response|>", "<turn|>", "<channel|>", "<tool|>")


def excluding(name: str, words) -> str:
    """EBNF rules `name` for any text holding none of `words`: one rule per state of how much of a word the text
    ends with (Aho-Corasick's automaton), each taking a character to the next state or, for any other, to the
    first."""
    prefixes = sorted({word[:size] for word in words for size in range(len(word))}, key=lambda p: (len(p), p))
    names = {prefix: f"{name}_{number}" if number else name for number, prefix in enumerate(prefixes)}

    def state(text):  # the longest end of `text` that begins a word
        return next(text[start:] for start in range(len(text) + 1) if text[start:] in names)

    alphabet = sorted({char for word in words for char in word})
    rules = []
    for prefix in prefixes:
        moves, apart = ['""'], []  # apart: the characters that do not go back to the first state
        for char in alphabet:
            following = prefix + char
            if any(following.endswith(word) for word in words):
                apart.append(char)  # it would complete a word
            elif state(following):
                apart.append(char)
                moves.append(f"{json.dumps(char)} {names[state(following)]}")
        escaped = "".join("\\" + char if char in "\\]^-" else char for char in apart)
        moves.append(f"[^{escaped}] {name}")
        rules.append(f"{names[prefix]} ::= " + " | ".join(moves))
    return "\n".join(rules) + "\n"


TEXT_RULES = excluding("gemma_text", EXCLUDED) + """gemma_string ::= "<|\\"|>" gemma_text "<|\\"|>"
gemma_number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
gemma_integer ::= "-"? ("0" | [1-9] [0-9]*)
gemma_key ::= [^:{}\\[\\],<\\n]+
gemma_value ::= gemma_string | gemma_number | "true" | "false" | "null" | gemma_dict | gemma_list
gemma_dict ::= "{" (gemma_key ":" gemma_value ("," gemma_key ":" gemma_value)*)? "}"
gemma_list ::= "[" (gemma_value ("," gemma_value)*)? "]"
"""
SCALARS = {"string": "gemma_string", "number": "gemma_number", "integer": "gemma_integer",
           "boolean": '("true" | "false")', "null": '"null"'}
EMPTY = '""'
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
RULE_NAME = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|\b(root(?:_\d+)?)\b')


def arguments_grammar(schema: dict) -> str:
    """The EBNF grammar (xgrammar's) of a call's arguments for the function's parameters, a JSON schema."""
    rules = GrammarRules(schema)
    root = rules.value(schema)
    return f"root ::= {root}\n" + "".join(f"{name} ::= {body}\n" for name, body in rules.rules.items()) + TEXT_RULES


class GrammarRules:
    """The rules a schema's values need, named as they are made ($refs once, so a recursive schema ends)."""

    def __init__(self, root):
        self.root = root
        self.rules = {}
        self.refs = {}

    def add(self, body: str) -> str:
        name = f"gemma_rule_{len(self.rules)}"
        self.rules[name] = body
        return name

    def value(self, schema) -> str:
        """An EBNF expression for the values `schema` lets be."""
        if schema is True or not isinstance(schema, dict):
            return "gemma_value"
        if "$ref" in schema:
            return self.ref(schema["$ref"])
        if "const" in schema:
            return literal(schema["const"])
        if "enum" in schema:
            return "(" + " | ".join(literal(value) for value in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return "(" + " | ".join(self.value({**without(schema, key), **branch}) for branch in schema[key]) + ")"
        if "allOf" in schema and len(schema["allOf"]) == 1:
            return self.value({**without(schema, "allOf"), **schema["allOf"][0]})
        kinds = schema.get("type")
        if isinstance(kinds, list):
            return "(" + " | ".join(self.value({**schema, "type": kind}) for kind in kinds) + ")"
        if kinds is None and "properties" in schema:
            kinds = "object"
        if kinds == "string":
            return self.string(schema)
        if kinds in ("integer", "number") and any(key in schema for key in BOUNDS):
            return self.bounded(schema, kinds)
        if kinds in SCALARS:
            return SCALARS[kinds]
        if kinds == "array":
            return self.array(schema)
        if kinds == "object":
            return self.dict(schema)
        return "gemma_value"

    def ref(self, ref: str) -> str:
        if ref not in self.refs:
            self.refs[ref] = name = self.add('""')  # named before it is made: it may refer to itself
            target = self.root
            for part in ref.removeprefix("#").strip("/").split("/") if ref != "#" else []:
                target = target[part.replace("~1", "/").replace("~0", "~")]
            self.rules[name] = self.value(target)
        return self.refs[ref]

    def string(self, schema) -> str:
        if "pattern" in schema:
            return '"<|\\"|>" ' + self.regex(schema["pattern"]) + ' "<|\\"|>"'
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not low and high is None:
            return "gemma_string"
        return '"<|\\"|>" ' + f"[^<]{{{low},{'' if high is None else high}}}" + ' "<|\\"|>"'

    def bounded(self, schema, kind) -> str:
        """A number between its bounds, by xgrammar's own regex of a range (of six decimals for a number, so that
        an exclusive bound is the next value it writes)."""
        from xgrammar.testing import _generate_float_regex, _generate_range_regex

        low = max((bound for bound in (schema.get("minimum"), schema.get("exclusiveMinimum")) if bound is not None),
                  default=None)
        high = min((bound for bound in (schema.get("maximum"), schema.get("exclusiveMaximum")) if bound is not None),
                   default=None)
        if kind == "number":
            step = 1e-6
            low = low + step if low is not None and low == schema.get("exclusiveMinimum") else low
            high = high - step if high is not None and high == schema.get("exclusiveMaximum") else high
            return self.regex(_generate_float_regex(low, high))
        low = None if low is None else math.floor(low) + 1 if low == schema.get("exclusiveMinimum") else math.ceil(low)
        high = None if high is None else math.ceil(high) - 1 if high == schema.get("exclusiveMaximum") \
            else math.floor(high)
        return self.regex(_generate_range_regex(low, high))

    def regex(self, pattern: str) -> str:
        """The pattern's grammar (xgrammar's), its rules renamed into this grammar's."""
        import xgrammar as xgr

        prefix = f"gemma_pattern_{len(self.rules)}_"
        # Any character, or any but some, is any but "<" too: the text holds no quote or control token.
        ebnf = str(xgr.Grammar.from_regex(pattern)).replace("[\\0-\\U0010ffff]", "[^<]").replace("[^", "[^<")
        renamed = RULE_NAME.sub(lambda m: prefix + m.group(1) if m.group(1) else m.group(), ebnf)
        for line in renamed.strip().splitlines():
            name, _, body = line.partition(" ::= ")
            self.rules[name] = body
        return prefix + "root"

    def array(self, schema) -> str:
        item = self.value(schema.get("items", True))
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if high == 0:
            return '"[]"'
        more = "*" if high is None and low <= 1 else f"{{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
        items = f'{item} ("," {item}){more}'
        return f'"[" {items} "]"' if low else f'"[" ({items})? "]"'

    def dict(self, schema) -> str:
        properties = schema.get("properties") or {}
        if not properties:
            # no properties named: any dict, but where they are named as none (xgrammar's reading), none
            return "gemma_dict" if "properties" not in schema and schema.get("additionalProperties") is not False \
                or schema.get("additionalProperties") not in (None, False) else '"{}"'
        required = set(schema.get("required") or ())
        keys = sorted(properties, key=str.lower)  # as the template's dictsort writes them
        members = [f'{literal_key(key)} ":" {self.value(properties[key])}' for key in keys]
        # after[i]: the members from keys[i] on where one was written before them (each opens with a comma)
        after = [""] * (len(keys) + 1)
        for index in range(len(keys) - 1, 0, -1):
            then = after[index + 1]
            after[index] = self.add(either(sequence('","', members[index], then), keys[index] in required, then))
        # The members from the start: from the first required key on, or an optional one before it instead.
        last = next((index for index, key in enumerate(keys) if key in required), len(keys))
        start = sequence(members[last], after[last + 1]) if last < len(keys) else ""
        for index in range(last - 1, -1, -1):
            start = self.add(either(sequence(members[index], after[index + 1]), False, start))
        return sequence('"{"', start, '"}"')


def sequence(*parts: str) -> str:
    return " ".join(part for part in parts if part)


def either(expression: str, required: bool, otherwise: str) -> str:
    """`expression`, or where it may be left out, `otherwise` (nothing where that is empty)."""
    return expression if required else f"{expression} | {otherwise or EMPTY}"


def without(schema: dict, key: str) -> dict:
    return {name: value for name, value in schema.items() if name != key}


def literal(value) -> str:
    """The EBNF string of a value as the template writes it (format_argument, keys bare)."""
    return json.dumps(gemma_text(value), ensure_ascii=False)


def literal_key(key: str) -> str:
    """A key as written: bare, or between quotes where the reader could not take it bare (a colon, a space at
    either end, ...)."""
    bare = KEY.fullmatch(key) is not None and key == key.strip() and key
    return json.dumps(key if bare else QUOTE + key + QUOTE, ensure_ascii=False)


def gemma_text(value) -> str:
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{gemma_text(value[key])}" for key in sorted(value, key=str.lower)) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma_text(item) for item in value) + "]"
    return json.dumps(value)
