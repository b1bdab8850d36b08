"""--serve under load and faults: 64 clients at once against a queue of 16 (the rest refused with 503 and
Retry-After, none lost, none hung), clients hanging up mid-stream at random, and SIGTERM under that load (every
accepted request ends with a complete response or a proper end of stream, and the process exits 0)."""

import concurrent.futures
import json
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from test_server import MODEL_ID, LiveServer, build_chat_llama, free_port

from helpers import SCRIPT, cli_env, wait_until_healthy
from rungen.loading import load
from rungen.server import ServeOptions, build

CLIENTS, QUEUE, BATCH = 64, 16, 4
TOKENS = 40  # long enough that the first requests still run when the last ones arrive


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # --serve names the model after its directory
    return build_chat_llama(str(tmp_path_factory.mktemp("load") / MODEL_ID))


def request_body(number, stream):
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": f"Tell me about number {number}"}],
            "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0.8, "seed": number, "stream": stream}


def ask(url, number, plan, started, ready):
    """One client: a plain request, a stream read to its end, or a stream it hangs up on after `plan` events.
    Returns (status, outcome); `started` is set when the server has answered its headers. Every client is made
    before the barrier `ready` (a client builds an SSL context, some 25 ms), so that the requests come at once."""
    stream = plan is not None
    with httpx.Client(timeout=120) as client:
        ready.wait()
        if not stream:
            started.set()  # a plain request's headers come with its whole answer
            response = client.post(url + "/v1/chat/completions", json=request_body(number, False))
            return response.status_code, response
        with client.stream("POST", url + "/v1/chat/completions", json=request_body(number, True)) as response:
            started.set()
            if response.status_code != 200:
                response.read()
                return response.status_code, response
            events = []
            for line in response.iter_lines():
                if line:
                    events.append(line)
                    if plan >= 0 and len(events) > plan:
                        return 200, "hung up"
            return 200, events


def check_outcome(status, outcome, finishes=("length",)):
    """A 503 in OpenAI's shape with Retry-After, a whole answer, a stream ended properly, or a planned hang-up."""
    if status == 503:
        assert outcome.headers["retry-after"] == "1"
        assert outcome.json()["error"]["type"] == "server_error"
        return "refused"
    assert status == 200, (status, getattr(outcome, "text", outcome))
    if outcome == "hung up":
        return outcome
    if isinstance(outcome, list):  # a stream: chunks, a finish_reason on the last, then [DONE]
        assert outcome[-1] == "data: [DONE]", outcome[-3:]
        chunks = [json.loads(line[6:]) for line in outcome[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] in finishes, chunks[-1]
        content = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
        assert content or chunks[-1]["choices"][0]["finish_reason"] == "abort"
        return "streamed"
    choice = outcome.json()["choices"][0]
    assert choice["finish_reason"] in finishes, choice
    if choice["finish_reason"] == "length":
        assert outcome.json()["usage"]["completion_tokens"] == TOKENS
    return "answered"


def plans(seed):
    """Per client: None (a plain request), -1 (a stream read to the end) or n >= 0 (hang up after n events)."""
    rng = random.Random(seed)
    return [rng.choice([None, -1, -1, rng.randrange(0, TOKENS)]) for _ in range(CLIENTS)]


def test_64_clients_against_a_queue_of_16_and_hang_ups_at_random(checkpoint):
    loaded = load(checkpoint, device=torch.device("cpu"))
    app, engine = build(loaded, ServeOptions(model_id=MODEL_ID, max_batch=BATCH, max_queue=QUEUE))
    live = LiveServer(app)
    try:
        chosen = plans(20261125)
        started, ready = [threading.Event() for _ in range(CLIENTS)], threading.Barrier(CLIENTS, timeout=60)
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(ask, live.url, number, plan, started[number], ready)
                       for number, plan in enumerate(chosen)]
            outcomes = [future.result(timeout=300) for future in futures]  # none hung
        kinds = [check_outcome(*outcome) for outcome in outcomes]
        accepted = len(kinds) - kinds.count("refused")
        assert kinds.count("refused") > 0 and accepted >= QUEUE, kinds  # the queue filled, and was used
        for _ in range(500):  # every accepted request left the engine: the hung-up ones were cancelled
            # (the engine's thread empties the rows and then hands back the batch's cache: wait for both)
            if not engine.batch.rows and not engine.waiting and not engine.batch.kv.held():
                break
            time.sleep(0.02)
        assert not engine.batch.rows and not engine.waiting and not engine.batch.kv.held()
        # none lost: the server counted each request once, under the status its client saw
        counted = {status: sum(1 for status_, _ in outcomes if status_ == status) for status in (200, 503)}
        lines = [f'rungen_requests_total{{endpoint="/v1/chat/completions",status="{status}"}} {count}'
                 for status, count in counted.items()]
        for _ in range(500):  # a hung-up stream is counted when the server has seen the hang-up
            metrics = httpx.get(live.url + "/metrics").text
            if all(line in metrics for line in lines):
                break
            time.sleep(0.02)
        assert all(line in metrics for line in lines), (lines, [m for m in metrics.splitlines() if "total{" in m])
        again = httpx.post(live.url + "/v1/chat/completions", json=request_body(0, False), timeout=60)
        assert check_outcome(again.status_code, again) == "answered"
    finally:
        live.stop()
        engine.close()
        engine.abort()


@pytest.mark.slow
def test_sigterm_under_64_clients_ends_every_accepted_request_and_exits_0(checkpoint):
    """run_generation.py --serve with a queue of 16: 64 clients, some hanging up; SIGTERM once every client has
    its answer's headers. Accepted requests end complete or with finish_reason "abort" and [DONE]; exit 0."""
    port = free_port()
    process = subprocess.Popen([sys.executable, SCRIPT, "--serve", "--model_name_or_path", checkpoint, "--port",
                                str(port), "--max_queue", str(QUEUE), "--max_batch", str(BATCH),
                                "--shutdown_grace", "1"], env=cli_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url)
        # Streams only (each gets its headers and role chunk as soon as it is queued), so that SIGTERM comes
        # when every request has been taken or refused, not while one is still on its way in.
        chosen = [-1 if plan is None else plan for plan in plans(7)]
        started, ready = [threading.Event() for _ in range(CLIENTS)], threading.Barrier(CLIENTS, timeout=60)
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(ask, url, number, plan, started[number], ready)
                       for number, plan in enumerate(chosen)]
            for event in started:
                assert event.wait(120)
            process.send_signal(signal.SIGTERM)
            outcomes = [future.result(timeout=120) for future in futures]
        assert process.wait(timeout=60) == 0, process.stderr.read().decode()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    kinds = [check_outcome(*outcome, finishes=("length", "abort")) for outcome in outcomes]
    assert kinds.count("refused") > 0 and kinds.count("streamed") >= 1, kinds
    stderr = process.stderr.read().decode()
    assert "Traceback" not in stderr, stderr[-3000:]
