"""Thinking models on a live server through the official openai client (and Anthropic's, on /v1/messages), and in
jsonl records: a tiny random model with Qwen3's published chat template and Qwen3's <think> and </think> as tokens
of their own. A random model does not think by itself: logit_bias pushes it to open and close the block, and
/v1/completions on the same prompt tokens gives the raw text the chat reply must be split from."""

import contextlib
import json
import os

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch
from transformers import AutoTokenizer

import rungen.messages
import rungen.responses
from helpers import run_main, serving
from rungen.loading import load
from tiny_models import build_tiny_checkpoint, set_context

MODEL_ID = "tiny-qwen3"
TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates", "qwen3.jinja")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
          "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
CONTEXT = 4096


def template_checkpoint(path, template, added=(), special=()):
    """A tiny qwen2 at `path` with a published `template` and its family's tokens: `added` ones (which decoded text
    keeps) and `special` ones; returns its tokenizer."""
    build_tiny_checkpoint("qwen2", path)
    set_context(path, CONTEXT)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.model_max_length = CONTEXT
    tokenizer.add_tokens(list(added))
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    with open(template, encoding="utf-8") as f:
        tokenizer.chat_template = f.read()
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        assert len(tokenizer) <= json.load(f)["vocab_size"]  # the model can write every token
    return tokenizer


@contextlib.contextmanager
def served(path):
    """(url, loaded) of a live server on the checkpoint at `path`, while the block runs."""
    loaded = load(path, device=torch.device("cpu"))
    with serving(loaded, model_id=MODEL_ID, max_batch=8) as (live, _):
        yield live.url, loaded


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("thinking") / "qwen2")
    # Qwen3's tokenizer holds these as tokens of their own (added, not special: they stay in decoded text).
    template_checkpoint(path, TEMPLATE, added=["<tool_call>", "</tool_call>", "<think>", "</think>"])
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    with served(checkpoint) as server:
        yield server


def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def token(server, text):
    return server[1].tokenizer.convert_tokens_to_ids(text)


def chat(server, **kwargs):
    kwargs.setdefault("messages", ASK)
    return client(server).chat.completions.create(model=MODEL_ID, **kwargs)


def raw_split(text, opening="<think>", closing="</think>"):
    """(reasoning, content) of a raw reply, as the user reads it: the block's text, and what follows it."""
    if not text.startswith(opening):
        return None, text.lstrip()
    inside, closed, after = text[len(opening) :].partition(closing)
    return inside.strip(), (after.lstrip() or None) if closed else None


def prompt_ids(server, messages=ASK, **variables):
    tokenizer = server[1].tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **variables)
    return tokenizer.encode(text, add_special_tokens=False)


# <think> pushed at every step (so most replies open a block and write it again inside), </think> less.
OPEN_AND_CLOSE = dict(temperature=1.0, seed=1, n=8, max_tokens=30)


def bias(server, opening=7, closing=5):
    return {str(token(server, "<think>")): opening, str(token(server, "</think>")): closing}


def test_the_thinking_block_is_reasoning_and_what_follows_it_the_content(server):
    raw = client(server).completions.create(model=MODEL_ID, prompt=prompt_ids(server), logit_bias=bias(server),
                                            **OPEN_AND_CLOSE)
    reply = chat(server, logit_bias=bias(server), **OPEN_AND_CLOSE)
    split = [(choice.message.reasoning_content, choice.message.content) for choice in reply.choices]
    assert split == [raw_split(choice.text) for choice in raw.choices]
    assert any(reasoning and content for reasoning, content in split)  # some replies thought, then answered
    assert all("</think>" not in (reasoning or "") for reasoning, _ in split)


def test_a_stream_sends_the_reasoning_apart_and_assembles_to_the_plain_reply(server):
    whole = chat(server, logit_bias=bias(server), **OPEN_AND_CLOSE)
    reasoning, content = [""] * 8, [""] * 8
    for chunk in chat(server, logit_bias=bias(server), stream=True, **OPEN_AND_CLOSE):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning[choice.index] += extra.get("reasoning_content") or ""
            content[choice.index] += choice.delta.content or ""
            assert not (extra.get("reasoning_content") and choice.delta.content)  # one or the other a delta
    assert [(r, c) for r, c in zip(reasoning, content)] == \
        [(choice.message.reasoning_content or "", choice.message.content or "") for choice in whole.choices]


def test_a_block_the_model_never_closes_is_all_reasoning(server):
    reply = chat(server, logit_bias=bias(server, opening=100, closing=-100), max_tokens=5, temperature=0)
    choice = reply.choices[0]
    assert choice.message.reasoning_content == "<think>" * 4 and choice.message.content is None
    assert choice.finish_reason == "length"


def test_chat_template_kwargs_reach_the_template(server):
    """Qwen3's enable_thinking false: the template closes an empty block in the prompt, so the reply is all
    content, whatever the model writes."""
    plain = chat(server, temperature=0, max_tokens=8)
    off = chat(server, temperature=0, max_tokens=8, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == len(prompt_ids(server, enable_thinking=False)) > plain.usage.prompt_tokens
    assert off.choices[0].message.reasoning_content is None and off.choices[0].message.content
    # /tokenize counts the prompt a request with the same variables runs on; they apply to messages only.
    counted = httpx.post(server[0] + "/tokenize", json={"messages": ASK, "chat_template_kwargs": {
        "enable_thinking": False}}).json()
    assert counted["tokens"] == prompt_ids(server, enable_thinking=False)
    assert counted["count"] == off.usage.prompt_tokens
    refused = httpx.post(server[0] + "/tokenize", json={"prompt": "Hi", "chat_template_kwargs": {
        "enable_thinking": False}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("body,param,message", [
    ({"chat_template_kwargs": {"thinking_budget": 100}}, "chat_template_kwargs", "does not read 'thinking_budget'"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "set by the server"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs", "must be an object"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "does not read reasoning_effort"),
])
def test_variables_the_template_does_not_read_are_refused(server, body, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(server, max_tokens=2, extra_body=body)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and message in error["message"]


def check_json(choice):
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_a_grammar_applies_from_the_end_of_the_thinking_block(server):
    """response_format on a template where the model opens the block itself: the prompt gets <think>, the model
    thinks unconstrained (the bias on </think> ends the block at random), and the JSON follows its schema."""
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    reply = chat(server, response_format=response_format, logit_bias={str(token(server, "</think>")): 4},
                 temperature=1.0, seed=1, n=4, max_tokens=60)
    assert reply.usage.prompt_tokens == len(prompt_ids(server)) + 1  # the opening <think>
    done = [choice for choice in reply.choices if choice.finish_reason == "stop"]
    assert done
    for choice in done:
        check_json(choice)
        # Free text inside the block: the JSON grammar would have allowed nothing but "{" first.
        assert choice.message.reasoning_content and not choice.message.reasoning_content.startswith("{")
    for choice in reply.choices:
        if choice.finish_reason == "length":  # cut while thinking (no content) or inside the JSON
            assert choice.message.reasoning_content and (choice.message.content or "{").startswith("{")
    # Without thinking (the template closes the block), the grammar applies from the first token.
    off = chat(server, response_format=response_format, temperature=1.0, seed=1, max_tokens=60,
               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    check_json(off.choices[0])
    assert off.choices[0].message.reasoning_content is None


def test_a_required_tool_call_follows_the_thinking(server):
    reply = chat(server, tools=[WEATHER], tool_choice="required", logit_bias={str(token(server, "</think>")): 4},
                 temperature=1.0, seed=1, n=4, max_tokens=80, parallel_tool_calls=False)
    called = [choice for choice in reply.choices if choice.finish_reason == "tool_calls"]
    assert called
    for choice in called:
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and choice.message.content is None
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
        assert choice.message.reasoning_content
    # The prompt the calls followed holds the opened block: /tokenize with the same tools counts it; with thinking
    # off the template closes the block and nothing is added.
    for variables in ({}, {"enable_thinking": False}):
        counted = httpx.post(server[0] + "/tokenize", json={"messages": ASK, "tools": [WEATHER],
                                                             "chat_template_kwargs": variables}).json()
        reply = chat(server, tools=[WEATHER], tool_choice="required", temperature=1.0, seed=1, max_tokens=4,
                     extra_body={"chat_template_kwargs": variables})
        assert reply.usage.prompt_tokens == counted["count"]
        ending = server[1].tokenizer.decode(counted["tokens"][-4:])
        assert ending.endswith("<think>") if not variables else ending.endswith("</think>\n\n")
    # And the Messages API's count, and its stream's first count, are the prompt its constrained reply runs on.
    anthropic_tool = {"name": "get_weather", "input_schema": SCHEMA}
    client = messages_client(server)
    counted = client.messages.count_tokens(model=MODEL_ID, messages=ASK, tools=[anthropic_tool],
                                           tool_choice={"type": "any"}).input_tokens
    events = list(client.messages.create(model=MODEL_ID, max_tokens=4, messages=ASK, tools=[anthropic_tool],
                                         tool_choice={"type": "any"}, stream=True))
    started = events[0].message.usage.input_tokens
    finished = [event for event in events if event.type == "message_delta"][0].usage.input_tokens
    assert counted == started == finished


def pushed_to_think(tmp_path, server, opening=7.0, closing=5.0):
    """A --generation_config whose sequence_bias opens and closes the block as logit_bias does on the server
    (generate() then runs the prompts)."""
    path = tmp_path / "bias.json"
    path.write_text(json.dumps({"sequence_bias": [[[token(server, "<think>")], opening],
                                                  [[token(server, "</think>")], closing]]}))
    return ["--generation_config", str(path)]


def test_jsonl_records_carry_the_reasoning_beside_the_content(server, checkpoint, tmp_path):
    args = ["--model_name_or_path", checkpoint, "--input_format", "jsonl", "--output_format", "jsonl",
            "--length", "30", "--temperature", "1", "--num_return_sequences", "8"]
    result = run_main(args + pushed_to_think(tmp_path, server), stdin=json.dumps({"messages": ASK}))
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    records = [json.loads(line) for line in result.stdout.decode().splitlines()]
    split = [(record["reasoning_content"], record["content"]) for record in records]
    assert split == [raw_split(record["generated_text"]) for record in records]
    assert any(reasoning and content for reasoning, content in split)
    # A line with tools required: the prompt opens the block, the tiny model never closes it (no bias here), so
    # it is all reasoning, unconstrained (no call), and the record says so.
    line = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required"}
    result = run_main(args[:-4] + ["--temperature", "0"], stdin=json.dumps(line))
    [record] = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert record["num_prompt_tokens"] == len(prompt_ids(server, tools=[WEATHER])) + 1
    assert record["reasoning_content"] == record["generated_text"].strip() != ""
    assert record["content"] is None and record["tool_calls"] == [] and record["finish_reason"] == "length"


def test_thinking_budget_on_the_command_line(server, checkpoint):
    """--thinking_budget caps the block of a jsonl line's reply as thinking_token_budget does a request's: the line
    with tools required (its prompt opens the block, which this model never closes) thinks three tokens, then the
    block is closed for it and the tools' grammar makes the call. Refused where it would cap nothing."""
    args = ["--model_name_or_path", checkpoint, "--input_format", "jsonl", "--output_format", "jsonl", "--length",
            "60", "--temperature", "0"]
    line = json.dumps({"messages": ASK, "tools": [WEATHER], "tool_choice": "required"})
    result = run_main(args + ["--thinking_budget", "3"], stdin=line)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    [record] = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert record["reasoning_content"] and len(server[1].tokenizer.encode(record["reasoning_content"],
                                                                          add_special_tokens=False)) <= 3
    [call] = record["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
    beams = run_main(args + ["--thinking_budget", "3", "--num_beams", "2"], stdin=line)
    assert beams.returncode == 2 and "--thinking_budget caps replies on the tool's engine" in beams.stderr.decode()
    plain = run_main(["--model_name_or_path", checkpoint, "--prompt", "Hi", "--no-chat", "--thinking_budget", "3"])
    assert plain.returncode == 2 and "--no-chat leaves prompts unwrapped" in plain.stderr.decode()


def test_chat_template_kwargs_set_the_templates_variables_on_the_command_line_in_a_session_and_for_the_server(
        server, checkpoint):
    """--chat_template_kwargs '{"enable_thinking": false}': Qwen3's prompt closes an empty block, so the reply is
    all answer; the server takes it as every request's default, which a request's own variables override."""
    off, on = len(prompt_ids(server, enable_thinking=False)), len(prompt_ids(server))
    assert off > on
    args = ["--model_name_or_path", checkpoint, "--output_format", "jsonl", "--length", "2", "--temperature", "0"]
    off_flags = ["--chat", "--chat_template_kwargs", '{"enable_thinking": false}']
    result = run_main(args + off_flags, stdin=ASK[0]["content"])
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    [record] = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert record["num_prompt_tokens"] == off and record["reasoning_content"] is None
    for flags, message in (
            (["--chat", "--chat_template_kwargs", '{"thinking_budget": 1}'], "does not read 'thinking_budget'"),
            (["--chat", "--chat_template_kwargs", '{"enable_thinking": "no"}'], "must be true or false"),
            (["--chat", "--chat_template_kwargs", '{"reasoning_effort": "low"}'],
             "error: --chat_template_kwargs.reasoning_effort: this model's chat template does not read"),
            (["--chat_template_kwargs", '{"enable_thinking": false}'], "add --chat")):
        refused = run_main(args + flags, stdin=ASK[0]["content"])
        assert refused.returncode == 2 and message in refused.stderr.decode() and not refused.stdout
    session = session_for(checkpoint, "--length", "2", template_kwargs={"enable_thinking": False})
    assert session.encode(ASK[0]["content"])[0].ids == prompt_ids(server, enable_thinking=False)
    with serving(load(checkpoint, device=torch.device("cpu")), model_id=MODEL_ID,
                 template_kwargs={"enable_thinking": False}) as (live, _):
        served = (live.url, server[1])
        assert chat(served, max_tokens=1).usage.prompt_tokens == off
        assert chat(served, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": True}}) \
            .usage.prompt_tokens == on
        assert messages_client(served).messages.count_tokens(
            model=MODEL_ID, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024}).input_tokens == on


def session_for(checkpoint, *flags, tools=None, **options):
    import dataclasses

    from rungen.arguments import parse_args, settings_from_args
    from rungen.session import Session

    args = parse_args(["--model_name_or_path", checkpoint, *flags])
    loaded = load(checkpoint, device=torch.device("cpu"))
    torch.manual_seed(args.seed)  # as main() seeds the run
    settings = dataclasses.replace(settings_from_args(args, loaded.context), chat=True)
    return Session(loaded, settings, tools=args.tools, **options)


def test_a_session_shows_the_reasoning_on_stderr_and_the_answer_alone_on_stdout(server, checkpoint, tmp_path,
                                                                                 capsys):
    session = session_for(checkpoint, "--length", "30", "--temperature", "1", "--seed", "7",
                          *pushed_to_think(tmp_path, server))
    session.turn("What is the weather in Paris?")
    shown = capsys.readouterr()
    reply = session.messages[-1]
    assert reply["reasoning_content"] and reply["content"], reply  # it thought, then answered
    assert shown.out == reply["content"] + "\n"
    assert reply["reasoning_content"] in shown.err and reply["reasoning_content"] not in shown.out
    # On the engine, streamed: a tools turn opens the block in the prompt, and the tiny model stays in it.
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps({"tools": [WEATHER], "tool_choice": "required"}))
    for figures in (True, False):
        session = session_for(checkpoint, "--length", "12", "--temperature", "0", "--tools", str(tools),
                              figures=figures)
        session.turn("What is the weather in Paris?")
        shown = capsys.readouterr()
        reasoning = session.messages[-1]["reasoning_content"]
        assert reasoning and shown.out == "" and session.messages[-1]["content"] == ""  # no empty line for no answer
        assert (reasoning in shown.err) == figures  # --quiet leaves it out


def test_a_session_refuses_a_setting_that_would_drop_its_thinking_budget(checkpoint, capsys):
    # beams run on generate(), which has no such cap: the /set is refused in one line, the cap and the session stay
    from rungen.session import Repl

    session = session_for(checkpoint, "--chat", "--length", "12", "--temperature", "0", "--thinking_budget", "3")
    repl = Repl(session)
    assert repl.command("set", "num_beams 2") is False
    assert "error: --thinking_budget caps replies on the tool's engine; beam search" in capsys.readouterr().err
    assert session.settings.num_beams == 1 and session.settings.thinking_budget == 3
    repl.command("set", "temperature 0.5")  # what the engine runs is still set
    assert session.settings.temperature == 0.5


#
# The Messages API (/v1/messages): the block as a thinking content block
#


def messages_client(server):
    return anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0, timeout=120)


def push_messages(monkeypatch, **fields):
    """The Messages API has no logit_bias or seed: the chat body a Messages request becomes gets them here."""
    translate = rungen.messages.to_chat

    def to_chat(body, chat_template, count=False):
        chat, origins = translate(body, chat_template, count)
        return ({**chat, **fields} if not count else chat), origins

    monkeypatch.setattr(rungen.messages, "to_chat", to_chat)


def test_the_messages_api_gives_the_block_as_a_thinking_block(server, monkeypatch):
    """The same request as a chat completion and as a message: reasoning_content is the thinking block's text (with
    a signature), content the text block's; streamed, thinking_delta events assemble to the same message."""
    def reply(seed):
        return chat(server, logit_bias=bias(server), seed=seed, max_tokens=30).choices[0].message

    seed = next((seed for seed in range(1, 30) if reply(seed).reasoning_content and reply(seed).content), None)
    assert seed is not None, "no seed gave a reply that thinks, then answers"
    reply = reply(seed)
    push_messages(monkeypatch, logit_bias=bias(server), seed=seed)
    client = messages_client(server)
    message = client.messages.create(model=MODEL_ID, max_tokens=30, messages=ASK)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == reply.reasoning_content and message.content[0].signature
    assert message.content[1].text == reply.content
    events = list(client.messages.create(model=MODEL_ID, max_tokens=30, messages=ASK, stream=True))
    deltas = [event.delta for event in events if event.type == "content_block_delta"]
    assert "".join(delta.thinking for delta in deltas if delta.type == "thinking_delta") == reply.reasoning_content
    assert "".join(delta.text for delta in deltas if delta.type == "text_delta") == reply.content
    assert [delta.signature for delta in deltas if delta.type == "signature_delta"] == [message.content[0].signature]
    with client.messages.stream(model=MODEL_ID, max_tokens=30, messages=ASK) as stream:
        final = stream.get_final_message()
    assert [block.model_dump(exclude={"parsed_output"}) for block in final.content] == \
        [block.model_dump() for block in message.content] and final.stop_reason == message.stop_reason
    # the thinking block given back in the next turn is taken (and left out of the prompt, as the template drops it)
    history = ASK + [message.to_param(), {"role": "user", "content": "And in Rome?"}]
    assert client.messages.create(model=MODEL_ID, max_tokens=4, messages=history).usage.output_tokens == 4


def test_the_messages_api_thinking_field_reaches_the_template(server, monkeypatch):
    """thinking disabled: Qwen3's enable_thinking false closes an empty block in the prompt, so the reply is all
    text; a block never closed is all thinking, cut by max_tokens."""
    client = messages_client(server)
    counts = {kind: client.messages.count_tokens(model=MODEL_ID, messages=ASK, thinking=thinking).input_tokens
              for kind, thinking in (("off", {"type": "disabled"}),
                                     ("on", {"type": "enabled", "budget_tokens": 1024}))}
    assert counts["off"] == len(prompt_ids(server, enable_thinking=False)) > counts["on"] == len(prompt_ids(server))
    push_messages(monkeypatch, logit_bias=bias(server, opening=100, closing=-100))
    off = client.messages.create(model=MODEL_ID, max_tokens=5, messages=ASK, thinking={"type": "disabled"},
                                 extra_body={"temperature": 0})
    assert [block.type for block in off.content] == ["text"] and off.usage.input_tokens == counts["off"]
    cut = client.messages.create(model=MODEL_ID, max_tokens=5, messages=ASK, extra_body={"temperature": 0})
    assert [block.type for block in cut.content] == ["thinking"] and cut.stop_reason == "max_tokens"
    assert cut.content[0].thinking == "<think>" * 4
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL_ID, max_tokens=1024, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert "budget_tokens (1024) must be less than max_tokens (1024)" in caught.value.body["error"]["message"]


def test_a_thinking_budget_closes_the_block_for_the_model(server, monkeypatch):
    """thinking_token_budget (vLLM's field), and the Messages API's budget_tokens: once the block holds that many
    tokens, </think> is chosen for the model and the reply goes on as its answer; a budget the model stays within
    changes nothing."""
    never_closes = bias(server, opening=100, closing=-100)
    capped = chat(server, logit_bias=never_closes, temperature=0, max_tokens=12,
                  extra_body={"thinking_token_budget": 3})
    assert capped.choices[0].message.reasoning_content == "<think>" * 3  # opened by the model, three tokens in it
    assert capped.choices[0].message.content == "<think>" * 7 and capped.choices[0].finish_reason == "length"
    free = chat(server, logit_bias=bias(server), **OPEN_AND_CLOSE)
    within = chat(server, logit_bias=bias(server), extra_body={"thinking_token_budget": 30}, **OPEN_AND_CLOSE)
    assert [choice.message for choice in within.choices] == [choice.message for choice in free.choices]
    with pytest.raises(openai.BadRequestError) as caught:
        chat(server, max_tokens=2, extra_body={"thinking_token_budget": -1})
    assert caught.value.body["param"] == "thinking_token_budget"
    push_messages(monkeypatch, logit_bias=never_closes)
    message = messages_client(server).messages.create(
        model=MODEL_ID, max_tokens=1030, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0})
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "<think>" * 1024 and message.content[1].text == "<think>" * 4


def test_reasoning_given_back_in_a_tool_loop_reaches_the_prompt_through_each_api(server):
    """An agent gives a turn's reasoning back with its tool call (chat's reasoning_content, a Responses reasoning
    item, a Messages thinking block): Qwen3's template shows it in the prompt after the last user message, so the
    next reply follows the thinking that made the call; each API gives the template the same conversation."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    loop = ASK + [{"role": "assistant", "content": "", "reasoning_content": "Ask the tool.", "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    unthought = [loop[0], {key: value for key, value in loop[1].items() if key != "reasoning_content"}, loop[2]]
    shown = len(prompt_ids(server, loop, tools=[WEATHER])) - len(prompt_ids(server, unthought, tools=[WEATHER]))
    assert shown > 0  # the template shows it

    def chat_tokens(messages):
        return chat(server, messages=messages, tools=[WEATHER], max_tokens=1).usage.prompt_tokens

    assert chat_tokens(loop) - chat_tokens(unthought) == shown
    item = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                          "text": "Ask the tool."}]}
    items = [{"role": "user", "content": ASK[0]["content"]}, item,
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}]
    response = client(server).responses.create(
        model=MODEL_ID, input=items, max_output_tokens=1,
        tools=[{"type": "function", "name": "get_weather", "parameters": SCHEMA}])
    assert response.usage.input_tokens == chat_tokens(loop)
    # A client that keeps no store gives the item back as include=["reasoning.encrypted_content"] had it.
    sealed = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": rungen.responses.seal(
        "Ask the tool.")}
    response = client(server).responses.create(
        model=MODEL_ID, input=[items[0], sealed, *items[2:]], max_output_tokens=1, store=False,
        tools=[{"type": "function", "name": "get_weather", "parameters": SCHEMA}])
    assert response.usage.input_tokens == chat_tokens(loop)
    thinking = {"type": "thinking", "thinking": "Ask the tool.", "signature": "s"}
    use = {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}
    message = messages_client(server).messages.create(
        model=MODEL_ID, max_tokens=1, tools=[{"name": "get_weather", "input_schema": SCHEMA}],
        messages=[ASK[0], {"role": "assistant", "content": [thinking, use]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "18 C"}]}])
    assert message.usage.input_tokens == chat_tokens(loop)


#
# /v1/responses: the block as a reasoning item
#


@pytest.fixture(scope="module")
def closing_server(checkpoint, tmp_path_factory):
    """A copy of the thinking checkpoint whose model closes its block by itself, greedily: </think>'s output row
    is another token's (scaled up), the one greedy decoding writes a few tokens into the block, so the reply
    thinks for a few tokens, closes, and answers. (/v1/responses has no logit_bias to push it.)"""
    import shutil

    from transformers import AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("closing") / "qwen2")
    shutil.copytree(checkpoint, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    # A constrained request's prompt: the template's, and the opening <think> (see the grammar test above).
    prompt = torch.tensor([tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(
        "<think>")]])
    closing = tokenizer.convert_tokens_to_ids("</think>")
    for step in range(2, 8):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        greedy = model.generate(prompt, max_new_tokens=step + 1, do_sample=False)[0, prompt.shape[1]:].tolist()
        with torch.no_grad():
            model.get_output_embeddings().weight[closing] = model.get_output_embeddings().weight[greedy[step]] * 1.5
        after = model.generate(prompt, max_new_tokens=step + 1, do_sample=False)[0, prompt.shape[1]:].tolist()
        if closing in after and after.index(closing) >= 2:
            break
    else:
        pytest.fail("no greedy step to close the block at")
    model.save_pretrained(path)
    with served(path) as server:
        yield server


def test_a_response_gives_the_block_as_a_reasoning_item_and_the_answer_as_the_message(closing_server):
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA}
    responses = client(closing_server).responses
    response = responses.create(model=MODEL_ID, input=ASK[0]["content"], temperature=0, max_output_tokens=60,
                                text={"format": fmt}, reasoning={"summary": "auto"})
    chat_reply = chat(closing_server, temperature=0, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}).choices[0].message
    assert response.status == "completed" and [item.type for item in response.output] == ["reasoning", "message"]
    reasoning, message = response.output
    assert reasoning.id.startswith("rs_") and chat_reply.reasoning_content
    assert [part.text for part in reasoning.content] == [part.text for part in reasoning.summary] == \
        [chat_reply.reasoning_content]
    assert response.output_text == chat_reply.content and "<think>" not in response.output_text
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    # Streamed: the block's deltas as reasoning (and summary) text, then the message's.
    events = list(responses.create(model=MODEL_ID, input=ASK[0]["content"], temperature=0, max_output_tokens=60,
                                   text={"format": fmt}, reasoning={"summary": "auto"}, stream=True))
    kinds = [event.type for event in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert "".join(event.delta for event in events if event.type == "response.reasoning_summary_text.delta") == \
        "".join(event.delta for event in events if event.type == "response.reasoning_text.delta") == \
        chat_reply.reasoning_content
    assert events[-1].type == "response.completed" and events[-1].response.output_text == response.output_text
    with responses.stream(model=MODEL_ID, input=ASK[0]["content"], temperature=0, max_output_tokens=60,
                          text={"format": fmt}, reasoning={"summary": "auto"}) as stream:
        assert [event.type for event in stream] == kinds  # the SDK's stream helper takes every event
        helped = stream.get_final_response()
    assert helped.output[0].summary[0].text == chat_reply.reasoning_content
    assert helped.output_text == response.output_text
    # include=["reasoning.encrypted_content"]: the item carries its text for a client without a store to give back.
    sealed = responses.create(model=MODEL_ID, input=ASK[0]["content"], temperature=0, max_output_tokens=60,
                              text={"format": fmt}, include=["reasoning.encrypted_content"], store=False)
    assert rungen.responses.unseal(sealed.output[0].encrypted_content) == chat_reply.reasoning_content
    streamed = list(responses.create(model=MODEL_ID, input=ASK[0]["content"], temperature=0, max_output_tokens=60,
                                     text={"format": fmt}, include=["reasoning.encrypted_content"], stream=True))
    done = next(event.item for event in streamed if event.type == "response.output_item.done")
    assert done.encrypted_content == sealed.output[0].encrypted_content
    assert response.output[0].encrypted_content is None  # not asked for
    # Without a summary asked for, the item holds the text, and no summary.
    plain = responses.create(model=MODEL_ID, input=ASK[0]["content"], temperature=0, max_output_tokens=60,
                             text={"format": fmt})
    assert plain.output[0].summary == [] and plain.output[0].content[0].text == chat_reply.reasoning_content
    # Log-probabilities would mix the block's tokens with the answer's: refused.
    with pytest.raises(openai.BadRequestError) as caught:
        responses.create(model=MODEL_ID, input="Hi", max_output_tokens=2, include=["message.output_text.logprobs"])
    assert caught.value.body["param"] == "include" and "thinking model" in caught.value.body["message"]


# Mistral's reasoning models: [THINK] and [/THINK] are special tokens (a decode that skips them loses the block).
MINISTRAL = os.path.join(os.path.dirname(TEMPLATE), "ministral-3-reasoning.jinja")
MISTRAL_SPECIAL = ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]", "[THINK]", "[/THINK]"]


@pytest.fixture(scope="module")
def special_checkpoint(tmp_path_factory):
    """A tiny model with Ministral 3 Reasoning's published template and Mistral's control tokens as special tokens."""
    path = str(tmp_path_factory.mktemp("special") / "qwen2")
    template_checkpoint(path, MINISTRAL, special=MISTRAL_SPECIAL)
    return path


@pytest.fixture(scope="module")
def special_server(special_checkpoint):
    with served(special_checkpoint) as server:
        yield server


def test_a_block_between_special_tokens_comes_apart_as_well(special_server, special_checkpoint, tmp_path):
    """The split where the delimiters are special tokens: the server's replies (the engine), streamed and whole, and
    the jsonl records of generate() runs, each against its raw text (the tokens' own text, in the logprobs, or the
    record's generated_text, which now keeps the delimiters)."""
    bias = {str(token(special_server, "[THINK]")): 7, str(token(special_server, "[/THINK]")): 5}
    whole = chat(special_server, logit_bias=bias, logprobs=True, **OPEN_AND_CLOSE)
    split = [(choice.message.reasoning_content, choice.message.content) for choice in whole.choices]
    skipped = set(special_server[1].tokenizer.all_special_tokens) - {"[THINK]", "[/THINK]"}  # as in any reply
    raw = ["".join(item.token for item in choice.logprobs.content if item.token not in skipped)
           for choice in whole.choices]
    assert split == [raw_split(text, "[THINK]", "[/THINK]") for text in raw]
    assert any(reasoning and content for reasoning, content in split)
    assert all("[/THINK]" not in (reasoning or "") for reasoning, _ in split)
    streamed = [["", ""] for _ in range(8)]
    for chunk in chat(special_server, logit_bias=bias, stream=True, **OPEN_AND_CLOSE):
        for choice in chunk.choices:
            streamed[choice.index][0] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            streamed[choice.index][1] += choice.delta.content or ""
    assert streamed == [[reasoning or "", content or ""] for reasoning, content in split]
    path = tmp_path / "bias.json"
    path.write_text(json.dumps({"sequence_bias": [[[token(special_server, "[THINK]")], 7.0],
                                                  [[token(special_server, "[/THINK]")], 5.0]]}))
    args = ["--model_name_or_path", special_checkpoint, "--input_format", "jsonl", "--output_format", "jsonl",
            "--length", "30", "--temperature", "1", "--num_return_sequences", "8", "--generation_config", str(path)]
    result = run_main(args, stdin=json.dumps({"messages": ASK}))
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    records = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert [(record["reasoning_content"], record["content"]) for record in records] == \
        [raw_split(record["generated_text"], "[THINK]", "[/THINK]") for record in records]
    assert any(record["reasoning_content"] and record["content"] for record in records)
    # A streamed reply (generate() runs it, for the sequence bias) prints what the whole one does, delimiters too.
    one = ["--model_name_or_path", special_checkpoint, "--chat", "--prompt", "Hi", "--length", "12", "--seed", "1",
           "--temperature", "1", "--generation_config", str(path)]
    streamed, whole = run_main(one + ["--stream"]), run_main(one + ["--no-stream"])
    assert streamed.returncode == whole.returncode == 0, streamed.stderr.decode()[-2000:]
    assert streamed.stdout.decode().strip() == whole.stdout.decode().strip()
    assert "THINK]" in whole.stdout.decode()


# gpt-oss: the harmony format's channels and markers are special tokens; a reply thinks in the analysis channel,
# then answers in the final channel or calls a tool in the commentary channel.
GPT_OSS = os.path.join(os.path.dirname(TEMPLATE), "gpt-oss.jinja")
HARMONY_SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    """A tiny model with gpt-oss's published template, its harmony tokens special and <|return|> and <|call|> its
    ends of generation, as gpt-oss's tokenizer and generation config have them."""
    path = str(tmp_path_factory.mktemp("harmony") / "qwen2")
    tokenizer = template_checkpoint(path, GPT_OSS, special=HARMONY_SPECIAL)
    ends = [tokenizer.convert_tokens_to_ids(name) for name in ("<|return|>", "<|call|>")]
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(path, name), encoding="utf-8") as f:
            config = json.load(f)
        config["eos_token_id"] = ends
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            json.dump(config, f)
    with served(path) as server:
        yield server


def test_gpt_oss_thinks_in_its_analysis_channel_then_calls_a_tool_or_answers(harmony_server):
    """A budget closes the analysis channel (the tiny model never does): with tools the model is left at the next
    message's start and the grammar makes the call in the commentary channel; with a JSON format the final channel's
    opening is chosen for it too, and the answer is the JSON alone. Neither leaks a channel's name."""
    budget = {"thinking_token_budget": 3}
    weather = {"type": "function", "function": {**WEATHER["function"], "description": "The weather in a city."}}
    called = chat(harmony_server, tools=[weather], tool_choice="required", temperature=1.0, seed=2, n=3,
                  max_tokens=200, extra_body=budget)
    for choice in called.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
        reasoning = choice.message.reasoning_content
        assert reasoning and "<|" not in reasoning and choice.message.content is None
    answered = chat(harmony_server, temperature=1.0, seed=3, n=3, max_tokens=80, extra_body=budget,
                    response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    for choice in answered.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.message.reasoning_content and "<|" not in choice.message.reasoning_content
    # Stop strings inside the final channel's opening (chosen for the model) do not cut it: the same replies.
    cut = chat(harmony_server, temperature=1.0, seed=3, n=3, max_tokens=80, extra_body=budget, stop=["final", "ass"],
               response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    assert [choice.message.content for choice in cut.choices] == \
        [choice.message.content for choice in answered.choices]
    # The model closing its analysis itself (pushed to): the final channel's opening follows for it, then the JSON.
    closes = {str(token(harmony_server, "<|end|>")): 6}
    itself = chat(harmony_server, temperature=1.0, seed=4, n=4, max_tokens=80, logit_bias=closes,
                  response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    for choice in itself.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # The recipient after the channel, as OpenAI's guide writes a call: read as a call, no header in the content.
    from rungen.reasoning import ReplyPlan, detect_delimiters, split_reply
    from rungen.tool_formats import HARMONY
    from rungen.tool_reply import CallParser, message_of

    plan = ReplyPlan(detect_delimiters(harmony_server[1].tokenizer.chat_template), "start")
    reasoning, content = split_reply(plan, '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant'
                                           '<|channel|>commentary to=functions.get_weather <|constrain|>json'
                                           '<|message|>{"city": "Paris"}')
    calls = message_of(CallParser(HARMONY), content)
    assert reasoning == "Need weather." and calls[0] is None
    assert [call["function"]["name"] for call in calls[1]] == ["get_weather"]


def test_a_session_keeps_its_history_where_the_template_refuses_an_empty_answer(special_checkpoint, tmp_path,
                                                                                capsys):
    """Mistral's template takes no assistant turn without content: a turn that was all thinking is kept as the
    model wrote it ([THINK] and all), so the next turn's prompt holds it, and no turn is dropped "to fit the
    context" for a refusal."""
    path = tmp_path / "bias.json"
    tokenizer = AutoTokenizer.from_pretrained(special_checkpoint)
    path.write_text(json.dumps({"sequence_bias": [[[tokenizer.convert_tokens_to_ids("[THINK]")], 100.0],
                                                  [[tokenizer.convert_tokens_to_ids("[/THINK]")], -100.0]]}))
    session = session_for(special_checkpoint, "--length", "6", "--temperature", "0", "--generation_config",
                          str(path))
    session.turn("Hi")
    first = session.messages[-1]
    assert first["content"].startswith("[THINK]") and "reasoning_content" not in first, first
    session.turn("And then?")
    shown = capsys.readouterr()
    assert "dropped" not in shown.err and "error" not in shown.err, shown.err
    assert [message["role"] for message in session.messages] == ["user", "assistant"] * 2


class Scripted:
    """A forward hook that makes a model write `text` (a large bias on each of its tokens in turn, from the step
    after a prompt's prefill), then as it would: a random model writing what a thinking model writes."""

    def __init__(self, loaded):
        self.ids, self.step = [], 0
        self.tokenizer = loaded.tokenizer

        def hook(module, args, kwargs, out):
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            if input_ids is not None and input_ids.shape[1] > 1:
                self.step = 0  # a prefill: the reply starts
            if self.step < len(self.ids):
                out.logits[:, -1, self.ids[self.step]] += 60.0
            self.step += 1
            return out

        loaded.model.register_forward_hook(hook, with_kwargs=True)

    def write(self, text, end=None):
        self.ids = self.tokenizer.encode(text, add_special_tokens=False) + ([end] if end is not None else [])


def test_apriel_thinks_after_its_plain_text_opening_and_answers_after_the_marker(tmp_path):
    """Apriel 1.6's prompt opens the block in plain text ("Here are my reasoning steps:", many tokens in a small
    vocabulary), and the answer follows "[BEGIN FINAL RESPONSE]": a budget closes the block (the tiny model never
    does), the reasoning is what came before it, the answer what follows; a required call follows the marker too."""
    path = str(tmp_path / "qwen2")
    template_checkpoint(path, os.path.join(os.path.dirname(TEMPLATE), "apriel-1.6-thinker.jinja"),
                        special=["<|begin_system|>", "<|begin_user|>", "<|begin_assistant|>", "<|begin_tool_result|>",
                                 "<|end|>"])
    with served(path) as server:
        assert len(server[1].tokenizer.encode("Here are my reasoning steps:\n")) > 8  # past the tail's own tokens
        reply = chat(server, temperature=1.0, seed=1, n=4, max_tokens=30, logprobs=True,
                     extra_body={"thinking_token_budget": 5})
        for choice in reply.choices:
            text = "".join(token.token for token in choice.logprobs.content)  # the reply as the model wrote it
            thought, marked, answer = text.partition("[BEGIN FINAL RESPONSE]")
            assert marked and choice.message.reasoning_content == thought.strip()
            assert choice.message.content == (answer.strip() or None)
        called = chat(server, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                      seed=2, n=2, max_tokens=120, extra_body={"thinking_token_budget": 3})
        for choice in called.choices:
            [call] = choice.message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
            assert "[BEGIN FINAL RESPONSE]" not in (choice.message.reasoning_content or "")



def test_a_plain_text_closing_is_found_however_its_tokens_were_cut(tmp_path):
    """Apriel's model may close its block after a space, where "[BEGIN FINAL RESPONSE]" takes other tokens than
    alone (" [" is a token of its own in a byte-level vocabulary): the grammar of a required call still starts after
    it (the call made, the reasoning what came before), and a thinking budget sees the block closed (nothing forced
    into the answer)."""
    path = str(tmp_path / "qwen2")
    tokenizer = template_checkpoint(path, os.path.join(os.path.dirname(TEMPLATE), "apriel-1.6-thinker.jinja"),
                                    special=["<|begin_system|>", "<|begin_user|>", "<|begin_assistant|>",
                                             "<|begin_tool_result|>", "<|end|>"])
    marker = "[BEGIN FINAL RESPONSE]"
    alone = tokenizer.encode(marker, add_special_tokens=False)
    after_space = tokenizer.encode("I think. " + marker, add_special_tokens=False)
    assert tuple(after_space[-len(alone) :]) != tuple(alone)  # the case: other ids than the marker's own
    loaded = load(path, device=torch.device("cpu"))
    script = Scripted(loaded)
    with serving(loaded, model_id=MODEL_ID, max_batch=1, prefix_cache_mb=0) as (live, _):
        server = (live.url, loaded)
        script.write("I think. " + marker + "\n")
        reply = chat(server, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0,
                     max_tokens=150)
        choice = reply.choices[0]
        assert choice.message.reasoning_content == "I think." and choice.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), SCHEMA)
        script.write("I think. " + marker + "\nHello there.", end=tokenizer.eos_token_id)
        reply = chat(server, temperature=0, max_tokens=60, extra_body={"thinking_token_budget": 40})
        message = reply.choices[0].message
        assert message.reasoning_content == "I think." and message.content == "Hello there.", message
        # A budget running out while the model writes the marker: the rest of it is written, no piece of it in
        # the reasoning or the answer.
        thought = len(tokenizer.encode("I think. ", add_special_tokens=False))
        inside = range(thought + 1, len(after_space) - 1)  # the budget runs out after a piece of the marker
        for budget in (inside[0], inside[len(inside) // 2], inside[-1]):
            message = chat(server, temperature=0, max_tokens=60,
                           extra_body={"thinking_token_budget": budget}).choices[0].message
            assert message.reasoning_content == "I think." and "[" not in (message.content or ""), (budget, message)


def test_a_constrained_reply_does_not_end_inside_its_thinking_block(checkpoint):
    """A reply whose constraint waits for the block to close (a required call, a response format) may not end inside
    the block: tool_choice required is a call or nothing finished (OpenAI's promise), never a stop with no call.
    A reply with no constraint ends where the model ends it."""
    loaded = load(checkpoint, device=torch.device("cpu"))
    script = Scripted(loaded)
    eos = loaded.tokenizer.eos_token_id
    with serving(loaded, model_id=MODEL_ID, max_batch=1, prefix_cache_mb=0) as (live, _):
        server = (live.url, loaded)
        script.write("I think.", end=eos)
        plain = chat(server, temperature=0, max_tokens=40).choices[0]
        assert plain.finish_reason == "stop" and plain.message.content == "I think."
        for kwargs in ({"tools": [WEATHER], "tool_choice": "required"},
                       {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}):
            choice = chat(server, temperature=0, max_tokens=40, **kwargs).choices[0]
            assert choice.finish_reason in ("length", "tool_calls"), (kwargs, choice)
            assert choice.message.reasoning_content.startswith("I think.") and not choice.message.content
