"""/v1/messages: Anthropic's Messages API over the server's one chat path (docs/server.md#post-v1messages).

A Messages request is translated into a chat completion body for rungen.openai_api.run_chat, and its answer or
stream back into content blocks or Anthropic's server-sent events; errors are answered in Anthropic's shape, under
the request's own field names.
"""

import contextlib
import hashlib
import json
import math
import re

from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from . import openai_api
from .conversation import PART_SEPARATOR
from .openai_api import APIError, excerpt, has_value, number, refuse_extra
from .reasoning import template_reads, thinking_switch

# Anthropic's error type for each status (any other 4xx: invalid_request_error, any other 5xx: api_error).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "timeout_error",
               529: "overloaded_error"}
# A chat field a run_chat error may name, and the Messages field it came from.
FIELD_NAMES = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice", "chat_template_kwargs": "thinking",
               "thinking_token_budget": "thinking", "max_completion_tokens": "max_tokens", "stream_options": "stream"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # else: end_turn, or stop_sequence
BLOCK_KEYS = {"text": {"type", "text", "cache_control", "citations"},
              "tool_use": {"type", "id", "name", "input", "cache_control"},
              "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
              "thinking": {"type", "thinking", "signature"},
              "redacted_thinking": {"type", "data"}}
TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control", "strict"}
THINKING_MIN_BUDGET = 1024  # Anthropic's least budget_tokens


# Errors


def error_type(status):
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(error):
    return {"type": "error", "error": {"type": error_type(error.status), "message": error.message}}


def error_response(error):
    """An APIError in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


def error_event(error):
    """An APIError as a stream's error event."""
    return sse("error", error_body(error))


@contextlib.contextmanager
def renamed(origins):
    """An APIError from the chat path re-raised under the Messages request's names: fields, messages' places
    (the chat's messages[3] may be the request's messages[1] or its system), tools' parts."""
    try:
        yield
    except APIError as error:
        message = error.message
        name = FIELD_NAMES.get(error.param, error.param)
        if error.param in FIELD_NAMES:
            message = re.sub(rf"(?<![\w.]){re.escape(error.param)}(?!\w)", name, message)
        message = re.sub(r"messages\[(\d+)\]",
                         lambda found: origins[int(found[1])] if int(found[1]) < len(origins) else found[0], message)
        message = message.replace(".function.parameters", ".input_schema").replace(".function.", ".")
        # The chat path's tool messages and calls are this API's blocks.
        for chat_name, block_name in (("tool_call_id", "tool_use_id"), (".tool_calls:", " tool_use:"),
                                      ("tool message", "tool_result block"), ("tool call", "tool_use")):
            message = message.replace(chat_name, block_name)
        raise APIError(message, name, error.status, error.kind, error.code, error.headers) from error


# The request


def blocks_of(content, where, allowed):
    """A content (a string or a list of blocks) as a list of blocks, each checked against `allowed` types."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    field = where.split("[")[0].split(".")[0]  # the request's field: system or messages
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of content blocks", field)
    for index, block in enumerate(content):
        at = f"{where}[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise APIError(f"{at} must be a content block with a type", field)
        if kind not in allowed:
            raise APIError(f"{at}: {excerpt(kind)} blocks are not supported by this server (here: "
                           f"{', '.join(allowed)})", field)
        refuse_extra(block, BLOCK_KEYS[kind], at, field)
        if block.get("cache_control") is not None and not isinstance(block["cache_control"], dict):
            raise APIError(f"{at}.cache_control must be an object", field)
        if kind == "text" and not isinstance(block.get("text"), str):
            raise APIError(f"{at}.text must be a string", field)
        if kind == "thinking" and not isinstance(block.get("thinking"), str):
            raise APIError(f"{at}.thinking must be a string", field)
    return content


def text_of(blocks):
    return PART_SEPARATOR.join(block["text"] for block in blocks)


def read_system(body):
    if not has_value(body, "system"):
        return None
    return text_of(blocks_of(body["system"], "system", ("text",)))


def tool_result(block, at):
    """A tool_result block as a chat tool message."""
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise APIError(f"{at}.tool_use_id must be a non-empty string", "messages")
    content = block.get("content")
    text = "" if content is None else text_of(blocks_of(content, f"{at}.content", ("text",)))
    if has_value(block, "is_error"):
        if not isinstance(block["is_error"], bool):
            raise APIError(f"{at}.is_error must be true or false", "messages")
        if block["is_error"]:
            text = "Error: " + text
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def tool_use(block, at):
    """A tool_use block as a chat tool call (arguments a JSON string)."""
    if not isinstance(block.get("id"), str) or not block["id"]:
        raise APIError(f"{at}.id must be a non-empty string", "messages")
    if not isinstance(block.get("name"), str):
        raise APIError(f"{at}.name must be a string", "messages")
    if not isinstance(block.get("input"), dict):
        raise APIError(f"{at}.input must be an object", "messages")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"])}}


def read_messages(body, system):
    """(chat messages, where each came from in the request, for errors)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", "messages")
    chat, origins = [], []
    if system is not None:
        chat.append({"role": "system", "content": system})
        origins.append("system")
    for place, message in enumerate(messages):
        where = f"messages[{place}]"
        if not isinstance(message, dict):
            raise APIError(f"{where} must be an object", "messages")
        refuse_extra(message, ("role", "content"), where, "messages")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise APIError(f"{where}.role must be user or assistant, got {excerpt(role)}", "messages")
        if "content" not in message:
            raise APIError(f"{where}.content is required", "messages")
        if role == "user":
            blocks = blocks_of(message["content"], f"{where}.content", ("text", "tool_result"))
            text = None
            for index, block in enumerate(blocks):
                if block["type"] == "tool_result":
                    chat.append(tool_result(block, f"{where}.content[{index}]"))
                    origins.append(where)
                    text = None
                elif text is None:  # text blocks in a row make one user message
                    text = {"role": "user", "content": block["text"]}
                    chat.append(text)
                    origins.append(where)
                else:
                    text["content"] += PART_SEPARATOR + block["text"]
            if not blocks:
                chat.append({"role": "user", "content": ""})
                origins.append(where)
        else:
            blocks = blocks_of(message["content"], f"{where}.content",
                               ("text", "tool_use", "thinking", "redacted_thinking"))
            calls = [tool_use(block, f"{where}.content[{index}]") for index, block in enumerate(blocks)
                     if block["type"] == "tool_use"]
            text = text_of([block for block in blocks if block["type"] == "text"])
            reply = {"role": "assistant", "content": None if calls and not text else text}
            if calls:
                reply["tool_calls"] = calls
            # Thinking given back is the turn's reasoning_content (the template decides whether the prompt shows
            # it); redacted thinking is another model's, unreadable here.
            thinking = PART_SEPARATOR.join(block["thinking"] for block in blocks if block["type"] == "thinking")
            if thinking:
                reply["reasoning_content"] = thinking
            chat.append(reply)
            origins.append(where)
    if messages[-1].get("role") == "assistant":
        raise APIError("the last message is the assistant's: continuing a prefilled reply is not supported by this "
                       "server (the reply is a new assistant turn)", "messages")
    return chat, origins


def read_tools(body):
    """tools as chat function tools (None without them)."""
    if not has_value(body, "tools"):
        return None
    tools = body["tools"]
    if not isinstance(tools, list):
        raise APIError("tools must be a list of {name, description, input_schema}", "tools")
    if not tools:
        return None  # no tools to call, as without the field
    functions = []
    for index, tool in enumerate(tools):
        at = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise APIError(f"{at} must be an object", "tools")
        if tool.get("type") not in (None, "custom"):
            raise APIError(f"{at}: {excerpt(tool['type'])} tools (Anthropic's server and client tools) are not "
                           "supported by this server; give {name, description, input_schema}", "tools")
        refuse_extra(tool, TOOL_KEYS, at, "tools")
        if not isinstance(tool.get("input_schema"), dict):
            raise APIError(f"{at}.input_schema must be a JSON schema object", "tools")
        if tool.get("cache_control") is not None and not isinstance(tool["cache_control"], dict):
            raise APIError(f"{at}.cache_control must be an object", "tools")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        functions.append({"type": "function", "function": function})
    return functions


def read_tool_choice(body, tools):
    """(tool_choice, parallel_tool_calls) of the chat body (None: absent)."""
    if not has_value(body, "tool_choice"):
        return None, None
    choice = body["tool_choice"]
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise APIError('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or '
                       '{"type": "none"}', "tool_choice")
    allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    extra = sorted(key for key in choice if key not in allowed and choice[key] is not None)
    if extra:
        raise APIError(f"tool_choice.{extra[0]} is not supported with type {kind}", "tool_choice")
    if tools is None:
        if kind in ("any", "tool"):
            raise APIError(f"tool_choice {kind} needs tools", "tool_choice")
        return None, None  # auto or none without tools: nothing to call either way
    parallel = None
    if has_value(choice, "disable_parallel_tool_use"):
        if not isinstance(choice["disable_parallel_tool_use"], bool):
            raise APIError("tool_choice.disable_parallel_tool_use must be true or false", "tool_choice")
        parallel = not choice["disable_parallel_tool_use"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise APIError("tool_choice.name must be a tool's name", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def read_thinking(body, chat_template, max_tokens):
    """(the chat template's variables for `thinking`, its budget_tokens or None): its switch of thinking
    (enable_thinking, or DeepSeek V3.1's thinking), where the template reads one, or the variable that does the same
    (Seed-OSS's thinking_budget, Hunyuan 3's reasoning_effort) ({} when thinking is absent)."""
    if not has_value(body, "thinking"):
        return {}, None
    thinking = body["thinking"]
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise APIError('thinking must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} or '
                       '{"type": "disabled"}', "thinking")
    allowed = {"type", "budget_tokens"} if kind == "enabled" else {"type"}
    refuse_extra(thinking, allowed, "thinking", "thinking")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < THINKING_MIN_BUDGET:
            raise APIError(f"thinking.budget_tokens must be an integer of at least {THINKING_MIN_BUDGET}, got "
                           f"{excerpt(budget)}", "thinking")
        if max_tokens is not None and budget >= max_tokens:
            raise APIError(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                           "thinking")
    switch = thinking_switch(chat_template)
    if switch is None:
        from .reasoning import detect_delimiters

        thinks = detect_delimiters(chat_template) is not None  # always, where its template reads no other variable
        budget = thinking.get("budget_tokens")
        if thinks and template_reads(chat_template, "thinking_budget"):  # Seed-OSS's: 0 off, N its budget, -1 any
            return ({"thinking_budget": 0} if kind == "disabled" else {"thinking_budget": budget} if budget else {},
                    budget)
        if thinks and template_reads(chat_template, "reasoning_effort") and "no_think" in str(chat_template):
            # Hunyuan 3's: off ("no_think") unless its effort is set
            return ({} if kind == "disabled" else {"reasoning_effort": "high"}), budget
        if thinks and kind != "disabled":  # only the cap to apply
            return {}, budget
        why = "always thinks (its chat template has no switch)" if thinks else \
            "has a chat template that reads no switch of thinking (enable_thinking, thinking)"
        raise APIError(f"thinking: this model {why}, so thinking cannot be turned "
                       f"{'off' if kind == 'disabled' else 'on'}; leave thinking out", "thinking")
    return {switch: kind != "disabled"}, thinking.get("budget_tokens")


def read_metadata(body):
    if not has_value(body, "metadata"):
        return
    metadata = body["metadata"]
    if not isinstance(metadata, dict):
        raise APIError("metadata must be an object", "metadata")
    extra = sorted(key for key in metadata if key != "user_id" and metadata[key] is not None)
    if extra:
        raise APIError(f"metadata.{extra[0]} is not supported by this server (metadata takes user_id)", "metadata")
    if has_value(metadata, "user_id") and not isinstance(metadata["user_id"], str):
        raise APIError("metadata.user_id must be a string", "metadata")


def to_chat(body, chat_template, count=False):
    """(chat completion body, origins) of a Messages request body (`count`: a count_tokens body, no max_tokens)."""
    max_tokens = None
    if not count:
        if not has_value(body, "max_tokens"):
            raise APIError("max_tokens is required", "max_tokens")
        max_tokens = number(body, "max_tokens", None, 1, None, integer=True)
    system = read_system(body)
    messages, origins = read_messages(body, system)
    tools = read_tools(body)
    tool_choice, parallel = read_tool_choice(body, tools)
    variables, budget = read_thinking(body, chat_template, max_tokens)
    chat = {"messages": messages}
    if tools is not None:
        chat["tools"] = tools
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    if "reasoning_effort" in variables:  # a field of its own in a chat request
        chat["reasoning_effort"] = variables.pop("reasoning_effort")
    if variables:
        chat["chat_template_kwargs"] = variables
    if count:
        return chat, origins
    read_metadata(body)
    if budget is not None:
        chat["thinking_token_budget"] = budget
    chat["max_tokens"] = max_tokens
    if has_value(body, "stop_sequences"):
        stops = body["stop_sequences"]
        if not isinstance(stops, list) or not all(isinstance(stop, str) and stop for stop in stops):
            raise APIError("stop_sequences must be a list of non-empty strings", "stop_sequences")
        if stops:
            chat["stop"] = stops
    chat["temperature"] = number(body, "temperature", 1.0, 0, 1)  # Anthropic's range, and its default
    if has_value(body, "top_k"):
        number(body, "top_k", None, 1, None, integer=True)  # Anthropic's: at least 1 (chat's 0 and -1 are off)
    for name in ("top_p", "top_k"):  # checked by the chat path, under the same names
        if has_value(body, name):
            chat[name] = body[name]
    if has_value(body, "stream"):
        chat["stream"] = body["stream"]
        if body["stream"] is True:
            chat["stream_options"] = {"include_usage": True}
    return chat, origins


def prompt_ids(service, chat, **encoding):
    """The token ids of a chat body's prompt as run_chat runs on it; `encoding`: encode_prompt's keyword options."""
    return openai_api.counted_prompt(service, chat, **encoding)


# The answer


def message_id(chat_id):
    return "msg_" + chat_id.split("-", 1)[-1]


def tool_use_id(call_id):
    return "toolu_" + call_id.removeprefix("call_")


def signature(thinking):
    """A thinking block's signature: opaque to the client; here the SHA-256 of its text (nothing checks it)."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def stop_reason(finish_reason, stop):
    if finish_reason == "abort":
        raise APIError("the server shut down before the reply ended", status=503, kind="server_error")
    if stop is not None:  # a stop sequence ended it (after complete calls, too)
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason, "end_turn")


def arguments_input(arguments):
    """A call's arguments (a JSON string) as the tool_use block's input ({} for a call max_tokens cut). A number past
    a double's range (a grammar lets a model write 1e999) is its text: no JSON answer could hold it as a number."""
    def number(text):
        value = float(text)
        return value if math.isfinite(value) else text

    try:
        value = json.loads(arguments, parse_float=number, parse_constant=str)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def message_of(result, model):
    """A chat completion (run_chat's dict) as a Messages answer."""
    choice = result["choices"][0]
    reply = choice["message"]
    content = []
    if reply.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": reply["reasoning_content"],
                        "signature": signature(reply["reasoning_content"])})
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                        "input": arguments_input(call["function"]["arguments"])})
    return {"id": message_id(result["id"]), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason(choice["finish_reason"], choice.get("stop_reason")),
            "stop_sequence": choice.get("stop_reason"),
            "usage": {"input_tokens": result["usage"]["prompt_tokens"],
                      "output_tokens": result["usage"]["completion_tokens"]}}


def sse(event, data):
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


class Events:
    """Anthropic's stream events of a chat stream's chunks: message_start, each block's start, deltas and stop,
    message_delta and message_stop; an error event where a step failed."""

    def __init__(self, model, input_tokens):
        self.model, self.input_tokens = model, input_tokens
        self.blocks = -1  # the index of the last block opened
        self.open = None  # the kind of the open block ("text", "thinking", "tool_use"), or None
        self.thinking = ""
        self.finish = None

    def start(self, chunk):
        message = {"id": message_id(chunk["id"]), "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return [sse("message_start", {"type": "message_start", "message": message})]

    def block(self, kind, content_block):
        events = self.close()
        self.blocks += 1
        self.open = kind
        events.append(sse("content_block_start", {"type": "content_block_start", "index": self.blocks,
                                                  "content_block": content_block}))
        return events

    def close(self):
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(self.delta({"type": "signature_delta", "signature": signature(self.thinking)}))
            self.thinking = ""
        self.open = None
        events.append(sse("content_block_stop", {"type": "content_block_stop", "index": self.blocks}))
        return events

    def delta(self, delta):
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.blocks, "delta": delta})

    def chunk(self, chunk):
        """The events of one chat chunk."""
        events = []
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                if self.open != "thinking":
                    events += self.block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self.thinking += delta["reasoning_content"]
                events.append(self.delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                if self.open != "text":
                    events += self.block("text", {"type": "text", "text": ""})
                events.append(self.delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                if call.get("id") is not None:  # a call's first delta: its id and name
                    events += self.block("tool_use", {"type": "tool_use", "id": tool_use_id(call["id"]),
                                                      "name": call["function"]["name"], "input": {}})
                if call["function"].get("arguments"):
                    events.append(self.delta({"type": "input_json_delta",
                                              "partial_json": call["function"]["arguments"]}))
            if choice.get("finish_reason") is not None:
                events += self.close()
                self.finish = (choice["finish_reason"], choice.get("stop_reason"))
        if chunk.get("usage") is not None and self.finish is not None:
            reason = stop_reason(*self.finish)
            usage = {"input_tokens": chunk["usage"]["prompt_tokens"],
                     "output_tokens": chunk["usage"]["completion_tokens"]}
            events.append(sse("message_delta", {"type": "message_delta",
                                                "delta": {"stop_reason": reason, "stop_sequence": self.finish[1]},
                                                "usage": usage}))
            events.append(sse("message_stop", {"type": "message_stop"}))
        return events


async def stream(chunks, model, input_tokens):
    """The server-sent events of a Messages stream, from run_chat's chunks."""
    events = Events(model, input_tokens)
    started = False
    try:
        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"]
                yield error_event(APIError(error["message"], status=500, kind=error.get("type", "server_error")))
                return
            for event in ([] if started else events.start(chunk)) + events.chunk(chunk):
                yield event
            started = True
    except APIError as error:  # the server shut down before the reply ended
        yield error_event(error)
    finally:
        await chunks.aclose()


# The routes


async def create(service, http_request, body):
    """POST /v1/messages (its fields and model checked)."""
    model = body["model"]
    chat, origins = to_chat(body, service.loaded.tokenizer.chat_template)
    with renamed(origins):
        # message_start comes before the answer's usage: the prompt is counted here.
        input_tokens = len(prompt_ids(service, chat)) if chat.get("stream") is True else None
        result = await openai_api.run_chat(service, http_request, chat)
        if result is None:
            return PlainTextResponse("", status_code=499)  # the client went away
        if isinstance(result, dict):
            return message_of(result, model)
    return StreamingResponse(stream(result, model, input_tokens), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def count_tokens(service, body):
    """POST /v1/messages/count_tokens: the prompt's tokens as the same request would prefill them."""
    chat, origins = to_chat(body, service.loaded.tokenizer.chat_template, count=True)
    with renamed(origins):  # a prompt past the context is counted, not refused: counting is how a client knows
        return {"input_tokens": len(prompt_ids(service, chat, within_context=False))}
