"""The OpenAI API's chat and completions requests, below the server's routes (rungen/server.py): reading and checking
a request's fields (APIError, the readers), the Service the routes share, generate() over the engine, and the
Answer that builds a response or its stream of chunks. run_chat is the one path of chat requests; the other APIs'
translators (rungen/messages.py, rungen/responses.py) run on it."""

import asyncio
import codecs
import dataclasses
import functools
import json
import re
import time
import uuid

from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from .conversation import MessageError, read_conversation
from .engine import EngineBusy, EngineClosed
from .errors import PromptError
from .logprobs import score_prompts, token_texts
from .prompts import Prompt, encode_prompt
from .reasoning import VariableError, detect_delimiters, plan_reply, read_template_variables, reply_budget, split_reply
from .requests import Delta, Done, End
from .requests import Request as EngineRequest
from .sampling import Sampling
from .tool_reply import message_of, stream_deltas
from .tools import ToolError, plan_tools

MAX_LOGPROBS = 20
MAX_STOPS = 16
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
# Fields that name the same constraint in vLLM (guided_*, structured_outputs) and llama-server (grammar,
# json_schema); each maps to rungen/constrain.py's kind.
CONSTRAINT_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar",
                     "grammar": "grammar", "json_schema": "json_schema"}
STRUCTURED_OUTPUT_KEYS = {"json": "json_schema", "regex": "regex", "grammar": "grammar"}
COMMON_FIELDS = {"model", "max_tokens", "n", "stop", "stream", "stream_options", "temperature", "top_p", "seed",
                 "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k", "min_p",
                 "repetition_penalty", "ignore_eos", "structured_outputs", *CONSTRAINT_FIELDS}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                               "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                               "reasoning_effort", "thinking_token_budget", "store", "safety_identifier",
                               "prompt_cache_key"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "logprobs", "best_of", "suffix"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message, param=None, status=400, kind="invalid_request_error", code=None, headers=None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code
        self.headers = headers

    def response(self):
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def has_value(body, name):
    """A field counts as given unless absent or null (OpenAI reads null as the default)."""
    return body.get(name) is not None


def number(body, name, default, low=None, high=None, integer=False, low_open=False):
    if not has_value(body, name):
        return default
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and value != int(value)):
        raise APIError(f"{name} must be {'an integer' if integer else 'a number'}, got {excerpt(value)}", name)
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high) or abs(value) > 2**64:  # 2**64: past a float's reach too
        bounds = f"{'(' if low_open else '['}{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise APIError(f"{name} must be in {bounds}, got {excerpt(value)}", name)
    return int(value) if integer else float(value)


def excerpt(value, limit=60):
    """A request's value in an error message, cut short."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def boolean(body, name, default=False, where=""):
    """body[name], a JSON boolean, or `default`; a 400 naming `where` + name (the field's path in the request)."""
    if not has_value(body, name):
        return default
    if not isinstance(body[name], bool):
        raise APIError(f"{where}{name} must be true or false, got {excerpt(body[name])}", where + name)
    return body[name]


def read_stop(body):
    if not has_value(body, "stop"):
        return ()
    stop = body["stop"]
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOPS:
        raise APIError(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    return tuple(stops)


def read_logit_bias(body, vocab_size):
    if not has_value(body, "logit_bias"):
        return ()
    bias = body["logit_bias"]
    if not isinstance(bias, dict):
        raise APIError("logit_bias must be an object mapping token ids to values in [-100, 100]", "logit_bias")
    pairs = []
    for key, value in bias.items():
        if not (isinstance(key, str) and re.fullmatch(r"[0-9]{1,12}", key) and int(key) < vocab_size):
            raise APIError(f"logit_bias: {excerpt(key)} is not a token id of this model (0..{vocab_size - 1})",
                           "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise APIError(f"logit_bias[{key}] must be a number in [-100, 100], got {excerpt(value)}", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def read_sampling(body, vocab_size):
    top_k = number(body, "top_k", 0, -1, None, integer=True)
    return Sampling(
        temperature=number(body, "temperature", 1.0, 0, 2),
        top_p=number(body, "top_p", 1.0, 0, 1, low_open=True),
        top_k=max(top_k, 0),  # vLLM's -1 is off, as 0 is
        min_p=number(body, "min_p", 0.0, 0, 1),
        presence_penalty=number(body, "presence_penalty", 0.0, -2, 2),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -2, 2),
        repetition_penalty=number(body, "repetition_penalty", 1.0, 0, None, low_open=True),
        logit_bias=read_logit_bias(body, vocab_size),
        seed=number(body, "seed", None, *SEED_RANGE, integer=True),
        ignore_eos=boolean(body, "ignore_eos"),
    )


def read_constraint_source(body, response_format_allowed):
    """(kind, source, param) of the request's one constraint, or None."""
    found = []
    for name, kind in CONSTRAINT_FIELDS.items():
        if has_value(body, name):
            value = body[name]
            if kind == "json_schema" and isinstance(value, (dict, bool)):
                value = json.dumps(value)
            if not isinstance(value, str) or not value.strip():
                raise APIError(f"{name} must be a non-empty {'schema' if kind == 'json_schema' else 'string'}", name)
            found.append((kind, value, name))
    if has_value(body, "structured_outputs"):
        structured = body["structured_outputs"]
        if not isinstance(structured, dict) or set(structured) - set(STRUCTURED_OUTPUT_KEYS):
            raise APIError("structured_outputs takes one of json, regex, grammar", "structured_outputs")
        for key, kind in STRUCTURED_OUTPUT_KEYS.items():
            if structured.get(key) is not None:
                value = structured[key]
                value = json.dumps(value) if kind == "json_schema" and isinstance(value, (dict, bool)) else value
                if not isinstance(value, str):
                    raise APIError(f"structured_outputs.{key} must be a string", "structured_outputs")
                found.append((kind, value, "structured_outputs"))
    if response_format_allowed and has_value(body, "response_format"):
        response_format = body["response_format"]
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            found.append(("json_schema", '{"type": "object"}', "response_format"))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
                raise APIError("response_format.json_schema.schema must be a JSON schema", "response_format")
            found.append(("json_schema", json.dumps(spec["schema"]), "response_format"))
        elif kind != "text":
            raise APIError("response_format.type must be text, json_object or json_schema", "response_format")
    if len(found) > 1:
        raise APIError(f"one constraint per request; got {', '.join(param for _, _, param in found)}", found[1][2])
    return found[0] if found else None


def check_fields(body, allowed):
    for name in body:
        if name not in allowed and body[name] is not None:
            raise APIError(f"{name} is not supported by this server", name)


def refuse_extra(obj, allowed, where, param):
    """APIError naming the first field of `obj` (found at `where`) that is set and not in `allowed`."""
    extra = sorted(key for key in obj if key not in allowed and obj[key] is not None)
    if extra:
        raise APIError(f"{where}.{extra[0]} is not supported by this server", param)


def read_messages(body):
    try:
        return read_conversation(body.get("messages"))
    except MessageError as error:
        raise APIError(str(error), "messages") from error


@dataclasses.dataclass
class Job:
    """One engine request seen from the HTTP side: its events come through an asyncio queue."""

    request: object
    prompt_ids: list
    first_choice: int  # the choice index of its first row in the response


class Service:
    """The routes' shared state: the model, the engine, the options, compiled constraints."""

    def __init__(self, loaded, engine, options):
        self.loaded, self.engine, self.options = loaded, engine, options
        self.tokenizer_lock = engine.tokenizer_lock
        self.eos_ids = sorted(engine.eos_ids)
        self.constraints = {}  # (kind, source) -> Constraint (compiling costs tens of milliseconds)
        self.delimiters = detect_delimiters(loaded.tokenizer.chat_template)  # a thinking block's, or None
        self.created = int(time.time())

    def compile(self, kind, source, param, spelled=frozenset()):
        from .constrain import ConstraintError, compile_constraint

        key = (kind, source, spelled)
        if key not in self.constraints:
            try:
                with self.tokenizer_lock:
                    constraint = compile_constraint(kind, source, self.loaded.tokenizer, self.loaded.vocab_size,
                                                    self.eos_ids, spelled)
            except ConstraintError as error:
                raise APIError(str(error), param) from error
            if len(self.constraints) >= 64:
                self.constraints.pop(next(iter(self.constraints)))
            self.constraints[key] = constraint
        return self.constraints[key]

    def encode(self, prompt, param, tools=None, **encoding):
        """encode_prompt's ids (`encoding`: its keyword options), or a 400 naming `param`."""
        try:
            with self.tokenizer_lock:
                return encode_prompt(self.loaded, prompt, tools=tools, **encoding)
        except PromptError as error:
            raise APIError(str(error), param) from error

    def max_tokens(self, body, prompt_len, default, n, names):
        """max_tokens under the context and the cache bound, or a 400."""
        context = self.loaded.context
        given = [name for name in names if has_value(body, name)]
        room = self.engine.max_cache_tokens // n - prompt_len
        if given:
            value = number(body, given[0], None, 0, None, integer=True)
            if context and prompt_len + value > context:
                raise APIError(f"the prompt ({prompt_len} tokens) plus {given[0]} ({value}) exceeds the model's "
                               f"context of {context} tokens", given[0])
            if value > room:
                raise APIError(f"the prompt ({prompt_len} tokens) plus {given[0]} ({value}) for n={n} exceeds the "
                               f"server's cache bound of {self.engine.max_cache_tokens} tokens", given[0])
            return value
        if default is not None:  # a fixed default (completions' 16) is a request's length as if sent: never cut
            if context and prompt_len + default > context:
                raise APIError(f"the prompt ({prompt_len} tokens) plus {names[-1]}'s default ({default}) exceeds the "
                               f"model's context of {context} tokens; send a smaller {names[-1]}", names[-1])
            if default > room:
                raise APIError(f"the prompt ({prompt_len} tokens) plus {names[-1]}'s default ({default}) for n={n} "
                               f"exceeds the server's cache bound of {self.engine.max_cache_tokens} tokens; send a "
                               f"smaller {names[-1]}", names[-1])
            return default
        value = min(context - prompt_len, room) if context else room  # up to the context (chat's default)
        if value < 1:
            raise APIError(f"the prompt ({prompt_len} tokens) leaves no room to generate", names[-1])
        return value


def read_prompt_ids(service, body, name, most, room, allow_empty=True):
    """The token ids of each prompt in the field `name`: a string, a list of strings, a list of token ids, or a
    list of those; at most `most` prompts, each leaving `room` tokens of the context (1 to generate, 0 to embed);
    `allow_empty`: an empty string starts from the BOS token (else it is refused)."""
    prompt = body.get(name)
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise APIError(f"{name} must be a string, a list of strings, or token ids", name)
    if len(prompt) > most:
        raise APIError(f"at most {most} {name}s per request, got {len(prompt)}", name)
    if len({isinstance(item, str) for item in prompt}) > 1:  # OpenAI's schema: strings, or token id lists
        raise APIError(f"{name} mixes strings and token ids: send a list of one kind", name)
    context, encoded = service.loaded.context, []
    for place, item in enumerate(prompt):
        where = f"{name}[{place}]" if len(prompt) > 1 else name
        if isinstance(item, str):
            if not item and not allow_empty:
                raise APIError(f"{where} is an empty string", name)
            ids = service.encode(Prompt(0, item), name, within_context=False)
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            if not all(0 <= t < service.loaded.vocab_size for t in item):
                raise APIError(f"{where}: token ids must be in 0..{service.loaded.vocab_size - 1}", name)
            ids = list(item)
        else:
            raise APIError(f"{name} must be a string, a list of strings, or token ids", name)
        if context and len(ids) > context - room:  # never cut: the caller shortens it
            raise APIError(f"{where} is {len(ids)} tokens; the model's context is {context}", name)
        encoded.append(ids)
    return encoded


def chat_prompt(service, body, **encoding):
    """(token ids, rungen.tools.ToolPlan) of a chat request's messages and tools through the chat template
    (`encoding`: encode_prompt's keyword options)."""
    messages = read_messages(body)
    constraint_source = read_constraint_source(body, response_format_allowed=True)
    reply_schema = constraint_source[1] if constraint_source and constraint_source[0] == "json_schema" else None
    try:
        tools = plan_tools(body, messages, service.loaded.tokenizer.chat_template, reply_schema)
    except ToolError as error:
        raise APIError(str(error), error.param) from error
    last_user = [message["content"] for message in messages if message["role"] == "user"][-1:]
    ids = service.encode(Prompt(0, "".join(last_user), messages=tools.messages), "messages", tools.template_tools,
                         **encoding)
    return ids, tools


def counted_prompt(service, body, add_generation_prompt=True, **encoding):
    """The token ids of a chat body's prompt as a request runs on it (/tokenize's, count_tokens'): a constrained
    reply's thinking block opened as generate() opens it (rungen.reasoning.plan_reply)."""
    variables = template_variables(service, body)
    ids, tools = chat_prompt(service, body, add_generation_prompt=add_generation_prompt, template_kwargs=variables,
                             **encoding)
    constrained = tools.grammar is not None or read_constraint_source(body, response_format_allowed=True)
    if add_generation_prompt and constrained and service.delimiters is not None:
        with service.tokenizer_lock:
            ids, _ = plan_reply(service.loaded.tokenizer, service.delimiters, ids, True, tools.fmt is not None,
                                variables)
    return ids


def template_variables(service, body) -> dict:
    """The chat template's variables: --chat_template_kwargs', and over them those the body sets
    (chat_template_kwargs, reasoning_effort), or a 400."""
    try:
        return {**service.options.template_kwargs,
                **read_template_variables(body, service.loaded.tokenizer.chat_template)}
    except VariableError as error:
        raise APIError(str(error), error.param) from error


def check_user(body):
    """The identifiers and hints a request may carry, strings the server needs not read (the prefix cache needs no
    key); `store` at false only (chat completions are not stored)."""
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if has_value(body, name) and not isinstance(body[name], str):
            raise APIError(f"{name} must be a string, got {excerpt(body[name])}", name)
    if has_value(body, "store") and body["store"] is not False:
        raise APIError(f"store {excerpt(body['store'])} is not supported: this server stores no chat completions",
                       "store")


def thinking_token_budget(body, delimiters):
    """vLLM's thinking_token_budget: the most tokens a reply's thinking block holds before it is closed (None: no
    cap); a 400 where the chat template has no block."""
    budget = number(body, "thinking_token_budget", None, 0, None, integer=True)
    if budget is not None and delimiters is None:
        raise APIError("thinking_token_budget: this model's chat template has no thinking block to cap",
                       "thinking_token_budget")
    return budget


async def called(engine, future, what):
    """The result of an engine.call(), or a 503 where the engine stopped (shutdown's grace over) before running it:
    it cancels the calls it has not run."""
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        if not engine.stopped:
            raise
        raise APIError(f"the server stopped before {what}", status=503, kind="server_error") from None


def to_loop(loop, events, job, event):
    """A request's sink: its events to the handler's loop, from the model thread (none once the loop has closed: the
    server stopped waiting for its handlers, and nobody reads them)."""
    try:
        loop.call_soon_threadsafe(events.put_nowait, (job, event))
    except RuntimeError:
        if not loop.is_closed():
            raise


async def generate(service, http_request, body, prompts, logprobs, *, chat, max_token_names, default_max, tools=None):
    """Validates the generation fields and queues one engine request per prompt; returns the answer (a dict), the
    async iterator of a stream's chunks (dicts), or None when the client went away (respond() makes any of them an
    HTTP response)."""
    options, engine, loaded = service.options, service.engine, service.loaded
    n = number(body, "n", 1, 1, options.max_n, integer=True)
    stream = boolean(body, "stream")
    include_usage = False
    if has_value(body, "stream_options"):
        stream_options = body["stream_options"]
        if not stream:
            raise APIError("stream_options needs stream: true", "stream_options")
        if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
            raise APIError("stream_options takes include_usage only", "stream_options")
        include_usage = boolean(stream_options, "include_usage", where="stream_options.")
    echo = not chat and boolean(body, "echo")
    check_user(body)
    sampling = read_sampling(body, loaded.vocab_size)
    stops = read_stop(body)
    constraint_source = read_constraint_source(body, response_format_allowed=chat)
    tool_kept = frozenset()  # the tool format's special tokens (Mistral's [TOOL_CALLS])
    tool_markers = ()  # and their text, which a stop string may not cut into
    if tools is not None:
        with service.tokenizer_lock:
            tool_kept = tools.kept(loaded.tokenizer)
            tool_markers = token_texts(loaded.tokenizer, tool_kept)
    if tools is not None and tools.grammar is not None:
        if constraint_source and not tools.holds_format:  # a regex or grammar beside the tools' own
            raise APIError(f"one constraint per request; got tools and {constraint_source[2]}", constraint_source[2])
        constraint_source = ("tools", tools.grammar, "tools", tool_kept)
    constraint = None
    if constraint_source:
        loop = asyncio.get_running_loop()
        constraint = await loop.run_in_executor(None, service.compile, *constraint_source)
    budget = thinking_token_budget(body, service.delimiters) if chat else None
    replies = [None] * len(prompts)  # rungen.reasoning.ReplyPlan of each, when the chat template thinks
    budgets = [None] * len(prompts)  # and its thinking budget (rungen.reasoning.Budget)
    if chat and service.delimiters is not None:
        variables = template_variables(service, body)
        with service.tokenizer_lock:
            for job, ids in enumerate(prompts):
                prompts[job], replies[job] = plan_reply(loaded.tokenizer, service.delimiters, ids,
                                                        constraint is not None, bool(tools and tools.fmt), variables)
                budgets[job] = reply_budget(loaded.tokenizer, replies[job], budget)
    plans = []
    for ids in prompts:
        max_tokens = service.max_tokens(body, len(ids), default_max, n, max_token_names)
        if max_tokens == 0 and not echo:
            name = next((name for name in max_token_names if has_value(body, name)), max_token_names[0])
            raise APIError(f"{name} 0 generates nothing: it scores the prompt with echo and logprobs", name)
        plans.append((ids, max_tokens))

    # Prompt scoring (echo with logprobs) runs on the model thread between two decode steps.
    prompt_scores = [None] * len(prompts)
    if echo and logprobs is not None:
        try:
            futures = [engine.call(functools.partial(score_prompts, loaded, [Prompt(0, None, ids=ids)], logprobs))
                       for ids, _ in plans]
        except EngineClosed as error:
            raise APIError(str(error), status=503, kind="server_error") from error
        prompt_scores = [(await called(engine, future, "the prompt was scored"))[0] for future in futures]

    loop = asyncio.get_running_loop()
    events = asyncio.Queue()
    jobs = []
    for job, (ids, max_tokens) in enumerate(plans):
        if max_tokens == 0:
            continue
        sink = functools.partial(to_loop, loop, events, job)
        request = EngineRequest(ids, max_tokens, sampling, sink, n=n, stop=stops, logprobs=logprobs,
                                constraint=constraint,
                                reasoning_end=replies[job].end_ids if replies[job] else None,
                                reasoning_close=replies[job].text_close if replies[job] else "",
                                thinking_budget=budgets[job],
                                kept=tool_kept | (replies[job].kept if replies[job] else frozenset()),
                                markers=(replies[job].delimiters.texts if replies[job] else ()) + tool_markers)
        jobs.append((job, request))
    try:
        for _, request in jobs:
            engine.submit(request)
    except (EngineBusy, EngineClosed) as error:
        for _, request in jobs:
            request.cancelled = True
        status = 503
        raise APIError(f"the server is busy: {error}; retry later", status=status, kind="server_error",
                       headers={"Retry-After": "1"}) from error
    answer = Answer(service, chat, prompts, n, logprobs, echo, prompt_scores, include_usage, tools, replies)
    for job, (_, max_tokens) in enumerate(plans):
        if max_tokens == 0:
            answer.score_only(job)
    pending = {job for job, _ in jobs}

    def cancel():
        for _, request in jobs:
            request.cancelled = True

    if stream:
        return answer.stream(events, pending, cancel)
    try:
        while pending:
            try:
                job, event = await asyncio.wait_for(events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await http_request.is_disconnected():
                    cancel()
                    return None
                continue
            if isinstance(event, End):
                pending.discard(job)
            else:
                answer.add(job, event)
    except asyncio.CancelledError:
        cancel()
        raise
    if answer.error:
        raise APIError(answer.error, status=500, kind="server_error")
    return answer.body()


def respond(result):
    """generate()'s result as the HTTP response of the OpenAI routes."""
    if result is None:
        return PlainTextResponse("", status_code=499)  # the client went away
    if isinstance(result, dict):
        return result
    return StreamingResponse(sse(result), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def sse(chunks, done="[DONE]"):
    """Server-sent events of chunks (dicts; `done`: the last event's data, or None)."""
    async for chunk in chunks:
        yield "data: " + json.dumps(chunk) + "\n\n"
    if done is not None:
        yield f"data: {done}\n\n"


async def run_chat(service, http_request, body):
    """A chat completion request's body (its fields checked) through the engine: generate()'s result. The one path
    of chat requests, which other APIs' routes translate to and from."""
    ids, tools = chat_prompt(service, body, template_kwargs=template_variables(service, body))
    logprobs = None
    if boolean(body, "logprobs"):
        logprobs = number(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
    elif has_value(body, "top_logprobs"):
        raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
    return await generate(service, http_request, body, [ids], logprobs, chat=True,
                          max_token_names=("max_completion_tokens", "max_tokens"), default_max=None, tools=tools)


class Answer:
    """Builds a response (or its stream of chunks) from the engine's events."""

    def __init__(self, service, chat, prompts, n, logprobs, echo, prompt_scores, include_usage, tools=None,
                 replies=None):
        self.service, self.chat, self.prompts, self.n = service, chat, prompts, n
        self.logprobs, self.echo, self.prompt_scores, self.include_usage = logprobs, echo, prompt_scores, include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        total = len(prompts) * n
        # One tool-call parser a choice (rungen/tool_reply.py), when the reply may hold calls.
        self.parsers = [tools.parser() for _ in range(total)] if tools is not None and tools.fmt else None
        # Each choice's reply plan and reasoning splitter (rungen/reasoning.py), when the chat template thinks.
        self.replies = [replies[choice // n] for choice in range(total)] if replies and any(replies) else None
        self.splitters = [reply.splitter() for reply in self.replies] if self.replies else None
        self.texts, self.items, self.finish = [""] * total, [[] for _ in range(total)], [None] * total
        self.stops = [None] * total  # the stop string that ended each choice (vLLM's stop_reason)
        self.error = None
        self.completion_tokens = 0
        self.cached = [0] * len(prompts)  # each prompt's tokens the prefix cache held
        self.bos_added = None  # whether the tokenizer puts a BOS before every text (added_bos), once asked

    def index(self, job, row):
        return job * self.n + row

    def score_only(self, job):
        for row in range(self.n):
            self.finish[self.index(job, row)] = "length"

    def add(self, job, event):
        """A Delta or a Done of the engine request `job`."""
        choice = self.index(job, event.index)
        if isinstance(event, Delta):
            self.texts[choice] += event.text
            if event.logprobs:
                self.items[choice] += event.logprobs
        else:
            finish = event.finish
            self.finish[choice] = finish.reason
            self.stops[choice] = finish.stop
            self.completion_tokens += len(finish.tokens)
            self.cached[job] = finish.cached
            if finish.error and finish.reason == "abort":
                self.error = finish.error

    @property
    def prompt_tokens(self):
        return sum(len(ids) for ids in self.prompts)

    def usage(self):
        """OpenAI's usage: the prompts' tokens (those the prefix cache held among them: cached_tokens), the
        choices'."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached)}}

    def prompt_text(self, job):
        """The echoed prompt: its tokens' text, special tokens included (as sent, and as its logprobs list them), but
        a BOS token the tokenizer put before it."""
        ids = self.prompts[job]
        spelled = ids[1:] if self.added_bos(ids) else ids
        with self.service.tokenizer_lock:
            return self.service.loaded.tokenizer.decode(spelled, skip_special_tokens=False)

    def added_bos(self, ids):
        """Whether `ids` start with the BOS token this tokenizer puts before every text (Llama's <s>)."""
        tokenizer = self.service.loaded.tokenizer
        if not ids or tokenizer.bos_token_id is None or ids[0] != tokenizer.bos_token_id:
            return False
        if self.bos_added is None:
            with self.service.tokenizer_lock:
                self.bos_added = tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id]
        return self.bos_added

    def body(self):
        choices = []
        for choice, text in enumerate(self.texts):
            job = choice // self.n
            if self.chat:
                logprobs = {"content": [chat_item(item) for item in self.items[choice]]} \
                    if self.logprobs is not None else None
                reasoning = None
                if self.replies:
                    reasoning, text = split_reply(self.replies[choice], text)
                message = {"role": "assistant", "content": text}
                if self.parsers:
                    content, calls = message_of(self.parsers[choice], text or "")
                    message = {"role": "assistant", "content": content if text is not None else None,
                               **({"tool_calls": calls} if calls else {})}
                if self.replies:
                    message["reasoning_content"] = reasoning
                choices.append({"index": choice, "message": message, "logprobs": logprobs,
                                "finish_reason": self.finish_reason(choice), "stop_reason": self.stops[choice]})
            else:
                prefix = self.prompt_text(job) if self.echo else ""
                logprobs = None
                if self.logprobs is not None:
                    items = list(self.items[choice])
                    logprobs = completion_logprobs(self.echo_items(job) + items, prefix_offset=0)
                choices.append({"index": choice, "text": prefix + text, "logprobs": logprobs,
                                "finish_reason": self.finish[choice], "stop_reason": self.stops[choice]})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.service.options.model_id, "choices": choices,
                "usage": self.usage()}

    def echo_items(self, job):
        """The prompt's tokens as logprob items (the first has no log-probability)."""
        if not self.echo:
            return []
        score = self.prompt_scores[job]
        ids = self.prompts[job]
        with self.service.tokenizer_lock:
            first = self.service.loaded.tokenizer.decode(ids[:1], skip_special_tokens=False)
        head = [{"token": first, "id": ids[0], "logprob": None, "top_logprobs": None,
                 **({"bytes": []} if self.added_bos(ids) else {})}]  # (not in the echoed text)
        # A special token is spelled out in the echoed prompt (its name), where a reply's adds nothing to the text.
        return head + [{**item, "bytes": item["bytes"] or list(item["token"].encode())}
                       for item in (score[0]["content"] if score else [])]

    def chunk(self, choices, usage=False):
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.service.options.model_id, "choices": choices}
        if self.include_usage:
            chunk["usage"] = self.usage() if usage else None
        return chunk

    async def stream(self, events, pending, cancel):
        """The chunks (dicts) of a stream: one per delta, one with each finish_reason; an {"error": ...} object
        where a step failed. sse() sends them as server-sent events."""
        offsets = [0] * len(self.texts)
        try:
            if self.chat:
                yield self.chunk([{"index": choice, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None} for choice in range(len(self.texts))])
            elif self.echo:
                for choice in range(len(self.texts)):
                    text = self.prompt_text(choice // self.n)
                    logprobs = completion_logprobs(self.echo_items(choice // self.n), 0) \
                        if self.logprobs is not None else None
                    offsets[choice] = len(text)
                    yield self.chunk([{"index": choice, "text": text, "logprobs": logprobs, "finish_reason": None}])
            for choice, finish in enumerate(self.finish):  # max_tokens 0: the prompt alone
                if finish is not None:
                    yield self.chunk(self.final_choice(choice))
            while pending:
                job, event = await events.get()
                if isinstance(event, End):
                    pending.discard(job)
                    continue
                self.add(job, event)
                choice = self.index(job, event.index)
                if isinstance(event, Delta):
                    text, items = event.text, event.logprobs or []
                    if self.chat:
                        logprobs = {"content": [chat_item(item) for item in items]} if self.logprobs is not None \
                            else None
                        deltas = self.deltas(choice, text) or ([{}] if logprobs else [])
                        for place, delta in enumerate(deltas):
                            yield self.chunk([{"index": choice, "delta": delta,
                                               "logprobs": logprobs if place == 0 else None, "finish_reason": None}])
                    else:
                        logprobs = completion_logprobs(items, offsets[choice]) if self.logprobs is not None else None
                        offsets[choice] += len(text)
                        yield self.chunk([{"index": choice, "text": text, "logprobs": logprobs,
                                           "finish_reason": None}])
                elif isinstance(event, Done):
                    if self.parsers or self.splitters:  # what they held back (the start of a call or a delimiter)
                        for delta in self.deltas(choice, "", final=True):
                            yield self.chunk([{"index": choice, "delta": delta, "logprobs": None,
                                               "finish_reason": None}])
                    if self.error:
                        yield {"error": {"message": self.error, "type": "server_error", "param": None, "code": None}}
                    yield self.chunk(self.final_choice(choice))
            if self.include_usage:
                yield self.chunk([], usage=True)
        finally:
            if pending:  # the client went away (or the server cancels the response): free the rows
                cancel()

    def deltas(self, choice, text, final=False):
        """A chat stream's deltas for the text a choice gains (`final`: the reply ended, what was held back):
        reasoning apart, calls parsed."""
        if not self.parsers and not self.splitters:
            return [{"content": text}]
        reasoning = ""
        if self.splitters:
            splitter = self.splitters[choice]
            reasoning, text = splitter.finish() if final else splitter.feed(text)
        deltas = [{"reasoning_content": reasoning}] if reasoning else []
        if self.parsers:
            parser = self.parsers[choice]
            deltas += stream_deltas(parser.feed(text) + (parser.finish() if final else []))
        elif text:
            deltas.append({"content": text})
        return deltas

    def finish_reason(self, choice):
        """A reply that ended by itself after calling tools says so (OpenAI's "tool_calls")."""
        parser = self.parsers[choice] if self.parsers else None
        if parser is not None and parser.calls and parser.complete and self.finish[choice] == "stop":
            return "tool_calls"
        return self.finish[choice]

    def final_choice(self, choice):
        if self.chat:
            return [{"index": choice, "delta": {}, "logprobs": None, "finish_reason": self.finish_reason(choice),
                     "stop_reason": self.stops[choice]}]
        return [{"index": choice, "text": "", "logprobs": None, "finish_reason": self.finish[choice],
                 "stop_reason": self.stops[choice]}]


def chat_item(item):
    """rungen/logprobs.py's item in OpenAI's chat shape (with the bytes of each token)."""
    top = [{"token": alt["token"], "logprob": alt["logprob"], "bytes": alt["bytes"]}
           for alt in item.get("top_logprobs") or []]
    return {"token": item["token"], "logprob": item["logprob"], "bytes": item["bytes"], "top_logprobs": top}


def completion_logprobs(items, prefix_offset):
    """Items in the legacy completions shape: tokens, token_logprobs, top_logprobs (the `logprobs` most likely and
    the token itself: up to logprobs + 1, as OpenAI's), text_offset (each token's first character in the text: the
    characters its bytes and those before it complete). A token that is no whole character is written as OpenAI
    writes it, "bytes:\\xe6\\x97"."""
    tokens, values, tops, offsets = [], [], [], []
    decoder, characters = codecs.getincrementaldecoder("utf-8")(errors="ignore"), 0  # a character whole once ended
    for item in items:
        tokens.append(legacy_token(item))
        values.append(item["logprob"])
        alternatives = item.get("top_logprobs")
        top = None
        if alternatives is not None:
            top = {legacy_token(alt): alt["logprob"] for alt in alternatives}
            if item["logprob"] is not None:
                top.setdefault(tokens[-1], item["logprob"])
        tops.append(top)
        offsets.append(prefix_offset + characters)
        characters += len(decoder.decode(bytes(item["bytes"]) if "bytes" in item else item["token"].encode()))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def legacy_token(item):
    """A token's text, or "bytes:\\xNN..." where its bytes are no whole UTF-8 character."""
    raw = bytes(item.get("bytes") or b"")
    if raw:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return item["token"]
