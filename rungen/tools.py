"""Tool calling (OpenAI's `tools` API) in the model's own format: reading the request's tools, detecting the
format from the chat template, rendering the conversation, constraining the calls, parsing the reply.

Formats (docs/server.md#tool-calling):

- hermes: Qwen2.5 / Hermes, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a call.
- llama3_json: Llama 3.1-3.3, `{"name": ..., "parameters": {...}}` as the reply (after `<|python_tag|>` at
  times); one call a reply, as the published template allows.
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Nemo); granite: Granite 3.x,
  `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`; apertus: Apertus, `<|tools_prefix|>[{"name": {...}}, ...]
  <|tools_suffix|>`.
- mistral_args: `[TOOL_CALLS]name[ARGS]{...}`, one marker a call (Ministral 3, Magistral, Devstral); mistral_call_id
  with `[CALL_ID]` and a 9-character id before `[ARGS]` (Mistral Small 3.2).
- qwen_xml: Qwen3.5, Qwen3-Coder, Nemotron 3, `<tool_call>\n<function=name>\n<parameter=key>\nvalue\n</parameter>\n
  </function>\n</tool_call>`; seed_xml the same in `<seed:tool_call>` (Seed-OSS); glm_xml: GLM-4.5 on,
  `<tool_call>name<arg_key>key</arg_key><arg_value>value</arg_value></tool_call>`; minimax_xml: MiniMax-M2, `<invoke
  name=...>` blocks in one `<minimax:tool_call>`; deepseek_dsml, deepseek_v4_dsml: DeepSeek V3.2 and V4,
  `<｜DSML｜invoke name=...>` blocks in one `<｜DSML｜function_calls>` (V4: `<｜DSML｜tool_calls>`), each value said to
  be text or JSON (rungen/tool_xml.py: elsewhere a value is text where its schema says string, JSON otherwise).
- apriel, nemotron: a JSON list of calls in `<tool_calls>[...]</tool_calls>` (Apriel), `<TOOLCALL>[...]</TOOLCALL>`
  (Nemotron Nano 2); pythonic: LFM2's `<|tool_call_start|>[name(key=value, ...)]<|tool_call_end|>`, values JSON.
- deepseek_v3_1: DeepSeek V3.1, V3.1-Terminus, V3.2-Exp, `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name
  <｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; deepseek_r1: DeepSeek V3, R1 and its distills, the
  same region of `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{...}\n```<｜tool▁call▁end｜>`, one a
  line. Their templates render calls and results but not the tools: those go into the system message in DeepSeek's
  own words.
- kimi: Kimi K2, `<|tool_calls_section_begin|><|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}
  <|tool_call_end|>...<|tool_calls_section_end|>`, the index the conversation's count of calls.
- command_r: Command R7B, Command A, `<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": ..., "parameters":
  {...}}, ...\n]<|END_ACTION|>`.
- harmony: gpt-oss's calls in its commentary channel; gemma: Gemma 4's `<|tool_call>call:name{...}<tool_call|>`
  (rungen/tool_gemma.py). Where xgrammar writes no grammar of a syntax, rungen/tool_schema.py does.
- generic: a template that does not render tools (SmolLM2's among them): the tools are described in a system
  message and a call is the line `{"tool_call": {"name": ..., "arguments": {...}}}`, as llama-server's
  generic handler does.

The format is read from the template's text, never configured; a template that writes calls in another XML
(MiniMax-M3's `<invoke>`) is refused rather than read as Hermes. Markers that are
special tokens (Mistral's, Gemma's) stay in the reply's text, and the grammar takes them as the text they name. A
per-request grammar constrains the calls (at most one whitespace character at a time in the arguments, so a small
model cannot pad them to max_tokens): calls only for `required` or a named function; for `auto`, free text until
the call's opening marker. One incremental parser reads a whole reply and a stream alike, so both give the same
calls (tokenizer.parse_response knows few formats and reports a call only once it closes).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import uuid

from . import tool_gemma, tool_python
from .tool_schema import IDENTIFIER, arguments_grammar, python_name
from .tool_xml import NAME, NUMBER_START, SCALAR, WORDS, prefix_length, read_call, skip_space
from .tool_xml import STYLES as XML_STYLES

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolError(ValueError):
    """A tools field, tool message or tool choice that cannot be honoured (HTTP 400 naming `param`)."""

    def __init__(self, message, param):
        super().__init__(message)
        self.param = param


# Formats


@dataclasses.dataclass(frozen=True)
class Format:
    """How one family writes a call; `region` (begin, end) wraps the whole list of calls (Mistral's, Apriel's,
    MiniMax's)."""

    name: str
    begin: str  # before the function's name
    middle: str  # between the name and the arguments
    end: str  # after the arguments
    # What starts a call's grammar under tool_choice auto: the parser's marker, so that all it reads as a call was
    # held to a tool's schema.
    trigger: str
    separator: str  # between calls
    markers: tuple[str, ...]  # literal text that opens a call region when parsing
    arguments_keys: tuple[str, ...] = ("arguments",)
    region: tuple[str, str] | None = None
    one_call: bool = False  # the template renders one call a reply at most
    native: bool = True  # the template renders the tools itself
    # The pattern of an id the model writes after `middle`, and the text after it, before the arguments: Mistral Small
    # 3.2's nine characters then "[ARGS]", Kimi's index of the call then <|tool_call_argument_begin|>.
    call_id: tuple[str, str] | None = None
    id_first: bool = False  # the id comes before the name: begin, id, call_id[1], name, middle (Command R's)
    name_key: str = "name"  # a JSON call's key of the function's name ("": the name is the call's one key, Apertus's)
    # How the arguments are written: JSON, an XML of rungen/tool_xml.py's (xgrammar's "qwen_xml": <parameter=key>
    # value..., "glm_xml", ...), "gemma" (rungen/tool_gemma.py) or "python" (LFM2's keywords).
    style: str = "json"
    alternate: tuple[str, str] | None = None  # another (begin, middle) the model may write a call with (gpt-oss's)
    # The family's own words for the tools where its template writes none (a key of INSTRUCTIONS); its template's
    # calls are then not used either (DeepSeek's join the arguments as text): a turn's calls are its text.
    instructions: str | None = None
    after_text: str = "\n"  # between a turn's text and its calls, where they are its text (DeepSeek's: nothing)

    @property
    def listed(self) -> bool:
        """The calls are a JSON list in the region (Mistral's, Apriel's), not one tagged call after another."""
        return self.region is not None and self.region[0].rstrip().endswith("[")

    @property
    def texts(self) -> tuple[str, ...]:
        """The format's literal text: what the reply's text must keep of special tokens to be parsed."""
        return (self.begin, self.middle, self.end, self.trigger, *self.markers, *(self.region or ()),
                *(self.call_id[1:] if self.call_id else ()), *(self.alternate or ()),
                *((tool_gemma.QUOTE,) if self.style == "gemma" else ()))


HERMES = Format("hermes", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "<tool_call>", "\n",
                ("<tool_call>",))
LLAMA3_JSON = Format("llama3_json", '{"name": "', '", "parameters": ', "}", '{"name"', "",
                     ('{"name"', "<|python_tag|>"), arguments_keys=("parameters", "arguments"), one_call=True)
MISTRAL = Format("mistral", '{"name": "', '", "arguments": ', "}", "[TOOL_CALLS]", ", ", ("[TOOL_CALLS]",),
                 region=("[TOOL_CALLS] [", "]"))
MISTRAL_ARGS = Format("mistral_args", "[TOOL_CALLS]", "[ARGS]", "", "[TOOL_CALLS]", "", ("[TOOL_CALLS]",))
MISTRAL_CALL_ID = Format("mistral_call_id", "[TOOL_CALLS]", "[CALL_ID]", "", "[TOOL_CALLS]", "", ("[TOOL_CALLS]",),
                         call_id=("[A-Za-z0-9]{9}", "[ARGS]"))
QWEN_XML = Format("qwen_xml", "<tool_call>\n<function=", ">\n", "</function>\n</tool_call>", "<tool_call>", "\n",
                  ("<tool_call>",), style="qwen_xml")
MINIMAX_XML = Format("minimax_xml", '<invoke name="', '">\n', "</invoke>\n", "<minimax:tool_call>", "",
                     ("<minimax:tool_call>",), region=("<minimax:tool_call>\n", "</minimax:tool_call>"),
                     style="minimax_xml")
# Granite 3.x: a JSON list of calls after <|tool_call|>
GRANITE = Format("granite", '{"name": "', '", "arguments": ', "}", "<|tool_call|>", ", ", ("<|tool_call|>",),
                 region=("<|tool_call|>[", "]"))
# Apertus: a JSON list of calls, each {"name": arguments}
APERTUS = Format("apertus", '{"', '": ', "}", "<|tools_prefix|>", ", ", ("<|tools_prefix|>",),
                 region=("<|tools_prefix|>[", "]<|tools_suffix|>"), name_key="")
# Apriel 1.5 and 1.6, Nemotron Nano 2: a JSON list of calls in one region
APRIEL = Format("apriel", '{"name": "', '", "arguments": ', "}", "<tool_calls>", ", ", ("<tool_calls>",),
                region=("<tool_calls>[", "]</tool_calls>"))
NEMOTRON = Format("nemotron", '{"name": "', '", "arguments": ', "}", "<TOOLCALL>", ", ", ("<TOOLCALL>",),
                  region=("<TOOLCALL>[", "]</TOOLCALL>"))
# Seed-OSS: Qwen's XML in a <seed:tool_call>, the values written tight
SEED_XML = Format("seed_xml", "<seed:tool_call>\n<function=", ">\n", "</function>\n</seed:tool_call>",
                  "<seed:tool_call>", "\n", ("<seed:tool_call>",), style="seed_xml")
# LFM2: Python calls in a list, their values JSON
PYTHONIC = Format("pythonic", "", "(", ")", "<|tool_call_start|>", ", ", ("<|tool_call_start|>",),
                  region=("<|tool_call_start|>[", "]<|tool_call_end|>"), style="python")
# LFM2.5: the same calls, their values Python's literals ('text', True, None) as its template writes them
PYTHON_LITERALS = dataclasses.replace(PYTHONIC, name="python_literals", style="python_literal")
# DeepSeek: its calls one after another in a region (V3.1 writes the arguments right after the name; V3 and R1 name
# the function's type first and fence the arguments as JSON, a call a line).
DEEPSEEK_CALLS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DEEPSEEK_V3_1 = Format("deepseek_v3_1", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                       DEEPSEEK_CALLS[0], "", (DEEPSEEK_CALLS[0],), region=DEEPSEEK_CALLS,
                       instructions="deepseek_v3_1", after_text="")
DEEPSEEK_R1 = Format("deepseek_r1", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>", "\n```json\n",
                     "\n```<｜tool▁call▁end｜>", DEEPSEEK_CALLS[0], "\n", (DEEPSEEK_CALLS[0],), region=DEEPSEEK_CALLS,
                     instructions="deepseek_r1", after_text="")
# Kimi K2: functions.name:index, the index the conversation's count of calls (held to a number, not to that count: a
# reply's calls share their grammar), in a region
KIMI = Format("kimi", "<|tool_call_begin|>functions.", ":", "<|tool_call_end|>", "<|tool_calls_section_begin|>", "",
              ("<|tool_calls_section_begin|>",), region=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
              call_id=("0|[1-9][0-9]{0,5}", "<|tool_call_argument_begin|>"))
# Command R7B, Command A: a JSON list of calls, each with its index (held to a number, as Kimi's) before the name,
# laid out as their template lays out a turn's calls
COMMAND_R = Format("command_r", '{"tool_call_id": "', '", "parameters": ', "}", "<|START_ACTION|>", ",\n    ",
                   ("<|START_ACTION|>",), arguments_keys=("parameters",), region=("<|START_ACTION|>[\n    ",
                                                                                "\n]<|END_ACTION|>"),
                   call_id=("0|[1-9][0-9]{0,5}", '", "tool_name": "'), id_first=True, name_key="tool_name")
# DeepSeek V3.2 and V4 (DSML): <｜DSML｜invoke> blocks in one region, named function_calls (V3.2) or tool_calls (V4)
DSML = Format("deepseek_dsml", '<｜DSML｜invoke name="', '">\n', "</｜DSML｜invoke>\n", "<｜DSML｜function_calls>", "",
              ("<｜DSML｜function_calls>",), region=("<｜DSML｜function_calls>\n", "</｜DSML｜function_calls>"),
              style="deepseek_xml")
DSML_V4 = dataclasses.replace(DSML, name="deepseek_v4_dsml", trigger="<｜DSML｜tool_calls>",
                              markers=("<｜DSML｜tool_calls>",),
                              region=("<｜DSML｜tool_calls>\n", "</｜DSML｜tool_calls>"))
GLM_XML = Format("glm_xml", "<tool_call>", "", "</tool_call>", "<tool_call>", "\n", ("<tool_call>",), style="glm_xml")
# gpt-oss: the recipient before the channel, as its template writes a call, or after it, as OpenAI's guide does.
HARMONY = Format("harmony", "<|start|>assistant to=functions.", "<|channel|>commentary json<|message|>", "",
                 "<|start|>assistant to=functions.", "",
                 ("<|start|>assistant to=functions.", "<|start|>assistant<|channel|>commentary to=functions."),
                 one_call=True,
                 alternate=("<|start|>assistant<|channel|>commentary to=functions.", " <|constrain|>json<|message|>"))
GEMMA = Format("gemma", "<|tool_call>" + tool_gemma.OPEN, "", tool_gemma.CLOSE, "<|tool_call>", "", ("<|tool_call>",),
               style="gemma")
GEMMA_TURN_END = "<turn|>\n"  # how Gemma 4's template closes a turn
GENERIC = Format("generic", '{"tool_call": {"name": "', '", "arguments": ', "}}", '{"tool_call"', "\n",
                 ('{"tool_call"',), native=False)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS, MISTRAL_CALL_ID, QWEN_XML, GLM_XML,
                                MINIMAX_XML, APRIEL, NEMOTRON, SEED_XML, PYTHONIC, DEEPSEEK_V3_1, DEEPSEEK_R1, KIMI,
                                COMMAND_R, DSML, DSML_V4, GRANITE, APERTUS, PYTHON_LITERALS,
                                HARMONY, GEMMA, GENERIC)}
GRAMMAR_STYLES = {"seed_xml": "qwen_xml"}  # xgrammar's style of a format's parameters, where it is not its own name
# How templates that write calls in an XML not parsed here show it (MiniMax-M3's).
XML_SIGNS = ("<invoke ",)
KNOWN = ("Hermes/Qwen JSON <tool_call>, Qwen, Seed-OSS, GLM, MiniMax-M2 and DeepSeek's DSML XML, Llama 3 JSON, "
         "Mistral [TOOL_CALLS], Granite <|tool_call|>, Apertus <|tools_prefix|>, Apriel <tool_calls>, Nemotron "
         "<TOOLCALL>, LFM2's Python calls, DeepSeek V3, R1 and V3.1, Kimi K2, Command R7B/A <|START_ACTION|>, gpt-oss "
         "and Gemma 4")


def template_text(chat_template) -> str | None:
    """The template that renders tools: a tokenizer may hold several by name (tool_use, default)."""
    if isinstance(chat_template, dict):
        return chat_template.get("tool_use") or chat_template.get("default")
    return chat_template


def detect_format(chat_template) -> Format | str:
    """The format the chat template asks for, or a one-line reason why tools cannot be served."""
    text = template_text(chat_template)
    if not text:
        return "this model has no chat template"
    if "<|channel|>commentary" in text and "functions." in text:
        return HARMONY
    if GEMMA.begin in text:
        return GEMMA
    if "｜DSML｜" in text:  # llama.cpp's templates build the markers from a dsml_token; V4 names its region tool_calls
        return DSML if "function_calls" in text else DSML_V4
    if KIMI.trigger in text:
        return KIMI
    if COMMAND_R.trigger in text:
        return COMMAND_R
    if DEEPSEEK_V3_1.middle in text:  # <｜tool▁sep｜>: V3 and R1 fence the arguments, V3.1 does not
        return DEEPSEEK_R1 if "```json" in text else DEEPSEEK_V3_1
    if "[TOOL_CALLS]" in text:
        return MISTRAL_CALL_ID if "[CALL_ID]" in text else MISTRAL_ARGS if "[ARGS]" in text else MISTRAL
    if "<tool_call>" in text and "<function=" in text and "<parameter=" in text:
        return QWEN_XML
    if "<tool_call>" in text and "<arg_key>" in text and "<arg_value>" in text:
        return GLM_XML
    if MINIMAX_XML.trigger in text and MINIMAX_XML.begin in text:
        return MINIMAX_XML
    if GRANITE.trigger in text:
        return GRANITE
    if APERTUS.trigger in text:
        return APERTUS
    if APRIEL.region[0] in text:  # before Hermes: its instructions also name <tool_call></tool_call> tags
        return APRIEL
    if NEMOTRON.region[0] in text:
        return NEMOTRON
    if "<|tool_list_start|>" in text:  # LFM2's tool list: its calls are Python's
        return PYTHONIC
    if "List of tools: [" in text:  # LFM2.5's, in plain text: Python calls of Python values
        return PYTHON_LITERALS
    if SEED_XML.trigger in text and "<function=" in text:
        return SEED_XML
    xml = next((sign for sign in XML_SIGNS if sign in text), None)
    if xml is not None:
        return (f"this model's chat template writes tool calls as XML ({xml.strip()}...), which is not parsed here "
                f"(it knows {KNOWN})")
    if "<tool_call>" in text:
        return HERMES
    if '"parameters": ' in text and ("<|start_header_id|>" in text or "<|python_tag|>" in text):
        return LLAMA3_JSON
    if re.search(r"\btools\b", text):
        return f"this model's chat template renders tools in a format not parsed here (it knows {KNOWN})"
    return GENERIC


def open_turn(chat_template, prompt: str, variables: dict | None = None) -> str:
    """The prompt with the model's turn opened where Gemma 4's template left it closed: after tool results it adds
    no generation prompt (the model goes on in its turn), but where that turn held text too it closes it. The turn
    opens as the template opens one with these `variables` (with thinking off, its empty thought channel too)."""
    template = template_text(chat_template) or ""
    if prompt.endswith(GEMMA_TURN_END) and GEMMA.begin in template:
        return prompt + turn_opening(template, json.dumps(variables or {}, sort_keys=True, default=str))
    return prompt


@functools.lru_cache(maxsize=8)
def turn_opening(template: str, variables: str) -> str:
    """The template's generation prompt with these variables: what it writes after a user turn to open the model's."""
    from .chat_template import render

    asked = [{"role": "user", "content": "Hello"}]
    try:
        bare, opened = (render(template, asked, add_generation_prompt=flag, **json.loads(variables))
                        for flag in (False, True))
    except Exception:  # noqa: BLE001 - a template that refuses the probe: its turn's plain opening
        return "<|turn>model\n"
    return opened[len(bare) :] if opened.startswith(bare) else "<|turn>model\n"


# The request


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """The request's tools (OpenAI's shape, parameters filled in), tool choice and parallel_tool_calls."""

    tools: tuple
    choice: str
    parallel: bool

    def names(self):
        return [tool["function"]["name"] for tool in self.tools]


def read_tool_request(body) -> ToolRequest | None:
    """tools, tool_choice and parallel_tool_calls from a chat request body, checked; None without tools."""
    tools = body.get("tools")
    if tools is None:
        for name in ("tool_choice", "parallel_tool_calls"):
            if body.get(name) is not None:
                raise ToolError(f"{name} needs tools", name)
        return None
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}", "tools")
    checked, names = [], set()
    for number, tool in enumerate(tools):
        where = f"tools[{number}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ToolError(f"{where}: only function tools are supported, got type {kind!r}", "tools")
        extra = sorted(key for key in tool if key not in ("type", "function"))
        if extra:
            raise ToolError(f"{where}.{extra[0]} is not supported by this server", "tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"{where}.function must be an object", "tools")
        extra = sorted(key for key in function if key not in FUNCTION_KEYS and function[key] is not None)
        if extra:
            raise ToolError(f"{where}.function.{extra[0]} is not supported by this server", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {json.dumps(name)}",
                            "tools")
        if name in names:
            raise ToolError(f"{where}: two tools are named {name!r}", "tools")
        names.add(name)
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise ToolError(f"{where}.function.description must be a string", "tools")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise ToolError(f"{where}.function.strict must be true or false", "tools")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        check_schema(parameters, f"{where}.function.parameters")
        clean = {"name": name}
        if function.get("description") is not None:
            clean["description"] = function["description"]
        clean["parameters"] = parameters
        checked.append({"type": "function", "function": clean})
    return ToolRequest(tuple(checked), read_choice(body.get("tool_choice"), names),
                       read_parallel(body.get("parallel_tool_calls")))


def check_schema(schema, where):
    """A function's parameters: a valid JSON schema (Draft 2020-12) describing an object."""
    import jsonschema

    if not isinstance(schema, dict):
        raise ToolError(f"{where} must be a JSON schema object", "tools")
    if schema.get("type", "object") != "object":
        raise ToolError(f"{where} must describe an object (type \"object\"), got type {json.dumps(schema['type'])}",
                        "tools")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as error:
        path = "".join(f"[{json.dumps(part)}]" for part in error.absolute_path)
        raise ToolError(f"{where}{path} is not a valid JSON schema: {error.message}", "tools") from error
    remote = next(remote_refs(schema), None)
    if remote is not None:  # xgrammar would warn and constrain nothing there
        raise ToolError(f"{where}: $ref {remote!r} points outside the schema; only local refs (#/...) are "
                        "supported", "tools")


def remote_refs(value):
    if isinstance(value, dict):
        ref = value.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            yield ref
        for item in value.values():
            yield from remote_refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from remote_refs(item)


def read_choice(choice, names):
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) <= {"type", "function"}:
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or set(function) - {"name"}:
            raise ToolError('tool_choice.function must be {"name": ...}', "tool_choice")
        if name not in names:
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(sorted(names))})",
                            "tool_choice")
        return name
    raise ToolError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                    '{"name": ...}}', "tool_choice")


def read_parallel(value):
    if value is None:
        return True  # OpenAI's default
    if not isinstance(value, bool):
        raise ToolError(f"parallel_tool_calls must be true or false, got {json.dumps(value)}", "parallel_tool_calls")
    return value


# The conversation


def check_answers(messages) -> dict[str, str]:
    """Each assistant turn's tool calls answered by the tool messages right after it, each once (as OpenAI and
    Anthropic require): a result without its call, or a call without its result, is a conversation the model
    never had. Raises ToolError; returns the calls' names by id."""
    waiting, names, asked_at = {}, {}, None
    for number, message in enumerate(messages):
        if message["role"] == "tool":
            call_id = message["tool_call_id"]
            if call_id not in waiting:
                again = " again" if call_id in names else ""
                raise ToolError(f"messages[{number}]: tool_call_id {call_id!r} answers no tool call{again} of the "
                                "assistant message before it", "messages")
            del waiting[call_id]
            continue
        if waiting:
            raise ToolError(f"messages[{asked_at}].tool_calls: {', '.join(map(repr, waiting))} answered by no tool "
                            f"message before messages[{number}]", "messages")
        for call in message.get("tool_calls") or []:
            if call["id"] in names:
                raise ToolError(f"messages[{number}].tool_calls: the id {call['id']!r} is used twice", "messages")
            names[call["id"]] = waiting[call["id"]] = call["name"]
        asked_at = number
    if waiting:
        raise ToolError(f"messages[{asked_at}].tool_calls: {', '.join(map(repr, waiting))} answered by no tool "
                        "message (the conversation ends first)", "messages")
    return names


def template_messages(messages, fmt: Format, request: ToolRequest | None, calls_as_text: bool = False,
                      describe: bool = False):
    """The conversation as the chat template takes it, calls and results in the format's shape (the generic format
    describes the tools in the system message); every call answered (check_answers). `calls_as_text`: the template
    renders no tool_calls (SmolLM3's, LFM2's), so an assistant turn's calls are its text, as the model wrote them.
    `describe`: the template writes no tools, so the format's instructions describe them (DeepSeek's)."""
    calls = check_answers(messages)  # id -> name
    ids = template_ids(fmt, messages)
    out = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            name = calls[message["tool_call_id"]]
            if fmt.native:
                out.append({"role": "tool", "content": message["content"], "name": name,
                            "tool_call_id": ids[message["tool_call_id"]]})
            else:
                result = json.dumps({"tool_response": {"name": name, "content": message["content"]}})
                if out and out[-1].get("tool_results"):
                    out[-1]["content"] += "\n" + result
                else:
                    out.append({"role": "user", "content": result, "tool_results": True})
        elif message.get("tool_calls"):
            if fmt.native and not (calls_as_text and fmt.style in ("json", "python", "python_literal") and
                                   not fmt.call_id):
                out.append({"role": "assistant", "content": message.get("content") or "",
                            "tool_calls": [{"id": ids[call["id"]], "type": "function",
                                            "function": {"name": call["name"], "arguments": call["arguments"]}}
                                           for call in message["tool_calls"]]})
            else:
                written = calls_text(fmt, message["tool_calls"])
                out.append({"role": "assistant",
                            "content": message["content"] + fmt.after_text + written if message.get("content")
                            else written})
        else:
            out.append({"role": role, "content": message["content"] if message["content"] is not None else ""})
        if role == "assistant" and message.get("reasoning_content") is not None:
            out[-1]["reasoning_content"] = message["reasoning_content"]  # for the templates that read it back
    for message in out:
        message.pop("tool_results", None)
    if not fmt.native and request is not None and request.choice != "none":
        described = generic_instructions(request)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    elif describe and request is not None and request.choice != "none":
        # after the system prompt, as DeepSeek's cards lay it out ("{system prompt}\n\n{tools}"); R1's template
        # keeps the last system message alone
        described = "\n\n" + INSTRUCTIONS[fmt.instructions](request)
        last = max((number for number, message in enumerate(out) if message["role"] == "system"), default=None)
        if last is None:
            out.insert(0, {"role": "system", "content": described})
        else:
            out[last] = {"role": "system", "content": out[last]["content"] + described}
    return out


def calls_text(fmt: Format, calls) -> str:
    """An assistant turn's calls as the model writes them, in a format whose arguments are JSON (or Python keywords
    of JSON values)."""
    def arguments(values):
        if fmt.style not in ("python", "python_literal"):
            return json.dumps(values, ensure_ascii=False)
        named = next((key for key in values if not python_name(key)), None)
        if named is not None:
            raise ToolError(f"messages: a call's argument {named!r} is no Python identifier, which this model's calls "
                            "name arguments by", "messages")
        value_text = tool_python.python_text if fmt.style == "python_literal" else \
            functools.partial(json.dumps, ensure_ascii=False)
        return ", ".join(f"{key}={value_text(value)}" for key, value in values.items())

    written = fmt.separator.join(fmt.begin + call["name"] + fmt.middle + arguments(call["arguments"]) + fmt.end
                                 for call in calls)
    return fmt.region[0] + written + fmt.region[1] if fmt.region else written


def template_ids(fmt, messages) -> dict[str, str]:
    """Each call's id as the template takes it, alike for call and result: Mistral's templates take 9-character
    alphanumeric ids only; Kimi's model knows a call as `functions.name:index` (Kimi K2's first template writes a
    result's id as given, and numbers the calls of a turn from 0)."""
    ids = {}
    for message in messages:
        for index, call in enumerate(message.get("tool_calls") or []):
            call_id = call["id"]
            if fmt is KIMI:
                ids[call_id] = f"functions.{call['name']}:{index}"
            elif fmt.trigger == "[TOOL_CALLS]" and not (len(call_id) == 9 and call_id.isalnum()):
                ids[call_id] = hashlib.sha256(call_id.encode()).hexdigest()[:9]
            else:
                ids[call_id] = call_id
    return ids


def generic_instructions(request: ToolRequest) -> str:
    described = "\n".join(json.dumps(tool["function"]) for tool in request.tools)
    several = "one JSON object per call, each on its own line" if request.parallel else "one JSON object"
    return ("You can call the following tools, each given with its name, what it does and a JSON schema of its "
            f"arguments:\n{described}\n\nTo call a tool, answer with {several}, and nothing else:\n"
            '{"tool_call": {"name": <tool name>, "arguments": <arguments object>}}\n'
            'A tool\'s result comes back as {"tool_response": {"name": <tool name>, "content": <result>}}.')


def deepseek_v3_1_instructions(request: ToolRequest) -> str:
    """The tools as DeepSeek-V3.1's model card writes them into the system prompt, word for word."""
    described = "".join(f"### {function['name']}\nDescription: {function.get('description', '')}\n\nParameters: "
                        f"{json.dumps(function['parameters'], ensure_ascii=False)}\n\n"
                        for function in (tool["function"] for tool in request.tools))
    return ("## Tools\nYou have access to the following tools:\n\n" + described +
            "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
            "tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{additional_tool_calls}<｜tool▁calls▁end｜>"
            "\n\nWhere:\n- `tool_call_name` must be an exact match to one of the available tools\n"
            "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
            "- For multiple tool calls, chain them directly without separators or spaces")


def deepseek_r1_instructions(request: ToolRequest) -> str:
    """The functions as DeepSeek V3's function-calling example lists them, then the call's syntax (R1's distills
    were not trained on calls: an example is all they have, as llama.cpp's R1 template gives them)."""
    listed = "\n".join(f"- `{tool['function']['name']}`:\n```json\n"
                       f"{json.dumps(tool['function'], indent=4, ensure_ascii=False)}\n```" for tool in request.tools)
    several = ("\nFor several calls, write each <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> on a line of its own "
               "before <｜tool▁calls▁end｜>." if request.parallel else "")
    return ("## Tools\n\n### Function\n\nYou have the following functions available:\n\n" + listed +
            "\n\nTo call a function, answer with:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
            "function_name\n```json\n{arguments}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>" + several)


INSTRUCTIONS = {"deepseek_v3_1": deepseek_v3_1_instructions, "deepseek_r1": deepseek_r1_instructions}


# The constraint


def tool_grammar(fmt: Format, request: ToolRequest, reply_schema: str | None = None) -> str | None:
    """The EBNF grammar (xgrammar's dialect) a reply must follow, or None for tool_choice none. `reply_schema`:
    the response format's JSON schema, which a reply under tool_choice auto follows where it calls no tool."""
    import xgrammar as xgr
    from xgrammar.structural_tag import (
        ConstStringFormat,
        GrammarFormat,
        JSONSchemaFormat,
        OrFormat,
        RegexFormat,
        SequenceFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
        TriggeredTagsFormat,
    )

    from .constrain import json_string_characters

    if request.choice == "none":
        return None
    tools = [tool for tool in request.tools if request.choice in ("auto", "required", tool["function"]["name"])]
    tags = []
    for tool in tools:
        function = tool["function"]
        try:
            xgr.Grammar.from_json_schema(json.dumps(function["parameters"]))
        except (RuntimeError, ValueError, TypeError) as error:
            message = re.sub(r"^\[[0-9:]+\] \S+: ", "", str(error).splitlines()[0] if str(error) else "")
            raise ToolError(f"tools: the parameters of {function['name']!r} cannot be compiled: {message}",
                            "tools") from error
        if fmt.style in ("gemma", "python", "python_literal"):
            try:
                arguments = GrammarFormat(grammar=arguments_grammar(function["parameters"], fmt.style))
            except ValueError as error:
                raise ToolError(f"tools: the parameters of {function['name']!r} cannot be compiled: {error}",
                                "tools") from error
        else:
            arguments = JSONSchemaFormat(json_schema=function["parameters"],
                                         style=GRAMMAR_STYLES.get(fmt.style, fmt.style), max_whitespace_cnt=1)
        if fmt.id_first:  # the model's id, then the name: one begin for every tool, the name in the content
            tags.append(TagFormat(begin=fmt.begin, end=fmt.end, content=SequenceFormat(elements=[
                RegexFormat(pattern=fmt.call_id[0]), ConstStringFormat(value=fmt.call_id[1] + function["name"] +
                                                                       fmt.middle), arguments])))
            continue
        if fmt.call_id:  # the model's own id, then the arguments
            arguments = SequenceFormat(elements=[RegexFormat(pattern=fmt.call_id[0]),
                                                 ConstStringFormat(value=fmt.call_id[1]), arguments])
        for begin, middle in ((fmt.begin, fmt.middle), *([fmt.alternate] if fmt.alternate else [])):
            tags.append(TagFormat(begin=begin + function["name"] + middle, content=arguments, end=fmt.end))
    single = fmt.one_call or not request.parallel or request.choice not in ("auto", "required")
    calls = TagsWithSeparatorFormat(tags=tags, separator=fmt.separator, at_least_one=True,
                                    stop_after_first=single)
    if fmt.region is not None:
        calls = TagFormat(begin=fmt.region[0], content=calls, end=fmt.region[1])
    if request.choice == "auto" and reply_schema is not None:  # the calls, or the answer in its format
        answer = xgr.Grammar.from_json_schema(reply_schema, any_whitespace=False)  # as without tools: compact
        structure = OrFormat(elements=[calls, GrammarFormat(grammar=json_string_characters(str(answer)))])
    elif request.choice == "auto":
        if fmt.region is not None:
            structure = TriggeredTagsFormat(triggers=[fmt.trigger], tags=[calls], stop_after_first=True)
        else:
            triggers = [fmt.trigger, *([fmt.alternate[0]] if fmt.alternate else [])]
            structure = TriggeredTagsFormat(triggers=triggers, tags=tags, stop_after_first=single)
    else:
        structure = calls
    grammar = xgr.Grammar.from_structural_tag(StructuralTag(format=structure).model_dump_json())
    return json_string_characters(str(grammar))


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
    call's opening, cut short, where it did (a call, or the start of a marker, after calls is dropped)."""
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
    if fmt.style in ("python", "python_literal"):
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
    elif marker in ("<tool_call>", "<|python_tag|>"):
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
        if end is None or end == -1:
            return end
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


@dataclasses.dataclass
class ToolPlan:
    """A chat request's tools applied: the template's conversation and tools, the reply's grammar and the format
    its calls are parsed in (None: unconstrained / not parsed)."""

    messages: list
    template_tools: list | None = None
    grammar: str | None = None
    fmt: Format | None = None
    calls_only: bool = False  # tool_choice required or named
    holds_format: bool = False  # the grammar holds the response format (an answer that calls no tool follows it)
    schemas: dict | None = None  # {tool name: parameters}

    def parser(self):
        return CallParser(self.fmt, self.calls_only, self.schemas) if self.fmt is not None else None

    def kept(self, tokenizer) -> frozenset:
        """The format's special tokens: kept in the reply's text, and taken by the grammar as their names."""
        from .logprobs import special_ids

        return special_ids(tokenizer, self.fmt.texts) if self.fmt is not None else frozenset()


def plan_tools(body, messages, chat_template, reply_schema: str | None = None) -> ToolPlan:
    """The ToolPlan of a chat request (messages as read, with their tool fields; `reply_schema`: its response
    format's JSON schema, which the grammar then holds). Raises ToolError."""
    request = read_tool_request(body)
    if request is None and not any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        return ToolPlan(messages)
    fmt = detect_format(chat_template)
    if isinstance(fmt, str):
        raise ToolError(f"tools: {fmt}", "tools" if request is not None else "messages")
    calling = request is not None and request.choice != "none"
    template = template_text(chat_template)
    calls_as_text = "tool_calls" not in template or fmt.instructions is not None
    describe = fmt.instructions is not None and re.search(r"\btools\b", template) is None
    return ToolPlan(template_messages(messages, fmt, request, calls_as_text, describe),
                    template_tools=list(request.tools) if calling and fmt.native and not describe else None,
                    grammar=tool_grammar(fmt, request, reply_schema) if calling else None,
                    fmt=fmt if calling else None, calls_only=calling and request.choice != "auto",
                    holds_format=calling and reply_schema is not None,
                    schemas={tool["function"]["name"]: tool["function"].get("parameters", {})
                             for tool in request.tools} if calling else None)


def prompt_constraint(plan: ToolPlan, loaded, settings, compiled: dict, refusal: str | None, eos_ids):
    """The compiled grammar of a jsonl line's tool calls (`compiled` caches them by grammar); raises
    PromptError where these settings cannot take it. `refusal`: why the engine cannot run these settings
    (rungen.batch.engine_refusal), or None; eos_ids: the ids that end a reply."""
    from .constrain import ConstraintError, compile_constraint
    from .errors import PromptError

    if settings.constraint is not None:
        raise PromptError('"tools": one constraint per prompt, and --json_schema, --regex or --grammar is one')
    if refusal:
        raise PromptError(f'"tools": the calls are constrained per prompt on the engine, which {refusal} does not '
                          'run on')
    if plan.grammar not in compiled:
        try:
            compiled[plan.grammar] = compile_constraint("tools", plan.grammar, loaded.tokenizer, loaded.vocab_size,
                                                        eos_ids, plan.kept(loaded.tokenizer))
        except ConstraintError as error:
            raise PromptError(str(error)) from error
    return compiled[plan.grammar]


def record_of(plan: ToolPlan | None, generated_text: str) -> dict:
    """A jsonl record's tool fields: the reply's content and tool_calls (OpenAI's shapes), when it may call."""
    if plan is None or plan.fmt is None:
        return {}
    content, calls = message_of(plan.parser(), generated_text)
    return {"content": content, "tool_calls": calls}


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
