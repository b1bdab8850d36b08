"""A tool's parameters (a JSON schema) as the EBNF grammar (xgrammar's dialect) of the arguments in a call syntax other
than JSON's: Gemma 4's (strings between <|"|> quotes, bare keys sorted as its template writes them) and the Python
keyword arguments of LFM2's calls, whose values are JSON, and of LFM2.5's, whose values are Python's literals. xgrammar
writes JSON and its XML styles itself; for these the grammar is written here, a syntax a row of SYNTAXES. It holds the
schema's keys (in the syntax's order), the required ones, types, enums and consts, $refs, nesting, list lengths, string
lengths, patterns (alone, as xgrammar holds them), and numbers' bounds (by xgrammar's own range regexes, exclusive ones
to six decimals); a string's format is not held. A string holds no text the syntax excludes (Gemma's quote and control
tokens), and one with a length bound or a pattern none of the characters it excludes.
"""

from __future__ import annotations

import dataclasses
import json
import keyword
import math
import re

from .tool_python import python_text

GEMMA_QUOTE = '<|"|>'
# What a Gemma string's text never holds: the quote, and Gemma's control tokens (all of whose openings start "<|"),
# which the template would write back into the next prompt as the tokens themselves.
GEMMA_EXCLUDED = ("<|", "<tool_call|>", "<tool_response|>", "<turn|>", "<channel|>", "<tool|>")
GEMMA_KEY = re.compile(r"[^:{}\[\],<\n]*")  # a key Gemma's reader takes bare (rungen/tool_gemma.py)
IDENTIFIER = re.compile(r"[^\W\d]\w*")  # a Python keyword argument's name, as read (python_name: as written)


def excluding(name: str, words, narrowed: str = "", escape: str = "") -> str:
    """EBNF rules `name` for any text holding none of `words`: one rule per state of how much of a word the text
    ends with (Aho-Corasick's automaton), each taking a character to the next state or, for any other, to the
    first; never a character of the class `narrowed` (EBNF class text), but an `escape` sequence (EBNF) instead."""
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
        moves.append(f"[^{escaped}{narrowed}] {name}")
        if escape:
            moves.append(f"{escape} {name}")
        rules.append(f"{names[prefix]} ::= " + " | ".join(moves))
    return "\n".join(rules) + "\n"


def python_name(key: str) -> bool:
    """Whether a keyword argument may have this name (not `class`, `from`, ...)."""
    return key.isidentifier() and not keyword.iskeyword(key)


def gemma_text(value) -> str:
    """A value as Gemma's template writes it (format_argument, keys bare)."""
    if isinstance(value, str):
        return GEMMA_QUOTE + value + GEMMA_QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{gemma_text(value[key])}" for key in sorted(value, key=str.lower)) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma_text(item) for item in value) + "]"
    return json.dumps(value)


def gemma_key(key: str) -> str:
    """A key as Gemma's calls write it: bare, or between quotes where the reader could not take it bare (a colon, a
    space at either end, ...)."""
    bare = GEMMA_KEY.fullmatch(key) is not None and key == key.strip() and key
    return json.dumps(key if bare else GEMMA_QUOTE + key + GEMMA_QUOTE, ensure_ascii=False) + ' ":"'


@dataclasses.dataclass(frozen=True)
class Syntax:
    """How one call syntax writes values: its rules (`prefix`_string, _number, _integer, _value, _dict, _list), a
    string's quotes (EBNF) and one of its characters where a string is bounded, how a pattern's character classes
    are narrowed, a dict's key (an EBNF expression, with what follows it) and the separator between members and
    items, the EBNF string of a constant, and the order of a dict's keys."""

    prefix: str
    rules: str
    quotes: tuple[str, str]
    character: str  # one character of a bounded string
    narrowed: str  # what a pattern's "any character" becomes, and what its negated classes exclude besides theirs
    key: object  # key -> EBNF
    separator: str
    literal: object  # value -> its text
    sorted_keys: bool
    words: tuple[str, str, str] = ("true", "false", "null")  # true, false and null as written
    escaped: tuple[str, ...] = ()  # what a pattern may not write into a string (EBNF text): the syntax would escape it


GEMMA = Syntax(
    "gemma", excluding("gemma_text", GEMMA_EXCLUDED) + """gemma_string ::= "<|\\"|>" gemma_text "<|\\"|>"
gemma_number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
gemma_integer ::= "-"? ("0" | [1-9] [0-9]*)
gemma_key ::= [^:{}\\[\\],<\\n]+
gemma_value ::= gemma_string | gemma_number | "true" | "false" | "null" | gemma_dict | gemma_list
gemma_dict ::= "{" (gemma_key ":" gemma_value ("," gemma_key ":" gemma_value)*)? "}"
gemma_list ::= "[" (gemma_value ("," gemma_value)*)? "]"
""", ('"<|\\"|>"', '"<|\\"|>"'), "[^<]", "<", gemma_key, '","', gemma_text, True)
# JSON's values (LFM2's Python calls take them so), spaced or not after a comma or colon. A string holds no control
# token of the calls' model (LFM2's all start "<|"), no lone surrogate, and its quote and backslash escaped.
JSON_NARROWED = '\\"\\\\\\0-\\x1f\\ud800-\\udfff'
JSON_ESCAPE = '"\\\\" ([\\"\\\\/bfnrt] | "u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9])'
JSON = Syntax(
    "json", excluding("json_text", ("<|",), JSON_NARROWED, JSON_ESCAPE) + f"""json_string ::= "\\"" json_text "\\""
json_character ::= [^<{JSON_NARROWED}] | {JSON_ESCAPE}
""" + r"""json_number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
json_integer ::= "-"? ("0" | [1-9] [0-9]*)
json_value ::= json_string | json_number | "true" | "false" | "null" | json_dict | json_list
json_dict ::= "{" (json_string ":" " "? json_value ("," " "? json_string ":" " "? json_value)*)? "}"
json_list ::= "[" (json_value ("," " "? json_value)*)? "]"
""", ('"\\""', '"\\""'), "json_character", "<" + JSON_NARROWED,
    lambda key: json.dumps(json.dumps(key, ensure_ascii=False), ensure_ascii=False) + ' ":" " "?',
    '"," " "?', lambda value: json.dumps(value, ensure_ascii=False), False, escaped=('\\"', "\\\\"))
# Python's literals (LFM2.5's calls, as its template writes them): strings between single quotes, True, False, None.
PYTHON_NARROWED = "'\\\\\\0-\\x1f\\ud800-\\udfff"
# \\u escapes of no surrogate: Python's literals would not pair two into one character
PYTHON_ESCAPE = ('"\\\\" ([\\\\\'\\"/bfnrt] | "x" [A-Fa-f0-9] [A-Fa-f0-9] | '
                 '"u" ([0-9A-Ca-c] [A-Fa-f0-9] | [Dd] [0-7]) [A-Fa-f0-9] [A-Fa-f0-9] | '
                 '"u" [E-Fe-f] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9])')
PYTHON = Syntax(
    "python", excluding("python_text", ("<|",), PYTHON_NARROWED, PYTHON_ESCAPE) +
    f"""python_string ::= "'" python_text "'"
python_character ::= [^<{PYTHON_NARROWED}] | {PYTHON_ESCAPE}
""" + r"""python_number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
python_integer ::= "-"? ("0" | [1-9] [0-9]*)
python_value ::= python_string | python_number | "True" | "False" | "None" | python_dict | python_list
python_dict ::= "{" (python_string ":" " "? python_value ("," " "? python_string ":" " "? python_value)*)? "}"
python_list ::= "[" (python_value ("," " "? python_value)*)? "]"
""", ('"\'"', '"\'"'), "python_character", "<" + PYTHON_NARROWED,
    lambda key: json.dumps(python_text(key), ensure_ascii=False) + ' ":" " "?', '"," " "?', python_text, False,
    words=("True", "False", "None"), escaped=("'", "\\\\"))
SYNTAXES = {"gemma": GEMMA, "python": JSON, "python_literal": PYTHON}
EMPTY = '""'
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
RULE_NAME = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|\b(root(?:_\d+)?)\b')


def arguments_grammar(schema: dict, style: str) -> str:
    """The EBNF grammar (xgrammar's) of a call's arguments for the function's parameters, a JSON schema, in the
    format's `style`: Gemma's dict, or (python) Python keyword arguments."""
    syntax = SYNTAXES[style]
    rules = GrammarRules(schema, syntax)
    if style in ("python", "python_literal"):
        for key in schema.get("properties") or {}:
            if not python_name(key):
                raise ValueError(f"the parameter {key!r} is no Python identifier, which these calls name arguments by")
        if "properties" not in schema and schema.get("additionalProperties") is not False \
                or schema.get("additionalProperties") not in (None, False):
            raise ValueError("keyword arguments not named in properties are not held in these calls")
        root = rules.members(schema, lambda key: json.dumps(key + "="), '", "') or EMPTY
    else:
        root = rules.value(schema)
    return f"root ::= {root}\n" + "".join(f"{name} ::= {body}\n" for name, body in rules.rules.items()) + \
        syntax.rules


class GrammarRules:
    """The rules a schema's values need in one syntax, named as they are made ($refs once, so a recursive schema
    ends)."""

    def __init__(self, root, syntax: Syntax):
        self.root = root
        self.syntax = syntax
        self.rules = {}
        self.refs = {}

    def add(self, body: str) -> str:
        name = f"{self.syntax.prefix}_rule_{len(self.rules)}"
        self.rules[name] = body
        return name

    def named(self, kind: str) -> str:
        return f"{self.syntax.prefix}_{kind}"

    def literal(self, value) -> str:
        return json.dumps(self.syntax.literal(value), ensure_ascii=False)

    def value(self, schema) -> str:
        """An EBNF expression for the values `schema` lets be."""
        if schema is True or not isinstance(schema, dict):
            return self.named("value")
        if "$ref" in schema:
            return self.ref(schema["$ref"])
        if "const" in schema:
            return self.literal(schema["const"])
        if "enum" in schema:
            return "(" + " | ".join(self.literal(value) for value in schema["enum"]) + ")"
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
        if kinds in ("string", "number", "integer"):
            return self.named(kinds)
        if kinds == "boolean":
            return f'("{self.syntax.words[0]}" | "{self.syntax.words[1]}")'
        if kinds == "null":
            return f'"{self.syntax.words[2]}"'
        if kinds == "array":
            return self.array(schema)
        if kinds == "object":
            return self.dict(schema)
        return self.named("value")

    def ref(self, ref: str) -> str:
        if ref not in self.refs:
            self.refs[ref] = name = self.add(EMPTY)  # named before it is made: it may refer to itself
            target = self.root
            for part in ref.removeprefix("#").strip("/").split("/") if ref != "#" else []:
                target = target[part.replace("~1", "/").replace("~0", "~")]
            self.rules[name] = self.value(target)
        return self.refs[ref]

    def string(self, schema) -> str:
        opening, closing = self.syntax.quotes
        if "pattern" in schema:
            return sequence(opening, self.regex(schema["pattern"]), closing)
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not low and high is None:
            return self.named("string")
        return sequence(opening, f"{self.syntax.character}{{{low},{'' if high is None else high}}}", closing)

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
        """The pattern's grammar (xgrammar's), its rules renamed into this grammar's, its characters narrowed to
        those a string of the syntax may hold."""
        import xgrammar as xgr

        prefix = f"{self.syntax.prefix}_pattern_{len(self.rules)}_"
        narrowed = self.syntax.narrowed
        ebnf = str(xgr.Grammar.from_regex(pattern)).replace("[\\0-\\U0010ffff]", f"[^{narrowed}]")
        ebnf = ebnf.replace("[^", f"[^{narrowed}").replace(f"[^{narrowed}{narrowed}", f"[^{narrowed}")
        if any(escaped in ebnf.replace(narrowed, "") for escaped in self.syntax.escaped):
            raise ValueError(f"the pattern {pattern!r} writes a quote or a backslash, which a string here would need "
                             "escaped")
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
        items = f"{item} ({self.syntax.separator} {item}){more}"
        return f'"[" {items} "]"' if low else f'"[" ({items})? "]"'

    def dict(self, schema) -> str:
        if not schema.get("properties"):
            # no properties named: any dict, but where they are named as none (xgrammar's reading), none
            return self.named("dict") if "properties" not in schema and schema.get("additionalProperties") is not \
                False or schema.get("additionalProperties") not in (None, False) else '"{}"'
        return sequence('"{"', self.members(schema, self.syntax.key, self.syntax.separator), '"}"')

    def members(self, schema, key, separator) -> str:
        """An object's members: each property's key (`key` writes it) and value, `separator` between them, in the
        syntax's order, the required ones always there."""
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        keys = sorted(properties, key=str.lower) if self.syntax.sorted_keys else list(properties)
        members = [sequence(key(name), self.value(properties[name])) for name in keys]
        # after[i]: the members from keys[i] on where one was written before them (each opens with a separator)
        after = [""] * (len(keys) + 1)
        for index in range(len(keys) - 1, 0, -1):
            then = after[index + 1]
            after[index] = self.add(either(sequence(separator, members[index], then), keys[index] in required, then))
        # The members from the start: from the first required key on, or an optional one before it instead.
        last = next((index for index, name in enumerate(keys) if name in required), len(keys))
        start = sequence(members[last], after[last + 1]) if last < len(keys) else ""
        for index in range(last - 1, -1, -1):
            start = self.add(either(sequence(members[index], after[index + 1]), False, start))
        return start


def sequence(*parts: str) -> str:
    return " ".join(part for part in parts if part)


def either(expression: str, required: bool, otherwise: str) -> str:
    """`expression`, or where it may be left out, `otherwise` (nothing where that is empty)."""
    return expression if required else f"{expression} | {otherwise or EMPTY}"


def without(schema: dict, key: str) -> dict:
    return {name: value for name, value in schema.items() if name != key}
