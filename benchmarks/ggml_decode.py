"""Decode speed of the default model as the tool runs it (its GGUF file's own blocks), beside --dequantize
(float32), --quantize int4 and llama.cpp on the same file, in one run.

    python -m benchmarks.ggml_decode [--new-tokens 128] [--repeats 3] [--threads 2] [--jit] [--batch 4 16]
    ATEN_CPU_CAPABILITY=avx2 python -m benchmarks.ggml_decode --isa avx2 --llama-python AVX2_BUILD/bin/python

Every torch row is a model loaded by the tool's own rungen.loading.load, as the command line loads it for
those flags, decoding through generate(), except "on the engine": the same model through rungen/engine.py,
as the command line, the session and the server decode it. --jit adds the traced rows (the tool's --jit, its
tracing time printed). llama.cpp runs through
llama-cpp-python in a separate virtualenv (--llama-python, a benchmark-only install) as a child process
driven line by line, so its runs interleave with the others. Same prompt, greedy, batch 1, every mode once
a repeat, back to back; ratios are medians of per-repeat ratios (the machine may be shared). --batch adds
rows of several prompts at once (new tokens per second over the whole batch), torch modes only.

--isa avx2 on an AVX-512 machine runs the AVX2 code paths there: the tool's kernels by --isa, torch's own by
ATEN_CPU_CAPABILITY=avx2 (read when torch is imported, so set in the environment), and llama.cpp from a build
without AVX-512 (GGML_NATIVE=OFF GGML_AVX512=OFF). Same cores and memory: it compares code, not machines.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from benchmarks.common import at_least, command, cpu_flags, has_llama_cpp, load_float32, run_interleaved
from benchmarks.gguf_files import set_isa
from benchmarks.quantized_decode import PROMPT, Mode
from rungen.gguf import native_kernels
from rungen.loading import default_model_file, load

LLAMA_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    new_tokens = int(line)
    llm.reset()
    tokens = llm.tokenize(prompt.encode())
    out, stamps = [], []
    start = time.perf_counter()
    for token in llm.generate(tokens, top_k=1, temp=0.0, repeat_penalty=1.0):
        stamps.append(time.perf_counter())
        out.append(token)
        if len(out) == new_tokens:
            break
    print(json.dumps({"tokens_per_s": new_tokens / (stamps[-1] - start),
                      "ms_per_token": (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3,
                      "text": llm.detokenize(out).decode(errors="replace")}), flush=True)
"""


class LlamaCpp:
    """llama.cpp on the very GGUF file, in a child process of the virtualenv that has llama-cpp-python."""

    name = "llama.cpp (same GGUF)"

    def __init__(self, python, threads):
        self.child = subprocess.Popen([python, "-c", LLAMA_CHILD, default_model_file(), str(threads), PROMPT],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        json.loads(self.child.stdout.readline())
        self.tokens_per_s, self.ms_per_token, self.text = [], [], None

    def run(self, new_tokens):
        self.child.stdin.write(f"{new_tokens}\n")
        self.child.stdin.flush()
        result = json.loads(self.child.stdout.readline())
        self.tokens_per_s.append(result["tokens_per_s"])
        self.ms_per_token.append(result["ms_per_token"])
        self.text = result["text"]


class EngineMode:
    """The default model as the command line and the server run it: prompts through the engine
    (rungen/engine.py), greedy, every new token decoded (no EOS, as llama.cpp's loop here)."""

    def __init__(self, name, loaded):
        from rungen.engine import Engine

        self.name, self.loaded = name, loaded
        self.engine = Engine(loaded, max_batch=64, max_queue=64, prefix_cache_bytes=0, eos_ids=())
        self.tokens_per_s, self.ms_per_token, self.text = [], [], None

    def generate(self, batch, new_tokens):
        from rungen.requests import Done, Request
        from rungen.sampling import Sampling

        ids = self.loaded.tokenizer(PROMPT)["input_ids"]
        finishes = []
        requests = [Request(ids, new_tokens, Sampling(temperature=0), deltas=False,
                            sink=lambda event: isinstance(event, Done) and finishes.append(event.finish))
                    for _ in range(batch)]
        start = time.perf_counter()
        for request in requests:
            self.engine.submit(request)
        self.engine.run_here()
        return start, time.perf_counter(), requests[0].first_token_at, finishes

    def run(self, new_tokens):
        start, end, first, finishes = self.generate(1, new_tokens)
        self.tokens_per_s.append(new_tokens / (end - start))
        self.ms_per_token.append((end - first) / (new_tokens - 1) * 1e3)
        self.text = finishes[0].text

    def batch_speed(self, batch, new_tokens):
        start, end, _, _ = self.generate(batch, new_tokens)
        return batch * new_tokens / (end - start)


def batch_speed(model, tokenizer, batch, new_tokens):
    """New tokens per second over a batch of `batch` copies of the prompt (greedy, no early stop)."""
    enc = tokenizer([PROMPT] * batch, return_tensors="pt")
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=new_tokens, eos_token_id=None, do_sample=False)
    return batch * new_tokens / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="*", default=[])
    parser.add_argument("--jit", action="store_true", help="also a GGUF-blocks row with --jit")
    parser.add_argument("--llama-python", default="/work/bench-venv/bin/python")
    parser.add_argument("--isa", choices=("amx", "avx512vnni", "avx2", "scalar"),
                        help="the tool's kernel path (default: the best the CPU has)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not native_kernels():
        sys.exit("the native kernels are not available")
    if args.isa:
        set_isa(args.isa)  # one line where this CPU or build has no such path, and torch's own ops on the same

    cpu = torch.device("cpu")
    float32 = load_float32()
    tokenizer = float32.tokenizer
    modes = [Mode("--dequantize (float32)", float32.model, tokenizer),
             Mode("--quantize int4", load(None, device=cpu, quantize="int4").model, tokenizer),
             Mode("default through generate()", load(None, device=cpu, own_model=False).model, tokenizer),
             EngineMode("default on the engine (the command line, the server)", load(None, device=cpu))]
    traced = {}
    if args.jit:
        # The default mode is not traced with --jit (its stack is one native call a step): no row of its own.
        for name, quantize in (("--quantize int4 --jit", "int4"),):
            model = load(None, device=cpu, quantize=quantize).model
            start = time.perf_counter()
            modes.append(Mode(name, model, tokenizer, jit=True))
            traced[name] = time.perf_counter() - start
    reference = None
    if has_llama_cpp(args.llama_python):
        reference = LlamaCpp(args.llama_python, args.threads)
        modes.append(reference)
    else:
        print(f"no llama.cpp row: {args.llama_python} cannot import llama_cpp", file=sys.stderr)

    run_interleaved(modes, args.repeats, args.new_tokens)

    med = statistics.median
    print(f"default model (SmolLM2-135M-Instruct), {args.new_tokens} new tokens, greedy, batch 1, "
          f"{args.threads} threads, median of {args.repeats}, torch {torch.__version__}, "
          f"kernel path {torch.ops.rungen_ggml.isa()}, torch's CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print(f"CPU flags: {cpu_flags()}")
    print("")
    print("| mode | tokens/s | vs llama.cpp | decode ms/token |")
    print("| --- | ---: | ---: | ---: |")
    for mode in modes:
        ratio = "-"
        if reference:
            ratio = f"{med([s / r for s, r in zip(mode.tokens_per_s, reference.tokens_per_s)]):.2f}x"
        print(f"| {mode.name} | {med(mode.tokens_per_s):.1f} | {ratio} | {med(mode.ms_per_token):.1f} |")
    print("")
    for name, seconds in traced.items():
        print(f"{name}: traced in {seconds:.1f} s (once a run, before the first prompt)")
    for mode in modes:
        print(f"{mode.name}: {mode.text[:70]!r}")
    if args.batch:
        torch_modes = [m for m in modes if m is not reference and "--jit" not in m.name]
        print("")
        print(f"| batch | {' | '.join(m.name + ' tokens/s' for m in torch_modes)} |")
        print(f"| ---: | {' | '.join('---:' for _ in torch_modes)} |")
        for batch in args.batch:
            speeds = [[] for _ in torch_modes]
            for _ in range(args.repeats):
                for speed, mode in zip(speeds, torch_modes):
                    speed.append(mode.batch_speed(batch, args.new_tokens // 4) if isinstance(mode, EngineMode)
                                 else batch_speed(mode.model, tokenizer, batch, args.new_tokens // 4))
            print(f"| {batch} | {' | '.join(f'{med(s):.1f}' for s in speeds)} |")
    if reference:
        reference.child.stdin.close()
        reference.child.wait()


if __name__ == "__main__":
    command(main)
