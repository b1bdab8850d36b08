"""--serve: an OpenAI-compatible HTTP server on one loaded model (FastAPI + uvicorn; docs/server.md).

OpenAI's routes (rungen/openai_api.py), Anthropic's /v1/messages (rungen/messages.py), OpenAI's /v1/responses
(rungen/responses.py), /tokenize, /detokenize, /health, /metrics. Every request field is honoured or refused with a
400 naming it; generation runs on the engine's model thread, which batches all clients' requests continuously.
"""

import asyncio
import contextlib
import copy
import dataclasses
import functools
import hmac
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from . import NOTICE, logger, strict_json
from .embeddings import as_base64, batches, embed
from .engine import Engine, EngineClosed, describe_memory
from .errors import UsageError
from .generation import eos_token_ids
from .metrics import Metrics
from .openai_api import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DEFAULT_COMPLETION_TOKENS,
    MAX_LOGPROBS,
    APIError,
    Service,
    boolean,
    called,
    check_fields,
    check_user,
    counted_prompt,
    excerpt,
    generate,
    has_value,
    number,
    read_prompt_ids,
    respond,
    run_chat,
)
from .prompts import Prompt

API_KEY_ENV = "RUN_GENERATION_API_KEY"
MAX_BODY_DEPTH = strict_json.MAX_DEPTH  # refused before parsing: the decoder recurses once a level
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit of inputs per embeddings request
# Seconds a body may take once its headers came: a client stalling mid-body gets a 408, not a handler forever.
BODY_TIMEOUT = 30.0
EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
# vLLM's names; tools, tool_choice and parallel_tool_calls shape a chat's prompt as they do in a chat request.
TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens", "tools",
                   "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort"}
DETOKENIZE_FIELDS = {"model", "tokens"}
# OpenAI's fields of /v1/responses that rungen/responses.py honours or checks.
RESPONSE_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                   "temperature", "top_p", "max_output_tokens", "reasoning", "store", "previous_response_id",
                   "metadata", "user", "safety_identifier", "prompt_cache_key", "stream", "include", "top_logprobs",
                   "truncation", "background"}
# Anthropic's Messages API (rungen/messages.py).
MESSAGES_FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
                   "metadata", "stream", "tools", "tool_choice", "thinking"}
COUNT_TOKENS_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking"}


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """How to serve (the --serve flags)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = dataclasses.field(default=None, repr=False)
    model_id: str = "model"
    max_queue: int = 64
    max_batch: int = 16
    max_cache_tokens: int = 65536
    prefix_cache_mb: int = 256
    max_body_bytes: int = 4 << 20
    body_timeout: float = BODY_TIMEOUT
    max_n: int = 16
    cors_origins: tuple[str, ...] = ()
    grace: float = 30.0
    threads: int = 0  # torch's intra-op threads on the model thread (0: as they are)
    template_kwargs: dict = dataclasses.field(default_factory=dict)  # --chat_template_kwargs: requests' defaults


# --- The app ---


def create_app(loaded, engine, options):
    """The FastAPI app serving `loaded` through `engine` (already started) under `options`."""
    from . import messages as messages_api

    service = Service(loaded, engine, options)
    metrics = engine.metrics
    app = FastAPI(title="run_generation", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    # Inside Starlette's outermost layer, whose Exception handler re-raises to uvicorn (closing the connection).
    app.add_middleware(Shield)
    if options.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(options.cors_origins),
                           allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version",
                                          "anthropic-beta"])

    @app.exception_handler(APIError)
    async def api_error(request, error):
        return error_response(error, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, error):
        message = str(error.detail)
        if error.status_code == 404 and message == "Not Found":  # no such route: OpenAI's words for it
            message = f"Invalid URL ({request.method} {request.url.path})"
        error = APIError(message, status=error.status_code, headers=error.headers)
        return error_response(error, request.url.path)  # (Anthropic's error type by status under /v1/messages)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def health():
        if engine.closing or engine.stopped or not engine.thread.is_alive():
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus():
        return PlainTextResponse(metrics.render(engine.queue_depth, len(engine.batch.rows)),
                                 media_type="text/plain; version=0.0.4")

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [{"id": options.model_id, "object": "model", "created": service.created,
                                            "owned_by": "run_generation"}]}

    @app.get("/v1/models/{model:path}")
    async def model_card(model: str):
        if model != options.model_id:
            raise APIError(f"the model {excerpt(model)} does not exist; this server serves {options.model_id!r}",
                           "model", status=404, code="model_not_found")
        return {"id": options.model_id, "object": "model", "created": service.created, "owned_by": "run_generation"}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request, options.max_body_bytes, options.body_timeout)
        check_fields(body, CHAT_FIELDS)
        check_model(body, options.model_id)
        return respond(await run_chat(service, request, body))

    @app.post("/v1/responses")
    async def responses(request: Request):
        from .responses import create_response

        body = await read_body(request, options.max_body_bytes, options.body_timeout)
        check_fields(body, RESPONSE_FIELDS)
        check_model(body, options.model_id)
        return await create_response(service, request, body)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request):
        from .responses import retrieve

        return retrieve(service, response_id, request.query_params)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        from .response_store import delete

        return delete(service, response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request):
        from .response_store import input_items

        return input_items(service, response_id, request.query_params)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request, options.max_body_bytes, options.body_timeout)
        check_fields(body, COMPLETION_FIELDS)
        check_model(body, options.model_id)
        if has_value(body, "suffix") and body["suffix"] != "":
            raise APIError("suffix (insertion) is not supported by this server", "suffix")
        if has_value(body, "best_of") and body["best_of"] != number(body, "n", 1, integer=True):
            raise APIError("best_of other than n is not supported by this server", "best_of")
        prompts = read_prompt_ids(service, body, "prompt", options.max_n, room=1)
        logprobs = number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
        return respond(await generate(service, request, body, prompts, logprobs, chat=False,
                                      max_token_names=("max_tokens",), default_max=DEFAULT_COMPLETION_TOKENS))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await read_body(request, options.max_body_bytes, options.body_timeout)
        check_fields(body, EMBEDDING_FIELDS)
        check_model(body, options.model_id)
        encoding = body["encoding_format"] if has_value(body, "encoding_format") else "float"
        if encoding not in ("float", "base64"):
            raise APIError(f"encoding_format must be float or base64, got {excerpt(encoding)}", "encoding_format")
        if has_value(body, "dimensions"):
            raise APIError("dimensions is not supported: this model's embeddings have one size", "dimensions")
        check_user(body)
        prompts = read_prompt_ids(service, body, "input", MAX_EMBEDDING_INPUTS, room=0, allow_empty=False)
        vectors = [None] * len(prompts)
        for place, group in enumerate(batches([len(ids) for ids in prompts])):
            if place and await request.is_disconnected():
                return PlainTextResponse("", status_code=499)
            try:
                future = engine.call(functools.partial(embed, loaded, [prompts[index] for index in group]))
            except EngineClosed as error:
                raise APIError(str(error), status=503, kind="server_error", headers={"Retry-After": "1"}) from error
            # one forward pass at a time: the running requests' decode steps go on between them
            found = await called(engine, future, "the embeddings were computed")
            for index, vector in zip(group, found):
                vectors[index] = as_base64(vector) if encoding == "base64" else vector.tolist()
        tokens = sum(len(ids) for ids in prompts)
        metrics.add_tokens(prompt=tokens)  # read by a forward pass as a generation's prompt is
        data = [{"object": "embedding", "index": index, "embedding": vector} for index, vector in enumerate(vectors)]
        return {"object": "list", "data": data, "model": options.model_id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request, options.max_body_bytes, options.body_timeout)
        check_fields(body, TOKENIZE_FIELDS)
        if has_value(body, "model"):  # optional, as in vLLM's route; when given, the served one
            check_model(body, options.model_id)
        special = boolean(body, "add_special_tokens", None)
        if has_value(body, "messages"):
            if has_value(body, "prompt"):
                raise APIError("give prompt or messages, not both", "prompt")
            ids = counted_prompt(service, body, boolean(body, "add_generation_prompt", True),
                                 add_special_tokens=special, within_context=False)
        else:
            for name in ("add_generation_prompt", "tools", "tool_choice", "parallel_tool_calls",
                         "chat_template_kwargs", "reasoning_effort"):
                if has_value(body, name):
                    raise APIError(f"{name} applies to messages, not to a prompt", name)
            if not isinstance(body.get("prompt"), str):
                raise APIError("prompt must be a string (or messages a list of messages)", "prompt")
            ids = service.encode(Prompt(0, body["prompt"]), "prompt", add_special_tokens=special, within_context=False)
        # The context is not checked: counting a text's tokens is how a client finds whether it fits.
        return {"tokens": ids, "count": len(ids), "max_model_len": loaded.context or None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_body(request, options.max_body_bytes, options.body_timeout)
        check_fields(body, DETOKENIZE_FIELDS)
        if has_value(body, "model"):
            check_model(body, options.model_id)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise APIError("tokens must be a list of token ids", "tokens")
        outside = next((token for token in tokens if not 0 <= token < loaded.vocab_size), None)
        if outside is not None:
            raise APIError(f"tokens: {excerpt(outside)} is not a token id of this model (0..{loaded.vocab_size - 1})",
                           "tokens")
        with service.tokenizer_lock:  # special tokens kept: /tokenize's ids of a chat give back its template text
            return {"prompt": loaded.tokenizer.decode(tokens, skip_special_tokens=False)}

    @app.post("/v1/messages")
    async def messages(request: Request):
        body = await read_body(request, options.max_body_bytes, options.body_timeout)
        check_fields(body, MESSAGES_FIELDS)
        check_model(body, options.model_id)
        return await messages_api.create(service, request, body)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        body = await read_body(request, options.max_body_bytes, options.body_timeout)
        check_fields(body, COUNT_TOKENS_FIELDS)
        check_model(body, options.model_id)
        return messages_api.count_tokens(service, body)

    return app


class Guard:
    """ASGI middleware: the API key on every route but /health (Authorization: Bearer KEY, or Anthropic's
    x-api-key: KEY), and the request counters."""

    def __init__(self, app, api_key, metrics):
        self.app, self.metrics = app, metrics
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = {}

        async def watch(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        if self.key is not None and path != "/health" and scope["method"] != "OPTIONS":
            headers = dict(scope["headers"])
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            key = headers.get(b"x-api-key")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(given, self.key)  # a scheme is any case
                    or key is not None and hmac.compare_digest(key, self.key)):
                error = APIError("a valid API key is required: Authorization: Bearer <key> (or x-api-key: <key>)",
                                 status=401, kind="invalid_request_error", code="invalid_api_key")
                await error_response(error, path)(scope, receive, watch)
                self.metrics.count_request(endpoint_label(path), 401)
                return
        try:
            await self.app(scope, receive, watch)
        finally:
            self.metrics.count_request(endpoint_label(path), status.get("code", 499))


class Shield:
    """ASGI middleware: an exception the routes let out is logged and answered with a 500 (a stream gets an error
    event and its end), and goes no further, so uvicorn keeps the connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        response = {}

        async def watch(message):
            if message["type"] == "http.response.start":
                response["headers"] = dict(message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                response["complete"] = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except ClientDisconnect:  # the client went away: nobody to answer
            return
        except Exception as error:
            if isinstance(error, OSError) and "headers" in response:
                return  # writing the answer to a client that went away
            logger.exception("request failed: %s %s", scope.get("method"), scope.get("path"))
            if response.get("complete"):
                return
            failure = APIError(f"internal error: {type(error).__name__}: {error}", status=500, kind="server_error")
            with contextlib.suppress(ClientDisconnect, OSError):
                if "headers" not in response:
                    await error_response(failure, scope["path"])(scope, receive, send)
                    return
                tail = b""
                if response["headers"].get(b"content-type", b"").startswith(b"text/event-stream"):
                    body = {"error": {"message": failure.message, "type": failure.kind, "param": None, "code": None}}
                    tail = ("data: " + json.dumps(body) + "\n\ndata: [DONE]\n\n").encode()
                    if is_messages_path(scope["path"]):  # Anthropic's stream ends with its error event
                        from .messages import error_event

                        tail = error_event(failure).encode()
                await send({"type": "http.response.body", "body": tail, "more_body": False})


def is_messages_path(path):
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_response(error, path):
    """An APIError as the response of the route's API: Anthropic's shape under /v1/messages, OpenAI's elsewhere."""
    if is_messages_path(path):
        from .messages import error_response as messages_error

        return messages_error(error)
    return error.response()


def endpoint_label(path):
    if path in ("/v1/messages", "/v1/messages/count_tokens"):
        return path
    known = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/tokenize", "/detokenize",
             "/health", "/metrics", "/v1/responses")
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}/input_items" if path.endswith("/input_items") else "/v1/responses/{id}"
    return path if path in known else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


async def read_body(request, limit, timeout=BODY_TIMEOUT):
    """The request's JSON object, parsed strictly (RFC 8259), at most `limit` bytes and MAX_BODY_DEPTH deep, within
    `timeout` seconds; else a 400 (413 for the size, 408 for the time)."""
    kind = request.headers.get("content-type")
    # No Content-Type reads as JSON (as FastAPI's own body parsing does); any other type is refused.
    if kind is not None and not re.fullmatch(r"application/json\s*(;\s*charset=\"?utf-8\"?\s*)?", kind, re.I):
        raise APIError(f"the request body must be application/json (UTF-8), got Content-Type: {excerpt(kind)}",
                       status=415)
    length = request.headers.get("content-length")
    too_big = APIError(f"the request body is larger than {limit} bytes", status=413)
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_big
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > limit:
                    raise too_big
    except ClientDisconnect as error:  # nobody reads the answer; it ends the request quietly
        raise APIError("the client disconnected before the request body ended") from error
    except TimeoutError as error:
        # Connection: close, as the rest of the body may still come: the connection cannot carry a next request.
        raise APIError(f"the request body did not arrive within {timeout:g} seconds", status=408,
                       code="request_timeout", headers={"Connection": "close"}) from error
    return parse_body(bytes(raw))


def parse_body(raw):
    """A request body (bytes) as a JSON object (rungen/strict_json.py), or an APIError naming what is wrong
    (and the field, where there is one)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError(f"the request body is not valid UTF-8 (byte {error.start})") from error
    try:
        body = strict_json.loads(text, MAX_BODY_DEPTH)
    except strict_json.JSONError as error:
        raise APIError(f"the request body: {error.message}", error.field) from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def check_model(body, model_id):
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError("model is required (GET /v1/models lists it)", "model")
    if model != model_id:
        raise APIError(f"the model {excerpt(model)} does not exist; this server serves {model_id!r}", "model",
                       status=404, code="model_not_found")


# --- Running ---


def is_loopback(host):
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def start_engine(loaded, options, metrics=None):
    """An Engine for `loaded`, started, with its memory bound logged."""
    engine = Engine(loaded, max_batch=options.max_batch, max_queue=options.max_queue,
                    max_cache_tokens=options.max_cache_tokens, prefix_cache_bytes=options.prefix_cache_mb << 20,
                    eos_ids=eos_token_ids_of(loaded), metrics=metrics or Metrics(),
                    tokenizer_lock=threading.Lock(), threads=options.threads)
    engine.start()
    logger.info("%s", describe_memory(engine))
    return engine


def eos_token_ids_of(loaded):
    from .generation import Settings

    return eos_token_ids(Settings(), loaded.model)


def build(loaded, options):
    """(app, engine): the ASGI app (auth and counters around the routes) and its started engine."""
    engine = start_engine(loaded, options)
    app = create_app(loaded, engine, options)
    return Guard(app, options.api_key, engine.metrics), engine


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket (as uvicorn binds one: address reuse on), or UsageError in one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        listening = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise UsageError(f"cannot listen on {host}:{port}: {reason} (another server there? choose another --port)"
                         ) from None
    listening.set_inheritable(True)
    return listening


def run(loaded, options):
    """Serves until SIGTERM or Ctrl-C: then takes no new requests, lets running ones finish within
    options.grace seconds (then ends them with finish_reason "abort"), and returns."""
    import uvicorn

    if not is_loopback(options.host) and not options.api_key:
        logger.warning("WARNING: listening on %s without --api_key: anyone who can reach this port can use the "
                       "model", options.host)
    listening = listen(options.host, options.port)  # before the engine starts: a port in use is bad input
    try:
        app, engine = build(loaded, options)
    except ValueError as error:
        raise UsageError(f"--serve: {error}") from error

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own re-raises the signal after shutdown: a graceful stop exits 0 instead.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                logger.log(NOTICE, "shutting down: finishing running requests (at most %.0f s)", options.grace)
                engine.close()
                timer = threading.Timer(options.grace, engine.abort)
                timer.daemon = True
                timer.start()
            elif not engine.stopped:  # a second signal: the grace is over (a third stops without waiting for it)
                logger.log(NOTICE, "shutting down now: ending running requests")
                engine.abort()
                return
            super().handle_exit(sig, frame)

    # A line per request (uvicorn's access log) only with --verbose: the log level main() set says so; on stderr
    # with the other logs (uvicorn writes it to stdout).
    verbose = logger.isEnabledFor(logging.INFO)
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    # No time limit of uvicorn's on the handlers at shutdown (it would cancel them mid-answer): the engine ends every
    # request at its next step or prefill once the grace is over.
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level="info" if verbose else "warning",
                            timeout_graceful_shutdown=None, access_log=verbose, log_config=log_config)
    server = Server(config)
    logger.log(NOTICE, "serving %s on http://%s:%d (OpenAI-compatible: /v1/chat/completions, /v1/completions, "
               "/v1/responses, /v1/embeddings; Anthropic-compatible: /v1/messages)",
               options.model_id, options.host, listening.getsockname()[1])
    server.run(sockets=[listening])
    engine.close()
    engine.abort()
    engine.thread.join()  # its step ends before the interpreter does (torch aborts a thread still running at exit)
    return None

