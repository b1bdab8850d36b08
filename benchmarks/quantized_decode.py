"""Decode speed of the default model in every speed mode, and llama.cpp on the same GGUF file, in one run.

    python -m benchmarks.quantized_decode [--new-tokens 128] [--repeats 3] [--threads 2]

Rows: float32 eager, --jit, --quantize int8 / int4 with and without --jit, and llama.cpp through
llama-cpp-python when it is installed (benchmark only, not a requirement: `pip install llama-cpp-python`
builds it from source in several minutes). Same prompt, greedy, batch 1, the modes interleaved and
each figure a median over repeats, as the machine is shared. tokens/s counts new tokens over the whole
generate call (prompt pass included), as the tool's own report does; decode ms/token is timed between
steps. "vs llama.cpp" is the median of per-repeat ratios: each repeat runs every mode once, back to
back, so a ratio compares runs made under the same load on a shared machine. "GB/s" is the weight
bytes a decode step reads over its time, beside the read bandwidth this machine reaches in a plain
tensor sum measured in the same run: that ratio is how close a mode comes to the memory-bound limit.
"""

import argparse
import copy
import importlib.util
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import LogitsProcessorList

from benchmarks.common import StepClock, at_least, command, cpu_flags, load_float32, run_interleaved
from rungen.jit import enable_jit
from rungen.loading import default_model_file
from rungen.quantize import Fp16Linear, quantize_model

PROMPT = "Once upon a time, in a small village by the sea,"
def read_bandwidth(size_mb=512, repeats=5):
    """GB/s of a plain float32 sum over a tensor far larger than the caches."""
    data = torch.ones(size_mb * 2**20 // 4)
    data.sum()
    seconds = min(_timed(data.sum) for _ in range(repeats))
    return data.numel() * 4 / seconds / 1e9


def _timed(function):
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def weight_bytes(model):
    """Bytes a decode step reads: every parameter and buffer, but of the input embedding only one row,
    unless the output head reads all of it (tied weights); plus the float16 head fbgemm keeps packed
    outside the module's buffers."""
    def table(module):  # a float weight, or a GGUF layer's blocks
        return getattr(module, "weight", None) if getattr(module, "weight", None) is not None \
            else getattr(module, "blocks", None)

    embedding, head = table(model.get_input_embeddings()), table(model.get_output_embeddings())
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    if head is None or head.data_ptr() != embedding.data_ptr():
        tensors.pop(embedding.data_ptr())
    packed = sum(m.out_features * m.in_features * 2 for m in model.modules() if isinstance(m, Fp16Linear))
    return sum(t.numel() * t.element_size() for t in tensors.values()) + packed


class Mode:
    def __init__(self, name, model, tokenizer, quantize=None, jit=False):
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.tokens_per_s, self.ms_per_token, self.text = [], [], None
        if quantize:
            quantize_model(model, quantize)
        if jit:
            enable_jit(model, tokenizer)
        self.bytes = weight_bytes(model)

    def run(self, new_tokens):
        enc = self.tokenizer([PROMPT], return_tensors="pt")
        clock = StepClock()
        start = time.perf_counter()
        with torch.inference_mode():
            # eos_token_id=None runs all new_tokens as llama.cpp's loop does; min_new_tokens would too,
            # but its processor tests the whole vocabulary against EOS every step (~1 ms here).
            out = self.model.generate(**enc, max_new_tokens=new_tokens, eos_token_id=None, do_sample=False,
                                      logits_processor=LogitsProcessorList([clock]))
        total = time.perf_counter() - start
        self.tokens_per_s.append(new_tokens / total)
        self.ms_per_token.append((clock.stamps[-1] - clock.stamps[0]) / (len(clock.stamps) - 1) * 1e3)
        self.text = self.tokenizer.decode(out[0, enc["input_ids"].shape[1]:])


class LlamaCpp:
    """llama.cpp on the very GGUF file the default model comes from."""

    name = "llama.cpp (same GGUF)"

    def __init__(self, threads):
        from llama_cpp import Llama

        path = default_model_file()
        self.llm = Llama(model_path=path, n_threads=threads, n_ctx=512, verbose=False)
        self.bytes = os.path.getsize(path)
        self.tokens_per_s, self.ms_per_token, self.text = [], [], None

    def run(self, new_tokens):
        self.llm.reset()
        tokens = self.llm.tokenize(PROMPT.encode())
        out, stamps = [], []
        start = time.perf_counter()
        for token in self.llm.generate(tokens, top_k=1, temp=0.0, repeat_penalty=1.0):
            stamps.append(time.perf_counter())
            out.append(token)
            if len(out) == new_tokens:
                break
        self.tokens_per_s.append(new_tokens / (stamps[-1] - start))
        self.ms_per_token.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3)
        self.text = self.llm.detokenize(out).decode(errors="replace")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=None, help="a subset of the row names")
    args = parser.parse_args()
    names = ("float32 eager", "float32 --jit", "int8", "int8 --jit", "int4", "int4 --jit")
    unknown = [name for name in args.modes or () if name not in names]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; known: {', '.join(names)}")
    torch.set_num_threads(args.threads)

    loaded = load_float32()  # the tool's load(): the default model de-quantized, as --dequantize runs it
    tokenizer, base = loaded.tokenizer, loaded.model
    specs = [("float32 eager", None, False), ("float32 --jit", None, True), ("int8", "int8", False),
             ("int8 --jit", "int8", True), ("int4", "int4", False), ("int4 --jit", "int4", True)]
    modes = [Mode(name, copy.deepcopy(base), tokenizer, quantize, jit) for name, quantize, jit in specs
             if not args.modes or name in args.modes]
    if importlib.util.find_spec("llama_cpp"):
        modes.append(LlamaCpp(args.threads))
    else:
        print("llama-cpp-python is not installed: no llama.cpp row", file=sys.stderr)

    bandwidth = read_bandwidth()
    run_interleaved(modes, args.repeats, args.new_tokens)
    bandwidth = max(bandwidth, read_bandwidth())

    med = statistics.median
    reference = next((m for m in modes if isinstance(m, LlamaCpp)), None)
    print(f"default model (SmolLM2-135M-Instruct), {args.new_tokens} new tokens, greedy, batch 1, "
          f"{args.threads} threads, median of {args.repeats}, torch {torch.__version__}")
    print(f"CPU flags: {cpu_flags()}; read bandwidth (tensor sum): {bandwidth:.1f} GB/s")
    print("")
    print("| mode | tokens/s | vs llama.cpp | decode ms/token | weights MB/token | GB/s | of bandwidth |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    ratios = {mode.name: [s / r for s, r in zip(mode.tokens_per_s, reference.tokens_per_s)]
              for mode in modes} if reference else {}
    for mode in modes:
        speed, step = med(mode.tokens_per_s), med(mode.ms_per_token)
        ratio = f"{med(ratios[mode.name]):.2f}x" if reference else "-"
        achieved = mode.bytes / (step / 1e3) / 1e9
        print(f"| {mode.name} | {speed:.1f} | {ratio} | {step:.1f} | {mode.bytes / 1e6:.0f} | {achieved:.1f} "
              f"| {achieved / bandwidth:.0%} |")
    print("")
    if reference:
        fastest = max((m for m in modes if m is not reference), key=lambda m: med(m.tokens_per_s))
        print(f"{fastest.name} vs llama.cpp, each repeat: " + ", ".join(f"{r:.2f}x" for r in ratios[fastest.name]))
        print("")
    for mode in modes:
        print(f"{mode.name}: {mode.text[:70]!r}")


if __name__ == "__main__":
    command(main)
