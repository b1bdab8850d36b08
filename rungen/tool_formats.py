"""The tool-call formats of the published model families, one row each, and which of them a chat template asks for
(read from its text, never configured); rungen/tools.py applies a format to a request, rungen/tool_reply.py reads a
reply in it (docs/server.md#tool-calling).

- hermes: Qwen2.5 / Hermes, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a call.
- llama3_json: Llama 3.1-3.3, `{"name": ..., "parameters": {...}}` as the reply (after `<|python_tag|>` at
  times); one call a reply, as the published template allows. llama4_json: Llama 4's, the same JSON (after
  `<|python_start|>` at times, as its template renders calls in the history); one call a reply read.
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Nemo); mistral_args:
  `[TOOL_CALLS]name[ARGS]{...}`, one marker a call (Ministral 3, Magistral, Devstral); mistral_call_id with
  `[CALL_ID]` and a 9-character id before `[ARGS]` (Mistral Small 3.2).
- JSON lists of calls in a region: apriel `<tool_calls>[...]</tool_calls>` (Apriel), nemotron `<TOOLCALL>[...]
  </TOOLCALL>` (Nemotron Nano 2), granite `<|tool_call|>[...]` (Granite 3.x), apertus `<|tools_prefix|>[{"name":
  {...}}, ...]<|tools_suffix|>` (Apertus), command_r `<|START_ACTION|>[{"tool_call_id": "0", "tool_name": ...,
  "parameters": {...}}, ...]<|END_ACTION|>` (Command R7B, Command A).
- qwen_xml: Qwen3.5, Qwen3-Coder, Nemotron 3, `<tool_call>\n<function=name>\n<parameter=key>\nvalue\n</parameter>\n
  </function>\n</tool_call>`; seed_xml the same in `<seed:tool_call>` (Seed-OSS); glm_xml: GLM-4.5 on,
  `<tool_call>name<arg_key>key</arg_key><arg_value>value</arg_value></tool_call>`; minimax_xml: MiniMax-M2, `<invoke
  name=...>` blocks in one `<minimax:tool_call>`; deepseek_dsml, deepseek_v4_dsml: DeepSeek V3.2 and V4,
  `<｜DSML｜invoke name=...>` blocks in one `<｜DSML｜function_calls>` (V4: `<｜DSML｜tool_calls>`), each value said to
  be text or JSON (rungen/tool_xml.py: elsewhere a value is text where its schema says string, JSON otherwise).
- pythonic: LFM2's `<|tool_call_start|>[name(key=value, ...)]<|tool_call_end|>`, values JSON; python_literals:
  LFM2.5's, values Python's literals (rungen/tool_python.py).
- deepseek_v3_1: DeepSeek V3.1, V3.1-Terminus, V3.2-Exp, `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name
  <｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; deepseek_r1: DeepSeek V3, R1 and its distills, the
  same region of `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{...}\n```<｜tool▁call▁end｜>`, one a
  line. Their templates render calls and results but not the tools: those go into the system message in DeepSeek's
  own words.
- kimi: Kimi K2, `<|tool_calls_section_begin|><|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}
  <|tool_call_end|>...<|tool_calls_section_end|>`, the index the conversation's count of calls (its first template
  numbers a turn's).
- harmony: gpt-oss's calls in its commentary channel; gemma: Gemma 4's `<|tool_call>call:name{...}<tool_call|>`
  (rungen/tool_gemma.py). Where xgrammar writes no grammar of a syntax, rungen/tool_schema.py does.
- generic: a template that does not render tools (SmolLM2's among them): the tools are described in a system
  message and a call is the line `{"tool_call": {"name": ..., "arguments": {...}}}`, as llama-server's
  generic handler does.

A template that writes calls in another XML (MiniMax-M3's `<invoke>`) is refused rather than read as Hermes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

from . import tool_gemma

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
    # value..., "glm_xml", ...), "gemma" (rungen/tool_gemma.py), "python" or "python_literal" (LFM2's and LFM2.5's
    # keywords, their values JSON or Python's literals).
    style: str = "json"
    alternate: tuple[str, str] | None = None  # another (begin, middle) the model may write a call with (gpt-oss's)
    # The family's own words for the tools where its template writes none (a key of INSTRUCTIONS); its template's
    # calls are then not used either (DeepSeek's join the arguments as text): a turn's calls are its text.
    instructions: str | None = None
    after_text: str = "\n"  # between a turn's text and its calls, where they are its text (DeepSeek's: nothing)

    @property
    def keywords(self) -> bool:
        """The calls are Python's, their arguments keywords (LFM2's values JSON, LFM2.5's Python literals)."""
        return self.style in ("python", "python_literal")

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
# Llama 4's: Llama 3's JSON, in its template's history after <|python_start|><|python_end|>
LLAMA4_JSON = dataclasses.replace(LLAMA3_JSON, name="llama4_json", markers=('{"name"', "<|python_start|>"))
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
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, LLAMA4_JSON, MISTRAL, MISTRAL_ARGS, MISTRAL_CALL_ID, QWEN_XML,
                                GLM_XML, MINIMAX_XML, APRIEL, NEMOTRON, SEED_XML, PYTHONIC, DEEPSEEK_V3_1, DEEPSEEK_R1,
                                KIMI, COMMAND_R, DSML, DSML_V4, GRANITE, APERTUS, PYTHON_LITERALS,
                                HARMONY, GEMMA, GENERIC)}
GRAMMAR_STYLES = {"seed_xml": "qwen_xml"}  # xgrammar's style of a format's parameters, where it is not its own name
# How templates that write calls in an XML not parsed here show it (MiniMax-M3's).
XML_SIGNS = ("<invoke ",)
KNOWN = ("Hermes/Qwen JSON <tool_call>, Qwen, Seed-OSS, GLM, MiniMax-M2 and DeepSeek's DSML XML, Llama 3 and 4 JSON, "
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
    if '"parameters": ' in text and "<|header_start|>" in text:
        return LLAMA4_JSON
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
