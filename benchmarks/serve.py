"""The --serve server under 1, 4 and 16 concurrent clients: output tokens/s, time to first token, time per
output token.

    python -m benchmarks.serve                              # default model, 1 4 16 clients, 32 tokens each
    python -m benchmarks.serve --clients 1 16 --max_tokens 64 --repeats 2
    python -m benchmarks.serve --compare_transformers      # and `transformers serve --continuous-batching`
    python -m benchmarks.serve --second_turn --clients     # only a conversation's next turn against a fresh prompt

Starts the real CLI (`run_generation.py --serve`) on a free loopback port, waits for /health, then for each
level of concurrency lets that many clients send streaming chat requests (greedy, ignore_eos so that every
request generates exactly --max_tokens tokens) back to back, 2 x clients requests in all, each client on one
kept HTTP connection pool. Per request, the client clocks the time to the first token and the time per output
token after it; output tokens/s is all tokens generated over the level's wall time. Levels run in order and
then in reverse (--repeats rounds), so a slow phase of the shared machine touches every level; each level's
figures are medians over the rounds.

--compare_transformers also starts `transformers serve --continuous-batching` (paged attention) on the same
checkpoint and runs every level on both servers back to back, alternating which goes first; ignore_eos is
then left out for both (transformers refuses it), so both generate the same greedy tokens.

--second_turn measures, on the tool's server alone, the time to first token of a conversation's second turn
after a first turn of about 1,000 tokens (the start of benchmarks/data/declaration.txt and a question; a new
document number each round, so the first turn is never cached), against a fresh prompt of about 20 tokens,
alternating, --repeats rounds of 3.
"""

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import httpx

from benchmarks.batch_throughput import PROMPTS, free_port
from benchmarks.common import cpu_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = os.path.join(ROOT, "run_generation.py")


_local = threading.local()


def http_client():
    """This thread's HTTP client, kept across its requests as a client program keeps one (the openai client
    does): a new httpx client first builds an SSL context, some 25 ms that would count as the server's."""
    if getattr(_local, "client", None) is None:
        _local.client = httpx.Client(timeout=600)
    return _local.client


def one_request(url, model, prompt, max_tokens, ignore_eos=True, reply=None, logprobs=False):
    """(ttft, tpot, tokens) of one streaming chat request; `prompt` a text or a list of messages; the reply's
    text is appended to `reply` when given. `logprobs`: each token's log-probability asked for, so that a token
    whose text is held back (an unfinished character) still comes as a chunk and counts as arrived."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if logprobs:
        body["logprobs"] = True
    client = http_client()
    start = time.perf_counter()
    first = last = None
    tokens = 0
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices", [])
            texts = [choice.get("delta", {}).get("content") or "" for choice in choices]
            if any(texts) or any((choice.get("logprobs") or {}).get("content") for choice in choices):
                last = time.perf_counter()
                first = first or last
                if reply is not None:
                    reply.append("".join(texts))
    ttft = first - start
    tpot = (last - first) / (tokens - 1) if tokens > 1 else float("nan")
    return ttft, tpot, tokens


def level(url, model, clients, max_tokens, ignore_eos, logprobs=False):
    """`clients` clients sending two requests each, back to back: output tokens/s, time to first token (median,
    95th percentile), time per output token, and how many requests came back with fewer than max_tokens."""
    prompts = [PROMPTS[number % len(PROMPTS)] for number in range(2 * clients)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda prompt: one_request(url, model, prompt, max_tokens, ignore_eos,
                                                           logprobs=logprobs), prompts))
    wall = time.perf_counter() - start
    ttfts = sorted(result[0] for result in results)
    return {"tokens_per_s": sum(result[2] for result in results) / wall,
            "ttft_p50": statistics.median(ttfts), "ttft_p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
            "tpot": statistics.median(result[1] for result in results),
            "short": sum(1 for result in results if result[2] < max_tokens)}


def wait_healthy(url, process, seconds=300):
    for _ in range(int(seconds * 10)):
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not become healthy")


def start_servers(args):
    """{name: (url, model id, process)}: this tool's server, and transformers' when asked for."""
    servers = {}
    port = free_port()
    batch = max(args.clients, default=1)
    command = [sys.executable, SCRIPT, "--serve", "--port", str(port), "--max_batch", str(batch)]
    if args.model_name_or_path:
        command += ["--model_name_or_path", args.model_name_or_path]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    servers["run_generation --serve"] = (url, None, process)
    wait_healthy(url, process)
    servers["run_generation --serve"] = (url, httpx.get(url + "/v1/models").json()["data"][0]["id"], process)
    if args.compare_transformers:
        from rungen.loading import default_model_dir

        path = args.model_name_or_path or default_model_dir()
        port = free_port()
        command = ["transformers", "serve", path, "--port", str(port), "--device", "cpu", "--dtype", "float32",
                   "--continuous-batching"]
        process = subprocess.Popen(command, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
        url = f"http://127.0.0.1:{port}"
        servers["transformers serve --continuous-batching"] = (url, path, process)
        wait_healthy(url, process)
    return servers


def second_turn(url, model, repeats):
    """Medians of (first turn TTFT, second turn TTFT, fresh 20-token prompt TTFT) over 3 x repeats rounds."""
    with open(os.path.join(ROOT, "benchmarks", "data", "declaration.txt"), encoding="utf-8") as f:
        passage = f.read()[:4300]  # about 1,000 tokens
    rounds = []
    for number in range(3 * repeats):
        history = [{"role": "user", "content": f"Document {number}:\n{passage}\nWhat is this document about?"}]
        reply = []
        first, _, _ = one_request(url, model, history, 16, reply=reply)
        history += [{"role": "assistant", "content": "".join(reply)},
                    {"role": "user", "content": "Say more about its first paragraph."}]
        second, _, _ = one_request(url, model, history, 4)
        fresh, _, _ = one_request(url, model, f"Round {number}: name three colours of the French flag, please.", 4)
        rounds.append((first, second, fresh))
    return [statistics.median(values) for values in zip(*rounds)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", default=None)
    parser.add_argument("--clients", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of (levels in order, then reversed)")
    parser.add_argument("--compare_transformers", action="store_true")
    parser.add_argument("--second_turn", action="store_true", help="a conversation's next turn (see above)")
    args = parser.parse_args()

    ignore_eos = not args.compare_transformers
    servers = {}
    try:
        servers = start_servers(args)
        for url, model, _ in servers.values():
            one_request(url, model, "Warm up", 4, ignore_eos)
        order = [*args.clients, *reversed(args.clients)] * args.repeats
        figures = {(name, clients): [] for name in servers for clients in args.clients}
        names = list(servers)
        for number, clients in enumerate(order):
            for name in names if number % 2 == 0 else reversed(names):
                url, model, _ = servers[name]
                figures[name, clients].append(level(url, model, clients, args.max_tokens, ignore_eos))
                run = figures[name, clients][-1]
                print(f"  {name}, {clients} clients: {run['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
        if args.second_turn:
            url, model, _ = servers[names[0]]
            turn = second_turn(url, model, args.repeats)
    finally:
        for _, _, process in servers.values():
            process.terminate()
            process.wait(timeout=60)

    rounds = len(order) // max(1, len(args.clients))
    print(f"CPU: {cpu_flags()}; torch threads: {os.environ.get('OMP_NUM_THREADS', 'default')}; "
          f"{args.max_tokens} tokens per request{' (ignore_eos)' if ignore_eos else ''}, 2 x clients requests per "
          f"level, medians of {rounds} runs")
    first = names[0]
    if not args.clients:
        names = []
    else:
        base = statistics.median(run["tokens_per_s"] for run in figures[first, args.clients[0]])
        print(f"{'server':<42} {'clients':>7} {'output tok/s':>12} {'x':>6} {'TTFT p50 s':>10} "
              f"{'TTFT p95 s':>10} {'TPOT ms':>8}")
    for name in names:
        for clients in args.clients:
            runs = figures[name, clients]
            median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            print(f"{name:<42} {clients:>7} {median['tokens_per_s']:>12.1f} {median['tokens_per_s'] / base:>6.2f} "
                  f"{median['ttft_p50']:>10.3f} {median['ttft_p95']:>10.3f} {median['tpot'] * 1000:>8.1f}")
    if names:
        print(f"x: output tokens/s over {first} with {args.clients[0]} client(s)")
    if args.second_turn:
        print(f"time to first token, medians of {3 * args.repeats}: first turn of ~1,000 tokens {turn[0]:.3f} s; "
              f"its second turn {turn[1]:.3f} s; a fresh ~20-token prompt {turn[2]:.3f} s; second / fresh "
              f"{turn[1] / turn[2]:.2f}")


if __name__ == "__main__":
    main()
