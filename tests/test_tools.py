"""Tool calling on a live server through the official openai client: each format on a tiny model carrying
its family's published chat template (tests/chat_templates), and the generic format on one whose template
renders no tools (ChatML, as SmolLM2-Instruct's). The tiny models are random: the constraint is what makes
their calls valid, so the calls checked here are the grammar's work, their parsing the parser's."""

import dataclasses
import json
import os
import re

import httpx
import jsonschema
import openai
import pytest
import torch
from test_server import CHAT_TEMPLATE, LiveServer
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import WEATHER, run_main
from rungen.loading import load
from rungen.server import ServeOptions, build
from tiny_models import build_tiny_checkpoint, set_context

TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")
# format: (tiny model type, chat template file or None for ChatML)
MODELS = {"hermes": ("qwen2", "qwen2.5-instruct.jinja"), "llama3_json": ("llama", "llama3.1-instruct.jinja"),
          "llama4_json": ("llama", "llama-4-scout.jinja"),
          "mistral": ("mistral", "mistral-7b-instruct-v0.3.jinja"),
          "mistral_args": ("mistral", "devstral-small-2507.jinja"),
          "mistral_call_id": ("mistral", "mistral-small-3.2.jinja"), "qwen_xml": ("qwen2", "qwen3.5.jinja"),
          "glm_xml": ("qwen2", "glm-4.6.jinja"), "gemma": ("qwen2", "gemma-4-it.jinja"),
          "minimax_xml": ("qwen2", "minimax-m2.jinja"), "apriel": ("mistral", "apriel-1.5-thinker.jinja"),
          "seed_xml": ("qwen2", "seed-oss.jinja"), "nemotron": ("qwen2", "nemotron-nano-v2.jinja"),
          "pythonic": ("qwen2", "lfm2-8b-a1b.jinja"), "deepseek_v3_1": ("qwen2", "deepseek-v3.2-exp.jinja"),
          "deepseek_r1": ("qwen2", "deepseek-r1-distill-llama-8b.jinja"), "kimi": ("qwen2", "kimi-k2.jinja"),
          "command_r": ("qwen2", "command-r7b-tool_use.jinja"), "deepseek_dsml": ("qwen2", "deepseek-v3.2.jinja"),
          "granite": ("qwen2", "granite-3.3.jinja"), "apertus": ("qwen2", "apertus-8b-instruct.jinja"),
          "python_literals": ("qwen2", "lfm2.5-instruct.jinja"),
          "generic": ("qwen2", None)}
# Qwen3.5 and GLM think first by default, and a tiny random model never closes its block: the calls follow no thinking.
TEMPLATE_KWARGS = {"qwen_xml": {"enable_thinking": False}, "glm_xml": {"enable_thinking": False},
                   "seed_xml": {"thinking_budget": 0}}
# MiniMax-M2's, Nemotron Nano 2's and DeepSeek R1's templates open the block: a budget of none closes it at once.
THINKING_BUDGET = {"minimax_xml": 0, "nemotron": 0, "deepseek_r1": 0}
# Mistral's control tokens, special in its tokenizers (a decode that skips special tokens drops them): v0.3's, and
# those the tekken tokenizers of Devstral and Mistral Small 3.2 add.
MISTRAL_CONTROL = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                   "[/TOOL_RESULTS]"]
TEKKEN_CONTROL = MISTRAL_CONTROL + ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]"]
# Gemma 4's control tokens, special in its tokenizer; <turn|> and <|tool_response> end a reply as its EOS does
# (generation_config's eos_token_id [1, 106, 50]).
GEMMA_CONTROL = ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>", "<|tool>", "<tool|>", "<|tool_call>",
                 "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>']
# DeepSeek's turn, thinking and tool markers: tokens of their own in its tokenizers, not special (its sentence markers
# are).
DEEPSEEK_ADDED = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>",
                  "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                  "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                  "<｜tool▁output▁end｜>"]
# Kimi K2's role and tool markers, special tokens of its tokenizer; <|im_end|> its EOS.
KIMI_CONTROL = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|tool_calls_section_begin|>",
                "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                "<|tool_call_end|>"]
# Command R7B's turn, thinking, response, action and result markers, special tokens of its tokenizer; <BOS_TOKEN> its
# BOS, <|END_OF_TURN_TOKEN|> its EOS.
COHERE_CONTROL = ["<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>",
                  "<|SYSTEM_TOKEN|>", "<|START_THINKING|>", "<|END_THINKING|>", "<|START_RESPONSE|>",
                  "<|END_RESPONSE|>", "<|START_ACTION|>", "<|END_ACTION|>", "<|START_TOOL_RESULT|>",
                  "<|END_TOOL_RESULT|>"]
# Granite 3.3's role markers and <|tool_call|>, special tokens of its tokenizer; <|end_of_text|> its EOS.
GRANITE_CONTROL = ["<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"]
# Apertus's role, deliberation and tool markers, special tokens of its tokenizer; <|assistant_end|> its EOS.
APERTUS_CONTROL = ["<|system_start|>", "<|system_end|>", "<|developer_start|>", "<|developer_end|>", "<|user_start|>",
                   "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>", "<|inner_prefix|>", "<|inner_suffix|>",
                   "<|tools_prefix|>", "<|tools_suffix|>"]
# The tokens a family's tokenizer holds beyond the tiny one's: special ones (add_special_tokens' dict), added ones, and
# its generation config's EOS (None: the tokenizer's own).
FAMILY_TOKENS = {
    "deepseek": ({"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}, DEEPSEEK_ADDED, None),
    "kimi": ({"additional_special_tokens": KIMI_CONTROL}, [], "<|im_end|>"),
    "command_r": ({"bos_token": "<BOS_TOKEN>", "additional_special_tokens": COHERE_CONTROL}, [],
                  "<|END_OF_TURN_TOKEN|>"),
    "granite": ({"eos_token": "<|end_of_text|>", "additional_special_tokens": GRANITE_CONTROL}, [], None),
    "apertus": ({"additional_special_tokens": APERTUS_CONTROL}, [], "<|assistant_end|>"),
    # Llama 4's: its turn and call markers special, <|eot|> its instruct model's EOS
    "llama4_json": ({"bos_token": "<|begin_of_text|>", "additional_special_tokens": [
        "<|header_start|>", "<|header_end|>", "<|eot|>", "<|eom|>", "<|python_start|>", "<|python_end|>"]}, [],
        "<|eot|>"),
}
# Apriel 1.5's turn markers, special tokens of its tokenizer.
APRIEL_CONTROL = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool_result|>", "<|content|>", "<|end|>"]
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CONTEXT = 4096
# The longest tags: MiniMax's, Kimi's and Command R's, and DeepSeek's, which a tiny model may spell byte by byte
# (three bytes a ｜ or ▁).
MAX_TOKENS = {"minimax_xml": 160, "deepseek_v3_1": 250, "deepseek_r1": 250, "kimi": 200, "command_r": 200,
              "deepseek_dsml": 300}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The checkpoint of each format, built on first use."""
    built = {}

    def get(fmt):
        if fmt not in built:
            model_type, template = MODELS[fmt]
            path = str(tmp_path_factory.mktemp(fmt) / model_type)
            build_tiny_checkpoint(model_type, path)
            # A tool prompt takes hundreds of the tiny vocabulary's tokens: a context as an instruct model's
            # (the rotary positions go on past the tiny default).
            set_context(path, CONTEXT)
            tokenizer = AutoTokenizer.from_pretrained(path)
            tokenizer.model_max_length = CONTEXT
            if fmt == "hermes":
                # Qwen2.5's tokenizer holds the tags as tokens of their own (added, not special).
                tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
            if fmt == "qwen_xml":  # Qwen3.5's, and its thinking block's
                tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])
            if fmt == "minimax_xml":  # MiniMax-M2's: its tags added, its role markers and EOS special
                tokenizer.add_tokens(["<minimax:tool_call>", "</minimax:tool_call>", "<think>", "</think>"])
                tokenizer.add_special_tokens({"additional_special_tokens": ["]~!b[", "]~b]", "[e~["]})
                model = AutoModelForCausalLM.from_pretrained(path)
                model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("[e~[")
                model.save_pretrained(path)
            if fmt == "seed_xml":  # Seed-OSS's tags, special in its tokenizer
                tokenizer.add_special_tokens({"additional_special_tokens": [
                    "<seed:bos>", "<seed:eos>", "<seed:think>", "</seed:think>", "<seed:cot_budget_reflect>",
                    "</seed:cot_budget_reflect>", "<seed:tool_call>", "</seed:tool_call>"]})
                model = AutoModelForCausalLM.from_pretrained(path)
                model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<seed:eos>")
                model.save_pretrained(path)
            if fmt == "nemotron":  # Nemotron Nano 2's: its turn markers special, the call tags and <think> added
                tokenizer.add_tokens(["<TOOLCALL>", "</TOOLCALL>", "<think>", "</think>"])
                tokenizer.add_special_tokens({"additional_special_tokens": ["<SPECIAL_10>", "<SPECIAL_11>",
                                                                            "<SPECIAL_12>"]})
                model = AutoModelForCausalLM.from_pretrained(path)
                model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<SPECIAL_12>")
                model.save_pretrained(path)
            if fmt in ("pythonic", "python_literals"):  # LFM2's and LFM2.5's markers, special in their tokenizers
                tokenizer.add_special_tokens({"additional_special_tokens": [
                    "<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>", "<|tool_call_end|>",
                    "<|tool_response_start|>", "<|tool_response_end|>"]})
            family = "deepseek" if fmt.startswith("deepseek") else fmt
            if family in FAMILY_TOKENS:
                special, added, eos = FAMILY_TOKENS[family]
                tokenizer.add_special_tokens(special)
                tokenizer.add_tokens(added)
                model = AutoModelForCausalLM.from_pretrained(path)
                model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)  # rows the model can write
                if "bos_token" in special:
                    model.generation_config.bos_token_id = tokenizer.bos_token_id
                model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(eos or tokenizer.eos_token)
                model.save_pretrained(path)
            if fmt == "glm_xml":  # GLM-4.6's
                tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                      "</arg_value>", "<think>", "</think>"])
            if fmt.startswith("mistral") or fmt in ("gemma", "apriel"):
                control = {"gemma": GEMMA_CONTROL, "apriel": APRIEL_CONTROL, "mistral": MISTRAL_CONTROL}.get(
                    fmt, TEKKEN_CONTROL)
                tokenizer.add_special_tokens({"additional_special_tokens": control})
                model = AutoModelForCausalLM.from_pretrained(path)
                model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)  # rows the model can write
                if fmt == "gemma":
                    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(
                        ["<turn|>", "<|tool_response>"])]
                model.save_pretrained(path)
            if template:
                with open(os.path.join(TEMPLATES, template), encoding="utf-8") as f:
                    tokenizer.chat_template = f.read()
            else:
                tokenizer.chat_template = CHAT_TEMPLATE
            tokenizer.save_pretrained(path)
            built[fmt] = path
        return built[fmt]

    return get


@pytest.fixture(scope="module")
def servers(checkpoints):
    """{format: (url, engine)}, each started on first use."""
    started = {}

    def get(fmt):
        if fmt not in started:
            loaded = load(checkpoints(fmt), device=torch.device("cpu"))
            assert len(loaded.tokenizer) <= loaded.vocab_size
            options = ServeOptions(model_id=fmt, max_batch=8, template_kwargs=TEMPLATE_KWARGS.get(fmt, {}))
            app, engine = build(loaded, options)
            started[fmt] = (LiveServer(app), engine, loaded)
        live, engine, loaded = started[fmt]
        return live.url, loaded

    yield get
    for live, engine, _ in started.values():
        live.stop()
        engine.close()
        engine.abort()


def client_for(servers, fmt):
    url, _ = servers(fmt)
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def create(servers, fmt, **kwargs):
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", MAX_TOKENS.get(fmt, 120))
    if fmt in THINKING_BUDGET:
        kwargs["extra_body"] = {"thinking_token_budget": THINKING_BUDGET[fmt], **kwargs.get("extra_body", {})}
    return client_for(servers, fmt).chat.completions.create(model=fmt, **kwargs)


def check_calls(choice, names):
    """Each call: an id, one of `names`, arguments that are a JSON object matching the function's schema."""
    calls = choice.message.tool_calls
    assert calls and choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({call.id for call in calls}) == len(calls)
    return [(call.function.name, json.loads(call.function.arguments)) for call in calls]


@pytest.mark.parametrize("fmt", sorted(MODELS))
def test_a_required_call_matches_its_schema(servers, fmt):
    response = create(servers, fmt, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3, n=4,
                      parallel_tool_calls=False)
    for choice in response.choices:
        assert len(check_calls(choice, SCHEMAS)) == 1


@pytest.mark.parametrize("fmt", sorted(MODELS))
def test_a_named_function_is_the_one_called(servers, fmt):
    response = create(servers, fmt, tools=TOOLS, temperature=1.0, seed=5, n=3,
                      tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in response.choices:
        assert [name for name, _ in check_calls(choice, {"get_time"})] == ["get_time"]


def test_parallel_calls_come_when_allowed_and_not_otherwise(servers):
    for fmt in ("hermes", "generic", "mistral", "qwen_xml", "gemma", "minimax_xml", "apriel", "pythonic",
                "deepseek_v3_1", "deepseek_r1", "kimi", "command_r"):
        several = create(servers, fmt, tools=TOOLS, tool_choice="required", temperature=1.0, seed=11, n=8,
                         max_tokens=250)
        counts = [len(check_calls(choice, SCHEMAS)) for choice in several.choices if choice.finish_reason != "length"]
        assert max(counts) >= 2, (fmt, counts)


def test_none_answers_in_text_without_the_tools(servers):
    plain = create(servers, "hermes", temperature=0, max_tokens=10)
    none = create(servers, "hermes", tools=TOOLS, tool_choice="none", temperature=0, max_tokens=10)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
    # none: the tools stay out of the prompt, so the reply is the one without tools.
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("fmt", sorted(MODELS))
def test_auto_on_a_prompt_that_needs_no_tool_answers_in_text(servers, fmt):
    plain = create(servers, fmt, temperature=0, max_tokens=12)
    auto = create(servers, fmt, tools=TOOLS, temperature=0, max_tokens=12)
    choice = auto.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert choice.message.content
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # the template rendered the tools


def test_auto_holds_a_call_the_model_opens_to_its_schema(servers):
    """The lazy constraint: free text until the model writes <tool_call> (pushed here with logit_bias on
    Qwen2.5's tag token), the call's schema from there."""
    _, loaded = servers("hermes")
    tag = loaded.tokenizer.convert_tokens_to_ids("<tool_call>")
    response = create(servers, "hermes", tools=TOOLS, temperature=1.0, seed=2, n=4, logit_bias={str(tag): 100},
                      parallel_tool_calls=False)
    for choice in response.choices:
        assert len(check_calls(choice, SCHEMAS)) == 1


@pytest.mark.parametrize("fmt, marker", [("mistral", "[TOOL_CALLS]"), ("mistral_args", "[TOOL_CALLS]"),
                                         ("mistral_call_id", "[TOOL_CALLS]"), ("gemma", "<|tool_call>")])
def test_auto_takes_a_call_opened_with_the_special_marker_token(servers, fmt, marker):
    """Mistral's [TOOL_CALLS] and Gemma 4's <|tool_call> are special tokens: under auto the model opens a call with
    one (pushed here with logit_bias), the grammar takes it as the marker's text and the reply's text keeps it, so
    the call is parsed (Gemma's <|"|> quotes alike)."""
    _, loaded = servers(fmt)
    tag = loaded.tokenizer.convert_tokens_to_ids(marker)
    response = create(servers, fmt, tools=TOOLS, temperature=1.0, seed=2, n=4, logit_bias={str(tag): 100},
                      parallel_tool_calls=False, logprobs=True)
    for choice in response.choices:
        assert choice.logprobs.content[0].token == marker  # the special token, not the marker spelt in pieces
        assert len(check_calls(choice, SCHEMAS)) == 1


@pytest.mark.parametrize("fmt", ["hermes", "generic"])
def test_auto_with_a_response_format_calls_a_tool_or_answers_in_the_format(servers, fmt):
    """Tools and a response format together (an agent with tools and an output type): under auto a reply is
    calls held to their schemas, or an answer that follows the format, never free text."""
    answer = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}}
    replies = create(servers, fmt, tools=TOOLS, response_format=response_format, temperature=1.0, seed=5, n=8,
                     max_tokens=200, parallel_tool_calls=False)
    kinds = set()
    for choice in replies.choices:
        if choice.finish_reason == "length":
            continue
        if choice.message.tool_calls:
            check_calls(choice, SCHEMAS)
            kinds.add("call")
        else:
            jsonschema.validate(json.loads(choice.message.content), answer)
            kinds.add("answer")
    assert kinds == {"call", "answer"}, kinds  # this seed's replies do both
    # Beside the tools' own, a regex cannot be held too: refused as before.
    with pytest.raises(openai.BadRequestError, match="one constraint per request"):
        create(servers, fmt, tools=TOOLS, extra_body={"guided_regex": "[a-z]+"}, max_tokens=4)


@pytest.mark.parametrize("fmt", sorted(MODELS))
def test_streamed_calls_assemble_to_the_plain_reply(servers, fmt):
    kwargs = dict(tools=TOOLS, tool_choice="required", temperature=1.0, seed=7, parallel_tool_calls=False)
    whole = create(servers, fmt, **kwargs)
    expected = check_calls(whole.choices[0], SCHEMAS)
    calls, pieces, finish, content = {}, 0, None, ""
    for chunk in create(servers, fmt, stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # a call opens with its id and name, its arguments follow
                    assert delta.id.startswith("call_") and delta.function.name
                    calls[delta.index] = [delta.function.name, delta.function.arguments or ""]
                else:
                    assert delta.id is None and delta.function.name is None
                    calls[delta.index][1] += delta.function.arguments
                    pieces += 1
    assert finish == "tool_calls" and content == ""
    assert [(name, json.loads(arguments)) for name, arguments in calls.values()] == expected
    assert pieces > 1  # the arguments came as they were generated, not at the end


def test_a_stop_string_inside_a_call_is_no_finished_call(servers):
    response = create(servers, "hermes", tools=[WEATHER], tool_choice="required", temperature=1.0, seed=4,
                      stop=['"unit"'])
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls[0].function.name == "get_weather"
    assert '"unit"' not in choice.message.tool_calls[0].function.arguments


@pytest.mark.parametrize("fmt, stop", [("gemma", "<|"), ("mistral_args", "[TOOL")])
def test_a_stop_string_is_no_piece_of_a_special_marker(servers, fmt, stop):
    """A format's markers that are special tokens (Gemma 4's <|tool_call> and <|"|>, Mistral's [TOOL_CALLS]) are in
    the reply's text only for the parser: a stop string cutting into one is none there, as it is none where other
    servers drop them."""
    response = create(servers, fmt, tools=TOOLS, temperature=1.0, seed=5, n=2, stop=[stop],
                      tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in response.choices:
        assert [name for name, _ in check_calls(choice, {"get_time"})] == ["get_time"]


@pytest.mark.parametrize("fmt", sorted(MODELS))
def test_a_round_trip_call_result_answer(servers, fmt):
    first = create(servers, fmt, tools=TOOLS, tool_choice="required", temperature=1.0, seed=1,
                   parallel_tool_calls=False)
    message = first.choices[0].message
    check_calls(first.choices[0], SCHEMAS)
    history = ASK + [{"role": "assistant", "content": None,
                      "tool_calls": [call.model_dump() for call in message.tool_calls]},
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 degrees, sunny"}]
    answer = create(servers, fmt, messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.prompt_tokens > \
        first.usage.prompt_tokens
    # Without tools in the request the history still renders (the result is in the prompt).
    again = create(servers, fmt, messages=history, temperature=0, max_tokens=8)
    assert again.choices[0].message.tool_calls is None


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(a)\\1"}}}}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools"),
    ({"tools": [dict(WEATHER, function=dict(WEATHER["function"], examples=[1]))]}, "tools"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tools": TOOLS, "guided_regex": "[a-z]+"}, "guided_regex"),  # a response format is taken: see above
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "18"}]}, "messages"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}]}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "18"}]}, "messages"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{}"}}]}, {"role": "user", "content": "And?"}]}, "messages"),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[f"{case[1]}-{number}" for number, case in enumerate(BAD)])
def test_bad_tools_are_a_400_naming_them(servers, fields, param):
    url, _ = servers("hermes")
    body = {"model": "hermes", "messages": ASK, **fields}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert create(servers, "hermes", max_tokens=2).choices[0].message.content is not None  # still serving


def test_a_template_with_tools_in_an_unknown_format_is_refused(servers):
    _, loaded = servers("generic")
    saved = loaded.tokenizer.chat_template
    loaded.tokenizer.chat_template = "{% for tool in tools %}<function={{ tool.function.name }}>{% endfor %}" + saved
    try:
        url, _ = servers("generic")
        response = httpx.post(url + "/v1/chat/completions", json={"model": "generic", "messages": ASK,
                                                                  "tools": TOOLS}, timeout=60)
    finally:
        loaded.tokenizer.chat_template = saved
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
    assert "not parsed here" in response.json()["error"]["message"]


def test_jsonl_lines_with_tools(checkpoints):
    """The command line's jsonl input takes tools as the server does: each line its own tools and grammar, the
    record's content and tool_calls parsed as the server's; a line with bad tools is an error record."""
    required = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "id": 1}
    bad = {"messages": ASK, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}
    history = ASK + [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    lines = "\n".join(json.dumps(line) for line in (required, bad, {"messages": history}, {"messages": ASK}))
    args = ["--model_name_or_path", checkpoints("hermes"), "--input_format", "jsonl", "--output_format", "jsonl",
            "--temperature", "0", "--length", "120"]
    result = run_main(args, stdin=lines)
    assert result.returncode == 1, result.stderr.decode()[-2000:]
    records = [json.loads(line) for line in result.stdout.decode().splitlines()]
    call, error, answer, plain = records
    assert call["id"] == 1 and call["content"] is None and len(call["tool_calls"]) == 1
    function = call["tool_calls"][0]["function"]
    jsonschema.validate(json.loads(function["arguments"]), SCHEMAS[function["name"]])
    assert "tools[0].function.name" in error["error"]
    assert "tool_calls" not in answer and answer["num_prompt_tokens"] > plain["num_prompt_tokens"]
    # Where the engine does not run (beam search) or another constraint is asked for, the line is refused.
    for extra, words in ((["--num_beams", "2"], "beam search"), (["--regex", "a+"], "one constraint")):
        refused = run_main(args + extra, stdin=json.dumps(required))
        assert refused.returncode == 1 and words in json.loads(refused.stdout.decode())["error"]


def test_a_session_with_tools_prints_the_call_it_would_make(checkpoints, tmp_path, capsys):
    from rungen.arguments import parse_args, settings_from_args
    from rungen.session import Session

    path = checkpoints("hermes")
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}))
    args = parse_args(["--model_name_or_path", path, "--tools", str(tools_file), "--temperature", "0",
                       "--length", "120"])
    loaded = load(path, device=torch.device("cpu"))
    settings = dataclasses.replace(settings_from_args(args, loaded.context), chat=True)
    session = Session(loaded, settings, stream=False, tools=args.tools)
    session.turn("What is the weather in Paris?")
    shown = capsys.readouterr()
    call = re.search(r"^\(tool call: (\w+)\((.*)\)\)$", shown.err, re.M)
    assert call, shown.err
    jsonschema.validate(json.loads(call[2]), SCHEMAS[call[1]])
    assert "<tool_call>" in shown.out  # the reply as the model wrote it
    assert session.messages[-1]["content"] == shown.out.strip()
    # A call --length cuts after its name: shown as cut, with its arguments as far as they came.
    session = Session(loaded, dataclasses.replace(settings, length=len(loaded.tokenizer.encode(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city"', add_special_tokens=False))), stream=False,
                      tools=args.tools)
    session.turn("What is the weather in Paris?")
    shown = capsys.readouterr()
    assert re.search(r"^\(tool call cut short by --length: get_weather\(.*\)\)$", shown.err, re.M), shown.err


def test_tools_flag_is_checked_and_only_for_a_session(checkpoints, tmp_path):
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps(TOOLS))
    base = ["--model_name_or_path", checkpoints("hermes")]
    piped = run_main(base + ["--tools", str(tools_file), "--prompt", "Hi"])
    assert piped.returncode == 2 and "--tools is for the terminal session" in piped.stderr.decode()
    served = run_main(base + ["--serve", "--tools", str(tools_file)])
    assert served.returncode == 2 and "--tools does not apply to --serve" in served.stderr.decode()
    tools_file.write_text(json.dumps([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}]))
    bad = run_main(base + ["--tools", str(tools_file), "--prompt", "Hi"])
    assert bad.returncode == 2 and "not a valid JSON schema" in bad.stderr.decode()


def test_tools_in_a_format_not_parsed_are_refused_before_a_session_and_named_once_in_a_record(checkpoints, tmp_path):
    """A template whose tool format is not parsed here: a session with --tools is refused before its first turn
    (exit 2, one line), and a jsonl line with tools is an error record naming the field once."""
    import shutil

    from rungen.arguments import parse_args, settings_from_args
    from rungen.errors import UsageError
    from rungen.session import run

    path = str(tmp_path / "model")
    shutil.copytree(checkpoints("generic"), path)
    unknown = "{% for tool in tools %}<function={{ tool.function.name }}>{% endfor %}" + CHAT_TEMPLATE
    (tmp_path / "model" / "chat_template.jinja").write_text(unknown)
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps(TOOLS))
    args = parse_args(["--model_name_or_path", path, "--tools", str(tools_file)])
    loaded = load(path, device=torch.device("cpu"))
    assert loaded.tokenizer.chat_template == unknown
    with pytest.raises(UsageError, match=r"^--tools: this model's chat template renders tools in a format not "
                                         r"parsed here \(it knows"):
        run(loaded, settings_from_args(args, loaded.context), tools=args.tools)
    # A template that refuses the tools themselves (gpt-oss's reads a description, which OpenAI's tools may lack).
    loaded.tokenizer.chat_template = ("{# calls in <tool_call> tags #}{% for tool in tools or [] %}"
                                      "{{ tool.function.description.upper() }}{% endfor %}" + CHAT_TEMPLATE)
    bare = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    tools_file.write_text(json.dumps(bare))
    args = parse_args(["--model_name_or_path", path, "--tools", str(tools_file)])
    with pytest.raises(UsageError, match=r"^--tools: .*description"):
        run(loaded, settings_from_args(args, loaded.context), tools=args.tools)
    result = run_main(["--model_name_or_path", path, "--input_format", "jsonl", "--output_format", "jsonl",
                       "--length", "4"], stdin=json.dumps({"messages": ASK, "tools": TOOLS}))
    [record] = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert record["error"].startswith('"tools": this model\'s chat template renders tools'), record["error"]


def test_gemma_goes_on_in_its_turn_after_tool_results(servers):
    """Gemma 4's template adds no generation prompt after tool results: the model goes on in its turn. Where that
    turn held text beside its calls the template closes it, and the prompt opens the model's next one. With thinking
    off (the template's own turns close the thought channel) the reply is the answer or a call, no block forced
    open for the grammar; the prompt /tokenize shows is the one the reply follows."""
    url, loaded = servers("gemma")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}
    endings = []
    for content in (None, "Let me look."):
        history = ASK + [{"role": "assistant", "content": content, "tool_calls": [call]}, result]
        ids = httpx.post(url + "/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
        endings.append(loaded.tokenizer.decode(ids, skip_special_tokens=False))
        reply = create(servers, "gemma", messages=history, tools=TOOLS, tool_choice="required", temperature=1.0,
                       seed=3, parallel_tool_calls=False)
        assert reply.usage.prompt_tokens == len(ids)
        assert (reply.choices[0].message.model_extra or {}).get("reasoning_content") is None
        check_calls(reply.choices[0], SCHEMAS)
    assert endings[0].endswith('response:get_time{value:<|"|>12:00<|"|>}<tool_response|>')
    # the turn opened as the template opens one: with thinking off, its empty thought channel too
    assert endings[1].endswith("Let me look.<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")
    thinking = httpx.post(url + "/tokenize", json={"messages": history, "chat_template_kwargs": {
        "enable_thinking": True}}).json()["tokens"]
    assert loaded.tokenizer.decode(thinking, skip_special_tokens=False).endswith("Let me look.<turn|>\n<|turn>model\n")


def test_a_session_with_tools_fits_its_history_with_the_tools_counted(checkpoints, tmp_path, capsys):
    """The tools the template renders are part of each turn's prompt: the oldest turns are dropped until the prompt
    with them fits the context, not the conversation alone (which would leave a prompt too long to generate)."""
    from rungen.arguments import parse_args, settings_from_args
    from rungen.prompts import Prompt, encode_prompt
    from rungen.session import Session

    path = checkpoints("hermes")
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps({"tools": TOOLS}))
    args = parse_args(["--model_name_or_path", path, "--tools", str(tools_file), "--temperature", "0",
                       "--length", "4"])
    loaded = load(path, device=torch.device("cpu"))
    settings = dataclasses.replace(settings_from_args(args, loaded.context), chat=True)
    session = Session(loaded, settings, stream=False, tools=args.tools)
    for number in range(6):
        session.messages += [{"role": "user", "content": f"Turn {number}: " + "tell me more " * 40},
                             {"role": "assistant", "content": "Here is more. " * 40}]
    asked = session.messages + [{"role": "user", "content": "And the weather?"}]
    plain = len(encode_prompt(loaded, Prompt(0, "", messages=asked), within_context=False))
    with_tools = len(encode_prompt(loaded, Prompt(0, "", messages=asked, tools=args.tools), within_context=False))
    assert with_tools > plain + 4
    loaded.context = plain + 4  # the conversation alone fits with the reply's room; with the tools it does not
    session.turn("And the weather?")
    shown = capsys.readouterr().err
    assert "error" not in shown and "dropped the oldest" in shown, shown
    assert session.replies  # the turn was generated


# In the manner of SmolLM3's published template: the tools come as xml_tools, the calls are written in <tool_call> tags
# but an assistant turn renders its content alone (no tool_calls), and a tool's result is a user turn.
XML_TOOLS_TEMPLATE = (
    "<|im_start|>system\n{% if xml_tools %}You are provided with function signatures within <tools></tools> XML "
    "tags:\n<tools>\n{% for tool in xml_tools %}{{ tool | string }}\n{% endfor %}</tools>\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags.{% endif %}"
    "<|im_end|>\n{% for message in messages %}{% set content = message.content if message.content is string else '' "
    "%}{% if message.role == 'tool' %}<|im_start|>user\n{{ content }}<|im_end|>\n{% else %}<|im_start|>"
    "{{ message.role }}\n{{ content }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")


def test_a_template_reading_xml_tools_and_no_tool_calls_gets_both_its_way(checkpoints, tmp_path):
    """The tools reach a template that reads them as xml_tools (SmolLM3's), and an earlier turn's calls, which it
    does not render from tool_calls, are that turn's text as the model wrote it: the next prompt holds them."""
    import shutil

    path = str(tmp_path / "model")
    shutil.copytree(checkpoints("hermes"), path)
    (tmp_path / "model" / "chat_template.jinja").write_text(XML_TOOLS_TEMPLATE)
    loaded = load(path, device=torch.device("cpu"))
    app, engine = build(loaded, ServeOptions(model_id="xml_tools", max_batch=4))
    live = LiveServer(app)
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        first = client.chat.completions.create(model="xml_tools", messages=ASK, tools=TOOLS, tool_choice="required",
                                               temperature=1.0, seed=1, parallel_tool_calls=False, max_tokens=120)
        [(name, arguments)] = check_calls(first.choices[0], SCHEMAS)
        call = first.choices[0].message.tool_calls[0]
        history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
        ids = httpx.post(live.url + "/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
        prompt = loaded.tokenizer.decode(ids)
        assert "'name': 'get_weather'" in prompt and "'name': 'get_time'" in prompt  # the tools, as xml_tools
        written = f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n' \
                  "</tool_call>"
        assert f"<|im_start|>assistant\n{written}<|im_end|>\n<|im_start|>user\n18 degrees" in prompt
    finally:
        live.stop()
        engine.close()
        engine.abort()


def test_kimis_later_template_renders_on_a_transformers_checkpoint(servers):
    """Kimi K2's later template queues its call ids in a list, which transformers' sandbox refuses: a checkpoint's
    conversation with calls renders in the tool's environment instead, its calls numbered as the template numbers
    them (a GGUF file's renders there anyway)."""
    url, loaded = servers("kimi")
    saved = loaded.tokenizer.chat_template
    with open(os.path.join(TEMPLATES, "kimi-k2-instruct.jinja"), encoding="utf-8") as f:
        loaded.tokenizer.chat_template = f.read()
    calls = [{"id": f"call_{n}", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
             for n in range(2)]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": calls},
                     {"role": "tool", "tool_call_id": "call_0", "content": "noon"},
                     {"role": "tool", "tool_call_id": "call_1", "content": "one"}]
    try:
        response = httpx.post(url + "/tokenize", json={"model": "kimi", "messages": history, "tools": TOOLS},
                              timeout=60)
        assert response.status_code == 200, response.text
        text = loaded.tokenizer.decode(response.json()["tokens"])
        answer = create(servers, "kimi", messages=history, tools=TOOLS, max_tokens=4)
    finally:
        loaded.tokenizer.chat_template = saved
    assert "functions.get_time:1<|tool_call_argument_begin|>" in text and "## Return of functions.get_time:1" in text
    assert answer.usage.prompt_tokens == response.json()["count"]
