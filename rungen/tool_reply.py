"""A reply read in its tool-call format (rungen/tool_formats.py): its content and calls, from a whole reply or a
growing stream alike, so both give the same calls (tokenizer.parse_response knows few formats and reports a call only
once it closes). The grammar makes a call's shape exact, so one small incremental parser covers the formats; a call's
arguments, JSON, only grow as the reply does.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from . import tool_gemma, tool_python
from .tool_formats import GENERIC, HARMONY, HERMES, Format
from .tool_schema import IDENTIFIER
from .tool_xml import NAME, NUMBER_START, SCALAR, WORDS, prefix_length, read_call, skip_space
from .tool_xml import STYLES as XML_STYLES

# The reply


@dataclasses.dataclass
class Call:
    name: str | None
    arguments: str  # the raw JSON text of the arguments as far as generated
    complete: bool


class CallParser:
    """Splits a growing reply into content and calls. feed() and finish() return events: ("content", text),
    ("call", index, id, name), ("arguments", index, text); content is the text outside calls, stripped."""

    def __init__(self, fmt: Format, calls_only: bool = False, schemas: dict | None = None):
        self.fmt = fmt
        self.schemas = schemas  # {name: parameters}: how XML values are read (a string's text, or JSON)
        # tool_choice required or named: the grammar allows calls alone, so text outside one (a call cut before its
        # name by max_tokens) is no content.
        self.calls_only = calls_only
        self.text = ""
        self.content_sent = 0  # characters of the (left-stripped) content sent
        self.calls = []  # [id, name, arguments sent]
        self.finished = []  # each named call's: finished or not (a stop string may cut one)
        self.unnamed = False  # a call begun but cut before its name

    def feed(self, text, final=False):
        self.text += text
        content, calls = parse(self.fmt, self.text, final, self.schemas)
        self.finished = [call.complete for call in calls if call.name is not None]
        self.unnamed = any(call.name is None for call in calls)
        events = []
        # Whitespace at the end may be all there is between two calls: it waits for text to follow it.
        content = "" if self.calls_only else content.strip()
        if len(content) > self.content_sent:
            events.append(("content", content[self.content_sent :]))
            self.content_sent = len(content)
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if index == len(self.calls):
                self.calls.append(["call_" + uuid.uuid4().hex[:24], call.name, 0])
                events.append(("call", index, self.calls[index][0], call.name))
            sent = self.calls[index][2]
            arguments = call.arguments if call.arguments or not call.complete else "{}"
            if len(arguments) > sent:
                events.append(("arguments", index, arguments[sent:]))
                self.calls[index][2] = len(arguments)
        return events

    def finish(self):
        return self.feed("", final=True)

    @property
    def complete(self) -> bool:
        """Every call so far is finished (a call cut before its name is none)."""
        return all(self.finished) and not self.unnamed


def parse(fmt: Format, text: str, final: bool, schemas=None):
    """(content, calls) of a reply so far. Text that may be the start of a marker is left out unless
    `final`; a region that is not a call after all (no JSON where one must be) stays content. A reply that ends
    (`final`) inside a call before its name: that text is content where the reply made no call, and the next
    call's opening, cut short, where it did (a call, or the start of a marker, after calls is dropped). U+FFFD at the
    text's end stands for a character not yet whole (a marker's multi-byte ｜, DeepSeek's), or one the reply's end cut:
    none of it."""
    text = text.rstrip("\ufffd")
    content, calls, position = [], [], 0
    while True:
        start, marker = find_marker(fmt, text, position)
        if start is None:
            rest = text[position:]
            if not final:
                rest = rest[: len(rest) - prefix_length(rest, fmt.markers)]
            elif calls and rest.strip() and prefix_length(rest.strip(), fmt.markers) == len(rest.strip()):
                rest = ""
            content.append(rest)
            break
        content.append(text[position:start])
        found = []
        end = parse_region(fmt, text, start, marker, found, schemas)
        if end == -1:  # not a call: the marker is text
            content.append(marker)
            position = start + len(marker)
            continue
        calls += found
        if end is None:
            if final and all(call.name is None for call in calls):
                content.append(text[start:])
                calls = []
            break
        position = end
    return "".join(content), calls


def find_marker(fmt, text, position):
    best = (None, None)
    for marker in fmt.markers:
        index = text.find(marker, position)
        if index != -1 and (best[0] is None or index < best[0]):
            best = (index, marker)
    return best


def parse_region(fmt, text, start, marker, found, schemas=None):
    """Parses one region's calls into `found`; returns its end, None if the text ends inside, -1 if no call."""
    if fmt.middle in ("[ARGS]", "[CALL_ID]"):
        return parse_named_call(fmt, text, start + len(marker), found)
    if fmt is HARMONY:
        return parse_harmony_call(text, start + len(marker), found)
    if fmt.style == "gemma":
        end, call = tool_gemma.read_call(text, start + len(marker))
        if call is not None:
            found.append(Call(*call))
        return end
    if fmt.keywords:
        return parse_python_calls(fmt, text, start + len(marker), found)
    if fmt.style != "json":
        return parse_xml_region(fmt, text, start + len(marker), found, schemas)
    if fmt.region is not None and not fmt.listed:
        return parse_tagged_calls(fmt, text, start + len(marker), found)
    listed = fmt.listed  # a JSON list of calls after the marker (Mistral's, Apriel's)
    if listed:
        position = list_opening(text, start + len(marker))
        if position is None or position == -1:
            return position
    elif marker in ("<tool_call>", "<|python_tag|>", "<|python_start|>"):
        position = skip_space(text, start + len(marker))
    else:
        position = start  # the marker is the call's own opening
    while True:
        position = skip_space(text, position)
        if position == len(text):
            return None
        if text[position] != "{":
            return -1 if not found else position
        call, end = parse_call(fmt, text, position)
        if call is None:
            return -1
        found.append(call)
        if end is None:
            return None
        position = skip_space(text, end)
        if marker == "<tool_call>":
            closing = "</tool_call>"
            if text.startswith(closing, position):
                return position + len(closing)
            if closing.startswith(text[position:]):
                return None  # the closing tag is on its way (or the reply ended before it)
            return -1 if not found[:-1] else position
        if listed:
            end, position = after_item(fmt, text, position)
            if position is None:
                return end
            continue
        if marker == "<|python_tag|>" and text.startswith(";", position):
            position += 1
            continue
        return end


def list_opening(text, position):
    """The position after the "[" that opens a list of calls at `position` (after whitespace); None while the text
    ends first, -1 where no list opens."""
    position = skip_space(text, position)
    if position == len(text):
        return None
    return position + 1 if text[position] == "[" else -1


def after_item(fmt, text, position):
    """What follows a call in a list, at `position`: (None, the next call's position) after a comma, else (the
    list's end, None): its region's end after "]", None while the text ends first, -1 for anything else."""
    if position == len(text):
        return None, None
    if text[position] == ",":
        return None, position + 1
    if text[position] == "]":
        return region_end(fmt, text, position + 1), None
    return -1, None


def region_end(fmt, text, position):
    """The end of a list of calls whose "]" ends at `position`: after the region's closing tag, if it has one
    (Apriel's </tool_calls>); None while that is on its way."""
    tail = fmt.region[1][fmt.region[1].index("]") + 1 :]
    if text.startswith(tail, position):
        return position + len(tail)
    return None if tail.startswith(text[position:]) else position


def parse_xml_region(fmt, text, position, found, schemas):
    """The XML call after a <tool_call> at `position`, or where the format wraps its calls in a region (MiniMax's
    <minimax:tool_call>), each call up to the region's end; as parse_region."""
    style = XML_STYLES[fmt.style]
    if fmt.region is None:
        end, call = read_call(style, text, position, schemas)
        if call is not None:
            found.append(Call(*call))
        return end
    while True:
        position = skip_space(text, position)
        rest = text[position:]
        if rest.startswith(fmt.region[1]):
            return position + len(fmt.region[1]) if found else -1
        if not rest or fmt.region[1].startswith(rest):
            return None  # the region's end, or another call, is on its way
        end, call = read_call(style, text, position, schemas)
        if call is not None:
            found.append(Call(*call))
        if end == -1:
            return -1 if not found else position  # what follows the calls is no call: the calls stand
        if end is None:
            return None
        position = end


ID = re.compile(r"[A-Za-z0-9]*")  # a call's id as a model writes it (its format's pattern holds it)


def parse_tagged_calls(fmt, text, position, found):
    """DeepSeek's and Kimi's calls after the region's opening at `position`, `begin name middle {...} end` (Kimi's
    index of the call after `middle`) one after another (whitespace between), up to the region's end: into `found`;
    as parse_region."""
    while True:
        position = skip_space(text, position)
        rest = text[position:]
        if found and rest.startswith(fmt.region[1]):
            return position + len(fmt.region[1])
        if not rest or fmt.begin.startswith(rest) or found and fmt.region[1].startswith(rest):
            return None  # a call, or the region's end, on its way
        if not rest.startswith(fmt.begin):
            return -1 if not found else position
        name = NAME.match(text, position + len(fmt.begin)).group()
        head = position + len(fmt.begin) + len(name)
        pieces = (fmt.middle,) if fmt.call_id is None else (fmt.middle, ID, fmt.call_id[1])
        for piece in pieces:  # the name's end, and Kimi's index of the call: what comes before the arguments
            if piece is ID:
                written = ID.match(text, head).group()
                head += len(written)
                if head < len(text) and not re.fullmatch(fmt.call_id[0], written):
                    return -1 if not found else position
            elif not text.startswith(piece, head):
                if piece.startswith(text[head:]):  # on its way
                    found.append(Call(None, "", False))
                    return None
                return -1 if not found else position
            else:
                head += len(piece)
        if not name:
            return -1 if not found else position
        end = arguments_call(text, head, name, found)
        if end is None or end == -1:
            return end if end is None or not found else position
        if text.startswith(fmt.end, end):
            position = end + len(fmt.end)
        elif fmt.end.startswith(text[end:]):
            return None  # the call's closing on its way
        else:
            return -1 if not found[:-1] else end


def parse_named_call(fmt, text, position, found):
    """Mistral's `name[ARGS]{...}` (`name[CALL_ID]id[ARGS]{...}`) after a [TOOL_CALLS] at `position`: one call into
    `found`; its end, None if the text ends inside, -1 if no call."""
    head_end = text.find("[ARGS]", position)
    head = text[position:] if head_end == -1 else text[position:head_end]
    if head_end == -1:  # the name, and the id, may be on their way
        head = head[: len(head) - prefix_length(head, ("[ARGS]", "[CALL_ID]"))]
    name, marked, call_id = head.partition("[CALL_ID]")
    if fmt.call_id and head_end != -1 and not marked:
        return -1
    if not re.fullmatch(r"[A-Za-z0-9_-]*", name) or not re.fullmatch(r"[A-Za-z0-9]*", call_id) \
            or head_end != -1 and not name:
        return -1
    if head_end == -1:
        found.append(Call(None, "", False))
        return None
    return arguments_call(text, head_end + len("[ARGS]"), name, found)


def arguments_call(text, position, name, found):
    """The call of `name` whose arguments, a JSON object, start at `position`, into `found`; its end, None if the
    text ends inside, -1 if no object starts there."""
    if position == len(text):  # a call once its arguments begin: a stream never takes one back
        found.append(Call(None, "", False))
        return None
    if text[position] != "{":
        return -1
    end = value_end(text, position)
    if end == -1:
        return -1
    found.append(Call(name, text[position:end] if end is not None else text[position:], end is not None))
    return end


HARMONY_HEADER = re.compile(r"(?:<\|channel\|>commentary|<\|constrain\|>|json|\s)*")  # between name and message
HARMONY_PIECES = ("<|message|>", "<|channel|>commentary", "<|constrain|>", "json")


def parse_python_calls(fmt, text, position, found):
    """LFM2's `[name(key=value, ...), ...]` after its <|tool_call_start|> at `position`, each value JSON (LFM2.5's a
    Python literal): the calls into `found`, their arguments the JSON object of the keywords as far as written; as
    parse_region."""
    position = list_opening(text, position)
    if position is None or position == -1:
        return position
    while True:
        position = skip_space(text, position)
        if position == len(text):
            return None
        if text[position] == "]" and found:
            return region_end(fmt, text, position + 1)
        end, call = python_call(text, position, fmt.style == "python_literal")
        if call is not None:
            found.append(call)
        if end is None or end == -1:
            return end
        end, position = after_item(fmt, text, skip_space(text, end))
        if position is None:
            return end


def python_call(text, position, literals=False):
    """(end, Call) of `name(key=value, ...)` at `position`, its values JSON or (`literals`) Python's literals, read
    into JSON; end None while the text ends inside, -1 if no call."""
    name = NAME.match(text, position).group()
    position += len(name)
    if position == len(text):
        return None, Call(None, "", False)
    if text[position] != "(" or not name:
        return -1, None
    out, position = ["{"], skip_space(text, position + 1)
    while True:
        if position == len(text):
            return None, Call(name, "".join(out), False)
        if text[position] == ")":
            return position + 1, Call(name, "".join(out) + "}", True)
        key = IDENTIFIER.match(text, position)
        if key is None:
            return -1, None
        position = skip_space(text, key.end())
        if position == len(text):
            return None, Call(name, "".join(out) + json.dumps(key.group())[:-1], False)
        if text[position] != "=":
            return -1, None
        out.append(json.dumps(key.group()) + ": ")
        position = skip_space(text, position + 1)
        if literals:
            end, value = tool_python.read_value(text, position)
        else:
            end = value_end(text, position) if position < len(text) else None
            value = text[position:end] if end is not None else text[position:]
        if end == -1:
            return -1, None
        out.append(value)
        if end is None:
            return None, Call(name, "".join(out), False)
        position = skip_space(text, end)
        if position < len(text) and text[position] == ",":
            out.append(", ")
            position = skip_space(text, position + 1)
        elif position < len(text) and text[position] != ")":
            return -1, None


def parse_harmony_call(text, position, found):
    """gpt-oss's `name<|channel|>commentary json<|message|>{...}` (or ` <|constrain|>json<|message|>{...}` where
    the recipient came after the channel) at `position`, after "to=functions.": one call into `found`; its end,
    None if the text ends inside, -1 if no call."""
    name = NAME.match(text, position).group()
    message = text.find("<|message|>", position + len(name))
    head = text[position + len(name) : len(text) if message == -1 else message]
    if message == -1:
        head = head[: len(head) - prefix_length(head, HARMONY_PIECES)]
    if HARMONY_HEADER.fullmatch(head) is None or (message != -1 or head) and not name:
        return -1
    if message == -1:
        found.append(Call(None, "", False))
        return None
    return arguments_call(text, message + len("<|message|>"), name, found)


def parse_call(fmt, text, position):
    """(Call, end) for the JSON object at `position`; end None while unfinished, Call None if no call."""
    fields, end = object_fields(text, position)
    if fields is None:
        return None, None
    if fmt is GENERIC:
        inner = fields.get("tool_call")
        if inner is None or inner[0] == len(text):
            return (None, None) if end is not None else (Call(None, "", False), None)
        if text[inner[0]] != "{":
            return None, None
        call, _ = parse_call(HERMES, text, inner[0])
        if call is None:
            return None, None
        call.complete = call.complete and end is not None
        return call, end
    if fmt.name_key == "":  # the name is the one key, its value the arguments
        if not fields:
            return (Call(None, "", False), None) if end is None else (None, None)
        (name, (start, stop)), = list(fields.items())[:1]
        if len(fields) > 1 or stop is not None and text[start] != "{":
            return None, None
        return Call(name, text[start:stop] if stop is not None else text[start:], end is not None), end
    name = None
    if fmt.name_key in fields and fields[fmt.name_key][1] is not None:
        try:
            name = json.loads(text[fields[fmt.name_key][0] : fields[fmt.name_key][1]])
        except json.JSONDecodeError:
            return None, None
        if not isinstance(name, str):
            return None, None
    elif end is not None:
        return None, None
    arguments = ""
    for key in fmt.arguments_keys:
        if key in fields:
            value_start, value_end = fields[key]
            arguments = text[value_start:value_end] if value_end is not None else text[value_start:]
            break
    return Call(name, arguments, end is not None), end


def object_fields(text, position):
    """({key: (value start, value end or None)}, object end or None) at `position`; (None, None): not JSON."""
    assert text[position] == "{"
    fields = {}
    position = skip_space(text, position + 1)
    if position == len(text):
        return fields, None
    if text[position] == "}":
        return fields, position + 1
    while True:
        if position == len(text):
            return fields, None
        if text[position] != '"':
            return None, None
        key_end = value_end(text, position)
        if key_end is None:
            return fields, None
        if key_end == -1:
            return None, None
        key = json.loads(text[position:key_end])
        position = skip_space(text, key_end)
        if position == len(text):
            return fields, None
        if text[position] != ":":
            return None, None
        position = skip_space(text, position + 1)
        if position == len(text):
            fields[key] = (position, None)
            return fields, None
        end = value_end(text, position)
        if end == -1:
            return None, None
        fields[key] = (position, end)
        if end is None:
            return fields, None
        position = skip_space(text, end)
        if position == len(text):
            return fields, None
        if text[position] == "}":
            return fields, position + 1
        if text[position] != ",":
            return None, None
        position = skip_space(text, position + 1)


def value_end(text, position):
    """Where the JSON value at `position` ends; None if the text ends first, -1 if it is not JSON."""
    first = text[position]
    if first == '"':
        index = position + 1
        while index < len(text):
            if text[index] == "\\":
                index += 2
                continue
            if text[index] == '"':
                return index + 1
            index += 1
        return None
    if first in "{[":
        depth, index, in_string = 0, position, False
        while index < len(text):
            char = text[index]
            if in_string:
                if char == "\\":
                    index += 1
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return index + 1
            index += 1
        return None
    if NUMBER_START.fullmatch(text, position) or any(word.startswith(text[position:]) for word in WORDS):
        return None  # a number or word on its way ("1." may go on to "1.5")
    match = SCALAR.match(text, position)
    return -1 if match is None else match.end()


def message_of(parser: CallParser, text: str):
    """(content or None, tool_calls in OpenAI's shape) of a whole reply."""
    events = parser.feed(text) + parser.finish()
    return assemble(events)


def assemble(events):
    content, calls = "", []
    for event in events:
        if event[0] == "content":
            content += event[1]
        elif event[0] == "call":
            calls.append({"id": event[2], "type": "function", "function": {"name": event[3], "arguments": ""}})
        else:
            calls[event[1]]["function"]["arguments"] += event[2]
    return (content or None) if calls else content, calls


def stream_deltas(events):
    """Chunk deltas (OpenAI's stream shape) for parser events."""
    deltas = []
    for event in events:
        if event[0] == "content":
            deltas.append({"content": event[1]})
        elif event[0] == "call":
            deltas.append({"tool_calls": [{"index": event[1], "id": event[2], "type": "function",
                                           "function": {"name": event[3], "arguments": ""}}]})
        else:
            deltas.append({"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]})
    return deltas
