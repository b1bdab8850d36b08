"""rungen/tools.py on its own: format detection from the published chat templates, the parsers on text the
published models write (whole and streamed), the grammars on the same text, and the checks of a request's
tools."""

import dataclasses
import json
import os

import pytest
from xgrammar.testing import _is_grammar_accept_string as grammar_accepts

from rungen.conversation import tool_fields
from rungen.tool_formats import (
    APERTUS,
    APRIEL,
    COMMAND_R,
    DEEPSEEK_R1,
    DEEPSEEK_V3_1,
    DSML,
    DSML_V4,
    GEMMA,
    GENERIC,
    GLM_XML,
    GRANITE,
    HARMONY,
    HERMES,
    KIMI,
    LLAMA3_JSON,
    LLAMA4_JSON,
    MINIMAX_XML,
    MISTRAL,
    MISTRAL_ARGS,
    MISTRAL_CALL_ID,
    NEMOTRON,
    PYTHON_LITERALS,
    PYTHONIC,
    QWEN_XML,
    SEED_XML,
    detect_format,
)
from rungen.tool_reply import (
    CallParser,
    assemble,
    message_of,
)
from rungen.tools import (
    ToolError,
    read_tool_request,
    template_messages,
    tool_grammar,
)

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "chat_templates")
# SmolLM2-135M-Instruct's template (ChatML, no tools).
SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                    "{% endif %}")


def template(name):
    with open(os.path.join(TEMPLATES, name), encoding="utf-8") as f:
        return f.read()


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

# Replies as the published models write them (spacing as their templates render calls in the history).
PUBLISHED = {
    "hermes": ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
    "llama4_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {}}]'),
    "generic": ('{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}\n'
                '{"tool_call": {"name": "get_time", "arguments": {}}}'),
    "mistral_args": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{}',
    "mistral_call_id": ('[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "unit": "celsius"}'
                        "[TOOL_CALLS]get_time[CALL_ID]Zz9Yy8Xx7[ARGS]{}"),
    "qwen_xml": ("I will look both up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                 "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                 "<function=get_time>\n</function>\n</tool_call>"),
    "harmony": ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", '
                '"unit": "celsius"}'),
    "glm_xml": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>unit"
                "</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>"),
    "minimax_xml": ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                    '<parameter name="unit">celsius</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n'
                    "</minimax:tool_call>"),
    "apriel": ('<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
               '{"name": "get_time", "arguments": {}}]</tool_calls>'),
    "nemotron": ('<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                 '{"name": "get_time", "arguments": {}}]</TOOLCALL>'),
    "seed_xml": ("<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n<parameter=unit>celsius"
                 "</parameter>\n</function>\n</seed:tool_call>\n<seed:tool_call>\n<function=get_time>\n</function>\n"
                 "</seed:tool_call>"),
    "pythonic": ('<|tool_call_start|>[get_weather(city="Paris", unit="celsius"), get_time()]<|tool_call_end|>'),
    "gemma": ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>'
              "<|tool_call>call:get_time{}<tool_call|>"),
    "deepseek_v3_1": ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "unit": '
                      '"celsius"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>'
                      "<｜tool▁calls▁end｜>"),
    "deepseek_r1": ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": '
                    '"Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    "get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "kimi": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             '{"city": "Paris", "unit": "celsius"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
             "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"),
    "deepseek_dsml": ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" '
                      'string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="unit" string="true">celsius'
                      '</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name="get_time">\n</｜DSML｜invoke>\n'
                      "</｜DSML｜function_calls>"),
    "granite": ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {}}]'),
    "apertus": ('<|tools_prefix|>[{"get_weather": {"city": "Paris", "unit": "celsius"}}, {"get_time": {}}]'
                "<|tools_suffix|>"),
    "python_literals": "<|tool_call_start|>[get_weather(city='Paris', unit='celsius'), get_time()]<|tool_call_end|>",
    "command_r": ('<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": '
                  '"Paris", "unit": "celsius"}},\n    {"tool_call_id": "1", "tool_name": "get_time", "parameters": {}}'
                  "\n]<|END_ACTION|>"),
}
FORMATS = {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "llama4_json": LLAMA4_JSON, "mistral": MISTRAL,
           "generic": GENERIC,
           "mistral_args": MISTRAL_ARGS, "mistral_call_id": MISTRAL_CALL_ID, "qwen_xml": QWEN_XML, "glm_xml": GLM_XML,
           "harmony": HARMONY, "gemma": GEMMA, "minimax_xml": MINIMAX_XML,
           "apriel": APRIEL, "nemotron": NEMOTRON, "seed_xml": SEED_XML,
           "pythonic": PYTHONIC, "deepseek_v3_1": DEEPSEEK_V3_1, "deepseek_r1": DEEPSEEK_R1,
           "kimi": KIMI, "command_r": COMMAND_R, "deepseek_dsml": DSML,
           "granite": GRANITE, "apertus": APERTUS, "python_literals": PYTHON_LITERALS}
# What takes a published reply off its schema: a value outside the enum, and the required city left out.
OFF_SCHEMA = {"qwen_xml": (("\ncelsius\n", "\nkelvin\n"), ("<parameter=city>\nParis\n</parameter>\n", "")),
              "glm_xml": ((">celsius<", ">kelvin<"), ("<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n", "")),
              "gemma": (("celsius", "kelvin"), ('city:<|"|>Paris<|"|>,', "")),
              "minimax_xml": ((">celsius<", ">kelvin<"), ('<parameter name="city">Paris</parameter>\n', "")),
              "seed_xml": ((">celsius<", ">kelvin<"), ("<parameter=city>Paris</parameter>\n", "")),
              "pythonic": (('"celsius"', '"kelvin"'), ('city="Paris", ', "")),
              "python_literals": (("'celsius'", "'kelvin'"), ("city='Paris', ", "")),
              "deepseek_dsml": ((">celsius<", ">kelvin<"), ('<｜DSML｜parameter name="city" string="true">Paris'
                                                            "</｜DSML｜parameter>\n", ""))}
OFF_JSON = (('"celsius"', '"kelvin"'), ('"city": "Paris", ', ""))


def calls_of(message):
    content, calls = message
    return content, [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


def streamed(fmt, text, step=1):
    parser, events = CallParser(fmt), []
    for start in range(0, len(text), step):
        events += parser.feed(text[start : start + step])
    return events + parser.finish()


def test_the_format_is_detected_from_the_template():
    assert detect_format(template("qwen2.5-instruct.jinja")) is HERMES
    assert detect_format(template("llama3.1-instruct.jinja")) is LLAMA3_JSON
    assert detect_format(template("llama-4-scout.jinja")) is LLAMA4_JSON
    assert detect_format(template("mistral-7b-instruct-v0.3.jinja")) is MISTRAL
    assert detect_format(template("devstral-small-2507.jinja")) is MISTRAL_ARGS
    assert detect_format(template("ministral-3-reasoning.jinja")) is MISTRAL_ARGS
    assert detect_format(template("mistral-small-3.2.jinja")) is MISTRAL_CALL_ID
    assert detect_format(template("qwen3.5.jinja")) is QWEN_XML
    assert detect_format(template("glm-4.6.jinja")) is GLM_XML
    assert detect_format(template("gpt-oss.jinja")) is HARMONY
    assert detect_format(template("gemma-4-it.jinja")) is GEMMA
    assert detect_format(template("minimax-m2.jinja")) is MINIMAX_XML
    # Apriel's instructions name <tool_call></tool_call> tags too, but it writes (and renders) a list in <tool_calls>.
    assert detect_format(template("apriel-1.5-thinker.jinja")) is APRIEL
    assert detect_format(template("apriel-1.6-thinker.jinja")) is APRIEL
    assert detect_format(template("nemotron-nano-v2.jinja")) is NEMOTRON
    assert detect_format(template("seed-oss.jinja")) is SEED_XML
    assert detect_format(template("lfm2-8b-a1b.jinja")) is PYTHONIC
    assert detect_format(template("deepseek-v3.2-exp.jinja")) is DEEPSEEK_V3_1
    assert detect_format(template("deepseek-r1-distill-llama-8b.jinja")) is DEEPSEEK_R1
    assert detect_format(template("kimi-k2.jinja")) is KIMI
    assert detect_format(template("kimi-k2-instruct.jinja")) is KIMI
    assert detect_format(template("command-r7b-tool_use.jinja")) is COMMAND_R
    assert detect_format(template("granite-3.3.jinja")) is GRANITE
    assert detect_format(template("apertus-8b-instruct.jinja")) is APERTUS
    assert detect_format(template("lfm2.5-instruct.jinja")) is PYTHON_LITERALS
    assert detect_format(template("lfm2.5-8b-a1b.jinja")) is PYTHON_LITERALS
    assert detect_format(template("deepseek-v3.2.jinja")) is DSML and detect_format(template("deepseek-v4.jinja")) is \
        DSML_V4
    # Calls written in another XML inside <tool_call> (MiniMax-M3's <invoke>) are no Hermes JSON.
    assert "writes tool calls as XML (<invoke...)" in detect_format(template("minimax-m3.jinja"))
    assert detect_format(SMOLLM2_TEMPLATE) is GENERIC
    assert detect_format({"default": SMOLLM2_TEMPLATE, "tool_use": template("qwen2.5-instruct.jinja")}) is HERMES
    # A template that renders tools in a format not known here is refused, not parsed as something else.
    unknown = "{% for tool in tools %}<function={{ tool.function.name }}>{% endfor %}"
    assert "not parsed here" in detect_format(unknown)
    assert "no chat template" in detect_format(None)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_replies_parse_whole_and_streamed_alike(name):
    fmt, text = FORMATS[name], PUBLISHED[name]
    whole = message_of(CallParser(fmt), text)
    content, calls = calls_of(whole)
    expected = [("get_weather", {"city": "Paris", "unit": "celsius"})]
    if not fmt.one_call:
        expected.append(("get_time", {}))
    assert calls == expected
    assert content == ("I will look both up." if name in ("hermes", "qwen_xml") else None)
    assert all(call["id"].startswith("call_") for call in whole[1])
    for step in (1, 3, 7):
        events = streamed(fmt, text, step)
        assert calls_of(assemble(events)) == (content, calls)
        # A call's name comes first, then its arguments in several pieces as they are written.
        pieces = [event for event in events if event[0] == "arguments" and event[1] == 0]
        assert len(pieces) > 1 if step == 1 else pieces
        assert events.index(next(e for e in events if e[0] == "call")) < events.index(pieces[0])


def test_llama_python_tag_and_text_that_only_looks_like_a_call():
    content, calls = calls_of(message_of(CallParser(LLAMA3_JSON), '<|python_tag|>{"name": "get_time", '
                                                                  '"parameters": {}}'))
    assert content is None and calls == [("get_time", {})]
    # Llama 4's template renders a turn's calls after <|python_start|> (and <|python_end|>, a special token not kept)
    content, calls = calls_of(message_of(CallParser(LLAMA4_JSON), '<|python_start|>{"name": "get_time", '
                                                                  '"parameters": {}}'))
    assert content is None and calls == [("get_time", {})]
    for fmt, text in ((HERMES, "Write <tool_call> tags around a call."), (GENERIC, 'JSON such as {"a": 1}.'),
                      (LLAMA3_JSON, 'A name: {"name": 5}'), (MISTRAL, "[TOOL_CALLS] then words"),
                      (MISTRAL_ARGS, "[TOOL_CALLS] then words"), (MISTRAL_ARGS, "[TOOL_CALLS]f[ARGS] {}"),
                      (MISTRAL_CALL_ID, "[TOOL_CALLS]f[ARGS]{}"),
                      (HARMONY, "<|start|>assistant to=functions.f<|channel|>commentary json<|message|> x")):
        assert message_of(CallParser(fmt), text) == (text, [])
        assert assemble(streamed(fmt, text)) == (text, [])


def test_a_reply_cut_before_a_call_names_its_function():
    """max_tokens may end a reply inside a call before its name: alone, what the model wrote is the content (not
    an empty reply); after calls, it is the next call's opening cut short, which is no content."""
    for fmt, text in ((GENERIC, '{"tool_call": {"name": {"description": {"type'), (HERMES, "<tool_call>\n{\"na"),
                      (MISTRAL, '[TOOL_CALLS] [{"na'), (MISTRAL_ARGS, "[TOOL_CALLS]get_wea"),
                      (MISTRAL_CALL_ID, "[TOOL_CALLS]get_weather[CALL_ID]a1B")):
        assert message_of(CallParser(fmt), text) == (text, [])
        assert assemble(streamed(fmt, text)) == (text, [])
        # Under tool_choice required or named the grammar allowed a call alone: the cut call is no content.
        for cut in (text, text[:4]):
            assert message_of(CallParser(fmt, calls_only=True), cut) == ("", [])  # an empty reply
    first = PUBLISHED["generic"].split("\n")[0]
    for cut in ('\n{"tool_', '\n{"tool_call": {"na', "\n{"):
        parser = CallParser(GENERIC)
        content, calls = calls_of(message_of(parser, first + cut))
        assert content is None and calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]
        assert calls_of(assemble(streamed(GENERIC, first + cut))) == (None, calls)


def test_a_reply_cut_inside_a_call_keeps_what_was_generated():
    text = PUBLISHED["hermes"][:90]
    parser = CallParser(HERMES)
    content, calls = message_of(parser, text)
    assert content == "I will look both up." and calls[0]["function"]["name"] == "get_weather"
    assert '{"city": "Paris", "unit": "celsius"}'.startswith(calls[0]["function"]["arguments"])
    assert not parser.complete  # the reply does not say "tool_calls" then
    whole = CallParser(HERMES)
    message_of(whole, PUBLISHED["hermes"])
    assert whole.complete


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_grammar_takes_the_published_replies_and_nothing_else(name):
    fmt, text = FORMATS[name], PUBLISHED[name]
    request = read_tool_request({"tools": [WEATHER, TIME]})
    required = tool_grammar(fmt, dataclasses.replace(request, choice="required"))
    auto = tool_grammar(fmt, request)
    named = tool_grammar(fmt, dataclasses.replace(request, choice="get_weather"))
    calls_only = text.split("\n", 1)[1].lstrip() if name in ("hermes", "qwen_xml") else text
    assert grammar_accepts(required, calls_only) and grammar_accepts(auto, text)
    assert grammar_accepts(auto, "No tool is needed here.")
    assert not grammar_accepts(required, "No tool is needed here.")
    # Arguments that do not match the schema: a value outside the enum, a missing required key.
    (value, other), (city, no_city) = OFF_SCHEMA.get(name, OFF_JSON)
    assert value in text and city in calls_only
    assert not grammar_accepts(auto, text.replace(value, other))
    assert not grammar_accepts(required, calls_only.replace(city, no_city))
    if fmt.one_call:
        assert grammar_accepts(named, text)
    else:
        assert not grammar_accepts(named, calls_only)  # two calls, one of another function
        single = tool_grammar(fmt, dataclasses.replace(request, choice="required", parallel=False))
        assert not grammar_accepts(single, calls_only)
    assert tool_grammar(fmt, dataclasses.replace(request, choice="none")) is None
    if fmt is MISTRAL_CALL_ID:  # the model's id: nine letters or digits
        assert not grammar_accepts(required, calls_only.replace("a1B2c3D4e", "a1B2c3"))
    if fmt in (KIMI, COMMAND_R):  # the call's index: a number as the template writes it
        one = ":1<" if fmt is KIMI else '"tool_call_id": "1"'
        assert grammar_accepts(required, calls_only.replace(one, one.replace("1", "12")))
        for index in ("01", "x", "", "1234567"):
            assert not grammar_accepts(required, calls_only.replace(one, one.replace("1", index))), index
    # Under auto, whatever the parser reads as a call is held to a tool: written compactly (the parser's marker
    # without the template's spaces), a call to no tool or with arguments off the schema is not generated.
    compact = {"generic": '{"tool_call":{"name":"get_date","arguments":{"town":"Rome"}}}',
               "llama3_json": '{"name":"get_date","parameters":{"town":"Rome"}}'}
    if name in compact:
        assert CallParser(fmt).feed(compact[name], final=True)[0][:2] == ("call", 0)  # parsed as a call
        assert not grammar_accepts(auto, compact[name])
        assert not grammar_accepts(auto, compact[name].replace("get_date", "get_time"))


BAD_TOOLS = [
    ({"tools": []}, "tools", "non-empty"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "only function tools"),
    ({"tools": [dict(WEATHER, extra=1)]}, "tools", "tools[0].extra"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":
                                                                                {"a": {"type": "nope"}}}}}]},
     "tools", "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools", "strict"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
]


@pytest.mark.parametrize("body, param, words", BAD_TOOLS, ids=[case[2] for case in BAD_TOOLS])
def test_bad_tools_are_named(body, param, words):
    with pytest.raises(ToolError) as error:
        read_tool_request(body)
    assert error.value.param == param and words in str(error.value)


def test_a_schema_the_compiler_cannot_take_is_named():
    backreference = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(a)\\1"}}}
    request = read_tool_request({"tools": [{"type": "function", "function": {"name": "f",
                                                                             "parameters": backreference}}]})
    with pytest.raises(ToolError, match="parameters of 'f' cannot be compiled: .*Backreference"):
        tool_grammar(HERMES, request)
    remote = {"type": "object", "properties": {"a": {"$ref": "https://example.com/schema.json"}}}
    with pytest.raises(ToolError, match="outside the schema"):
        read_tool_request({"tools": [{"type": "function", "function": {"name": "f", "parameters": remote}}]})


def test_calls_and_results_in_the_history_take_each_format_shape():
    call = {"id": "call_abc", "name": "get_weather", "arguments": {"city": "Paris"}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "18 C", "tool_call_id": "call_abc"}]
    native = template_messages(messages, MISTRAL, None)
    # Mistral's template takes 9-character alphanumeric ids: a call and its result keep the same one.
    assert native[1]["tool_calls"][0]["id"] == native[2]["tool_call_id"] and len(native[2]["tool_call_id"]) == 9
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    request = read_tool_request({"tools": [WEATHER]})
    generic = template_messages(messages, GENERIC, request)
    assert generic[0]["role"] == "system" and "get_weather" in generic[0]["content"]
    assert json.loads(generic[2]["content"]) == {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert generic[3] == {"role": "user", "content": json.dumps({"tool_response": {"name": "get_weather",
                                                                                   "content": "18 C"}})}
    assert tool_fields({"role": "assistant", "content": "Hi", "tool_calls": []}, 0) == {}
    # The reasoning an agent sends back with its call reaches the templates that read it, in either format.
    thought = [messages[0], dict(messages[1], reasoning_content="Ask the tool."), messages[2]]
    for fmt in (MISTRAL, GENERIC):
        assert template_messages(thought, fmt, None)[1]["reasoning_content"] == "Ask the tool."
    with pytest.raises(ToolError, match="answers no tool call"):
        template_messages([messages[0], dict(messages[2], tool_call_id="call_other")], HERMES, None)


def test_each_xml_format_reads_the_calls_its_template_writes():
    """A call the published template renders in the history, read back by the format's parser: the same name and
    arguments (GLM's template writes a string value as it is and another as JSON, Qwen3.5's alike)."""
    from rungen.chat_template import render

    arguments = {"city": "Paris", "days": 3, "when": {"from": "today"}, "code": "007"}
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                               "when": {"type": "object"}, "code": {"type": "string"}}}
    asked = [{"role": "user", "content": "Hi"}]
    for name, fmt in (("qwen3.5.jinja", QWEN_XML), ("glm-4.6.jinja", GLM_XML), ("minimax-m2.jinja", MINIMAX_XML),
                      ("seed-oss.jinja", SEED_XML), ("deepseek-v3.2.jinja", DSML), ("deepseek-v4.jinja", DSML_V4)):
        turn = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
        kwargs = {"enable_thinking": False}
        prompt = render(template(name), asked, add_generation_prompt=True, **kwargs)
        whole = render(template(name), asked + [turn], **kwargs)
        reply = whole[len(prompt) :] if whole.startswith(prompt) else whole[whole.index(fmt.trigger) :]
        content, calls = calls_of(message_of(CallParser(fmt, schemas={"get_weather": schema}), reply))
        assert calls == [("get_weather", arguments)], (name, reply)


def test_xml_values_are_read_as_their_schema_says():
    """Qwen's XML writes a value as text: a string parameter's text is the string, whatever it looks like; any
    other is the JSON it holds (the text itself where it holds none)."""
    schemas = {"f": {"type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "integer"},
                                                      "opts": {"type": "object"}, "flag": {"type": "boolean"}}}}
    text = ("<tool_call>\n<function=f>\n<parameter=code>\n123\n</parameter>\n<parameter=n>\n123\n</parameter>\n"
            "<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=flag>\ntrue\n</parameter>\n"
            "<parameter=note>\nline one\nline two\n</parameter>\n</function>\n</tool_call>")
    _, calls = calls_of(message_of(CallParser(QWEN_XML, schemas=schemas), text))
    assert calls == [("f", {"code": "123", "n": 123, "opts": {"a": [1, 2]}, "flag": True,
                            "note": "line one\nline two"})]
    whole = message_of(CallParser(QWEN_XML, schemas=schemas), text)[1][0]["function"]["arguments"]
    parser, sent, seen = CallParser(QWEN_XML, schemas=schemas), "", []
    for character in text:  # streamed: no content, and the arguments grow a parameter at a time
        for event in parser.feed(character):
            assert event[0] != "content"
            sent += event[2] if event[0] == "arguments" else ""
        seen.append(sent)
    assert sent == whole and all(whole.startswith(part) for part in seen)
    assert len(set(seen)) == 2 + 5 + 1  # nothing, "{", each parameter, "}"
    # A string the schema lets be in another way (an Optional's anyOf, an enum of strings), and a key that is no
    # identifier: as the grammar held them.
    optional = {"anyOf": [{"type": "string", "pattern": "^[0-9]{5}$"}, {"type": "null"}]}
    others = {"f": {"type": "object", "properties": {"zip": optional, "level": {"enum": ["1", "2", "3"]},
                                                     "城市": {"type": "string"},
                                                     "size": {"anyOf": [{"type": "number"}, {"type": "string"}]}}}}
    for fmt, write in ((QWEN_XML, "<parameter={}>\n{}\n</parameter>\n"),
                       (GLM_XML, "<arg_key>{}</arg_key>\n<arg_value>{}</arg_value>\n")):
        opening = "<tool_call>\n<function=f>\n" if fmt is QWEN_XML else "<tool_call>f\n"
        closing = "</function>\n</tool_call>" if fmt is QWEN_XML else "</tool_call>"
        for values, expected in ((("45201", "3", "Paris", "7"), {"zip": "45201", "level": "3", "城市": "Paris",
                                                                  "size": 7}),
                                 (("null", "1", "Rome", "large"), {"zip": None, "level": "1", "城市": "Rome",
                                                                   "size": "large"})):
            reply = opening + "".join(write.format(key, value) for key, value in
                                      zip(("zip", "level", "城市", "size"), values)) + closing
            assert calls_of(message_of(CallParser(fmt, schemas=others), reply)) == (None, [("f", expected)])
            parser = CallParser(fmt, schemas=others)
            events = [event for character in reply for event in parser.feed(character)] + parser.finish()
            assert calls_of(assemble(events)) == (None, [("f", expected)])


GEMMA_SCHEMA = {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}, "Units": {"enum": ["c", "f"]},
    "when": {"type": "object", "properties": {"from": {"type": "string"}, "hourly": {"type": "boolean"}}},
    "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3}, "note": {"type": ["string", "null"]}}}


def test_gemma_reads_the_calls_its_template_writes_and_its_grammar_takes_them():
    """Gemma 4's own syntax (strings between <|"|>, bare keys sorted as the template's dictsort writes them): a
    call the published template renders in the history is read back to the same arguments, whole and a character
    at a time, and the grammar built from the tool's schema takes it."""
    from rungen.chat_template import render
    from rungen.tool_schema import arguments_grammar

    arguments = {"city": 'Saint-"Malo"\nFrance <b>', "days": 3, "Units": "c",
                 "when": {"from": "today", "hourly": True}, "scores": [1.5, -2, 30000.0], "note": "x |> y <z>"}
    asked = [{"role": "user", "content": "Hi"}]
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
    whole = render(template("gemma-4-it.jinja"), asked + [turn])
    reply = whole[whole.index("<|tool_call>") : whole.index("<|tool_response>")]
    assert 'city:<|"|>Saint-"Malo"' in reply and reply.index("Units:") < reply.index("when:")  # as the model writes
    parse = CallParser(GEMMA, schemas={"get_weather": GEMMA_SCHEMA})
    assert calls_of(message_of(parse, reply)) == (None, [("get_weather", arguments)])
    assert calls_of(assemble(streamed(GEMMA, reply))) == (None, [("get_weather", arguments)])
    body = reply[len("<|tool_call>call:get_weather") : -len("<tool_call|>")]
    grammar = arguments_grammar(GEMMA_SCHEMA, "gemma")
    assert grammar_accepts(grammar, body)
    for written, off in (("days:3", "days:3.5"), ("days:3", "days:9"), ('Units:<|"|>c', 'Units:<|"|>k'),
                         ("30000.0]", "30000.0,4]"), ("hourly:true", "hourly:1"),
                         ('city:<|"|>Saint-"Malo"\nFrance <b><|"|>', "city:3"),
                         ("Units:", "units:")):  # off the schema: a type, a bound, an enum, a length, a key's name
        assert written in body and not grammar_accepts(grammar, body.replace(written, off)), off
    assert not grammar_accepts(grammar, "{days:3}")  # city is required
    assert grammar_accepts(grammar, '{city:<|"|>Paris<|"|>}')
    # A string's text holds no closing quote.
    assert not grammar_accepts(grammar, '{city:<|"|>a<|"|>b<|"|>}')


def test_gemma_arguments_grow_and_a_cut_call_keeps_its_text():
    """A stream's arguments are at every step the start of the final JSON, even where a step ends inside a quote
    token, a number or a key; a reply cut inside a call gives the arguments as far as written."""
    text = '<|tool_call>call:f{a:<|"|>x y<|"|>,b:-12.5e3,c:[true,null],d:{e:<|"|><|"|>}}<tool_call|>'
    whole = message_of(CallParser(GEMMA), text)[1][0]["function"]["arguments"]
    assert json.loads(whole) == {"a": "x y", "b": -12500.0, "c": [True, None], "d": {"e": ""}}
    parser, sent = CallParser(GEMMA), ""
    for char in text:
        for event in parser.feed(char):
            if event[0] == "arguments":
                sent += event[2]
                assert whole.startswith(sent)
    assert sent + "".join(event[2] for event in parser.finish() if event[0] == "arguments") == whole
    cut = message_of(CallParser(GEMMA), text[: text.index("-12")])
    assert cut[1][0]["function"]["arguments"] == '{"a": "x y", "b": '
    # Text that only looks like a call stays content.
    assert message_of(CallParser(GEMMA), "<|tool_call>calls are fine") == ("<|tool_call>calls are fine", [])


def test_gemma_grammar_keeps_what_the_reader_could_not_take_out_of_a_call():
    """What would break a call when read back, or the next prompt when the template writes it again, is not
    generated: a key the reader cannot take bare is quoted; a string holds no quote and no control token; named as
    none, properties are none (as xgrammar reads it); an exclusive bound of a number is not reached."""
    from rungen.tool_schema import arguments_grammar

    quote = '<|"|>'
    schema = {"type": "object", "properties": {
        "a:b": {"type": "integer"}, " lead": {"type": "integer"}, "s": {"type": "string"},
        "p": {"type": "string", "pattern": "^.*$"}, "none": {"type": "object", "properties": {}},
        "free": {"type": "object"}, "x": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}}
    grammar = arguments_grammar(schema, "gemma")
    taken = [f"{{{quote}a:b{quote}:1}}", f"{{{quote} lead{quote}:1}}", f"{{s:{quote}a |> b || c <b>{quote}}}",
             "{none:{}}", "{free:{k:1}}", "{x:0.5}", "{x:0.999999}"]
    refused = ["{a:b:1}", "{ lead:1}", f"{{s:{quote}a<|b{quote}}}", f"{{s:{quote}a<turn|>{quote}}}",
               f"{{s:{quote}<tool_call|>{quote}}}", f"{{p:{quote}a<b{quote}}}", "{none:{k:1}}", "{x:0}", "{x:1}"]
    assert [text for text in taken if not grammar_accepts(grammar, text)] == []
    assert [text for text in refused if grammar_accepts(grammar, text)] == []
    # And the reader takes a quoted key back as the key.
    parsed = message_of(CallParser(GEMMA), f"<|tool_call>call:f{{{quote}a:b{quote}:1,{quote} lead{quote}:2}}"
                                           "<tool_call|>")
    assert json.loads(parsed[1][0]["function"]["arguments"]) == {"a:b": 1, " lead": 2}


def test_python_calls_read_as_json_and_written_back_as_the_model_writes_them():
    """LFM2's calls are Python's, their values JSON: read into the JSON object of the keywords, a character at a
    time a prefix of the final JSON (a number on its way too); its template renders no tool_calls, so an earlier
    turn's calls are that turn's text, written as the model writes them; a schema whose keys Python cannot name is
    refused."""
    text = ('<|tool_call_start|>[get_weather(city="Paris", days=3, when={"from": "today"}, scores=[1.5, -2]), '
            "get_time()]<|tool_call_end|>")
    content, calls = calls_of(message_of(CallParser(PYTHONIC), text))
    expected = [("get_weather", {"city": "Paris", "days": 3, "when": {"from": "today"}, "scores": [1.5, -2]}),
                ("get_time", {})]
    assert content is None and calls == expected
    assert calls_of(assemble(streamed(PYTHONIC, text))) == (None, expected)
    whole = message_of(CallParser(PYTHONIC), text)[1][0]["function"]["arguments"]
    parser, sent = CallParser(PYTHONIC), ""
    for char in text:
        sent += "".join(event[2] for event in parser.feed(char) if event[0] == "arguments" and event[1] == 0)
        assert whole.startswith(sent)
    # Cut inside a second call's name: the first is finished, the second no named call (the session says so).
    parser = CallParser(PYTHONIC)
    assert calls_of(message_of(parser, '<|tool_call_start|>[get_weather(city="a"), get_w')) == \
        (None, [("get_weather", {"city": "a"})])
    assert parser.finished == [True] and parser.unnamed
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "a", "name": "get_weather", "arguments": expected[0][1]},
                   {"id": "b", "name": "get_time", "arguments": {}}]},
               {"role": "tool", "tool_call_id": "a", "content": "18 C"},
               {"role": "tool", "tool_call_id": "b", "content": "noon"}]
    written = template_messages(history, PYTHONIC, None, calls_as_text=True)[1]
    assert written == {"role": "assistant", "content": text}
    request = read_tool_request({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"two words": {"type": "string"}}}}}]})
    with pytest.raises(ToolError, match="no Python identifier"):
        tool_grammar(PYTHONIC, request)


def test_python_calls_take_only_what_python_and_the_next_prompt_can_hold():
    """LFM2's keyword arguments: a name Python takes (城市 too, not class), strings without a control token of the
    model (its markers all start "<|", and the template would write them back as the tokens) or an unescaped quote;
    a pattern that writes a quote, or keywords no property names, are refused rather than not held."""
    from rungen.tool_schema import arguments_grammar

    grammar = arguments_grammar({"type": "object", "properties": {"城市": {"type": "string"},
                                                                  "n": {"type": "integer"}}}, "python")
    assert grammar_accepts(grammar, '城市="a \\"quoted\\" <b> | c", n=3')
    for refused in ('城市="a <|tool_call_end|> b"', '城市="a"b"', "n=3, 城市=\"x\""):
        assert not grammar_accepts(grammar, refused), refused
    for schema, words in (({"type": "object", "properties": {"class": {"type": "string"}}}, "no Python identifier"),
                          ({"type": "object", "properties": {"s": {"type": "string", "pattern": '^q"$'}}},
                           "quote or a backslash"),
                          ({"type": "object", "additionalProperties": {"type": "string"}}, "not named in properties")):
        with pytest.raises(ValueError, match=words):
            arguments_grammar(schema, "python")
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "name": "f",
                                                                      "arguments": {"my-key": 1}}]},
               {"role": "tool", "tool_call_id": "a", "content": "ok"}]
    with pytest.raises(ToolError, match="'my-key' is no Python identifier") as error:
        template_messages(history, PYTHONIC, None, calls_as_text=True)
    assert error.value.param == "messages"


def test_deepseek_gets_its_tools_in_its_words_and_its_calls_back_as_it_wrote_them():
    """DeepSeek's templates render calls and results but no tools: the tools go after the system prompt in DeepSeek's
    words (V3.1's card word for word), and R1's template, which keeps the last system message alone, still shows
    them. A call in the history is its reply's text: both templates join the arguments to their text, which
    fails on an object, and R1's leaves a single call's region open."""
    from rungen.chat_template import render
    from rungen.tools import plan_tools

    call = {"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    history = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
               {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    body = {"tools": [WEATHER, TIME]}
    for name, fmt, card in (("deepseek-v3.2-exp.jinja", DEEPSEEK_V3_1, "You have access to the following tools:"),
                            ("deepseek-r1-distill-llama-8b.jinja", DEEPSEEK_R1,
                             "You have the following functions available:")):
        plan = plan_tools(body, history, template(name))
        assert plan.fmt is fmt and plan.template_tools is None  # the template reads no tools
        prompt = render(template(name), plan.messages, add_generation_prompt=True, bos_token="<s>")
        assert prompt.count(card) == 1 and "Use tools.\n\n## Tools" in prompt
        assert "- For multiple tool calls, chain them directly" in prompt or fmt is DEEPSEEK_R1
        reply = (fmt.region[0] + fmt.begin + "get_weather" + fmt.middle + '{"city": "Paris", "unit": "celsius"}' +
                 fmt.end + fmt.region[1])
        opening = "<｜Assistant｜>" if fmt is DEEPSEEK_R1 else "<｜Assistant｜></think>"
        assert opening + reply + "<｜end▁of▁sentence｜>" in prompt
        assert calls_of(message_of(CallParser(fmt), reply))[1] == [("get_weather", call["arguments"])]
        assert prompt.endswith("<｜tool▁output▁begin｜>18 C<｜tool▁output▁end｜>" +
                               ("<｜tool▁outputs▁end｜>" if fmt is DEEPSEEK_R1 else ""))
        # Without a system prompt the tools are all of it, after a blank line as the card lays it out; tool_choice
        # none leaves them out.
        bare = plan_tools(body, history[2:3], template(name)).messages
        assert bare[0]["role"] == "system" and bare[0]["content"].startswith("\n\n## Tools\n")
        assert plan_tools(dict(body, tool_choice="none"), history[2:3], template(name)).messages == history[2:3]
        # A turn's text and its calls as the model writes them: one right after the other.
        said = [history[2], dict(history[3], content="Let me look."), history[4]]
        written = render(template(name), plan_tools(body, said, template(name)).messages)
        assert "Let me look." + fmt.region[0] in written
        # The template's own rendering of the call object is what the text stands in for.
        with pytest.raises(TypeError):
            render(template(name), history[2:3] + [{"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": call["arguments"]}}]}])


def test_kimi_numbers_the_calls_as_its_templates_do():
    """Kimi K2's model knows a call as `functions.name:index`: its later template numbers the conversation's calls
    and queues their ids in a list, which the tool's template sandbox lets it do (transformers' refuses any change to
    a list), its first one writes a result's id as given, so each call's id becomes its index in its turn."""
    from rungen.chat_template import render
    from rungen.tools import plan_tools

    calls = [{"id": "call_a", "name": "get_weather", "arguments": {"city": "Paris"}},
             {"id": "call_b", "name": "get_time", "arguments": {}}]
    history = [{"role": "user", "content": "Weather and time?"},
               {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": "call_a", "content": "18 C"},
               {"role": "tool", "tool_call_id": "call_b", "content": "noon"}]
    for name in ("kimi-k2.jinja", "kimi-k2-instruct.jinja"):
        plan = plan_tools({"tools": [WEATHER, TIME]}, history, template(name))
        assert plan.fmt is KIMI and plan.template_tools is not None  # its template declares them
        prompt = render(template(name), plan.messages, tools=plan.template_tools, add_generation_prompt=True)
        assert "<|im_system|>tool_declare<|im_middle|>" in prompt
        assert '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}' in prompt
        assert "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}" in prompt
        first, second = prompt.index("## Return of functions.get_weather:0"), prompt.index(
            "## Return of functions.get_time:1")
        assert prompt.index("18 C") > first and prompt.index("noon") > second > first


def test_command_r_calls_are_laid_out_as_its_template_writes_them():
    """Command R7B's template writes a turn's calls one a line with their index, and the results with the same
    index: the grammar holds a reply to that layout (what the model saw of its own calls), and the parser reads
    the template's text back."""
    from rungen.chat_template import render
    from rungen.tools import plan_tools

    calls = [{"id": "call_a", "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
             {"id": "call_b", "name": "get_time", "arguments": {}}]
    history = [{"role": "user", "content": "Weather and time?"},
               {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": "call_b", "content": "noon"},
               {"role": "tool", "tool_call_id": "call_a", "content": "18 C"}]
    plan = plan_tools({"tools": [WEATHER, TIME]}, history, template("command-r7b-tool_use.jinja"))
    prompt = render(template("command-r7b-tool_use.jinja"), plan.messages, tools=plan.template_tools,
                    add_generation_prompt=True)
    start = prompt.index(COMMAND_R.region[0])
    written = prompt[start : prompt.index(COMMAND_R.region[1], start) + len(COMMAND_R.region[1])]
    assert written == PUBLISHED["command_r"]
    required = tool_grammar(COMMAND_R, read_tool_request({"tools": [WEATHER, TIME], "tool_choice": "required"}))
    assert grammar_accepts(required, written)
    assert calls_of(message_of(CallParser(COMMAND_R), written))[1] == [(call["name"], call["arguments"])
                                                                       for call in calls]
    results = prompt[prompt.rindex("<|START_TOOL_RESULT|>[") :]
    assert results.index('"tool_call_id": "1"') < results.index("noon") < results.index('"tool_call_id": "0"') < \
        results.index("18 C")


def test_dsml_values_are_what_the_model_says_they_are():
    """DeepSeek's DSML says of each value whether it is text (string="true": as written, spaces and all, JSON-like
    or not) or JSON (string="false"), where a schema lets a parameter be either (anyOf)."""
    def parameter(key, text, value):
        return f'<｜DSML｜parameter name="{key}" string="{text}">{value}</｜DSML｜parameter>\n'

    either = {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "object"}]}
    schema = {"type": "object", "properties": {key: either for key in "abcd"}}
    reply = (DSML.region[0] + '<｜DSML｜invoke name="f">\n' + parameter("a", "true", " 42 ") +
             parameter("b", "false", "42") + parameter("c", "false", '{"x": [1]}') + parameter("d", "true", '{"x": 1}')
             + "</｜DSML｜invoke>\n" + DSML.region[1])
    parsed = calls_of(message_of(CallParser(DSML, schemas={"f": schema}), reply))
    assert parsed == (None, [("f", {"a": " 42 ", "b": 42, "c": {"x": [1]}, "d": '{"x": 1}'})])
    request = read_tool_request({"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                                 "tool_choice": "required"})
    assert grammar_accepts(tool_grammar(DSML, request), reply)


def test_granite_gets_an_earlier_call_as_the_text_it_wrote():
    """Granite 3.3's template renders a turn's content alone (no tool_calls) and results in a tool role: an earlier
    call is its turn's text, written as the model writes it."""
    from rungen.chat_template import render
    from rungen.tools import plan_tools

    call = {"id": "call_a", "name": "get_weather", "arguments": {"city": "Paris"}}
    history = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_a", "content": "18 C"}]
    plan = plan_tools({"tools": [WEATHER]}, history, template("granite-3.3.jinja"))
    prompt = render(template("granite-3.3.jinja"), plan.messages, tools=plan.template_tools,
                    add_generation_prompt=True)
    assert ('<|start_of_role|>assistant<|end_of_role|><|tool_call|>[{"name": "get_weather", "arguments": {"city": '
            '"Paris"}}]<|end_of_text|>') in prompt
    assert "<|start_of_role|>tool<|end_of_role|>18 C<|end_of_text|>" in prompt
    assert "<|start_of_role|>available_tools<|end_of_role|>" in prompt


def test_lfm25_calls_are_python_literals_read_into_json_as_they_grow():
    """LFM2.5's template writes a call's values as Python's literals ('text', True, None, Python lists, dicts as
    JSON): the grammar holds a reply to them, the reader turns them into the arguments' JSON (its text growing with
    the reply's, so a stream's arguments only grow), and an earlier call is written back in them."""
    from rungen.chat_template import render
    from rungen.tool_python import python_text, read_value
    from rungen.tools import calls_text, plan_tools

    values = ["it's \"quoted\" \\ a\nb", -2.5e3, True, None, [1, "x", [False]], {"k": [1, {"z": None}], "a b": "c"}]
    for value in values:
        text = python_text(value)
        end, written = read_value(text + ")", 0)
        assert end == len(text) and json.loads(written) == value
        for cut in range(len(text)):
            assert read_value(text[:cut], 0)[0] is None and written.startswith(read_value(text[:cut], 0)[1])
    assert read_value('{"a": true, "b": null}', 0) == (22, '{"a": true, "b": null}')  # JSON's literals too
    for bad in ("Trux)", "[1,]", "{'a' 1}", "'a\\q'", "'\\ud83d'"):  # a lone surrogate: no JSON string holds it
        assert read_value(bad, 0)[0] == -1, bad
    from rungen.tool_schema import arguments_grammar

    strings = arguments_grammar({"type": "object", "properties": {"s": {"type": "string"}}}, "python_literal")
    assert grammar_accepts(strings, "s='\\u00e9\\ud7ff\\ue000'")
    assert not grammar_accepts(strings, "s='\\ud83d'") and not grammar_accepts(strings, "s='\\uDFFF'")
    # The 8B model's template writes the call itself: read back, it is the call.
    arguments = {"city": "Paris", "days": 3, "ok": True, "tags": ["a", "b"], "when": {"from": "today"}}
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
    asked = [{"role": "user", "content": "Hi"}]
    whole = render(template("lfm2.5-8b-a1b.jinja"), asked + [turn])
    reply = whole[whole.index(PYTHON_LITERALS.trigger) : whole.index("<|tool_call_end|>") + len("<|tool_call_end|>")]
    assert "city='Paris'" in reply and "ok=True" in reply
    assert calls_of(message_of(CallParser(PYTHON_LITERALS), reply))[1] == [("get_weather", arguments)]
    # The 1.2B model's template renders no calls: its turn's text is the call as the model writes it.
    call = {"id": "call_a", "name": "get_weather", "arguments": {"city": "Paris", "ok": True}}
    history = asked + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_a", "content": "18 C"}]
    plan = plan_tools({"tools": [WEATHER]}, history, template("lfm2.5-instruct.jinja"))
    assert plan.messages[1]["content"] == calls_text(PYTHON_LITERALS, [call]) == \
        "<|tool_call_start|>[get_weather(city='Paris', ok=True)]<|tool_call_end|>"


@pytest.mark.parametrize("fmt", [DSML, MINIMAX_XML])
def test_calls_before_a_cut_or_a_stray_text_in_their_region_stand(fmt):
    """A reply cut by max_tokens inside its region's closing, a multi-byte character of DeepSeek's ｜ cut in two (its
    text ends in U+FFFD), keeps the calls it wrote, whole and streamed alike; so does one whose region goes on in
    something no call."""
    invoke = (fmt.begin + "get_time" + fmt.middle + ('<｜DSML｜parameter name="zone" string="true">CET'
                                                     "</｜DSML｜parameter>\n" if fmt is DSML else
                                                     '<parameter name="zone">CET</parameter>\n') + fmt.end)
    for tail in (fmt.region[1][:3] + "\ufffd", fmt.region[1][:2], "\nnot a call"):
        text = fmt.region[0] + invoke + invoke + tail
        parser = CallParser(fmt)
        content, calls = calls_of(message_of(parser, text))
        assert calls == [("get_time", {"zone": "CET"})] * 2, tail
        assert calls_of(assemble(streamed(fmt, text))) == (content, calls)
        assert content == ("not a call" if "call" in tail else None)
