"""A conversation in OpenAI's chat format (a server's chat request, a jsonl line's "messages"), read and checked
once for both: roles, text parts, tool calls and results, reasoning, in the shape the chat path takes them.
"""

from __future__ import annotations

import json

ROLES = ("system", "developer", "user", "assistant", "tool")
# Between a message's text parts (or blocks), as vLLM joins them: one part's words never run into the next's.
PART_SEPARATOR = "\n"
# An assistant message's earlier reasoning, which thinking models' templates read (the first name is the one kept).
REASONING_KEYS = ("reasoning_content", "reasoning")
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", *REASONING_KEYS)


class MessageError(ValueError):
    """What is wrong with a conversation, naming the message (a 400 on "messages", an error record in jsonl)."""


def read_conversation(messages) -> list[dict]:
    """The checked conversation: "developer" read as "system" (chat templates know that name), a message's text
    parts joined, each message as {"role", "content"} plus its tool calls ({"id", "name", "arguments"}), its tool
    call's id or its reasoning; a field the tool cannot honour is a MessageError, never dropped."""
    if not isinstance(messages, list) or not messages:
        raise MessageError("must be a non-empty list")
    return [read_message(message, number) for number, message in enumerate(messages)]


def read_message(message, number: int) -> dict:
    where = f"messages[{number}]"
    if not isinstance(message, dict):
        raise MessageError(f"{where} must be an object")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list or an object cannot be looked up
        raise MessageError(f"{where}.role {json.dumps(role)[:60]} is not supported (roles: {', '.join(ROLES)})")
    extra = sorted(key for key in message if key not in MESSAGE_KEYS and message[key] is not None)
    if extra:
        raise MessageError(f"{where}.{extra[0]} is not supported")
    fields = tool_fields(message, number)
    # An assistant message that only calls tools has no content.
    content = None if fields.get("tool_calls") and message.get("content") is None else text(message, where)
    reasoning = next((message[key] for key in REASONING_KEYS if message.get(key) is not None), None)
    if reasoning is not None:
        if role != "assistant" or not isinstance(reasoning, str):
            raise MessageError(f"{where}: reasoning is a string on an assistant message")
        fields["reasoning_content"] = reasoning
    return {"role": "system" if role == "developer" else role, "content": content, **fields}


def text(message: dict, where: str) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise MessageError(f"{where}.content: only text parts are supported, got {kind}")
        return PART_SEPARATOR.join(part["text"] for part in content)
    raise MessageError(f"{where}.content must be a string or a list of text parts")


def tool_fields(message: dict, number: int) -> dict:
    """One message's tool fields: {"tool_calls": [...]}, {"tool_call_id": ...} or {}."""
    where = f"messages[{number}]"
    role = message.get("role")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise MessageError(f"{where}: a tool message needs tool_call_id")
        return {"tool_call_id": call_id}
    calls = message.get("tool_calls")
    if calls is None or calls == []:  # some clients send an empty list for "no calls"
        if message.get("tool_call_id") is not None:
            raise MessageError(f"{where}.tool_call_id belongs on a tool message")
        return {}
    if role != "assistant":
        raise MessageError(f"{where}.tool_calls belongs on an assistant message")
    if not isinstance(calls, list):
        raise MessageError(f"{where}.tool_calls must be a list")
    return {"tool_calls": [tool_call(call, f"{where}.tool_calls[{index}]") for index, call in enumerate(calls)]}


def tool_call(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(function, dict):
        raise MessageError(f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}')
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise MessageError(f"{where}.id must be a non-empty string")
    if not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str):
        raise MessageError(f"{where}.function needs a string name and arguments (a JSON string)")
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError as error:
        raise MessageError(f"{where}.function.arguments is not valid JSON ({error.msg})") from error
    if not isinstance(arguments, dict):
        raise MessageError(f"{where}.function.arguments must be a JSON object")
    return {"id": call["id"], "name": function["name"], "arguments": arguments}
