"""Fast tier: conversations ({"messages": [...]} jsonl lines), --chat, --system and the sampling checks
that flags and a session's /set share; a tokenizer at most."""

import json
import types

import pytest

from rungen import openai_api
from rungen.arguments import parse_args, settings_from_args
from rungen.conversation import read_conversation
from rungen.errors import PromptError, UsageError
from rungen.generation import Settings
from rungen.prompts import Prompt, encode_prompt, parse_prompt_line
from tiny_models import build_tokenizer


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_a_jsonl_line_with_messages_is_a_conversation():
    messages = [{"role": "system", "content": "S"}, user("Hi"), assistant("Hello"), user("Bye")]
    prompt = parse_prompt_line(4, json.dumps({"messages": messages, "id": 9}).encode(), "jsonl")
    assert prompt == Prompt(4, "Bye", extra={"id": 9, "messages": messages}, messages=messages)
    # A line with a "prompt" is a text prompt, as before: a "messages" field beside it is only carried.
    both = parse_prompt_line(0, json.dumps({"prompt": "P", "messages": 1}).encode(), "jsonl")
    assert both == Prompt(0, "P", extra={"messages": 1})


@pytest.mark.parametrize(
    "record, error",
    [
        ({"messages": []}, '"messages": must be a non-empty list'),
        ({"messages": "Hi"}, '"messages": must be a non-empty list'),
        ({"messages": [{"role": "user"}]}, '"messages": messages[0].content must be a string or a list of text parts'),
        ({"messages": ["Hi"]}, '"messages": messages[0] must be an object'),
        ({"messages": [user("Hi"), {"role": "user", "content": "Hi", "name": "Ann"}]},
         '"messages": messages[1].name is not supported'),
        ({"messages": [{"role": "bot", "content": "Hi"}]}, '"messages": messages[0].role "bot" is not supported'),
    ],
)
def test_bad_conversations_are_error_records(record, error):
    prompt = parse_prompt_line(0, json.dumps(dict(record, id=1)).encode(), "jsonl")
    assert prompt.error.startswith(error) and prompt.extra == {"id": 1}


def test_the_server_and_jsonl_read_a_conversation_alike():
    """An agent's turn: a developer message, text parts, the assistant's reasoning and call sent back, the result."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "<ctx>"}, {"type": "text", "text": "Weather?"}]},
                {"role": "assistant", "content": None, "reasoning_content": "Ask the tool.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    expected = [{"role": "system", "content": "Be brief."}, user("<ctx>\nWeather?"),
                {"role": "assistant", "content": None, "reasoning_content": "Ask the tool.",
                 "tool_calls": [{"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}}]},
                {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}]
    assert read_conversation(messages) == expected
    assert openai_api.read_messages({"messages": messages}) == expected
    line = parse_prompt_line(0, json.dumps({"messages": messages}).encode(), "jsonl")
    assert line.error is None and line.messages == expected and line.text == "<ctx>\nWeather?"
    # "reasoning" is the other name clients send it by; on a user message it would mean nothing to a template.
    assert read_conversation([dict(messages[2], reasoning_content=None, reasoning="R")])[0]["reasoning_content"] == "R"
    bad = [user("Hi"), dict(user("Hi"), reasoning_content="R")]
    with pytest.raises(openai_api.APIError, match=r"^messages\[1\]: reasoning is a string on an assistant message$"):
        openai_api.read_messages({"messages": bad})
    assert parse_prompt_line(0, json.dumps({"messages": bad}).encode(), "jsonl").error == (
        '"messages": messages[1]: reasoning is a string on an assistant message')


@pytest.fixture(scope="module")
def chat_loaded(tmp_path_factory):
    tokenizer, _ = build_tokenizer("gpt2", str(tmp_path_factory.mktemp("tok")))
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"
    return types.SimpleNamespace(tokenizer=tokenizer, model=None, model_type="gpt2", context=128,
                                 vocab_size=len(tokenizer))


def test_encoding_a_conversation_uses_the_template_and_the_system_message(chat_loaded):
    tokenizer = chat_loaded.tokenizer

    def encoded(prompt, **kwargs):
        return tokenizer.decode(encode_prompt(chat_loaded, prompt, **kwargs))

    conversation = Prompt(0, "Hi", messages=[user("Hi")])
    assert encoded(conversation) == "[user]Hi[assistant]"
    assert encoded(conversation, system="Be brief.", prefix="P: ") == "[system]Be brief.[user]Hi[assistant]"
    own = Prompt(0, "Hi", messages=[{"role": "system", "content": "Own."}, user("Hi")])
    assert encoded(own, system="Be brief.") == "[system]Own.[user]Hi[assistant]"
    assert encoded(Prompt(0, "Hi"), chat=True, system="S", prefix="P: ") == "[system]S[user]P: Hi[assistant]"
    assert encoded(Prompt(0, "Hi"), system="S", prefix="P: ") == "P: Hi"  # no --chat: plain text


def test_without_a_template(chat_loaded):
    tokenizer = chat_loaded.tokenizer
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        with pytest.raises(PromptError, match="^this tokenizer has no chat template$"):
            encode_prompt(chat_loaded, Prompt(0, "Hi", messages=[user("Hi")]))
        with pytest.raises(PromptError, match="^--chat: this tokenizer has no chat template$"):
            encode_prompt(chat_loaded, Prompt(0, "Hi"), chat=True)
    finally:
        tokenizer.chat_template = template


def test_check_sampling_raises_and_the_flags_exit():
    with pytest.raises(UsageError, match="--k must be >= 0, got -1"):
        Settings(top_k=-1).check()
    with pytest.raises(UsageError, match="--k must be >= 0, got -1"):
        parse_args(["--k", "-1"])


def test_chat_flag_is_auto_unless_given():
    assert parse_args([]).chat is None and parse_args(["--chat"]).chat is True
    assert parse_args(["--no-chat"]).chat is False
    assert settings_from_args(parse_args([]), 128).chat is False  # auto is off outside a session
