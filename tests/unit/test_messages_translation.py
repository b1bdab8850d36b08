"""rungen/messages.py without a model: a Messages request into a chat body, a chat completion and its stream of
chunks back into a message and Anthropic's events (read back by Anthropic's own stream accumulator), errors under
the request's names."""

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message

from rungen.messages import Events, error_type, message_of, renamed, to_chat
from rungen.openai_api import APIError

THINKING_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking %}<think>{% endif %}"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_a_request_becomes_a_chat_body():
    body = {
        "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief.", "cache_control":
                                                   {"type": "ephemeral"}}, {"type": "text", "text": "Be kind."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                                         {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                          "content": [{"type": "text", "text": "no such city"}]},
                                         {"type": "text", "text": "<reminder>x</reminder>"},
                                         {"type": "text", "text": "And Rome?"}]}],
        "tools": [{"name": "get_weather", "description": "d", "input_schema": SCHEMA}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["\n\n"], "top_k": 5, "top_p": 0.9, "stream": True, "metadata": {"user_id": "u"},
        "thinking": {"type": "disabled"},
    }
    chat, origins = to_chat(body, THINKING_TEMPLATE)
    assert chat == {
        # Blocks joined by a line, as vLLM joins a message's text parts: a block's words never run into the next's.
        "messages": [{"role": "system", "content": "Be brief.\nBe kind."},
                     {"role": "user", "content": "Weather in Paris?"},
                     # The thinking given back is the turn's reasoning, which a thinking template may show.
                     {"role": "assistant", "content": "Let me look.", "reasoning_content": "hm", "tool_calls": [
                         {"id": "toolu_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
                     {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
                     {"role": "user", "content": "<reminder>x</reminder>\nAnd Rome?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA, "description": "d"}}],
        "tool_choice": "required", "parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": False},
        "max_tokens": 64, "stop": ["\n\n"], "temperature": 1.0, "top_p": 0.9, "top_k": 5, "stream": True,
        "stream_options": {"include_usage": True}}
    assert origins == ["system", "messages[0]", "messages[1]", "messages[2]", "messages[2]", "messages[2]"]
    named, _ = to_chat({**body, "tool_choice": {"type": "tool", "name": "get_weather"}, "stream": False},
                       THINKING_TEMPLATE)
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert "parallel_tool_calls" not in named and "stream_options" not in named
    counted, _ = to_chat({key: body[key] for key in ("model", "messages", "system", "tools")}, THINKING_TEMPLATE,
                         count=True)
    assert set(counted) == {"messages", "tools"}


@pytest.mark.parametrize("change, message", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1023}}, "at least 1024"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048, "display": "omitted"}}, "thinking.display"),
    ({"tool_choice": {"type": "any"}}, "tool_choice any needs tools"),
    ({"top_k": 0}, "top_k must be in [1, inf]"),
    ({"metadata": {"session": 1}}, "metadata.session"),
    ({"system": [{"type": "image"}]}, 'system[0]: "image" blocks'),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]}]},
     "messages[0].content[0].extra"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role must be user or assistant"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]},
                   {"role": "user", "content": "x"}]}, "messages[0].content[0].input must be an object"),
])
def test_refusals_name_the_request_field(change, message):
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}], **change}
    with pytest.raises(APIError) as caught:
        to_chat(body, THINKING_TEMPLATE)
    assert message in caught.value.message


def test_chat_errors_are_renamed_to_the_request_fields():
    cases = [(APIError("stop must be a non-empty string or a list of them", "stop"),
              "stop_sequences must be a non-empty string or a list of them", "stop_sequences"),
             (APIError("messages[3]: tool_call_id 'x' answers no tool call", "messages"),
              "messages[1]: tool_use_id 'x' answers no tool_use", "messages"),
             (APIError("tools[0].function.parameters is not a valid JSON schema", "tools"),
              "tools[0].input_schema is not a valid JSON schema", "tools"),
             (APIError("chat_template_kwargs.enable_thinking: ...", "chat_template_kwargs"),
              "thinking.enable_thinking: ...", "thinking")]
    for error, message, param in cases:
        with pytest.raises(APIError) as caught, renamed(["system", "messages[0]", "messages[1]", "messages[1]"]):
            raise error
        assert (caught.value.message, caught.value.param) == (message, param)


CALL = {"id": "call_ab12", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def chat_result(finish_reason="tool_calls", stop_reason=None):
    return {"id": "chatcmpl-0123", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": finish_reason, "stop_reason": stop_reason, "logprobs": None,
                         "message": {"role": "assistant", "content": "It is", "reasoning_content": "Paris, so...",
                                     "tool_calls": [CALL, {**CALL, "id": "call_cd34"}]}}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}}


def chunk(delta=None, finish_reason=None, stop_reason=None, usage=None):
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason, "stop_reason": stop_reason}]
    return {"id": "chatcmpl-0123", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": choices, "usage": usage}


def chat_chunks():
    """The chunks of chat_result() as run_chat streams them (role, reasoning, content, calls, finish, usage)."""
    pieces = [{"role": "assistant", "content": ""}, {"reasoning_content": "Paris, "}, {"reasoning_content": "so..."},
              {"content": "It"}, {"content": " is"}]
    for index, call_id in enumerate(("call_ab12", "call_cd34")):
        pieces.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                       "function": {"name": "get_weather", "arguments": ""}}]})
        pieces += [{"tool_calls": [{"index": index, "function": {"arguments": part}}]}
                   for part in ('{"city": ', '"Paris"}')]
    return [chunk(piece) for piece in pieces] + [
        chunk({}, finish_reason="tool_calls"), chunk(usage={"prompt_tokens": 11, "completion_tokens": 7,
                                                            "total_tokens": 18})]


def read_events(texts):
    events = []
    for text in texts:
        name, data = text.strip("\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
        events.append(event)
    return events


def test_a_chat_answer_becomes_a_message_and_its_stream_the_same_message():
    message = message_of(chat_result(), "m")
    Message.model_validate(message)
    assert message["id"] == "msg_0123" and message["stop_reason"] == "tool_use" and message["stop_sequence"] is None
    assert [block["type"] for block in message["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert message["content"][2] == {"type": "tool_use", "id": "toolu_ab12", "name": "get_weather",
                                     "input": {"city": "Paris"}}
    assert message["usage"] == {"input_tokens": 11, "output_tokens": 7}

    translator = Events("m", 11)
    texts = []
    for number, piece in enumerate(chat_chunks()):
        texts += (translator.start(piece) if number == 0 else []) + translator.chunk(piece)
    events = read_events(texts)
    assert [event["type"] for event in events][:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert events[-2]["type"] == "message_delta" and events[-1]["type"] == "message_stop"
    assert [event["delta"]["type"] for event in events if event["type"] == "content_block_delta"] == [
        "thinking_delta", "thinking_delta", "signature_delta", "text_delta", "text_delta",
        "input_json_delta", "input_json_delta", "input_json_delta", "input_json_delta"]
    snapshot, buffers = None, {}
    for event in events:
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    assert snapshot.model_dump(exclude_none=True) == Message.model_validate(message).model_dump(exclude_none=True)


def test_stop_reasons():
    assert message_of(chat_result("stop", "\n\n"), "m")["stop_reason"] == "stop_sequence"
    assert message_of(chat_result("stop", "\n\n"), "m")["stop_sequence"] == "\n\n"
    assert message_of(chat_result("stop"), "m")["stop_reason"] == "end_turn"
    assert message_of(chat_result("length"), "m")["stop_reason"] == "max_tokens"
    with pytest.raises(APIError) as caught:
        message_of(chat_result("abort"), "m")
    assert caught.value.status == 503
    translator = Events("m", 11)
    texts = translator.start(chunk({"role": "assistant", "content": ""}))
    texts += translator.chunk(chunk({"content": "Hi"}))
    texts += translator.chunk(chunk({}, finish_reason="stop", stop_reason="\n\n"))
    texts += translator.chunk(chunk(usage={"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}))
    delta = read_events(texts)[-2]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n\n"}
    # a stop sequence after complete calls (chat's finish_reason tool_calls) is still the stop sequence
    assert message_of(chat_result("tool_calls", "\n\n"), "m")["stop_reason"] == "stop_sequence"
    assert delta["usage"]["output_tokens"] == 2


def test_error_types_by_status():
    assert [error_type(status) for status in (400, 401, 403, 404, 405, 408, 413, 429, 500, 503, 529)] == [
        "invalid_request_error", "authentication_error", "permission_error", "not_found_error",
        "invalid_request_error", "timeout_error", "request_too_large", "rate_limit_error", "api_error",
        "overloaded_error", "overloaded_error"]


def test_thinking_on_a_model_that_always_thinks_takes_the_budget_and_refuses_disabled():
    """gpt-oss's template has no switch: it always thinks. enabled and adaptive are what it does (the budget caps
    it); disabled cannot be honoured. A template that does not think refuses both; one whose switch is another
    name than enable_thinking gets it set."""
    import os

    from rungen.messages import read_thinking

    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "chat_templates")
    with open(os.path.join(folder, "gpt-oss.jinja"), encoding="utf-8") as f:
        gpt_oss = f.read()
    with open(os.path.join(folder, "llama3.1-instruct.jinja"), encoding="utf-8") as f:
        llama = f.read()
    assert read_thinking({"thinking": {"type": "enabled", "budget_tokens": 1024}}, gpt_oss, 2000) == ({}, 1024)
    assert read_thinking({"thinking": {"type": "adaptive"}}, gpt_oss, 2000) == ({}, None)
    with pytest.raises(APIError, match="always thinks"):
        read_thinking({"thinking": {"type": "disabled"}}, gpt_oss, 2000)
    with pytest.raises(APIError, match="reads no switch of thinking"):
        read_thinking({"thinking": {"type": "adaptive"}}, llama, 2000)
    # DeepSeek V3.1's switch is `thinking` (off unless set): enabled and disabled set it.
    with open(os.path.join(folder, "deepseek-v3.2-exp.jinja"), encoding="utf-8") as f:
        deepseek = f.read()
    assert read_thinking({"thinking": {"type": "enabled", "budget_tokens": 1024}}, deepseek, 2000) == \
        ({"thinking": True}, 1024)
    assert read_thinking({"thinking": {"type": "disabled"}}, deepseek, 2000) == ({"thinking": False}, None)
    # Seed-OSS turns thinking off and caps it by its thinking_budget (0: none); Hunyuan 3's reasoning_effort is
    # no_think unless set.
    with open(os.path.join(folder, "seed-oss.jinja"), encoding="utf-8") as f:
        seed = f.read()
    assert read_thinking({"thinking": {"type": "disabled"}}, seed, 2000) == ({"thinking_budget": 0}, None)
    assert read_thinking({"thinking": {"type": "enabled", "budget_tokens": 1024}}, seed, 2000) == \
        ({"thinking_budget": 1024}, 1024)
    assert read_thinking({"thinking": {"type": "adaptive"}}, seed, 2000) == ({}, None)
    with open(os.path.join(folder, "hy3.jinja"), encoding="utf-8") as f:
        hunyuan = f.read()
    assert read_thinking({"thinking": {"type": "disabled"}}, hunyuan, 2000) == ({}, None)
    assert read_thinking({"thinking": {"type": "adaptive"}}, hunyuan, 2000) == ({"reasoning_effort": "high"}, None)
    from rungen.messages import to_chat
    from rungen.reasoning import read_template_variables

    for template, body, expected in ((hunyuan, {"type": "adaptive"}, {"reasoning_effort": "high"}),
                                     (seed, {"type": "disabled"}, {"thinking_budget": 0})):
        chat, _ = to_chat({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2000, "thinking": body},
                          template)
        assert read_template_variables(chat, template) == expected  # a chat request's own fields, taken


def test_a_number_past_a_doubles_range_in_a_call_is_its_text():
    """A tool's number the grammar let the model write past a double's range (56e6720) cannot be a JSON number in
    the tool_use block's input: it is its text, the rest as written (never a 500)."""
    import json

    from rungen.messages import arguments_input

    value = arguments_input('{"x": 56e6720, "y": 5E+99, "z": -1e400, "w": [1.5]}')
    assert value == {"x": "56e6720", "y": 5e99, "z": "-1e400", "w": [1.5]}
    json.dumps(value, allow_nan=False)
