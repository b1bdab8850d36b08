"""/v1/messages (Anthropic's Messages API) against a live server on a tiny llama, through Anthropic's official
client and raw HTTP: text, stop sequences, max_tokens, streams, a tool round trip, count_tokens, errors in
Anthropic's shape, the API key as x-api-key. The answers are compared with /v1/chat/completions' on the same
request: both run the one chat path."""

import json
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch
from test_server import HELLO, MODEL_ID, build_chat_llama
from transformers import AutoTokenizer

import rungen.messages
from helpers import LiveServer, serving
from rungen.engine import Engine
from rungen.loading import load
from rungen.server import Guard, ServeOptions, create_app
from tiny_models import set_context

GREEDY = {"temperature": 0}  # anthropic 2.14's create() has no temperature argument; the API takes the field
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The current weather in a city", "input_schema": SCHEMA}


CONTEXT = 4096  # a tool prompt takes hundreds of the tiny vocabulary's tokens


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """The tiny llama of tests/test_server.py (ChatML: the generic tool format), with an instruct model's context."""
    path = build_chat_llama(str(tmp_path_factory.mktemp("messages") / "llama"))
    set_context(path, CONTEXT)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.model_max_length = CONTEXT
    tokenizer.save_pretrained(path)
    return load(path, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def served(loaded):
    with serving(loaded, model_id=MODEL_ID, max_batch=8) as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served[0].url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat_client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def create(client, **kwargs):
    kwargs.setdefault("messages", HELLO)
    return client.messages.create(model=MODEL_ID, extra_body=GREEDY, **kwargs)


def text_of(message):
    assert [block.type for block in message.content] in (["text"], [])
    return "".join(block.text for block in message.content)


def test_text_max_tokens_and_a_stop_sequence(client, chat_client):
    message = create(client, max_tokens=16)
    chat = chat_client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=16, temperature=0)
    text = text_of(message)
    assert text == chat.choices[0].message.content and len(text) > 8
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL_ID and message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.input_tokens == chat.usage.prompt_tokens and message.usage.output_tokens == 16

    stop = text[4:7]  # three characters mid-text
    cut = create(client, max_tokens=16, stop_sequences=["\u2603never", stop])
    assert text_of(cut) == text[: text.index(stop)]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    # The chat route says which stop string ended a choice, as vLLM's stop_reason does.
    chat = chat_client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=16, temperature=0,
                                               stop=["\u2603never", stop])
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].model_extra["stop_reason"] == stop


def test_a_stream_assembles_to_the_whole_message(client):
    whole = create(client, max_tokens=12, system="You are brief.")
    with client.messages.stream(model=MODEL_ID, max_tokens=12, messages=HELLO, system="You are brief.",
                                extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text_of(final) == text_of(whole) and len(pieces) > 1
    assert final.stop_reason == whole.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.usage.input_tokens == whole.usage.input_tokens
    counted = client.messages.count_tokens(model=MODEL_ID, messages=HELLO, system="You are brief.")
    assert counted.input_tokens == whole.usage.input_tokens

    # create(stream=True): the raw events, in Anthropic's order.
    events = list(client.messages.create(model=MODEL_ID, max_tokens=12, messages=HELLO, system="You are brief.",
                                         stream=True, extra_body=GREEDY))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == \
        ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == counted.input_tokens and events[0].message.content == []
    assert "".join(event.delta.text for event in events[2:-3]) == text_of(whole)
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 12


def test_raw_events_are_server_sent_events_with_event_lines(served):
    body = {"model": MODEL_ID, "max_tokens": 4, "messages": HELLO, "stream": True, "temperature": 0,
            "stop_sequences": ["\u2603"]}
    with httpx.stream("POST", served[0].url + "/v1/messages", json=body, timeout=60,
                      headers={"anthropic-version": "2023-06-01", "anthropic-beta": "x"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    pairs = list(zip(lines[::2], lines[1::2]))
    assert len(pairs) * 2 == len(lines)
    for event, data in pairs:
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]
    assert pairs[-1][0] == "event: message_stop"


def test_a_tool_round_trip(client):
    tools = [WEATHER, {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    called = create(client, max_tokens=200, messages=ask, tools=tools,
                    tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert called.stop_reason == "tool_use", called
    uses = [block for block in called.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, SCHEMA)
    # streamed, the same call: its input arrives as input_json_delta pieces
    with client.messages.stream(model=MODEL_ID, max_tokens=200, messages=ask, tools=tools, extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    streamed = [block for block in final.content if block.type == "tool_use"]
    assert final.stop_reason == "tool_use"
    assert [(block.name, block.input) for block in streamed] == [("get_weather", uses[0].input)]

    anyone = create(client, max_tokens=200, messages=ask, tools=tools,
                    tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert anyone.stop_reason == "tool_use" and [b.type for b in anyone.content] == ["tool_use"]
    history = ask + [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in
                                                       called.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                   "content": [{"type": "text", "text": "18 C and sunny"}]}]}]
    answer = create(client, max_tokens=8, messages=history, tools=tools)
    assert answer.stop_reason == "max_tokens" and text_of(answer)
    # a result the client marks as an error reaches the model too; the same history counted
    history[-1]["content"][0]["is_error"] = True
    assert create(client, max_tokens=2, messages=history, tools=tools, tool_choice={"type": "none"}).content
    assert client.messages.count_tokens(model=MODEL_ID, messages=history, tools=tools).input_tokens > \
        client.messages.count_tokens(model=MODEL_ID, messages=history).input_tokens


def bad_request(client, **kwargs):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL_ID, **kwargs)
    body = caught.value.body
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


@pytest.mark.parametrize("kwargs, named", [
    (dict(messages=HELLO, max_tokens=None), "max_tokens is required"),
    (dict(messages=HELLO, max_tokens=0), "max_tokens"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x",
                                                                              "media_type": "image/png"}}]}],
          max_tokens=4), '"image" blocks are not supported'),
    (dict(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}], max_tokens=4),
     '"document" blocks'),
    (dict(messages=HELLO, max_tokens=4, stop_sequences=[""]), "stop_sequences"),
    (dict(messages=HELLO, max_tokens=4, extra_body={"temperature": 1.5}), "temperature"),
    (dict(messages=HELLO, max_tokens=4, extra_body={"logit_bias": {}}), "logit_bias is not supported"),
    (dict(messages=HELLO, max_tokens=4, tools=[{"name": "f", "input_schema": {"type": "string"}}]),
     "tools[0].input_schema must describe an object"),
    (dict(messages=HELLO, max_tokens=4, tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}),
     "tool_choice names 'nope'"),
    (dict(messages=HELLO, max_tokens=4, tools=[{"type": "web_search_20250305", "name": "web_search"}]),
     "tools[0]"),
    (dict(messages=HELLO, max_tokens=4, thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
    (dict(messages=HELLO + [{"role": "assistant", "content": "Sure"}], max_tokens=4), "prefill"),
    (dict(messages=[{"role": "user", "content": "x"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "y"}]}], max_tokens=4),
     "messages[1]: tool_use_id 'toolu_1' answers no tool_use"),
    # A tool_use answered by no tool_result in the next user turn (Anthropic's 400 too).
    (dict(messages=HELLO + [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name":
                                                                "get_weather", "input": {"city": "Paris"}}]},
                            {"role": "user", "content": "And?"}], max_tokens=4, tools=[WEATHER]),
     "messages[1] tool_use: 'toolu_1' answered by no tool_result block before messages[2]"),
    (dict(messages=HELLO, max_tokens=CONTEXT), "max_tokens"),
])
def test_bad_requests_are_400s_in_anthropic_shape_naming_the_field(client, kwargs, named):
    if kwargs.get("max_tokens", 1) is None:
        kwargs = dict(kwargs, max_tokens=anthropic.omit)
    assert named in bad_request(client, **kwargs)


def test_errors_of_every_kind_are_in_anthropic_shape(served, client):
    url = served[0].url
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=HELLO)
    assert caught.value.body["error"]["type"] == "not_found_error"
    for path, content, status in (("/v1/messages", b"{", 400), ("/v1/messages", b"[1]", 400),
                                  ("/v1/messages/count_tokens", b'{"model": "tiny-llama", "messages": 1}', 400),
                                  ("/v1/messages/count_tokens", b'{"model": "tiny-llama", "messages": [], '
                                                                b'"max_tokens": 3}', 400),
                                  ("/v1/messages/nope", b"{}", 404)):
        response = httpx.post(url + path, content=content, headers={"content-type": "application/json"})
        assert response.status_code == status and response.json()["type"] == "error", (path, response.text)
    assert httpx.get(url + "/v1/messages").json()["error"]["type"] == "invalid_request_error"
    too_big = httpx.post(url + "/v1/messages", content=b" " * (5 << 20))
    assert too_big.status_code == 413 and too_big.json()["error"]["type"] == "request_too_large"
    # the OpenAI routes keep their own shape
    assert set(httpx.post(url + "/v1/chat/completions", content=b"{").json()) == {"error"}


def test_an_unexpected_error_is_a_500_in_anthropic_shape_before_and_during_a_stream(client, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    with monkeypatch.context() as patch:
        patch.setattr(rungen.messages, "message_of", broken)
        with pytest.raises(anthropic.InternalServerError) as caught:
            create(client, max_tokens=2)
    assert caught.value.status_code == 500 and caught.value.body["error"]["type"] == "api_error"
    assert "a bug" in caught.value.body["error"]["message"]
    with monkeypatch.context() as patch:
        patch.setattr(rungen.messages.Events, "close", broken)
        with pytest.raises(anthropic.APIStatusError) as caught:
            with client.messages.stream(model=MODEL_ID, max_tokens=4, messages=HELLO, extra_body=GREEDY) as stream:
                list(stream.text_stream)
    assert "a bug" in str(caught.value)
    assert text_of(create(client, max_tokens=2))  # the server goes on


def test_the_api_key_as_x_api_key(loaded, served):
    engine = served[1]
    keyed = LiveServer(Guard(create_app(loaded, engine, ServeOptions(model_id=MODEL_ID)), "s3cret", engine.metrics))
    try:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL_ID, max_tokens=2, messages=HELLO)
        assert caught.value.body["error"]["type"] == "authentication_error"
        allowed = anthropic.Anthropic(base_url=keyed.url, api_key="s3cret", max_retries=0)
        assert allowed.messages.create(model=MODEL_ID, max_tokens=2, messages=HELLO).usage.output_tokens == 2
        assert allowed.messages.count_tokens(model=MODEL_ID, messages=HELLO).input_tokens > 0
        bearer = anthropic.Anthropic(base_url=keyed.url, auth_token="s3cret", max_retries=0)  # Claude Code's way
        assert bearer.messages.create(model=MODEL_ID, max_tokens=2, messages=HELLO).usage.output_tokens == 2
        # x-api-key opens the OpenAI routes too; their refusal keeps OpenAI's shape
        assert httpx.get(keyed.url + "/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
        denied = httpx.get(keyed.url + "/v1/models", headers={"x-api-key": "wrong"})
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    finally:
        keyed.stop()


def test_a_full_queue_is_a_503_overloaded_error(loaded, served):
    full = Engine(loaded, max_queue=0, eos_ids=served[1].eos_ids, prefix_cache_bytes=0)
    full.start()
    busy = LiveServer(create_app(loaded, full, ServeOptions(model_id=MODEL_ID)))
    try:
        with pytest.raises(anthropic.APIStatusError) as caught:
            anthropic.Anthropic(base_url=busy.url, api_key="unused", max_retries=0).messages.create(
                model=MODEL_ID, max_tokens=2, messages=HELLO)
        assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"] == "1"
        assert caught.value.body["error"]["type"] == "overloaded_error"
    finally:
        busy.stop()
        full.close()


def test_a_client_dropping_mid_stream_frees_its_slot(served, client):
    live, engine = served
    # 4000 tokens take seconds (a stop sequence that never comes decodes each step's text); the hang-up frees the row
    # at the next step
    body = {"model": MODEL_ID, "max_tokens": 4000, "messages": HELLO, "stream": True, "temperature": 0,
            "stop_sequences": ["\u2603"]}
    with httpx.stream("POST", live.url + "/v1/messages", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line == "event: content_block_delta":
                break  # the first text came: hang up
    for _ in range(100):
        if not engine.batch.rows:
            break
        time.sleep(0.02)
    assert not engine.batch.rows
    assert text_of(create(client, max_tokens=2))
