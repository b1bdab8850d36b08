"""The --serve server under 1, 4 and 16 concurrent clients: output tokens/s, time to first token, time per
output token.

    python benchmarks/serve.py                              # default model, 1 4 16 clients, 32 tokens each
    python benchmarks/serve.py --clients 1 16 --max_tokens 64 --repeats 2

Starts the real CLI (`run_generation.py --serve`) on a free loopback port, waits for /health, then for each
level of concurrency lets that many clients send streaming chat requests (greedy, ignore_eos so that every
request generates exactly --max_tokens tokens) back to back, 2 x clients requests in all. Per request, the
client clocks the time to the first token and the time per output token after it; output tokens/s is all
tokens generated over the level's wall time. Levels run in order and then in reverse (--repeats rounds), so
a slow phase of the shared machine touches every level; each level's figures are medians over the rounds.
"""

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.batch_throughput import PROMPTS, free_port  # noqa: E402
from benchmarks.common import cpu_flags  # noqa: E402

SCRIPT = os.path.join(ROOT, "run_generation.py")


def one_request(url, model, prompt, max_tokens):
    """(ttft, tpot, tokens) of one streaming chat request."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(choice["delta"].get("content") for choice in chunk["choices"]):
                last = time.perf_counter()
                first = first or last
    ttft = first - start
    tpot = (last - first) / (tokens - 1) if tokens > 1 else float("nan")
    return ttft, tpot, tokens


def level(url, model, clients, max_tokens):
    prompts = [PROMPTS[number % len(PROMPTS)] for number in range(2 * clients)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda prompt: one_request(url, model, prompt, max_tokens), prompts))
    wall = time.perf_counter() - start
    ttfts = sorted(result[0] for result in results)
    return {"tokens_per_s": sum(result[2] for result in results) / wall,
            "ttft_p50": statistics.median(ttfts), "ttft_p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
            "tpot": statistics.median(result[1] for result in results)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", default=None)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of (levels in order, then reversed)")
    args = parser.parse_args()

    port = free_port()
    command = [sys.executable, SCRIPT, "--serve", "--port", str(port), "--max_batch", str(max(args.clients))]
    if args.model_name_or_path:
        command += ["--model_name_or_path", args.model_name_or_path]
    server = subprocess.Popen(command, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              env=dict(os.environ, HF_HUB_OFFLINE="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        one_request(url, model, "Warm up", 4)
        order = [*args.clients, *reversed(args.clients)] * args.repeats
        figures = {clients: [] for clients in args.clients}
        for clients in order:
            figures[clients].append(level(url, model, clients, args.max_tokens))
    finally:
        server.terminate()
        server.wait(timeout=60)

    rounds = len(order) // len(args.clients)
    print(f"CPU: {cpu_flags()}; torch threads: {os.environ.get('OMP_NUM_THREADS', 'default')}; model: {model}; "
          f"{args.max_tokens} tokens per request, 2 x clients requests per level, medians of {rounds} runs")
    print(f"{'clients':>7} {'output tok/s':>12} {'x 1 client':>10} {'TTFT p50 s':>10} {'TTFT p95 s':>10} "
          f"{'TPOT ms':>8}")
    base = statistics.median(run["tokens_per_s"] for run in figures[args.clients[0]])
    for clients in args.clients:
        runs = figures[clients]
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(f"{clients:>7} {median['tokens_per_s']:>12.1f} {median['tokens_per_s'] / base:>10.2f} "
              f"{median['ttft_p50']:>10.3f} {median['ttft_p95']:>10.3f} {median['tpot'] * 1000:>8.1f}")


if __name__ == "__main__":
    main()
