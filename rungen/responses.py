"""POST /v1/responses: OpenAI's Responses API over the chat path (docs/server.md#post-v1responses).

A request is translated into a chat completion body for rungen/openai_api.py's run_chat, and its answer or stream
back into a response object or the Responses stream's events, errors under the Responses field names. Responses are
kept in a bounded in-memory store for `previous_response_id`.
"""

import base64
import copy
import json
import re
import time
import uuid

from fastapi.responses import StreamingResponse

from . import logger
from .conversation import PART_SEPARATOR
from .openai_api import APIError, boolean, excerpt, has_value, refuse_extra, respond, run_chat
from .openai_api import number as read_number
from .response_store import Stored, check_query, listed, store_of, stored_or_404

MAX_METADATA_PAIRS = 16  # OpenAI's limits on metadata: 16 pairs, keys of 64 characters, values of 512
ROLES = {"user", "system", "developer", "assistant"}
MESSAGE_KEYS = {"type", "role", "content", "id", "status"}
PART_KEYS = {"type", "text", "annotations", "logprobs"}
TEXT_PARTS = ("input_text", "output_text")
ITEM_KEYS = {
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    # Its text is the next assistant turn's reasoning_content: the chat template keeps it or leaves it out.
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}
TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
SUMMARIES = ("auto", "concise", "detailed")
LOGPROBS = "message.output_text.logprobs"
# A reasoning item's text for a client that keeps no store (store: false) to give back: not encrypted, encoded.
ENCRYPTED = "reasoning.encrypted_content"
SEALED = "rungen1."
# The chat path's field names, as the Responses request names them.
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
          "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def retrieve(service, response_id, query):
    """GET /v1/responses/{id}: a stored response (a stream of its events is not kept: stream=true is refused)."""
    check_query(query, ("include",))
    include = query.getlist("include")
    if include:
        read_include({"include": include})
    return stored_or_404(service, response_id).response


# The request


class Plan:
    """A Responses request read: the chat body to run, and what the response echoes and stores."""

    def __init__(self, service, body):
        self.service, self.body = service, body
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        # Each chat message's place in the request, and each of its tool calls', for error messages.
        self.origins, self.call_origins = [], {}
        self.stream = boolean(body, "stream")
        self.store = boolean(body, "store", True)
        self.summary = False
        self.history = []
        self.chat = self.read()

    def read(self):
        body = self.body
        include = read_include(body)
        self.logprobs = LOGPROBS in include or has_value(body, "top_logprobs")
        self.encrypted = ENCRYPTED in include
        # At their defaults only: a prompt past the context is refused, never cut; requests run in the foreground.
        for name, default in (("truncation", "disabled"), ("background", False)):
            if has_value(body, name) and not (type(body[name]) is type(default) and body[name] == default):
                raise APIError(f"{name} {excerpt(body[name])} is not supported by this server", name)
        for name in ("user", "safety_identifier", "prompt_cache_key"):  # the prefix cache needs no key
            if has_value(body, name) and not isinstance(body[name], str):
                raise APIError(f"{name} must be a string, got {excerpt(body[name])}", name)
        self.metadata = read_metadata(body)
        if has_value(body, "previous_response_id"):
            previous = body["previous_response_id"]
            if not isinstance(previous, str):
                raise APIError(f"previous_response_id must be a string, got {excerpt(previous)}",
                               "previous_response_id")
            found = store_of(self.service).get(previous)
            if found is None:
                raise APIError(f"Previous response with id {excerpt(previous)} not found.", "previous_response_id",
                               status=404, code="previous_response_not_found")
            self.history = found.items
        self.input = read_input(body)
        messages = []
        if has_value(body, "instructions"):
            if not isinstance(body["instructions"], str):
                raise APIError("instructions must be a string", "instructions")
            messages.append({"role": "system", "content": body["instructions"]})
            self.origins.append("instructions")
        messages += self.messages_of(self.history, "the previous response's items")
        messages += self.messages_of(self.input, "input")
        if not messages:
            raise APIError("input must be a string or a non-empty list of items", "input")
        chat = {"model": body["model"], "messages": messages}
        tools = read_tools(body)
        if tools:
            chat["tools"] = tools
        boolean(body, "parallel_tool_calls")
        for name in ("tool_choice", "parallel_tool_calls"):
            # Without tools, "auto", "none" and parallel_tool_calls change nothing (the chat path refuses the rest)
            idle = name == "parallel_tool_calls" or body.get(name) in ("auto", "none")
            if has_value(body, name) and (tools or not idle):
                chat[name] = tool_choice(body[name]) if name == "tool_choice" else body[name]
        read_number(body, "max_output_tokens", None, 1, None, integer=True)
        for name, chat_name in (("temperature", "temperature"), ("top_p", "top_p"), ("user", "user"),
                                ("max_output_tokens", "max_tokens")):
            if has_value(body, name):
                chat[chat_name] = body[name]
        response_format = read_text(body)
        if response_format is not None:
            chat["response_format"] = response_format
        effort = self.read_reasoning(body)
        if effort is not None:
            chat["reasoning_effort"] = effort
        if self.logprobs:
            self.check_logprobs(chat)
            chat["logprobs"] = True
            chat["top_logprobs"] = given(body, "top_logprobs", 0)
        if self.stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        return chat

    def check_logprobs(self, chat):
        """Log-probabilities go with the message's text: a reply that may hold calls, or a thinking model's block,
        would mix their tokens in."""
        name = "include" if self.body.get("include") else "top_logprobs"
        if chat.get("tools") and chat.get("tool_choice") != "none":
            raise APIError(f"{name}: log-probabilities with tools are not supported by this server", name)
        if self.service.delimiters is not None:
            raise APIError(f"{name}: log-probabilities of a thinking model's reply are not supported by this "
                           "server", name)

    def read_reasoning(self, body):
        if not has_value(body, "reasoning"):
            return None
        reasoning = body["reasoning"]
        if not isinstance(reasoning, dict):
            raise APIError("reasoning must be an object: {\"effort\", \"summary\"}", "reasoning")
        refuse_extra(reasoning, ("effort", "summary"), "reasoning", "reasoning")
        summary = reasoning.get("summary")
        if summary is not None and summary not in SUMMARIES:
            raise APIError(f"reasoning.summary must be one of {', '.join(SUMMARIES)}, got {excerpt(summary)}",
                           "reasoning")
        self.summary = summary is not None
        return reasoning.get("effort")

    def messages_of(self, items, label):
        """Chat messages of Responses items: function calls as the tool_calls of the assistant message before them
        (or their own), outputs as tool messages, a reasoning item as the reasoning_content of the assistant
        turn after it (as the chat request carries it back; the template decides whether the prompt shows it)."""
        messages, reasoning = [], None
        for number, item in enumerate(items):
            kind = item.get("type", "message")
            where = f"input[{number}]" if label == "input" else label
            if kind == "reasoning":
                reasoning = reasoning_text(item)
                continue
            joined = False  # a call joining the assistant message before it, which has its origin already
            if kind == "message":
                messages.append({"role": item["role"], "content": item_text(item, "")})
            elif kind == "function_call":
                arguments = item["arguments"]
                if item.get("status") == "incomplete" and not whole_json(arguments):
                    arguments = "{}"  # a call max_output_tokens cut: given back as called with nothing, as Messages'
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": arguments}}
                joined = bool(messages) and messages[-1]["role"] == "assistant"
                if joined:
                    messages[-1].setdefault("tool_calls", []).append(call)
                    self.call_origins.setdefault(len(self.origins) - 1, []).append(where)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                    self.call_origins[len(self.origins)] = [where]
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            if reasoning and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("reasoning_content", reasoning)
            reasoning = None
            if not joined:
                self.origins.append(where)
        return messages

    def error(self, error):
        """An APIError of the chat path under the Responses names (fields, and messages[i] as the item)."""
        param = PARAMS.get(error.param, error.param)
        first = re.search(r"messages\[(\d+)\]", error.message)
        if param == "input" and first and self.origin(int(first.group(1))) == "instructions":
            param = "instructions"
        text = re.sub(r"messages\[(\d+)\]\.tool_calls\[(\d+)\](\.function)?", lambda found: self.call_origin(
            int(found.group(1)), int(found.group(2))), error.message)
        text = re.sub(r"messages\[(\d+)\]", lambda found: self.origin(int(found.group(1))), text)
        for chat_name in ("max_tokens", "max_completion_tokens", "response_format"):
            text = re.sub(rf"\b{chat_name}\b", PARAMS[chat_name], text)
        text = text.replace("text.format.json_schema.", "text.format.")  # the schema sits in the format itself
        if param == "text.format":  # the constraint's compiler names the command line's flag
            text = re.sub(r"^--json_schema: ", "text.format.schema: ", text)
        if param == "input":
            text = text.replace("tool_call_id", "call_id").replace(".tool_calls:", ": function_call") \
                .replace("tool message", "function_call_output")
        # The field, not the template's variable of that name ("... does not read reasoning_effort")
        text = re.sub(r"^reasoning_effort\b", "reasoning.effort", text)
        if param == "tools":
            text = text.replace(".function.", ".").replace('{"type": "function", "function": {...}}',
                                                           '{"type": "function", "name": ...}')
        if param == "tool_choice":
            text = text.replace('"function": {"name": ...}}', '"name": ...}')
        return APIError(text, param, status=error.status, kind=error.kind, code=error.code, headers=error.headers)

    def origin(self, number):
        return self.origins[number] if number < len(self.origins) else f"input (message {number})"

    def call_origin(self, number, call):
        calls = self.call_origins.get(number, [])
        return calls[call] if call < len(calls) else f"{self.origin(number)} (call {call})"

    # The response

    def response(self, status, output, usage, error=None):
        body = self.body
        text = {"format": body["text"]["format"]} if has_value(body, "text") and has_value(body["text"], "format") \
            else {"format": {"type": "text"}}
        reasoning = body.get("reasoning") or {}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": read_number(body, "max_output_tokens", None, integer=True),  # 8.0 is 8
            "metadata": self.metadata, "model": self.service.options.model_id, "output": output,
            "parallel_tool_calls": boolean(body, "parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": self.store, "temperature": given(body, "temperature", 1.0), "text": text,
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "top_p": given(body, "top_p", 1.0), "top_logprobs": body.get("top_logprobs"), "truncation": "disabled",
            "usage": usage, "user": body.get("user"),
            **({"completed_at": int(time.time())} if status == "completed" else {}),
        }

    def usage(self, chat_usage, output):
        reasoning = "".join(part["text"] for item in output if item["type"] == "reasoning"
                            for part in item["content"])
        reasoning_tokens = 0
        if reasoning:
            with self.service.tokenizer_lock:
                reasoning_tokens = len(self.service.loaded.tokenizer.encode(reasoning, add_special_tokens=False))
        prompt, completion = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
        cached = chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, completion)},
                "total_tokens": prompt + completion}

    def keep(self, response):
        """Stores a finished response (with store: true) for a later previous_response_id and GET."""
        if self.store and response["status"] in ("completed", "incomplete"):
            store_of(self.service).put(self.id, Stored(response, [listed(item) for item in self.input],
                                                       self.history + self.input + list(response["output"])))


def given(body, name, default):
    return body[name] if has_value(body, name) else default


def read_include(body):
    """The optional outputs include asks for: the message's log-probabilities, reasoning items' encrypted_content."""
    if not has_value(body, "include"):
        return set()
    include = body["include"]
    if not isinstance(include, list) or not all(isinstance(value, str) for value in include):
        raise APIError("include must be a list of strings", "include")
    other = [value for value in include if value not in (LOGPROBS, ENCRYPTED)]
    if other:
        raise APIError(f"include {excerpt(other[0])} is not supported: this server produces {LOGPROBS} and "
                       f"{ENCRYPTED}", "include")
    return set(include)


def seal(text):
    """A reasoning item's encrypted_content: its text, base64-encoded behind a mark (opaque to the client)."""
    return SEALED + base64.urlsafe_b64encode(text.encode()).decode()


def unseal(content):
    """The text of encrypted_content this server made, else None (another server's cannot be read)."""
    if not isinstance(content, str) or not content.startswith(SEALED):
        return None
    try:
        return base64.urlsafe_b64decode(content[len(SEALED):].encode()).decode()
    except (ValueError, UnicodeDecodeError):
        return None


def read_metadata(body):
    if not has_value(body, "metadata"):
        return {}
    metadata = body["metadata"]
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS or not all(
            len(key) <= 64 and isinstance(value, str) and len(value) <= 512 for key, value in metadata.items()):
        raise APIError(f"metadata must be an object of at most {MAX_METADATA_PAIRS} string values (keys up to 64 "
                       "characters, values up to 512)", "metadata")
    return metadata


def read_input(body):
    """The request's input as a list of items, checked (a string is one user message)."""
    if not has_value(body, "input"):
        return []
    given = body["input"]
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    if not isinstance(given, list):
        raise APIError("input must be a string or a list of items", "input")
    for number, item in enumerate(given):
        where = f"input[{number}]"
        if not isinstance(item, dict):
            raise APIError(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise APIError(f"{where}.type must be a string, got {excerpt(kind)}", "input")
        if kind == "message":
            keys = MESSAGE_KEYS
            if not isinstance(item.get("role"), str) or item["role"] not in ROLES:
                raise APIError(f"{where}.role {excerpt(item.get('role'))} is not supported (roles: "
                               f"{', '.join(sorted(ROLES))})", "input")
            item_text(item, where)
        elif kind in ITEM_KEYS:
            keys = ITEM_KEYS[kind]
            for name in ("call_id", "name", "arguments") if kind == "function_call" else \
                    ("call_id",) if kind == "function_call_output" else ():
                if not isinstance(item.get(name), str) or (name != "arguments" and not item[name]):
                    raise APIError(f"{where}.{name} must be a {'' if name == 'arguments' else 'non-empty '}string",
                                   "input")
            if kind == "function_call_output":
                item_text({"content": item.get("output")}, f"{where}.output")
            if kind == "reasoning":
                reasoning_text(item, where)
        else:
            raise APIError(f"{where}: items of type {excerpt(kind)} are not supported (message, function_call, "
                           "function_call_output, reasoning)", "input")
        refuse_extra(item, keys, where, "input")
    return [dict(item, output=item_text({"content": item["output"]}, ""))
            if item.get("type") == "function_call_output" else item for item in given]


def reasoning_text(item, where=""):
    """A reasoning item's text: its reasoning_text parts, else its summary's summary_text parts, joined."""
    texts = {}
    for field, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(field)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(
                isinstance(part, dict) and part.get("type") == part_type and isinstance(part.get("text"), str)
                and set(part) <= {"type", "text"} for part in parts):
            raise APIError(f'{where}.{field} must be a list of {{"type": "{part_type}", "text"}} parts', "input")
        texts[field] = PART_SEPARATOR.join(part["text"] for part in parts)
    return texts.get("content") or texts.get("summary") or unseal(item.get("encrypted_content")) or ""


def item_text(item, where):
    """A message's (or a function call output's) text: a string or a list of text parts."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for number, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS \
                    or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(f"{where}.content[{number}]: only input_text and output_text parts are supported, "
                               f"got {excerpt(kind)}", "input")
            refuse_extra(part, PART_KEYS, f"{where}.content[{number}]", "input")
            texts.append(part["text"])
        return PART_SEPARATOR.join(texts)
    raise APIError(f"{where}.content must be a string or a list of text parts", "input")


def read_tools(body):
    """Responses' function tools ({"type": "function", "name", ...}) in the chat shape; the chat path checks
    the rest (names, schemas)."""
    if not has_value(body, "tools"):
        return None
    tools = body["tools"]
    if not isinstance(tools, list):
        raise APIError("tools must be a list of function tools", "tools")
    converted = []
    for number, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise APIError(f"tools[{number}]: only function tools are supported, got type {excerpt(kind)}", "tools")
        refuse_extra(tool, TOOL_KEYS, f"tools[{number}]", "tools")
        converted.append({"type": "function", "function": {key: value for key, value in tool.items()
                                                           if key != "type" and value is not None}})
    return converted


def tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        if set(choice) - {"type", "name"}:
            raise APIError('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                           "tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) or choice not in ("auto", "none", "required"):
        raise APIError('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                       "tool_choice")
    return choice


def read_text(body):
    """text.format as the chat path's response_format (None: plain text)."""
    if not has_value(body, "text"):
        return None
    text = body["text"]
    if not isinstance(text, dict):
        raise APIError("text must be an object: {\"format\": ...}", "text")
    refuse_extra(text, ("format",), "text", "text")
    if not has_value(text, "format"):
        return None
    fmt = text["format"]
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return {"type": "json_object"}
    if kind == "json_schema":
        refuse_extra(fmt, ("type", "name", "schema", "strict", "description"), "text.format", "text.format")
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise APIError("text.format.name must be a non-empty string", "text.format")
        if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
            raise APIError("text.format.strict must be true or false", "text.format")
        return {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": fmt.get("schema")}}
    raise APIError('text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                   '"name", "schema"}', "text.format")


# The answer


class Output:
    """The response's output items, built from the chat path's reply a piece at a time; each method gives the
    stream events of what it adds. A plain reply goes through the same pieces, so the two agree."""

    def __init__(self, plan):
        self.plan, self.items, self.open, self.calls = plan, [], None, {}
        self.sequence = 0
        self.pending = []  # log-probabilities of tokens whose text the chat path holds back yet

    def event(self, kind, **fields):
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self, item):
        self.items.append(item)
        self.open = item
        # A copy as it is now: the item's parts and text grow before the event is sent.
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))]

    def where(self):
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def reasoning(self, text):
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self.close()
            events += self.start({"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "summary": [],
                                  "content": [], "status": "in_progress"})
            self.open["content"].append({"type": "reasoning_text", "text": ""})
            events.append(self.event("response.content_part.added", **self.where(), content_index=0,
                                     part={"type": "reasoning_text", "text": ""}))
            if self.plan.summary:
                self.open["summary"].append({"type": "summary_text", "text": ""})
                events.append(self.event("response.reasoning_summary_part.added", **self.where(), summary_index=0,
                                         part={"type": "summary_text", "text": ""}))
        self.open["content"][0]["text"] += text
        events.append(self.event("response.reasoning_text.delta", **self.where(), content_index=0, delta=text))
        if self.plan.summary:
            self.open["summary"][0]["text"] += text
            events.append(self.event("response.reasoning_summary_text.delta", **self.where(), summary_index=0,
                                     delta=text))
        return events

    def text(self, text, logprobs=()):
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self.close()
            events += self.start({"id": "msg_" + uuid.uuid4().hex, "type": "message", "status": "in_progress",
                                  "role": "assistant", "content": []})
            self.open["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            events.append(self.event("response.content_part.added", **self.where(), content_index=0,
                                     part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        items, self.pending = self.pending + list(logprobs), []
        self.open["content"][0]["text"] += text
        self.open["content"][0]["logprobs"] += items
        events.append(self.event("response.output_text.delta", **self.where(), content_index=0, delta=text,
                                 logprobs=delta_logprobs(items)))
        return events

    def call(self, delta):
        """A chat stream's tool call delta: a new call ({"index", "id", "function": {"name"}}) or arguments."""
        events = []
        index, function = delta.get("index", 0), delta.get("function") or {}
        if index not in self.calls:
            events += self.close()
            events += self.start({"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "status": "in_progress",
                                  "call_id": delta["id"], "name": function.get("name", ""), "arguments": ""})
            self.calls[index] = self.open
        if function.get("arguments"):
            item = self.calls[index]
            item["arguments"] += function["arguments"]
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.items.index(item), delta=function["arguments"]))
        return events

    def close(self, status="completed"):
        """The open item's closing events."""
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        events = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            events.append(self.event("response.content_part.done", **where, content_index=0,
                                     part=dict(item["content"][0])))
            if item["summary"]:
                events.append(self.event("response.reasoning_summary_text.done", **where, summary_index=0, text=text))
                events.append(self.event("response.reasoning_summary_part.done", **where, summary_index=0,
                                         part=dict(item["summary"][0])))
            if self.plan.encrypted:
                item["encrypted_content"] = seal(text)
        elif item["type"] == "message":
            part = item["content"][0]
            if self.pending:  # tokens that added no text (the end of text): a delta of their own, as the done has them
                part["logprobs"] += self.pending
                events.append(self.event("response.output_text.delta", **where, content_index=0, delta="",
                                         logprobs=delta_logprobs(self.pending)))
                self.pending = []
            events.append(self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                     logprobs=delta_logprobs(part["logprobs"])))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=dict(part)))
        else:
            events.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                     arguments=item["arguments"]))
            if status == "incomplete" and whole_json(item["arguments"]):
                status = "completed"  # the reply was cut after this call ended (a call it cut was left out)
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=dict(item)))
        return events

    def chunk(self, chunk):
        """The events of one chat.completion.chunk (n is 1)."""
        events = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            if delta.get("reasoning_content"):
                events += self.reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += self.text(delta["content"], logprobs)
            else:
                self.pending += logprobs
            for call in delta.get("tool_calls") or []:
                events += self.call(call)
        return events

    def message(self, message, logprobs=None):
        """A plain reply's message (and its tokens' log-probabilities), through the same pieces as a stream's."""
        if message.get("reasoning_content"):
            self.reasoning(message["reasoning_content"])
        content = message.get("content")
        if content or (content is not None and not message.get("tool_calls")):
            self.text(content, logprobs or ())
        for index, call in enumerate(message.get("tool_calls") or []):
            self.call({"index": index, "id": call["id"], "function": call["function"]})


def whole_json(text):
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def delta_logprobs(items):
    """The chat path's log-probability items as a stream event carries them (without bytes)."""
    return [{"token": item["token"], "logprob": item["logprob"],
             "top_logprobs": [{"token": top["token"], "logprob": top["logprob"]} for top in item["top_logprobs"]]}
            for item in items]


def status_of(finish_reason):
    return {"stop": "completed", "tool_calls": "completed", "grammar": "completed", "stop_token": "completed",
            "length": "incomplete"}.get(finish_reason, "failed")


FAILED = {"code": "server_error", "message": "the server stopped before the response finished"}


async def create_response(service, http_request, body):
    """A /v1/responses request: the response object, a stream of its events, or 499 when the client went away."""
    plan = Plan(service, body)
    try:
        result = await run_chat(service, http_request, plan.chat)
    except APIError as error:
        raise plan.error(error) from None
    if result is None or isinstance(result, dict):
        if result is None:
            return respond(None)
        choice = result["choices"][0]
        output = Output(plan)
        output.message(choice["message"], (choice.get("logprobs") or {}).get("content"))
        status = status_of(choice["finish_reason"])
        output.close("completed" if status == "completed" else "incomplete")  # failed: the item was cut short
        response = plan.response(status, output.items, plan.usage(result["usage"], output.items),
                                 FAILED if status == "failed" else None)
        plan.keep(response)
        return response
    return StreamingResponse(sse(events(plan, result)), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def events(plan, chunks):
    """The Responses stream of a chat stream's chunks: created, in_progress, each item's events, and the response
    completed, incomplete or failed."""
    output = Output(plan)
    started = plan.response("in_progress", [], None)
    yield output.event("response.created", response=started)
    yield output.event("response.in_progress", response=started)
    finish, usage, error = None, None, None
    try:
        async for chunk in chunks:
            if "error" in chunk:
                error = {"code": "server_error", "message": chunk["error"]["message"]}
                yield output.event("error", code="server_error", message=error["message"], param=None)
                continue
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
            for event in output.chunk(chunk):
                yield event
    except Exception as failure:  # a bug: the stream still ends as a Responses stream does, failed
        logger.exception("a /v1/responses stream failed")
        error = {"code": "server_error", "message": f"internal error: {type(failure).__name__}: {failure}"}
        yield output.event("error", code="server_error", message=error["message"], param=None)
    finally:
        await chunks.aclose()
    status = "failed" if error else status_of(finish)
    if status == "failed" and error is None:  # ended by the server (shutdown): the error event comes first
        error = dict(FAILED)
        yield output.event("error", code=error["code"], message=error["message"], param=None)
    if not output.items and status != "failed":  # an empty reply: an empty message, as a plain reply has
        for event in output.text(""):
            yield event
    for event in output.close("completed" if status == "completed" else "incomplete"):
        yield event
    usage = plan.usage(usage, output.items) if usage else None
    response = plan.response(status, output.items, usage, error or (FAILED if status == "failed" else None))
    plan.keep(response)
    yield output.event(f"response.{status}", response=response)


async def sse(events):
    """Server-sent events as OpenAI sends a Responses stream: an event line naming each, no [DONE]."""
    async for event in events:
        yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
