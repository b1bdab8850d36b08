"""--serve under property-based fuzzing (hypothesis): every route, bodies of every JSON type in every field, NaN
and Infinity, deep nesting, truncated and oversized bodies, bad UTF-8, wrong content types and methods, all sent
over ONE keep-alive connection to a live server on a tiny llama. The properties: no 5xx, every 4xx in OpenAI's
error shape naming the field that was changed (in Anthropic's shape on /v1/messages), the connection never dropped,
and afterwards a normal request answers as it did before."""

import json
import math
import socket
import string
import time

import h11
import pytest
import torch
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st
from test_server import MODEL_ID, LiveServer, build_chat_llama

from rungen.loading import load
from rungen.server import MAX_BODY_DEPTH, ServeOptions, build

MAX_BODY = 64 << 10  # small, so that oversized bodies are cheap to make
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
MESSAGES_API = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
BASES = {
    CHAT: {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3},
    COMPLETIONS: {"model": MODEL_ID, "prompt": "Once upon", "max_tokens": 3},
    MESSAGES_API: {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3},
    RESPONSES: {"model": MODEL_ID, "input": "Hello", "max_output_tokens": 3},
}
# (route, a valid request) for every route that takes a body; /tokenize takes a text or a conversation.
VALID = [*BASES.items(), (EMBEDDINGS, {"model": MODEL_ID, "input": ["Once upon", "a time"]}),
         (TOKENIZE, {"prompt": "Once upon"}), (TOKENIZE, {"model": MODEL_ID, "messages": BASES[CHAT]["messages"]}),
         (DETOKENIZE, {"tokens": [5, 6, 7]}),
         (COUNT_TOKENS, {"model": MODEL_ID, "messages": BASES[MESSAGES_API]["messages"]}),
         (MESSAGES_API, {**BASES[MESSAGES_API], "system": "Be brief.", "stop_sequences": ["\n"], "stream": True,
                         "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                         "tool_choice": {"type": "auto"}}),
         (RESPONSES, {"model": MODEL_ID, "instructions": "Hi", "max_output_tokens": 3, "input": [
             {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Yo"}]}]})]
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "stop", "stream",
          "stream_options", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
          "user", "top_k", "min_p", "repetition_penalty", "ignore_eos", "structured_outputs", "guided_json",
          "guided_regex", "guided_grammar", "grammar", "json_schema", "logprobs", "top_logprobs",
          "response_format", "echo", "best_of", "suffix", "tools", "chat_template_kwargs", "reasoning_effort",
          "functions", "input", "encoding_format", "dimensions", "add_generation_prompt", "add_special_tokens",
          "tokens", "system", "stop_sequences", "metadata", "tool_choice", "thinking", "thinking_token_budget",
          "instructions", "parallel_tool_calls", "text", "max_output_tokens", "reasoning", "store",
          "previous_response_id", "include", "truncation", "background", "nonsense", ""]
# A change to one field may be refused under a field it bears on: the token budget is checked against the
# prompt and n, best_of against n, top_logprobs needs logprobs, stream_options needs stream; /tokenize takes a
# prompt or messages, and names prompt when it has both or neither.
RELATED = {"prompt": {"max_tokens"}, "messages": {"max_tokens", "max_completion_tokens", "prompt"},
           "n": {"max_tokens", "max_completion_tokens", "best_of"}, "echo": {"max_tokens"},
           "stream": {"stream_options"}, "logprobs": {"top_logprobs"},
           "input": {"max_output_tokens"}, "instructions": {"max_output_tokens", "input"}}
ERROR_KINDS = {"invalid_request_error", "not_found_error", "server_error"}
ANTHROPIC_ERROR_KINDS = {"invalid_request_error", "not_found_error", "request_too_large"}


class KeepAlive:
    """One HTTP/1.1 connection, kept for every request; fails if the server closes it or announces it will."""

    def __init__(self, port):
        self.address = ("127.0.0.1", port)
        self.sock = socket.create_connection(self.address, timeout=60)
        self.conn = h11.Connection(h11.CLIENT)
        self.requests = 0
        self.broken = None  # what ended the connection's usable life: the tests after it say so, not h11's state

    def request(self, method, target, body=b"", headers=()):
        assert self.broken is None, f"the connection broke at an earlier request: {self.broken}"
        try:
            return self._request(method, target, body, headers)
        except BaseException as error:
            if self.conn.our_state is not h11.IDLE:
                self.broken = f"{method} {target} ({len(body)} bytes): {error!r}"
            raise

    def _request(self, method, target, body, headers):
        headers = [("host", "127.0.0.1"), *headers]
        if method not in ("GET", "HEAD") or body:
            headers.append(("content-length", str(len(body))))
        self.sock.sendall(self.conn.send(h11.Request(method=method, target=target, headers=headers)))
        if body:
            self.sock.sendall(self.conn.send(h11.Data(data=body)))
        self.sock.sendall(self.conn.send(h11.EndOfMessage()))
        response, content = None, bytearray()
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = self.sock.recv(1 << 16)
                assert data, f"the server closed the connection (request {self.requests}: {method} {target})"
                self.conn.receive_data(data)
            elif isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                content += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                raise AssertionError(f"unexpected {event!r}")
        assert self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE, \
            f"the server will close the connection after {method} {target} ({response.status_code})"
        self.conn.start_next_cycle()
        self.requests += 1
        return response.status_code, {k.decode(): v.decode() for k, v in response.headers}, bytes(content)

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load(build_chat_llama(str(tmp_path_factory.mktemp("fuzz") / "llama")), device=torch.device("cpu"))


@pytest.fixture(scope="module")
def served(loaded):
    app, engine = build(loaded, ServeOptions(model_id=MODEL_ID, max_batch=8, max_queue=64, max_body_bytes=MAX_BODY))
    # The one connection may sit idle past uvicorn's 5 s between two requests on a loaded machine (the cause of its
    # "broken pipe" cascades): what it tests is that no request breaks it, not the idle timeout.
    live = LiveServer(app, keep_alive=3600)
    yield live
    live.stop()
    engine.close()
    engine.abort()


@pytest.fixture(scope="module")
def client(served):
    """The module's one connection, and the greedy answer it got before any fuzzing."""
    connection = KeepAlive(served.port)
    before = normal_answer(connection)
    yield connection
    assert normal_answer(connection) == before  # the server answers as before after everything the tests sent
    connection.close()


def normal_answer(connection):
    body = json.dumps({**BASES[COMPLETIONS], "temperature": 0, "max_tokens": 8}).encode()
    status, _, content = connection.request("POST", COMPLETIONS, body, [("content-type", "application/json")])
    assert status == 200, content
    return json.loads(content)["choices"][0]["text"]


#
# What is sent
#

NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-(2**70), 2**70) | st.floats()
           | st.text(max_size=12) | st.sampled_from(["", "0", "1e999", "\ud800", "x\udfff", MODEL_ID, "user"]))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6) | st.sampled_from(["role", "content", "type", "text",
                                                                                   "include_usage", "json"]),
                                             inner, max_size=4), max_leaves=12)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer",
                                                                     "tool", "x"]) | JSON_VALUES},
                                          optional={"content": st.text(max_size=20) | JSON_VALUES,
                                                    "name": JSON_VALUES}), max_size=3)
# Anthropic's content blocks, as /v1/messages takes them (and some it refuses).
BLOCKS = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "document", "x"]) | JSON_VALUES},
    optional={"text": st.text(max_size=8) | JSON_VALUES, "id": st.sampled_from(["toolu_1", ""]) | JSON_VALUES,
              "name": st.sampled_from(["f", "g"]) | JSON_VALUES, "input": JSON_VALUES,
              "tool_use_id": st.sampled_from(["toolu_1", "toolu_2"]) | JSON_VALUES,
              "content": st.text(max_size=8) | JSON_VALUES, "is_error": JSON_VALUES,
              "thinking": JSON_VALUES, "signature": JSON_VALUES, "cache_control": JSON_VALUES})
ANTHROPIC_MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]) | JSON_VALUES},
    optional={"content": st.text(max_size=20) | st.lists(BLOCKS, max_size=3) | JSON_VALUES}), max_size=3)
# Values near what each field takes, so that the checks past the type are reached too.
PLAUSIBLE = {
    "messages": MESSAGES | ANTHROPIC_MESSAGES,
    "prompt": st.text(max_size=30) | st.lists(st.integers(-2, 300), max_size=5) | st.lists(st.text(max_size=5)),
    "logit_bias": st.dictionaries(st.text(string.digits, max_size=4) | st.text(max_size=3),
                                  st.integers(-150, 150) | JSON_VALUES, max_size=3),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=3), max_size=20),
    "stream_options": st.dictionaries(st.sampled_from(["include_usage", "x"]), JSON_VALUES, max_size=2),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
                                             optional={"json_schema": JSON_VALUES}),
    "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "grammar", "x"]), JSON_VALUES,
                                          max_size=2),
    "guided_regex": st.sampled_from(["[ab]{1,3}", "(", "a*", ""]),
    "input": st.text(max_size=30) | st.lists(st.integers(-2, 800), max_size=5) | st.lists(st.text(max_size=5))
    | st.lists(st.lists(st.integers(-2, 800), max_size=4), max_size=3),
    "encoding_format": st.sampled_from(["float", "base64", "int8", ""]),
    "tokens": st.lists(st.integers(-2, 800), max_size=6),
    "system": st.text(max_size=10) | st.lists(BLOCKS, max_size=2),
    "stop_sequences": st.lists(st.text(max_size=3), max_size=20),
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                                         optional={"name": st.sampled_from(["f", "g"]) | JSON_VALUES,
                                                   "disable_parallel_tool_use": JSON_VALUES})
    | st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}]) | JSON_VALUES,
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive", "x"])},
                                      optional={"budget_tokens": st.integers(0, 5000) | JSON_VALUES}),
    "metadata": st.dictionaries(st.sampled_from(["user_id", "x"]), JSON_VALUES, max_size=2),
    # /v1/responses
    "text": st.fixed_dictionaries({}, optional={"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
        optional={"name": JSON_VALUES, "schema": JSON_VALUES, "strict": JSON_VALUES}), "verbosity": JSON_VALUES}),
    "reasoning": st.dictionaries(st.sampled_from(["effort", "summary", "x"]),
                                 st.sampled_from(["low", "auto", "concise", None]) | JSON_VALUES, max_size=2),
    "previous_response_id": st.sampled_from(["resp_x", ""]) | JSON_VALUES,
}
PLAUSIBLE["input"] |= st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"])},
    optional={"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | JSON_VALUES,
              "content": st.text(max_size=10) | st.lists(st.fixed_dictionaries(
                  {"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": JSON_VALUES})),
              "call_id": st.sampled_from(["call_1", ""]) | JSON_VALUES, "name": JSON_VALUES,
              "arguments": st.sampled_from(["{}", "{", "[]"]) | JSON_VALUES, "output": JSON_VALUES}), max_size=3)
PLAUSIBLE["tools"] = st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "web_search"]) | JSON_VALUES},
    optional={"name": st.sampled_from(["f", "get weather"]) | JSON_VALUES, "parameters": JSON_VALUES,
              "strict": JSON_VALUES, "description": JSON_VALUES, "function": JSON_VALUES}), max_size=2)
NUMBERS = st.integers(-3, 40) | st.floats(-3, 3) | NON_FINITE | st.integers(-(2**80), 2**80)


@st.composite
def field_values(draw, name):
    options = [JSON_VALUES, NON_FINITE, NUMBERS]
    if name in PLAUSIBLE:
        options.append(PLAUSIBLE[name])
    return draw(st.one_of(options))


@st.composite
def json_requests(draw, valid=tuple(VALID)):
    """(path, body, changed fields): a valid request with one or two fields set to anything, or removed."""
    path, base = draw(st.sampled_from(valid))
    body = dict(base)
    changed = draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=2, unique=True))
    for name in changed:
        if name in body and draw(st.booleans()) and draw(st.booleans()):
            del body[name]
        else:
            body[name] = draw(field_values(name))
    return path, body, set(changed)


class Big(bytes):
    def __repr__(self):  # a failing example prints it
        return f"<{len(self)} bytes: {bytes(self[:60])!r}...>"


def deep(depth, opener):
    closer = {"[": "]", '{"a":': "}"}[opener]
    return opener * depth + "1" + closer * depth


@st.composite
def raw_bodies(draw):
    """(bytes, what it is): bodies that are not a JSON object in UTF-8 of the allowed size."""
    path = draw(st.sampled_from([CHAT, COMPLETIONS, MESSAGES_API, RESPONSES]))
    text = json.dumps(BASES[path])
    kind = draw(st.sampled_from(["truncated", "deep", "bad utf-8", "not an object", "bytes", "oversized",
                                 "empty"]))
    if kind == "truncated":
        return path, text[: draw(st.integers(0, len(text) - 1))].encode(), kind
    if kind == "deep":
        depth = draw(st.integers(MAX_BODY_DEPTH - 2, MAX_BODY_DEPTH + 2) | st.integers(1, 20_000))
        nested = Big(deep(depth, draw(st.sampled_from(["[", '{"a":']))).encode())
        if draw(st.booleans()):
            nested = nested[: draw(st.integers(0, len(nested)))]  # unbalanced too
        field = draw(st.sampled_from(["model", "messages", "prompt", "stop", "x"]))
        return path, Big(f'{{"{field}": '.encode() + nested + f', "model": "{MODEL_ID}"}}'.encode()), kind
    if kind == "bad utf-8":
        raw = text.encode()
        at = draw(st.integers(0, len(raw)))
        junk = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80"]))
        if draw(st.integers(0, 5)) == 0:
            return path, b"\xef\xbb\xbf" + raw, "a byte-order mark"  # UTF-8, but JSON has none
        return path, raw[:at] + junk + raw[at:], kind
    if kind == "not an object":
        return path, json.dumps(draw(JSON_VALUES.filter(lambda v: not isinstance(v, dict)))).encode(), kind
    if kind == "bytes":
        return path, draw(st.binary(max_size=64)), kind
    if kind == "oversized":
        return path, Big(json.dumps({**BASES[path], "user": "x" * MAX_BODY}).encode()), kind
    return path, b"", kind


JSON_TYPES = (None, "application/json", "application/json; charset=utf-8", "APPLICATION/JSON;charset=UTF-8")
CONTENT_TYPES = st.sampled_from([*JSON_TYPES, "text/plain", "application/x-www-form-urlencoded",
                                 "multipart/form-data; boundary=x", "application/json; charset=latin-1", "",
                                 "application/jsonx", "*/*"])
TARGETS = st.sampled_from([CHAT, COMPLETIONS, "/v1/models", f"/v1/models/{MODEL_ID}", "/v1/models/other",
                           "/health", "/metrics", "/", "/v1", "/v1/chat/completions/", EMBEDDINGS, TOKENIZE,
                           DETOKENIZE, RESPONSES, "/tokenize/", "/v1/models/%00%ff", "/v1/completions?x=1",
                           "/%2e%2e/etc", MESSAGES_API, COUNT_TOKENS, "/v1/messages/x", "/v1/messages?beta=true"])
METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])


#
# What must hold
#


def check_answer(status, headers, content, changed=None, path=""):
    """No 5xx; a 4xx is OpenAI's error object, naming a changed field (or one it bears on) where fields were
    changed (on /v1/messages, Anthropic's error object, which names no field); a 200 stream ends with [DONE] (on
    /v1/messages, message_stop)."""
    assert status < 500, (status, content[:500])
    if path.split("?")[0].startswith(MESSAGES_API):
        return check_messages_answer(status, headers, content)
    if status >= 400:
        assert headers.get("content-type", "").startswith("application/json"), headers
        body = json.loads(content)
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"] in ERROR_KINDS, body
        assert error["param"] is None or isinstance(error["param"], str), body
        if changed is not None and status != 413:
            named = set(changed).union(*(RELATED.get(name, ()) for name in changed))
            # /v1/responses names a part of a field where it has one: text.format, reasoning.effort
            assert error["param"] in named or (error["param"] or "").split(".")[0] in named, (sorted(changed), error)
        return error
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [line for line in content.decode().split("\n") if line]
        if events[0].startswith("event: "):  # /v1/responses: named events, the last one the response's end
            assert all(line.startswith(("event: ", "data: ")) for line in events), events[-3:]
            last = json.loads(events[-1][len("data: "):])
            assert last["type"] in ("response.completed", "response.incomplete", "response.failed"), events[-3:]
            assert events[-2] == "event: " + last["type"], events[-3:]
        else:
            assert events[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in events), events[-3:]
    return None


def check_messages_answer(status, headers, content):
    if status >= 400:
        assert headers.get("content-type", "").startswith("application/json"), headers
        body = json.loads(content)
        assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] in ANTHROPIC_ERROR_KINDS and isinstance(body["error"]["message"], str), body
        assert body["error"]["message"], body
        return body["error"]
    if headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in content.decode().split("\n") if line]
        assert all(line.startswith("event: ") for line in lines[::2]) and len(lines) % 2 == 0, lines[-4:]
        assert lines[-2] == "event: message_stop", lines[-4:]
    return None


# The fast tier's runs are seeded (the same examples each time, some seconds); the slow tier's draw new ones, about
# a minute in all on two shared cores.
FAST = settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def send_json_request(client, request):
    path, body, changed = request
    content = json.dumps(body).encode()  # NaN and Infinity as Python writes them, which JSON does not allow
    status, headers, answer = client.request("POST", path, content, [("content-type", "application/json")])
    check_answer(status, headers, answer, changed, path)
    if not_json(body):
        assert status == 400, answer[:300]


def not_json(value):
    """Whether a value holds NaN, an infinity or a lone surrogate somewhere (none of which JSON allows)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, str):
        return any(0xD800 <= ord(char) <= 0xDFFF for char in value)
    if isinstance(value, dict):
        return any(not_json(key) or not_json(item) for key, item in value.items())
    return isinstance(value, list) and any(not_json(item) for item in value)


def send_raw_body(client, request, content_type):
    path, content, kind = request
    headers = [("content-type", content_type)] if content_type is not None else []
    status, answer_headers, answer = client.request("POST", path, content, headers)
    check_answer(status, answer_headers, answer, path=path)
    expected = (400, 413) if content_type in JSON_TYPES else (415,)
    assert status in expected, (kind, content_type, status, answer[:200])
    assert status == 413 or path == MESSAGES_API or \
        json.loads(answer)["error"]["param"] in (None, "model", "messages", "prompt", "input", "stop", "x")


def send_anything(client, method, target, content, content_type):
    headers = [("content-type", content_type)] if content_type is not None else []
    if method == "HEAD":
        content = b""
    status, answer_headers, answer = client.request(method, target, content, headers)
    if method != "HEAD":
        check_answer(status, answer_headers, answer, path=target)


@seed(20261125)
@FAST
@given(request=json_requests())
# the error names the field the client sent, not its alias: found at length
@example(request=("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hello"}],
                                           "max_tokens": 0}, {"max_tokens"}))
# a repetition penalty that float32 rounds to 0 divided a score of 0 by it (NaN): found at length
@example(request=("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hello"}],
                                           "max_tokens": 3, "repetition_penalty": 2.2250738585e-313},
                  {"repetition_penalty"}))
# a role that is a list was looked up in a set (unhashable: a 500): found at length on /v1/responses
@example(request=(CHAT, {"model": MODEL_ID, "messages": [{"role": [], "content": "Hello"}], "max_tokens": 3},
                  {"messages"}))
def test_any_field_holding_any_json_value(client, request):
    send_json_request(client, request)


@seed(20261128)
@settings(FAST, max_examples=100)
@given(request=json_requests([route for route in VALID if route[0] == RESPONSES]))
@example(request=(RESPONSES, {"model": MODEL_ID, "input": [{"type": "message", "role": []}], "max_output_tokens": 3},
                  {"input"}))
@example(request=(RESPONSES, {"model": MODEL_ID, "input": [{"type": {}, "role": "user", "content": "Hi"}],
                              "max_output_tokens": 3}, {"input"}))
def test_any_responses_field_holding_any_json_value(client, request):
    """/v1/responses alone, its items and nested fields (text, reasoning, tools) included."""
    send_json_request(client, request)


@seed(20261125)
@FAST
@given(request=raw_bodies(), content_type=CONTENT_TYPES)
def test_bodies_that_are_not_a_json_object(client, request, content_type):
    send_raw_body(client, request, content_type)


@seed(20261125)
@settings(FAST, max_examples=80)
@given(method=METHODS, target=TARGETS, content=st.binary(max_size=40) | json_requests().map(
    lambda request: json.dumps(request[1]).encode()), content_type=CONTENT_TYPES)
def test_every_route_and_method(client, method, target, content, content_type):
    send_anything(client, method, target, content, content_type)


@pytest.mark.slow
@settings(FAST, max_examples=400)
@given(request=json_requests())
def test_any_field_holding_any_json_value_at_length(client, request):
    send_json_request(client, request)


@pytest.mark.slow
@settings(FAST, max_examples=300)
@given(request=raw_bodies(), content_type=CONTENT_TYPES)
def test_bodies_that_are_not_a_json_object_at_length(client, request, content_type):
    send_raw_body(client, request, content_type)


@pytest.mark.slow
@settings(FAST, max_examples=200)
@given(method=METHODS, target=TARGETS, content=st.binary(max_size=40) | json_requests().map(
    lambda request: json.dumps(request[1]).encode()), content_type=CONTENT_TYPES)
def test_every_route_and_method_at_length(client, method, target, content, content_type):
    send_anything(client, method, target, content, content_type)


def test_declared_oversized_and_depth_limits(client):
    """A body declared larger than the limit is refused before it is read, and the connection goes on; the depth
    limit is exact; NaN names its field."""
    status, _, answer = client.request("POST", COMPLETIONS, b" " * (MAX_BODY + 1))
    assert status == 413 and json.loads(answer)["error"]["type"] == "invalid_request_error"
    for depth in (MAX_BODY_DEPTH - 1, MAX_BODY_DEPTH, MAX_BODY_DEPTH + 1, 20_000):
        body = f'{{"model": "{MODEL_ID}", "prompt": "x", "stop": {deep(depth - 1, "[")}}}'.encode()
        status, _, answer = client.request("POST", COMPLETIONS, body)
        error = json.loads(answer)["error"]
        assert status == 400
        # within the limit the body parses, and stop is refused as not a list of strings
        assert error["param"] == (None if depth > MAX_BODY_DEPTH else "stop"), (depth, error)
    status, _, answer = client.request("POST", COMPLETIONS, f'{{"model": "{MODEL_ID}", "prompt": "x", '
                                                              '"temperature": NaN}'.encode())
    error = json.loads(answer)["error"]
    assert status == 400 and error["param"] == "temperature" and "NaN" in error["message"]


def test_an_unexpected_error_is_a_500_in_shape_and_the_connection_goes_on(client, monkeypatch):
    """An exception no check foresaw, before the answer starts and in the middle of a stream: a 500 in OpenAI's
    shape, or the stream's error event and its end; the same connection then serves the next request."""
    import rungen.openai_api

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    body = json.dumps({**BASES[COMPLETIONS], "stop": ["\n"]}).encode()
    with monkeypatch.context() as patch:
        patch.setattr(rungen.openai_api, "read_stop", broken)
        status, headers, answer = client.request("POST", COMPLETIONS, body)
    error = json.loads(answer)["error"]
    assert status == 500 and error["type"] == "server_error" and "a bug" in error["message"], answer
    assert set(error) == {"message", "type", "param", "code"}

    stream = json.dumps({**BASES[COMPLETIONS], "max_tokens": 4, "stream": True, "ignore_eos": True,
                         "temperature": 0}).encode()
    with monkeypatch.context() as patch:
        patch.setattr(rungen.openai_api.Answer, "final_choice", broken)
        status, headers, answer = client.request("POST", COMPLETIONS, stream)
    events = [line for line in answer.decode().split("\n") if line]
    assert status == 200 and events[-1] == "data: [DONE]", events
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in events[:-2]]
    # the tokens came (a character split over tokens comes in one chunk), then the error event, then [DONE]
    assert texts and "a bug" in json.loads(events[-2][6:])["error"]["message"]
    assert normal_answer(client)


def test_a_temperature_near_zero_samples_the_greedy_token(client):
    """Floats the fuzzing found: the scores are shifted before they are divided (so that the top one is not sent
    to infinity and the softmax to NaN), in float64 (where 4e-141 does not round to 0)."""
    greedy = normal_answer(client)
    for temperature in (1.401298464324817e-45, 4.28301548912165e-141, 5e-324):
        body = json.dumps({**BASES[COMPLETIONS], "max_tokens": 8, "temperature": temperature}).encode()
        status, _, answer = client.request("POST", COMPLETIONS, body)
        assert status == 200 and json.loads(answer)["choices"][0]["text"] == greedy, (temperature, answer)


def test_a_client_leaving_mid_body_is_no_server_error(served, client, caplog):
    """A body cut short by the client closing its connection: nothing to answer, nothing logged as a failure,
    and the server goes on serving the module's connection."""
    def completions_counted():
        _, _, metrics = client.request("GET", "/metrics")
        return sum(int(line.rsplit(" ", 1)[1]) for line in metrics.decode().splitlines()
                   if line.startswith('rungen_requests_total{endpoint="/v1/completions"'))

    before = completions_counted()
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\n\r\n" + b'{"model": "' + MODEL_ID.encode())
    for _ in range(500):  # until the server has ended that request
        if completions_counted() > before:
            break
        time.sleep(0.01)
    assert completions_counted() == before + 1
    assert not [record for record in caplog.records if record.levelname == "ERROR"], caplog.text
    assert normal_answer(client)
