"""Whole-process time of a default-model run: the first (converting the GGUF) and cached ones.

    python benchmarks/startup.py --runs 5

Each first run gets a fresh, empty cache directory; cached runs reuse one. Reports the median.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = [sys.executable, os.path.join(ROOT, "run_generation.py"), "--prompt", "The capital of France is",
           "--temperature", "0", "--length", "20"]


def timed(cache_home):
    start = time.perf_counter()
    subprocess.run(COMMAND, check=True, capture_output=True,
                   env=dict(os.environ, XDG_CACHE_HOME=cache_home, HF_HUB_OFFLINE="1"))
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--first_runs", type=int, default=3)
    args = parser.parse_args()

    first = []
    for _ in range(args.first_runs):
        with tempfile.TemporaryDirectory() as cache_home:
            first.append(timed(cache_home))
    with tempfile.TemporaryDirectory() as cache_home:
        timed(cache_home)  # builds the cache
        cached = [timed(cache_home) for _ in range(args.runs)]
    print("| run | median s | all runs s |\n|---|---|---|")
    print(f"| first (converts GGUF) | {statistics.median(first):.1f} | {', '.join(f'{t:.1f}' for t in first)} |")
    print(f"| cached | {statistics.median(cached):.1f} | {', '.join(f'{t:.1f}' for t in cached)} |")


if __name__ == "__main__":
    main()
