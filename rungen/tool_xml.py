"""Tool calls written as XML (rungen/tool_formats.py's qwen_xml, glm_xml, minimax_xml and DeepSeek's DSML formats):
one call read from a growing reply.

A value is text: where the tool's schema says string it is that text, else the JSON it holds. The arguments are
the JSON object of the parameters read so far, a parameter once its closing tag came, so that a stream's arguments
only grow. The grammar of the same calls is xgrammar's style of the same name for the tool's schema, which
lets one whitespace character stand on each side of a value (the templates' line breaks): it is no part of it.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re


@dataclasses.dataclass(frozen=True)
class XmlStyle:
    """How a family writes one call after its <tool_call>: the function's name between `name` (its opening and
    closing; GLM's name ends at whitespace or a tag), each parameter as key[0] key key[1] value[0] value value[1],
    then the tags of `close`, whitespace between all of them. `kinds`: the value's openings where the model says
    what it is, (text, JSON) (DeepSeek's string="true" and string="false"), the schema's say elsewhere."""

    name: tuple[str, str]
    key: tuple[str, str]
    value: tuple[str, str]
    close: tuple[str, ...]
    kinds: tuple[str, str] | None = None


STYLES = {
    # Qwen3.5, Qwen3-Coder, Nemotron 3: <function=name> <parameter=key> value </parameter> </function> </tool_call>
    "qwen_xml": XmlStyle(("<function=", ">"), ("<parameter=", ">"), ("", "</parameter>"),
                         ("</function>", "</tool_call>")),
    # Seed-OSS: as Qwen's in a <seed:tool_call>, <parameter=key>value</parameter>
    "seed_xml": XmlStyle(("<function=", ">"), ("<parameter=", ">"), ("", "</parameter>"),
                         ("</function>", "</seed:tool_call>")),
    # GLM-4.5 on: name <arg_key>key</arg_key> <arg_value>value</arg_value> </tool_call>
    "glm_xml": XmlStyle(("", ""), ("<arg_key>", "</arg_key>"), ("<arg_value>", "</arg_value>"), ("</tool_call>",)),
    # MiniMax-M2 to M2.7, inside one <minimax:tool_call> region: <invoke name="name"> <parameter name="key">value
    # </parameter> </invoke>
    "minimax_xml": XmlStyle(('<invoke name="', '">'), ('<parameter name="', '">'), ("", "</parameter>"),
                            ("</invoke>",)),
    # DeepSeek V3.2, V4 (DSML), inside one <｜DSML｜function_calls> (<｜DSML｜tool_calls>) region: <｜DSML｜invoke
    # name="name"> <｜DSML｜parameter name="key" string="true">text</｜DSML｜parameter> (string="false": JSON)
    # </｜DSML｜invoke>
    "deepseek_xml": XmlStyle(('<｜DSML｜invoke name="', '">'), ('<｜DSML｜parameter name="', '"'),
                             ("", "</｜DSML｜parameter>"), ("</｜DSML｜invoke>",),
                             kinds=('string="true">', 'string="false">')),
}
NAME = re.compile(r"[A-Za-z0-9_.-]*")  # a function's, as the models write it after their markers (every reader's)
KEY = re.compile(r"[^<>\n]*")  # a parameter's: any property name a schema may have (a space, "城市"), in one line
WHITESPACE = (" ", "\n", "\r", "\t")
# The readers' JSON scalars (here with their other text helpers): one written, or one the text may still be writing.
SCALAR = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?|true|false|null")
NUMBER_START = re.compile(r"-?(\d+(\.\d*)?([eE][-+]?\d*)?)?")
WORDS = ("true", "false", "null")


def read_call(style: XmlStyle, text: str, position: int, schemas: dict | None):
    """(end, call) of the call at `position` (after its <tool_call>): end the position after it, None while the
    text ends inside, -1 where it is no call; call (name or None while unread, arguments, complete)."""
    name, position = read_name(style, text, skip_space(text, position))
    if name is None:
        return position, (None, "", False) if position is None else None
    schema = (schemas or {}).get(name, {}).get("properties", {})
    fields = []
    while True:
        position = skip_space(text, position)
        rest = text[position:]
        if any(len(rest) < len(tag) and tag.startswith(rest) for tag in (style.close[0], style.key[0])):
            return None, (name, "{" + ", ".join(fields), False)  # the next tag is on its way
        if rest.startswith(style.close[0]):
            return read_close(style, text, position + len(style.close[0]), (name, "{" + ", ".join(fields) + "}", True))
        key, start = tag_text(text, position, style.key, KEY)
        if start == -1:
            return -1, None
        kind = None
        if start is not None:
            start = skip_space(text, start)
            openings = style.kinds or (style.value[0],)
            kind = next((opening for opening in openings if text.startswith(opening, start)), None)
            if kind is None:
                if not any(opening.startswith(text[start:]) for opening in openings):
                    return -1, None
                start = None
            else:
                start += len(kind)
        end = text.find(style.value[1], start) if start is not None else -1
        if end == -1:
            return None, (name, "{" + ", ".join(fields), False)
        if style.kinds is not None and kind == style.kinds[0]:
            value = text[start:end]  # the model's text, as the template writes a string: as it is
        else:
            value = xml_value(text[start:end], schema.get(key) if style.kinds is None else None)  # JSON said, or read
        fields.append(json.dumps(key) + ": " + json.dumps(value, ensure_ascii=False))
        position = end + len(style.value[1])


def read_name(style, text, position):
    """(name, position after it): (None, None) while the text ends inside it, (None, -1) where there is none."""
    if style.name[0]:
        return tag_text(text, position, style.name)
    name = NAME.match(text, position).group()
    end = position + len(name)
    if end == len(text):
        return None, None
    return (name, end) if name and (text[end] == "<" or text[end] in WHITESPACE) else (None, -1)


def read_close(style, text, position, call):
    """(end, call) after the call's first closing tag: its other closing tags, whitespace between them."""
    for tag in style.close[1:]:
        position = skip_space(text, position)
        if text.startswith(tag, position):
            position += len(tag)
        elif tag.startswith(text[position:]):
            return None, call  # the closing tag is on its way (or the reply ended before it)
        else:
            return -1, None
    return position, call


def tag_text(text, position, tag, pattern=NAME):
    """(text, position after) of tag[0] text tag[1] at `position`, the text one `pattern` matches: (None, None)
    while the text ends inside it, (None, -1) where it is not there."""
    opening, closing = tag
    if not text.startswith(opening, position):
        return (None, None) if opening.startswith(text[position:]) else (None, -1)
    end = text.find(closing, position + len(opening))
    name = text[position + len(opening) : len(text) if end == -1 else end]
    if end == -1:  # the closing tag may have begun
        name = name[: len(name) - prefix_length(name, (closing,))]
    if pattern.fullmatch(name) is None or end != -1 and not name:
        return None, -1
    return (None, None) if end == -1 else (name, end + len(closing))


def xml_value(text, schema):
    """A parameter's value: the text between its tags less one whitespace character on each side. Where its schema
    lets a string be (a type, an enum's or const's value, a branch of anyOf/oneOf), the text itself, unless it is
    the JSON (or Python literal) of another value the schema lets be (null for an Optional); elsewhere the value
    that JSON or literal holds (the text where it holds neither)."""
    text = text[1:] if text[:1] in WHITESPACE else text
    text = text[:-1] if text[-1:] in WHITESPACE else text
    try:
        value = json.loads(text)
    except ValueError:
        value = python_literal(text)
        if value is NOT_READ:
            return text
    kinds = json_types(schema)
    if kinds is None or "string" not in kinds or not isinstance(value, str) and json_type(value) in kinds:
        return value
    return text


NOT_READ = object()


def python_literal(text):
    """The value of a Python literal (`{'a': True}`): what templates that write a value with str() put in the
    history (Seed-OSS's, Qwen3-Coder's), and so what their models may write; NOT_READ where it is none of JSON's."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return NOT_READ
    try:
        json.dumps(value)
    except (TypeError, ValueError):  # a tuple inside is fine, a set or bytes are not JSON
        return NOT_READ
    return value if isinstance(value, (dict, list, int, float, bool, type(None))) else NOT_READ


def json_types(schema) -> set | None:
    """The JSON types a schema lets a value be, None where it says nothing of them (any)."""
    if not isinstance(schema, dict):
        return None
    kinds = set()
    said = False
    if "type" in schema:
        said = True
        kinds.update(schema["type"] if isinstance(schema["type"], list) else [schema["type"]])
    for key in ("enum", "const"):
        if key in schema:
            said = True
            kinds.update(json_type(value) for value in (schema[key] if key == "enum" else [schema[key]]))
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or []:
            branch_kinds = json_types(branch)
            if branch_kinds is None:
                return None
            said = True
            kinds |= branch_kinds
    if "number" in kinds:  # an integer is a number too
        kinds.add("integer")
    return kinds if said else None


def json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "integer" if isinstance(value, int) or value.is_integer() else "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def skip_space(text, position):
    while position < len(text) and text[position] in WHITESPACE:
        position += 1
    return position


def prefix_length(text, words):
    """The length of the longest end of `text` that begins one of `words` (a marker the text may be writing)."""
    return max((size for word in words for size in range(min(len(word) - 1, len(text)), 0, -1)
                if text.endswith(word[:size])), default=0)
