"""Perplexity of the default model on a fixed English text: in float32 (--dequantize), each --quantize mode and
the default mode (the GGUF file's own blocks), every model loaded by the tool's own load().

    python -m benchmarks.perplexity [--text benchmarks/data/declaration.txt] [--threads 2]

The text (benchmarks/data/declaration.txt, about 2,350 tokens) is the Declaration of Independence
(1776), the Gettysburg Address (1863) and the Preamble and Article I, sections 1-3, of the US
Constitution (1787): public domain. It fits the model's 8,192-token context, so one forward pass
scores every token after the first; perplexity = exp(mean negative log-likelihood).

The default mode is scored twice: as it runs (the integer kernel, activations rounded to 8 bits per block of
32, as llama.cpp rounds them), and with every product taken on the exactly de-quantized blocks and unrounded
float32 activations (torch.ops.rungen_ggml.mm_tiled), which isolates what the activations' rounding costs.
"""

import argparse
import math
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from benchmarks.common import cpu_flags, load_float32
from rungen.ggml import GGMLLinear, native_kernels
from rungen.loading import load

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "declaration.txt")


def perplexity(model, ids):
    with torch.inference_mode():
        logits = model(ids).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    return math.exp(nll.item())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    float32 = load_float32()
    ids = float32.tokenizer(open(args.text).read(), return_tensors="pt")["input_ids"]
    reference = perplexity(float32.model, ids)
    del float32
    print(f"default model, {ids.shape[1]} tokens of {os.path.basename(args.text)}, torch {torch.__version__}, "
          f"CPU flags: {cpu_flags()}")
    print("")
    print("| weights | perplexity | vs float32 |")
    print("| --- | ---: | ---: |")
    print(f"| `--dequantize` (float32) | {reference:.3f} | - |")
    for mode in ("int8", "int4"):
        value = perplexity(load(None, device=torch.device("cpu"), quantize=mode).model, ids)
        print(f"| `--quantize {mode}` | {value:.3f} | {value / reference - 1:+.2%} |")
    if not native_kernels():
        sys.exit("the native kernels are not available")
    model = load(None, device=torch.device("cpu")).model
    value = perplexity(model, ids)
    print(f"| default: the file's own blocks, as it runs ({torch.ops.rungen_ggml.isa()}) | {value:.3f} "
          f"| {value / reference - 1:+.2%} |")
    GGMLLinear._matmul = lambda self, x: torch.ops.rungen_ggml.mm_tiled(
        x.float().contiguous(), self.blocks, int(self.qtype), self.in_features)
    value = perplexity(model, ids)
    print(f"| default: the file's own blocks, activations not rounded | {value:.3f} | {value / reference - 1:+.2%} |")


if __name__ == "__main__":
    main()
