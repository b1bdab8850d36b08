"""Decode (tg) and prompt processing (pp) of any GGUF file, the tool against llama.cpp on the same file, paired.

    python -m benchmarks.gguf_files --model FILE [FILE ...] [--repeats 3] [--threads 2] [--tg 128] [--pp 512]
                                    [--tests tg pp] [--llama-bench LLAMA_CPP/build/bin/llama-bench]
    python -m benchmarks.gguf_files --write DIR [--families llama qwen3] [--types Q4_K_M Q6_K ...]

Measuring: every file is loaded by the tool as the command line loads it (rungen.loading.load) and run on the
engine (rungen/engine.py: the loop the command line, the session and the server decode in); llama.cpp runs the same
file through its own llama-bench (--llama-bench BINARY, one run a job) or through llama-cpp-python in a child
process of a benchmark-only virtualenv (--llama-python, driven line by line; its Python sampling loop costs about a
millisecond a token, a fifth of a small model's step), so that a round measures both back to back under the same
load. tg: a short prompt, then `--tg` new tokens greedily (no EOS), tokens per second over the decode steps after
the first token, as llama-bench's tg counts them. pp: `--pp` random token ids (the same ids for both) processed in
one call, tokens per second to the first token, as llama-bench's pp counts them. Ratios are medians of per-round
ratios. CPU flags are printed with the figures.

Writing: files in published shapes with random weights (the text is meaningless, the memory and time are real),
the default model's tokenizer as vocabulary: each family in Q4_0 and Q8_0 as the gguf package writes them (random
blocks with valid fp16 scales), then every other type by llama.cpp's own quantizer (llama_model_quantize, with
allow_requantize), as published files are made; and the default model itself requantized.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.common import cpu_flags  # noqa: E402

BENCH_PYTHON = "/work/bench-venv/bin/python"

# Published shapes (config.json of each family's model of about 1-2B parameters); vocabulary: the default model's.
FAMILIES = {
    "llama": dict(arch="llama", layers=22, hidden=2048, ffn=5632, heads=32, kv_heads=4, head_dim=64,
                  rope_base=10000.0, eps=1e-5, tied=False),  # TinyLlama-1.1B
    "qwen3": dict(arch="qwen3", layers=28, hidden=2048, ffn=6144, heads=16, kv_heads=8, head_dim=128,
                  rope_base=1000000.0, eps=1e-6, tied=True, qk_norm=True),  # Qwen3-1.7B
}
# llama.cpp's file types (llama_ftype) by the names its quantizer uses.
FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q3_K_M": 12, "IQ4_XS": 30, "Q4_K_S": 14,
          "Q5_0": 8, "Q2_K": 10}

LLAMA_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
path, threads = sys.argv[1], int(sys.argv[2])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512, verbose=False)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    llm.reset()
    if job["kind"] == "pp":
        start = time.perf_counter()
        llm.eval(job["ids"])
        print(json.dumps({"tokens_per_s": len(job["ids"]) / (time.perf_counter() - start)}), flush=True)
        continue
    stamps = []
    for token in llm.generate(job["ids"], top_k=1, temp=0.0, repeat_penalty=1.0):
        stamps.append(time.perf_counter())
        if len(stamps) == job["new_tokens"]:
            break
    print(json.dumps({"tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}), flush=True)
"""


class LlamaCpp:
    def __init__(self, python, path, threads):
        self.child = subprocess.Popen([python, "-c", LLAMA_CHILD, path, str(threads)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        json.loads(self.child.stdout.readline())

    def run(self, kind, ids, new_tokens=0):
        self.child.stdin.write(json.dumps({"kind": kind, "ids": ids, "new_tokens": new_tokens}) + "\n")
        self.child.stdin.flush()
        return json.loads(self.child.stdout.readline())["tokens_per_s"]

    def close(self):
        self.child.stdin.close()
        self.child.wait()


class LlamaBench:
    """llama.cpp's own llama-bench (built from the source llama-cpp-python vendors), one run a job: no Python in
    its decode loop, the fairer reference for a small model whose step takes a few milliseconds."""

    def __init__(self, binary, path, threads):
        self.binary, self.path, self.threads = binary, path, threads

    def run(self, kind, ids, new_tokens=0):
        sizes = ["-p", str(len(ids)), "-n", "0"] if kind == "pp" else ["-p", "0", "-n", str(new_tokens)]
        out = subprocess.run([self.binary, "-m", self.path, "-t", str(self.threads), "-r", "1", "-o", "json", *sizes],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout)[0]["avg_ts"]

    def close(self):
        pass


class Tool:
    def __init__(self, path):
        import torch

        from rungen.engine import Engine
        from rungen.loading import load

        self.loaded = load(path, device=torch.device("cpu"))
        self.engine = Engine(self.loaded, max_batch=16, max_queue=16, prefix_cache_bytes=0, eos_ids=())

    def _request(self, ids, new_tokens):
        from rungen.engine import Request, Sampling

        request = Request(list(ids), new_tokens, Sampling(temperature=0), deltas=False, sink=lambda event: None)
        start = time.perf_counter()
        self.engine.submit(request)
        self.engine.run_here()
        return start, request.first_token_at, time.perf_counter()

    def run(self, kind, ids, new_tokens=0):
        if kind == "pp":
            start, first, _ = self._request(ids, 1)
            return len(ids) / (first - start)
        _, first, end = self._request(ids, new_tokens)
        return (new_tokens - 1) / (end - first)

    def close(self):
        pass


def has_llama_cpp(python):
    try:
        return subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0
    except OSError:  # no such interpreter
        return False


def measure(path, args):
    import random

    import torch

    torch.set_num_threads(args.threads)
    tool = Tool(path)
    vocab = len(tool.loaded.tokenizer)
    rng = random.Random(0)
    pp_ids = [rng.randrange(vocab) for _ in range(args.pp)]
    tg_ids = tool.loaded.tokenizer("The capital of France is")["input_ids"]
    runners = {"tool": tool}
    if args.llama_bench:
        runners["llama.cpp"] = LlamaBench(args.llama_bench, path, args.threads)
    elif has_llama_cpp(args.llama_python):
        runners["llama.cpp"] = LlamaCpp(args.llama_python, path, args.threads)
    else:
        print(f"no llama.cpp column: {args.llama_python} cannot import llama_cpp", file=sys.stderr)
    jobs = {"tg": lambda r: r.run("tg", tg_ids, args.tg), "pp": lambda r: r.run("pp", pp_ids)}
    jobs = {kind: job for kind, job in jobs.items() if kind in args.tests}
    for runner in runners.values():  # warm-up, uncounted
        runner.run("tg", tg_ids, 8)
        runner.run("pp", pp_ids[:64])
    results = {(name, kind): [] for name in runners for kind in jobs}
    for _ in range(args.repeats):
        for kind, job in jobs.items():
            for name, runner in runners.items():
                results[name, kind].append(job(runner))
    for runner in runners.values():
        runner.close()
    rows = []
    for kind in jobs:
        tool_speeds = results["tool", kind]
        ref = results.get(("llama.cpp", kind))
        ratio = statistics.median(t / r for t, r in zip(tool_speeds, ref)) if ref else None
        rows.append((kind, statistics.median(tool_speeds), statistics.median(ref) if ref else None, ratio))
    return rows


def quantize_with_llama_cpp(source, target, ftype):
    code = ("import sys, llama_cpp\n"
            "p = llama_cpp.llama_model_quantize_default_params()\n"
            f"p.ftype = {ftype}\np.allow_requantize = True\np.nthread = 2\n"
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
    subprocess.run([BENCH_PYTHON, "-c", code, source, target + ".tmp"], check=True, capture_output=True)
    os.replace(target + ".tmp", target)


def write_family(path, family, qtype_name, tokenizer_source):
    """A model of `family`'s published shape with random weights, every matrix in `qtype_name` (Q4_0 or Q8_0)
    blocks with valid fp16 scales, norms float32 ones, the head Q6_K as llama.cpp's Q4_0 files have it."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
    from gguf import GGMLQuantizationType as Q

    shape = FAMILIES[family]
    qtype = Q[qtype_name]
    fields = [(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
              for key, field in GGUFReader(tokenizer_source).fields.items() if key.startswith("tokenizer.")]
    vocab = next(len(value) for key, value, *_ in fields if key == "tokenizer.ggml.tokens")
    rng = np.random.default_rng(0)
    arch = shape["arch"]
    writer = GGUFWriter(path, arch, use_temp_file=True)
    writer.add_name(f"Random {family}-shaped")
    writer.add_context_length(4096)
    writer.add_embedding_length(shape["hidden"])
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_key_length(shape["head_dim"])
    writer.add_value_length(shape["head_dim"])
    writer.add_layer_norm_rms_eps(shape["eps"])
    writer.add_rope_freq_base(shape["rope_base"])
    writer.add_rope_dimension_count(shape["head_dim"])
    writer.add_vocab_size(vocab)
    writer.add_file_type({"Q4_0": 2, "Q8_0": 7}[qtype_name])
    for key, value, vtype, sub_type in fields:
        writer.add_key_value(key, value, vtype, sub_type)

    def blocks(name, rows, cols, kind, scale):
        block, size = GGML_QUANT_SIZES[kind]
        data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        d = np.full(data.shape[:2], scale, dtype=np.float16).view(np.uint8).reshape(*data.shape[:2], 2)
        if kind == Q.Q6_K:
            data[..., -2:] = d
        else:
            data[..., :2] = d
        writer.add_tensor(name, data.reshape(rows, -1), raw_dtype=kind)

    hidden, ffn, hd = shape["hidden"], shape["ffn"], shape["head_dim"]
    q_rows, kv_rows = shape["heads"] * hd, shape["kv_heads"] * hd
    small = 0.002 if qtype == Q.Q4_0 else 0.0002
    blocks("token_embd.weight", vocab, hidden, qtype, small * 5)
    for layer in range(shape["layers"]):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hidden, dtype=np.float32))
        if shape.get("qk_norm"):
            for norm in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hd, dtype=np.float32))
        for part, rows, cols in (("attn_q", q_rows, hidden), ("attn_k", kv_rows, hidden), ("attn_v", kv_rows, hidden),
                                 ("attn_output", hidden, q_rows), ("ffn_gate", ffn, hidden),
                                 ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            blocks(f"blk.{layer}.{part}.weight", rows, cols, qtype, small)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    if not shape["tied"]:
        blocks("output.weight", vocab, hidden, Q.Q6_K, 0.0005)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write(args):
    from rungen.loading import default_model_file

    os.makedirs(args.write, exist_ok=True)
    default = default_model_file()
    written = []
    for family in args.families:
        bases = {}
        for base in ("Q4_0", "Q8_0"):
            bases[base] = os.path.join(args.write, f"{family}-{base}.gguf")
            if not os.path.exists(bases[base]):
                print(f"writing {bases[base]}", file=sys.stderr, flush=True)
                write_family(bases[base] + ".tmp", family, base, default)
                os.replace(bases[base] + ".tmp", bases[base])
        for name in args.types:
            target = os.path.join(args.write, f"{family}-{name}.gguf")
            if name not in bases and not os.path.exists(target):
                print(f"writing {target} (llama.cpp's quantizer)", file=sys.stderr, flush=True)
                quantize_with_llama_cpp(bases["Q8_0"], target, FTYPES[name])
            written.append(target)
    for name in args.types:
        target = os.path.join(args.write, f"default-{name}.gguf")
        if not os.path.exists(target):
            print(f"writing {target} (llama.cpp's quantizer)", file=sys.stderr, flush=True)
            quantize_with_llama_cpp(default, target, FTYPES[name])
        written.append(target)
    print("\n".join(written))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="*", default=[], help="GGUF files to measure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tg", type=int, default=128, help="new tokens of the decode row")
    parser.add_argument("--pp", type=int, default=512, help="prompt tokens of the prompt-processing row")
    parser.add_argument("--tests", nargs="+", choices=("tg", "pp"), default=["tg", "pp"],
                        help="the rows to measure (--tests pp: prompt processing alone)")
    parser.add_argument("--llama-python", default=BENCH_PYTHON)
    parser.add_argument("--llama-bench", metavar="BINARY", help="llama.cpp's llama-bench as the reference instead of "
                        "llama-cpp-python (whose Python sampling loop costs a small model's decode ~1 ms a token)")
    parser.add_argument("--write", metavar="DIR", help="write the synthetic files into DIR instead")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--types", nargs="*", default=["Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "IQ4_XS", "Q8_0",
                                                       "Q4_0"], choices=list(FTYPES))
    args = parser.parse_args()
    if args.write:
        write(args)
        return
    reference = f"llama-bench ({args.llama_bench})" if args.llama_bench else f"llama-cpp-python ({args.llama_python})"
    print(f"CPU flags: {cpu_flags()}; {args.threads} threads; tg{args.tg}, pp{args.pp}; median of {args.repeats} "
          f"paired rounds; llama.cpp: {reference}")
    print("")
    print("| file | test | tool tok/s | llama.cpp tok/s | ratio |")
    print("| --- | --- | ---: | ---: | ---: |")
    for path in args.model:
        try:
            rows = measure(path, args)
        except Exception as error:  # one file's failure (a refused type) is a row, not the end of the table
            print(f"| {os.path.basename(path)} | - | {type(error).__name__}: {str(error).splitlines()[0][:80]} | | |",
                  flush=True)
            continue
        for kind, tool, ref, ratio in rows:
            ref_s = f"{ref:.1f}" if ref else "-"
            ratio_s = f"{ratio:.2f}x" if ratio else "-"
            print(f"| {os.path.basename(path)} | {kind}{args.tg if kind == 'tg' else args.pp} | {tool:.1f} | "
                  f"{ref_s} | {ratio_s} |", flush=True)


if __name__ == "__main__":
    main()
