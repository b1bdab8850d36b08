"""POST /v1/responses (OpenAI's Responses API) on a live server, through the vendors' own clients: the openai SDK's
responses.create and responses.stream, and the openai-agents SDK running an agent with a function tool. A tiny
llama with ChatML (the generic tool format) and a context as an instruct model's, since tools take hundreds of its
tokens."""

import asyncio
import json
import os
import time

import jsonschema
import openai
import pytest
import torch
from test_server import build_chat_llama

from helpers import serving
from rungen.loading import load
from tiny_models import set_context

MODEL_ID = "tiny-llama"
CONTEXT = 4096
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
          "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": SCHEMA,
           "strict": True}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = build_chat_llama(str(tmp_path_factory.mktemp("responses") / "llama"))
    set_context(path, CONTEXT)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    tokenizer_config["model_max_length"] = CONTEXT
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f)
    return path


@pytest.fixture(scope="module")
def served(checkpoint):
    with serving(load(checkpoint, device=torch.device("cpu")), model_id=MODEL_ID, max_batch=8) as (live, engine):
        live.engine = engine
        yield live


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def create(client, **kwargs):
    kwargs.setdefault("input", ASK)
    return client.responses.create(model=MODEL_ID, temperature=0, **kwargs)


def test_a_response_is_the_chat_reply_in_the_responses_shape(client):
    response = create(client, instructions="Answer in French.", max_output_tokens=6, metadata={"run": "1"},
                      user="someone")
    chat = client.chat.completions.create(model=MODEL_ID, temperature=0, max_tokens=6, messages=[
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": ASK}])
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL_ID
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert response.output_text == chat.choices[0].message.content  # one path: the chat reply
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == \
        (chat.usage.prompt_tokens, 6, chat.usage.prompt_tokens + 6)
    assert response.instructions == "Answer in French." and response.metadata == {"run": "1"}
    assert response.user == "someone" and response.max_output_tokens == 6 and response.temperature == 0
    assert response.tools == [] and response.tool_choice == "auto" and response.parallel_tool_calls is True
    assert response.store is True and response.text.format.type == "text"


def test_a_stream_sends_the_events_in_order_and_its_deltas_make_the_text(client):
    plain = create(client, max_output_tokens=8)
    events = list(create(client, max_output_tokens=8, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * (len(kinds) - 8),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == plain.output_text == events[-4].text
    assert events[0].response.status == "in_progress" and final.status == "incomplete"
    assert final.usage.output_tokens == 8 and final.id == events[0].response.id
    assert events[-2].item.id == events[2].item.id == final.output[0].id
    # Added as OpenAI adds it: empty, the text coming in the deltas only (a client that builds it gets it once).
    assert events[2].item.status == "in_progress" and events[2].item.content == []
    assert events[3].part.text == ""


def test_the_message_texts_log_probabilities(client):
    asked = dict(max_output_tokens=6, include=["message.output_text.logprobs"], top_logprobs=2)
    response = create(client, **asked)
    chat = client.chat.completions.create(model=MODEL_ID, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2,
                                          messages=[{"role": "user", "content": ASK}])
    part = response.output[0].content[0]
    assert [(item.token, item.bytes) for item in part.logprobs] == \
        [(item.token, item.bytes) for item in chat.choices[0].logprobs.content]
    # The second request finds the prompt in the prefix cache and computes only its end: sums in another order.
    assert [item.logprob for item in part.logprobs] == \
        pytest.approx([item.logprob for item in chat.choices[0].logprobs.content], abs=1e-4)
    assert len(part.logprobs) == 6 and all(len(item.top_logprobs) == 2 for item in part.logprobs)
    assert response.top_logprobs == 2
    events = list(create(client, stream=True, **asked))
    streamed = [item for event in events if event.type == "response.output_text.delta" for item in event.logprobs]
    done = next(event for event in events if event.type == "response.output_text.done")
    def pairs(items):
        return [(item.token, item.logprob) for item in items]

    assert pairs(streamed) == pairs(done.logprobs)
    assert [token for token, _ in pairs(streamed)] == [token for token, _ in pairs(part.logprobs)]
    assert [logprob for _, logprob in pairs(streamed)] == \
        pytest.approx([logprob for _, logprob in pairs(part.logprobs)], abs=1e-4)
    assert create(client, max_output_tokens=2).output[0].content[0].logprobs == []  # not asked for
    # A reply that ends (the schema's JSON complete, then the end of text): the token that adds no text comes in
    # a delta of its own, so the deltas still add up to the done event's.
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
    events = list(create(client, stream=True, text={"format": fmt}, max_output_tokens=60,
                         include=["message.output_text.logprobs"]))
    assert events[-1].type == "response.completed"
    streamed = [item for event in events if event.type == "response.output_text.delta" for item in event.logprobs]
    done = next(event for event in events if event.type == "response.output_text.done")
    assert pairs(streamed) == pairs(done.logprobs) == pairs(events[-1].response.output[0].content[0].logprobs)


def test_a_cut_reply_marks_incomplete_only_the_item_it_cut():
    """max_output_tokens ends the reply: a call whose arguments were whole is complete (the call the cut fell in
    may have been left out, cut before its name); the one cut inside its arguments is incomplete."""
    import types

    from rungen.responses import Output

    for arguments, status in (('{"city": "Paris"}', "completed"), ('{"city": "Pa', "incomplete")):
        output = Output(types.SimpleNamespace(summary=False))
        output.call({"index": 0, "id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}})
        output.call({"index": 1, "id": "call_2", "function": {"name": "get_weather", "arguments": arguments}})
        events = output.close("incomplete")
        assert [item["status"] for item in output.items] == ["completed", status]
        assert events[-1]["item"]["status"] == status


def test_json_schema_output_is_valid_and_the_stream_helper_gets_the_final_response(client):
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
    response = create(client, text={"format": fmt}, max_output_tokens=60)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    with client.responses.stream(model=MODEL_ID, input=ASK, temperature=0, text={"format": fmt},
                                 max_output_tokens=60) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.output_text == response.output_text
    json_object = create(client, text={"format": {"type": "json_object"}}, max_output_tokens=60)
    assert isinstance(json.loads(json_object.output_text), dict)
    # The SDK's parse(), with the schema of a pydantic model.
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=8)

    parsed = client.responses.parse(model=MODEL_ID, input=ASK, temperature=0, text_format=City, max_output_tokens=60)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)


def test_a_function_tool_round_trip(client):
    first = create(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_output_tokens=60)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    assert first.tools[0].name == "get_weather" and first.tool_choice == "required"
    # The call and its output sent back as items: the model answers in text.
    items = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}]
    second = create(client, input=items, tools=[WEATHER], max_output_tokens=5)
    assert [item.type for item in second.output] == ["message"] and second.output_text
    # The same through previous_response_id: the same prompt, so the same answer.
    chained = create(client, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=5,
                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}])
    assert chained.output_text == second.output_text
    assert chained.usage.input_tokens == second.usage.input_tokens
    # A named function, streamed: the arguments' deltas make the call's arguments.
    events = list(create(client, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                         parallel_tool_calls=False, max_output_tokens=60, stream=True))
    final = events[-1].response
    arguments = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    done = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert final.status == "completed" and [item.type for item in final.output] == ["function_call"]
    assert arguments == done[0].arguments == final.output[0].arguments
    jsonschema.validate(json.loads(arguments), SCHEMA)
    # The SDK's stream helper, which assembles the response from the events, gets the same.
    with client.responses.stream(model=MODEL_ID, input=ASK, temperature=0, tools=[WEATHER], max_output_tokens=60,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 parallel_tool_calls=False) as stream:
        kinds = [event.type for event in stream]
        helped = stream.get_final_response()
    assert helped.output[0].arguments == arguments and "response.function_call_arguments.done" in kinds


def test_previous_response_id_continues_a_stored_response(client):
    first = create(client, input="Tell me a story.", max_output_tokens=4, instructions="Be brief.")
    second = create(client, input="Go on.", previous_response_id=first.id, max_output_tokens=4)
    # The instructions are not carried over (as OpenAI does): the conversation is the items.
    chat = client.chat.completions.create(model=MODEL_ID, temperature=0, max_tokens=4, messages=[
        {"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Go on."}])
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    third = create(client, input="And then?", previous_response_id=second.id, max_output_tokens=2)
    assert third.usage.input_tokens > second.usage.input_tokens
    # (the conversation so far from the prefix cache, which usage says)
    assert 0 < third.usage.input_tokens_details.cached_tokens < third.usage.input_tokens
    unstored = create(client, input="Hello", max_output_tokens=2, store=False)
    for missing in ("resp_unknown", unstored.id):
        with pytest.raises(openai.NotFoundError) as caught:
            create(client, input="Go on.", previous_response_id=missing, max_output_tokens=2)
        error = caught.value.body
        assert error["param"] == "previous_response_id" and error["type"] == "invalid_request_error"
        assert error["code"] == "previous_response_not_found" and missing in error["message"]


def test_a_stored_response_is_retrieved_its_input_items_listed_and_deleted(client):
    first = create(client, input=[{"role": "user", "content": "Tell me a story."}], max_output_tokens=4)
    second = create(client, input=[{"role": "user", "content": "Go on."},
                                   {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                                    "text": "Briefly."}]}],
                    previous_response_id=first.id, max_output_tokens=3)
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    listed = client.responses.input_items.list(second.id)
    # This response's own input, newest first (OpenAI's default order), each with an id and text parts.
    assert [item.content[0].text for item in listed.data] == ["Briefly.", "Go on."]
    assert all(item.type == "message" and item.id.startswith("msg_") for item in listed.data)
    oldest = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert [item.content[0].text for item in oldest.data] == ["Go on."] and oldest.has_more
    after = client.responses.input_items.list(second.id, order="asc", after=oldest.data[0].id)
    assert [item.content[0].text for item in after.data] == ["Briefly."] and not after.has_more
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_items.list(second.id, limit=500)
    assert caught.value.body["param"] == "limit"
    assert client.responses.delete(first.id) is None  # the SDK returns nothing for the 200
    for gone in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id),
                 lambda: client.responses.input_items.list(first.id),
                 lambda: create(client, input="Go on.", previous_response_id=first.id, max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError):
            gone()
    unstored = create(client, input="Hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_an_agent_calls_its_tool_and_answers(served):
    """The Agents SDK's default model class (OpenAIResponsesModel) against the server. A random model is steered:
    the first turn must call (tool_choice required) and the run stops at the tool; the conversation so far (the
    SDK's own items: the question, the call, its output) then goes to an agent that answers in a schema, which
    ends (a reply cut by max_tokens would be a failed run for the SDK)."""
    from agents import Agent, ModelSettings, RunConfig, Runner
    from agents.models.openai_responses import OpenAIResponsesModel
    from agents.tool import FunctionTool
    from pydantic import BaseModel, Field

    calls = []

    async def get_weather(context, arguments):
        calls.append(json.loads(arguments))
        return "18 C and sunny"

    class Weather(BaseModel):
        city: str = Field(max_length=8)

    tool = FunctionTool(name="get_weather", description="The weather in a city", params_json_schema=SCHEMA,
                        on_invoke_tool=get_weather, strict_json_schema=True)
    model = OpenAIResponsesModel(model=MODEL_ID, openai_client=openai.AsyncOpenAI(
        base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120))
    settings = ModelSettings(temperature=0, max_tokens=60, parallel_tool_calls=False)
    caller = Agent(name="weather", instructions="Answer questions about the weather.", tools=[tool], model=model,
                   model_settings=settings.resolve(ModelSettings(tool_choice="required")),
                   tool_use_behavior="stop_on_first_tool")
    answerer = caller.clone(model_settings=settings.resolve(ModelSettings(tool_choice="none")),
                            output_type=Weather, tool_use_behavior="run_llm_again")
    config = RunConfig(tracing_disabled=True)

    async def run(streamed):
        if not streamed:
            first = await Runner.run(caller, ASK, run_config=config, max_turns=2)
            return first, await Runner.run(answerer, first.to_input_list(), run_config=config, max_turns=2)
        first = Runner.run_streamed(caller, ASK, run_config=config, max_turns=2)
        async for _ in first.stream_events():
            pass
        second = Runner.run_streamed(answerer, first.to_input_list(), run_config=config, max_turns=2)
        async for _ in second.stream_events():
            pass
        return first, second

    async def chained(first):
        """The server's state instead: previous_response_id and the tool's output alone."""
        return await Runner.run(answerer, [first.new_items[-1].to_input_item()], run_config=config, max_turns=2,
                                previous_response_id=first.last_response_id)

    async def all_runs():  # one event loop: the client's connections belong to it
        runs = [await run(streamed) for streamed in (False, True)]
        return runs, await chained(runs[0][0])

    runs, chained_run = asyncio.run(all_runs())
    for first, second in runs:
        assert [item.type for item in first.new_items] == ["tool_call_item", "tool_call_output_item"]
        assert first.final_output == "18 C and sunny"
        jsonschema.validate(calls[-1], SCHEMA)
        assert [item.type for item in second.new_items] == ["message_output_item"]
        assert isinstance(second.final_output, Weather)
    assert len(calls) == 2 and calls[0] == calls[1]  # the stream and the plain run: the same greedy call
    assert chained_run.final_output == runs[0][1].final_output == runs[1][1].final_output


@pytest.mark.parametrize("fields,param,status,message", [
    ({"seed": 1}, "seed", 400, "seed is not supported"),
    ({"stop": ["x"]}, "stop", 400, "stop is not supported"),
    ({"background": True}, "background", 400, "background true is not supported"),
    ({"include": ["file_search_call.results"]}, "include", 400, "not supported"),
    ({"include": ["message.output_text.logprobs"], "tools": [WEATHER]}, "include", 400,
     "log-probabilities with tools are not supported"),
    ({"top_logprobs": 21}, "top_logprobs", 400, "top_logprobs must be in [0, 20]"),
    ({"truncation": "auto"}, "truncation", 400, "not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools", 400, "only function tools are supported, got type \"web_search\""),
    ({"tools": [dict(WEATHER, defer_loading=True)]}, "tools", 400, "tools[0].defer_loading is not supported"),
    ({"tools": [dict(WEATHER, name="get weather")]}, "tools", 400, "tools[0].name must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice", 400, "'other'"),
    ({"tool_choice": "required"}, "tool_choice", 400, "tool_choice needs tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]}, "input", 400,
     "input[0].content[0]: only input_text and output_text parts"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", 400, "items of type \"item_reference\""),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", 400, "input[0].role \"tool\" is not supported"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]}, "input", 400,
     "input[0]: call_id 'call_1' answers no tool call"),
    # The chat path's messages[i] named as the item it came from (a call joins the assistant text before it).
    ({"instructions": "Be brief.", "input": [
        {"role": "user", "content": ASK}, {"role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_2", "output": "x"}], "tools": [WEATHER]}, "input", 400,
     "input[3]: call_id 'call_2' answers no tool call"),
    # A call answered by no output before the next message (OpenAI's 400 too), and an id used twice.
    ({"input": [{"role": "user", "content": ASK},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {"role": "user", "content": "And?"}], "tools": [WEATHER]}, "input", 400,
     "input[1]: function_call 'call_1' answered by no function_call_output before input[2]"),
    ({"input": [{"role": "user", "content": ASK},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "x"},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "x"}], "tools": [WEATHER]}, "input",
     400, "the id 'call_1' is used twice"),
    ({"input": [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "[1]"}],
      "tools": [WEATHER]}, "input", 400, "input[0].arguments must be a JSON object"),
    ({"input": [{"role": "user", "content": ASK}, {"role": "assistant", "content": "Let me look."},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{"}],
      "tools": [WEATHER]}, "input", 400, "input[3].arguments is not valid JSON"),
    ({"input": []}, "input", 400, "non-empty"),
    ({"instructions": 3}, "instructions", 400, "instructions must be a string"),
    ({"max_output_tokens": 10**6}, "max_output_tokens", 400, "max_output_tokens (1000000) exceeds"),
    ({"max_output_tokens": 0}, "max_output_tokens", 400, "max_output_tokens must be in [1, inf]"),
    ({"temperature": 3}, "temperature", 400, "temperature must be in"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format", 400,
     "text.format.schema: "),
    ({"text": {"format": {"type": "xml"}}}, "text.format", 400, "text.format must be"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", 400,
     "text.format.schema must be a JSON schema"),
    ({"text": {"verbosity": "low"}}, "text", 400, "text.verbosity is not supported"),
    ({"reasoning": {"effort": "low"}}, "reasoning.effort", 400,
     "reasoning.effort: this model's chat template does not read reasoning_effort"),
    ({"reasoning": {"summary": "short"}}, "reasoning", 400, "reasoning.summary must be one of"),
    ({"metadata": {"a": 1}}, "metadata", 400, "metadata must be"),
    ({"store": "yes"}, "store", 400, "store must be true or false"),
    ({"model": "other"}, "model", 404, "does not exist"),
])
def test_bad_requests_are_refused_naming_the_field(served, fields, param, status, message):
    import httpx

    body = {"model": MODEL_ID, "input": ASK, "max_output_tokens": 2, **fields}
    answer = httpx.post(served.url + "/v1/responses", json=body, timeout=60)
    error = answer.json()["error"]
    assert answer.status_code == status and error["param"] == param and message in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


def test_a_stream_that_fails_ends_with_its_error_and_response_failed(served, client, monkeypatch):
    import rungen.responses

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    with monkeypatch.context() as patch:
        patch.setattr(rungen.responses.Output, "text", broken)
        events = list(create(client, max_output_tokens=4, stream=True))
    assert [event.type for event in events[-2:]] == ["error", "response.failed"]
    assert "a bug" in events[-2].message and events[-1].response.error.code == "server_error"
    assert create(client, max_output_tokens=2).output_text  # the server goes on


def test_a_call_max_output_tokens_cut_does_not_block_the_chain(client):
    """A stored response whose function call max_output_tokens cut (its arguments no whole JSON): the next turn by
    previous_response_id answers the call, the cut call given back as called with nothing ({}), as /v1/messages
    gives one back; moving on without answering it is refused as for any call (OpenAI's "No tool output found");
    an item the client sends with broken arguments is still refused."""
    for limit in range(4, 40):  # the first limit that cuts the call inside its arguments
        cut = create(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                     max_output_tokens=limit)
        if [item.type for item in cut.output] == ["function_call"] and not whole(cut.output[0].arguments):
            break
    [call] = cut.output
    assert cut.status == "incomplete" and call.status == "incomplete" and not whole(call.arguments)
    answered = create(client, previous_response_id=cut.id, tools=[WEATHER], max_output_tokens=4,
                      input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert answered.output_text
    with pytest.raises(openai.BadRequestError) as unanswered:
        create(client, previous_response_id=cut.id, input="Never mind.", max_output_tokens=4)
    assert "answered by no" in unanswered.value.body["message"]
    items = [{"role": "user", "content": ASK}, {**call.model_dump(exclude_none=True), "status": "completed"}]
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, input=items, max_output_tokens=4)
    assert refused.value.body["param"] == "input" and "not valid JSON" in refused.value.body["message"]


def whole(text):
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def test_a_response_the_server_cuts_short_fails_with_its_message_incomplete(served):
    """A reply ended by the server (its shutdown's abort, here the row cancelled on the engine's side): the response
    fails, and the message it cut is "incomplete", as OpenAI lists an item cut short, never "completed"."""
    import httpx

    body = {"model": MODEL_ID, "input": ASK, "max_output_tokens": 2000, "temperature": 0, "stream": True}
    data = []
    with httpx.stream("POST", served.url + "/v1/responses", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                data.append(json.loads(line[len("data: "):]))
            if line == "event: response.output_text.delta" and len(data) < 6:
                for row in list(served.engine.batch.rows):
                    row.request.cancelled = True
    kinds = [event["type"] for event in data]
    assert kinds[-1] == "response.failed" and kinds.count("error") == 1  # its error event first, as documented
    assert kinds.index("error") < kinds.index("response.output_item.done")
    assert data[kinds.index("error")]["code"] == data[-1]["response"]["error"]["code"] == "server_error"
    [done] = [event for event in data if event["type"] == "response.output_item.done"]
    assert done["item"]["type"] == "message" and done["item"]["status"] == "incomplete"
    assert [item["status"] for item in data[-1]["response"]["output"]] == ["incomplete"]


def test_a_client_dropping_mid_stream_frees_its_rows(served, client):
    import httpx

    body = {"model": MODEL_ID, "input": ASK, "max_output_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.stream("POST", served.url + "/v1/responses", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line == "event: response.output_text.delta":
                break  # the first token came: hang up
    for _ in range(50):  # a second, where the whole reply takes several
        if not served.engine.batch.rows:
            break
        time.sleep(0.02)
    assert not served.engine.batch.rows
    assert create(client, max_output_tokens=2).output_text  # the server goes on


def test_the_store_drops_the_least_recently_used():
    from rungen.response_store import MAX_STORED_RESPONSES, Store

    store = Store(limit=2)
    store.put("resp_a", ["a"])
    store.put("resp_b", ["b"])
    assert store.get("resp_a") == ["a"]  # used: now the most recent
    store.put("resp_c", ["c"])
    assert store.get("resp_b") is None and store.get("resp_a") == ["a"] and store.get("resp_c") == ["c"]
    assert Store().limit == MAX_STORED_RESPONSES == 256  # the figure docs/server.md gives
