"""Peak memory and time to the first token of GGUF files run in their own blocks, against the import floor
and llama.cpp, each run a fresh process.

    python -m benchmarks.gguf_load [--skip-big] [--dequantize] [--workdir /tmp/gguf_bench]
    python -m benchmarks.gguf_load --model FILE [FILE ...] [--repeats 0]

Files: the default model's (SmolLM2-135M Q4_1, embedding Q8_0), and a llama of TinyLlama's shape
(22 layers, hidden 2048, ffn 5632, 32 heads, 4 kv heads; 1.1B parameters, vocabulary = the default
model's tokenizer, 49152) with random weights, written here under --workdir: in Q4_0 as llama.cpp's Q4_0
files are (token_embd Q4_0, output Q6_K; random blocks with valid fp16 scales), and, when llama-cpp-python
is installed in /work/bench-venv, turned into a real Q4_K_M mix by llama.cpp's own llama_model_quantize. Or,
with --model, the files given (e.g. those `benchmarks.gguf_files --write` makes: every type and family).

Rows: the floor (`import torch, transformers` and the llama modeling module); the tool's first run (empty
cache: the header is read and cached) and a repeat run, each loading with rungen.loading.load and
generating one token greedily from "The capital of France is"; with --dequantize, the float path as well;
llama.cpp (llama-cpp-python, same prompt, one token) beside them. Each row: seconds to the model loaded,
seconds to the first token, peak RSS (VmHWM of the process), from the process's start.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BENCH_PYTHON = "/work/bench-venv/bin/python"
PROMPT = "The capital of France is"


def peak_mb():
    """This process's peak RSS: VmHWM, its own image's (ru_maxrss would also count the pages it shared with the
    parent at fork, which has written the big files)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def process_start():
    """perf_counter's reading at the moment the parent started this process (BENCH_T0, wall clock): every row
    counts from its process's start, the interpreter's and the imports' time included."""
    return time.perf_counter() - (time.time() - float(os.environ["BENCH_T0"]))


def child_floor(start):
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    return {"ready_s": time.perf_counter() - start, "first_token_s": None, "peak_mb": peak_mb()}


def child_tool(start, path, dequantize):
    import torch

    from rungen.loading import load

    loaded = load(path, device=torch.device("cpu"), dequantize=dequantize)
    ready, ready_mb = time.perf_counter() - start, peak_mb()
    ids = loaded.tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():  # the first token greedily: a forward pass (the own GGUF model has no generate())
        loaded.model(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits[:, -1].argmax(-1)
    return {"ready_s": ready, "ready_mb": ready_mb, "first_token_s": time.perf_counter() - start,
            "peak_mb": peak_mb()}


LLAMA_CPP_CHILD = """
import json, os, sys, time
start = time.perf_counter() - (time.time() - float(os.environ["BENCH_T0"]))
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=int(sys.argv[2]), verbose=False)
ready = time.perf_counter() - start
llm(sys.argv[3], max_tokens=1, temperature=0)
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
print(json.dumps({"ready_s": ready, "first_token_s": time.perf_counter() - start, "peak_mb": peak}))
"""


def run_child(args, cache_home):
    """One fresh process; its JSON line of figures."""
    env = dict(os.environ, XDG_CACHE_HOME=cache_home, HF_HUB_OFFLINE="1", BENCH_T0=repr(time.time()))
    out = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"child failed: {' '.join(args)}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def tool_row(path, cache_home, dequantize=False):
    args = [sys.executable, "-m", "benchmarks.gguf_load", "--child", "tool", "--path", path or ""]
    return run_child(args + (["--dequantize"] if dequantize else []), cache_home)


QUANTIZE_CHILD = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
params.allow_requantize = True
params.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""


def has_llama_cpp():
    return os.path.exists(BENCH_PYTHON) and subprocess.run(
        [BENCH_PYTHON, "-c", "import llama_cpp"], capture_output=True).returncode == 0


def show(label, row, file_mb=None, floor=None):
    first = f"{row['first_token_s']:6.2f}" if row.get("first_token_s") is not None else "     -"
    ready_mb = f"{row['ready_mb']:9.0f}" if row.get("ready_mb") is not None else "        -"
    line = f"{label:<44} {row['ready_s']:7.2f} {first} {ready_mb} {row['peak_mb']:9.0f}"
    if file_mb and floor:
        line += f"   peak/(1.5 file + floor) {row['peak_mb'] / (1.5 * file_mb + floor['peak_mb']):.2f}"
    print(line, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=["floor", "tool"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--dequantize", action="store_true", help="also the float path (slow: minutes)")
    parser.add_argument("--skip-big", action="store_true", help="only the default model's file")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "gguf_bench"))
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--model", nargs="+", help="these GGUF files instead of the default list")
    parser.add_argument("--repeats", type=int, default=2, help="repeat runs (cached header) after the first")
    args = parser.parse_args()
    if args.child:
        start = process_start()
        row = child_floor(start) if args.child == "floor" else child_tool(start, args.path or None, args.dequantize)
        print(json.dumps(row))
        return

    from benchmarks.common import cpu_flags  # torch and transformers: the parent's imports, not a child's
    from benchmarks.gguf_files import write_family
    from rungen.loading import default_model_file

    print(f"CPU flags: {cpu_flags()}; cores: {os.cpu_count()}; load average {os.getloadavg()[0]:.1f}")
    os.makedirs(args.workdir, exist_ok=True)
    default = default_model_file()
    files = {"default model (SmolLM2-135M Q4_1)": default}
    if args.model:
        missing = [path for path in args.model if not os.path.isfile(path)]
        if missing:
            sys.exit(f"{sys.argv[0]}: error: --model {missing[0]}: no such file")
        files = {os.path.basename(path): os.path.abspath(path) for path in args.model}
    elif not args.skip_big:
        q4_0 = os.path.join(args.workdir, "tinyllama-shape-Q4_0.gguf")
        if not os.path.exists(q4_0):
            print(f"writing {q4_0} ...", file=sys.stderr, flush=True)
            write_family(q4_0 + ".tmp", "llama", "Q4_0", default)
            os.replace(q4_0 + ".tmp", q4_0)
        files["1.1B random Q4_0"] = q4_0
        if has_llama_cpp():
            q4_k_m = os.path.join(args.workdir, "tinyllama-shape-Q4_K_M.gguf")
            if not os.path.exists(q4_k_m):
                print(f"writing {q4_k_m} (llama.cpp's llama_model_quantize) ...", file=sys.stderr, flush=True)
                subprocess.run([BENCH_PYTHON, "-c", QUANTIZE_CHILD, q4_0, q4_k_m + ".tmp"], check=True,
                               capture_output=True)
                os.replace(q4_k_m + ".tmp", q4_k_m)
            files["1.1B random Q4_K_M (llama.cpp's mix)"] = q4_k_m
        else:
            print("llama-cpp-python is not in /work/bench-venv: no Q4_K_M file, no llama.cpp rows", file=sys.stderr)

    cache = tempfile.mkdtemp(prefix="gguf_bench_cache_")
    try:
        floor = run_child([sys.executable, "-m", "benchmarks.gguf_load", "--child", "floor"], cache)
        print(f"{'row':<44} {'ready':>7} {'token':>6} {'ready MB':>9} {'peak MB':>9}   (seconds from process start; "
              "MB: peak RSS when loaded, and after the first token)")
        show("import floor (torch, transformers, llama)", floor)
        for label, path in files.items():
            file_mb = os.path.getsize(path) / 2**20
            print(f"--- {label}: {file_mb:.0f} MB; goals: peak <= {1.5 * file_mb + floor['peak_mb']:.0f} MB, "
                  f"repeat first token <= {floor['ready_s'] + 2:.1f} s")
            tool_path = None if path == default else path
            show("tool, first run (header read and cached)", tool_row(tool_path, cache), file_mb, floor)
            for repeat in range(args.repeats):  # each beside a fresh floor: the shared CPU's load drifts
                paired = run_child([sys.executable, "-m", "benchmarks.gguf_load", "--child", "floor"], cache)
                row = tool_row(tool_path, cache)
                show(f"tool, repeat run {repeat + 1}", row, file_mb, floor)
                print(f"{'':<8}loaded {row['ready_s'] - paired['ready_s']:+.2f} s over the floor run just before it "
                      f"({paired['ready_s']:.2f} s)", flush=True)
            if args.dequantize:
                show("tool --dequantize, first run", tool_row(tool_path, cache, True), file_mb, floor)
                if path == default:
                    show("tool --dequantize, cached float32 conversion", tool_row(None, cache, True), file_mb,
                         floor)
            if has_llama_cpp():
                row = run_child([BENCH_PYTHON, "-c", LLAMA_CPP_CHILD, path, str(args.threads), PROMPT], cache)
                show("llama.cpp (llama-cpp-python)", row, file_mb, floor)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
