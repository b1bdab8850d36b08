"""Throughput of prompts piped through stdin, one batch size against others, in one run.

    python -m benchmarks.batch_throughput                   # default model, 32 prompts, sizes 1 and 16 (the default)
    python -m benchmarks.batch_throughput --sizes 1 4 8 16 32 --processes 1 2
    python -m benchmarks.batch_throughput --sizes 16 --scripts run_generation.py ../before/run_generation.py

Each size runs the real CLI on the same 32 prompts (greedy, jsonl). Tokens/s counts the tokens the
model generated (jsonl's num_generated_tokens) over the generation time the tool reports on stderr,
so model loading is left out. Runs alternate between sizes and the median of --repeats is kept.
"""

import argparse
import importlib.metadata
import json
import os
import re
import socket
import statistics
import subprocess
import sys

from benchmarks.common import cpu_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "run_generation.py")

# 32 prompts of mixed lengths, as a real prompt file has.
SUBJECTS = ["The capital of France", "A good breakfast", "The history of the bicycle", "Python decorators",
            "The water cycle", "My favourite book", "Photosynthesis", "The moon landing"]
FORMS = ["{} is", "Write one sentence about {}:", "Here is a short story about {}. Once upon a time,",
         "Explain to a child what {} means, in simple words, step by step:"]
PROMPTS = [form.format(subject) for subject in SUBJECTS for form in FORMS]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script, batch_size, processes, length, extra):
    command = [sys.executable, script]
    if processes > 1:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                   str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", str(free_port()), script]
    command += ["--temperature", "0", "--length", str(length), "--output_format", "jsonl",
                "--batch_size", str(batch_size), *extra]
    result = subprocess.run(command, input="\n".join(PROMPTS).encode(), capture_output=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if result.returncode != 0:
        sys.exit(result.stderr.decode()[-2000:])
    tokens = sum(json.loads(line)["num_generated_tokens"] for line in result.stdout.decode().splitlines())
    figures = re.search(r"Generated \d+ tokens in ([\d.]+) s", result.stderr.decode())
    if figures is None:
        sys.exit(f"{' '.join(command[-len(extra) - 9:])}: no line of figures on stderr (--quiet hides it)")
    return tokens, float(figures.group(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--processes", type=int, nargs="+", default=[1])
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scripts", nargs="+", default=[SCRIPT],
                        help="run_generation.py of each checkout to compare (another commit's worktree)")
    parser.add_argument("extra", nargs="*", help="more run_generation.py flags, after --")
    args = parser.parse_args()

    configs = [(script, size, processes) for script in args.scripts for processes in args.processes
               for size in args.sizes]
    samples = {config: [] for config in configs}
    for _ in range(args.repeats):
        for config in configs:
            samples[config].append(run(*config, args.length, args.extra))
            print(f"  {config[0]}, batch {config[1]}, {config[2]} process(es): {samples[config][-1]}", file=sys.stderr)

    base = None
    print(f"{len(PROMPTS)} prompts, --length {args.length}, greedy, median of {args.repeats}; torch "
          f"{importlib.metadata.version('torch')}, CPU flags {cpu_flags()}\n")
    print("| script | processes | batch size | tokens | generation s | tokens/s | vs first row |")
    print("|---|---|---|---|---|---|---|")
    for config in configs:
        tokens = samples[config][0][0]
        seconds = statistics.median(s for _, s in samples[config])
        rate = tokens / seconds
        base = base or rate
        ratio = f"{rate / base:.2f}x"
        script = os.path.relpath(config[0])
        print(f"| {script} | {config[2]} | {config[1]} | {tokens} | {seconds:.2f} | {rate:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
