"""Perplexity of the default model on a fixed English text: in float32 (--dequantize), each --quantize mode and
the default mode (the GGUF file's own blocks), every model loaded by the tool's own load().

    python -m benchmarks.perplexity [--text benchmarks/data/declaration.txt] [--threads 2] [--draws 5]
    python -m benchmarks.perplexity --model FILE.gguf   # another GGUF file (the default model requantized to
                                                        # Q4_K_M, say): float32 and its own blocks, no --quantize

The text (benchmarks/data/declaration.txt, about 2,350 tokens) is the Declaration of Independence
(1776), the Gettysburg Address (1863) and the Preamble and Article I, sections 1-3, of the US
Constitution (1787): public domain. It fits the model's 8,192-token context, so one forward pass
scores every token after the first; perplexity = exp(mean negative log-likelihood).

The default mode is scored twice: as it runs (the integer kernel, activations rounded to 8 bits per block of
32, as llama.cpp rounds them), and with every product taken on the exactly de-quantized blocks and unrounded
float32 activations (torch.ops.rungen_ggml.mm_tiled), which isolates what the activations' rounding costs.
--rounding adds two rows that round the activations in Python before those exact products: to 8 bits per block
of 32 for every product (what the kernels do, in another order of float sums), and per 256 for the products of
k-quant and IQ4_XS weights (what llama.cpp does there: its Q8_K), to weigh what the coarser rounding would cost.

A model whose activations are rounded to 8 bits is chaotic in the last bits: a relative change of 1e-6 in its
input (as another summation order gives, from another instruction set or thread count) moves a code across a
rounding boundary here and there, and the perplexity by several tenths of a percent. So each row is scored
--draws times, the first as it is and the others with the embeddings scaled by 1 + 1e-6 * N(0, 1) (fixed
seeds), and gives the median and the range: a difference inside the range is not a difference.
"""

import argparse
import math
import os
import statistics
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from benchmarks.common import command, cpu_flags, load_float32
from rungen.gguf.blocks import GGMLLinear, native_kernels
from rungen.gguf.decoder import products_one_by_one
from rungen.loading import load

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "declaration.txt")


def perplexity(model, ids, jitter_seed=None):
    """exp(mean negative log-likelihood) of ids[0, 1:]; with jitter_seed, the embeddings scaled by
    1 + 1e-6 * N(0, 1) drawn from that seed."""
    def jitter(module, args, output):
        noise = torch.randn(output.shape, generator=torch.Generator().manual_seed(jitter_seed))
        return output * (1 + 1e-6 * noise)

    hook = None if jitter_seed is None else model.get_input_embeddings().register_forward_hook(jitter)
    try:
        with torch.inference_mode():
            logits = model(ids).logits[0, :-1].float()
    finally:
        if hook is not None:
            hook.remove()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    return math.exp(nll.item())


def drawn(model, ids, draws):
    """(median, lowest, highest) perplexity over `draws` scorings: as it is, then jittered (seeds 1, 2, ...)."""
    values = [perplexity(model, ids, None if seed == 0 else seed) for seed in range(draws)]
    return statistics.median(values), min(values), max(values)


def row(name, value, reference):
    median, low, high = value
    print(f"| {name} | {median:.3f} | {low:.3f} - {high:.3f} | {median / reference - 1:+.2%} "
          f"({low / reference - 1:+.2%} to {high / reference - 1:+.2%}) |")


SUPERBLOCK_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}


def rounded(x: torch.Tensor, block: int) -> torch.Tensor:
    """x rounded to 8 bits per block of `block` values along its last dimension as the kernels and llama.cpp
    round them: scale max|x| / 127, codes round(x / scale) (an all-zero block stays zero); returned de-quantized."""
    v = x.reshape(-1, block)
    scale = v.abs().amax(-1, keepdim=True) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(v / safe) * scale).reshape(x.shape)


def exact_products(superblock: int | None = None):
    """GGMLLinear._matmul taking each product on the exactly de-quantized blocks; with `superblock`, its
    activations rounded first, per `superblock` for the k-quant and IQ4_XS weights and per 32 for the others."""
    def matmul(self, x):
        x = x.float().contiguous()
        if superblock is not None:
            x = rounded(x, superblock if self.qtype.name in SUPERBLOCK_TYPES else 32)
        return torch.ops.rungen_ggml.mm_tiled(x, self.blocks, self.code, self.in_features)
    return matmul


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draws", type=int, default=5, help="scorings a row: one as it is, the rest jittered")
    parser.add_argument("--model", help="a GGUF file of the default model's tokenizer (default: the default model)")
    parser.add_argument("--rounding", action="store_true",
                        help="two more rows: the activations rounded per 32, and per 256 for k-quant products")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    float32 = load_float32(args.model)
    ids = float32.tokenizer(open(args.text).read(), return_tensors="pt")["input_ids"]
    reference = drawn(float32.model, ids, args.draws)
    del float32
    name = os.path.basename(args.model) if args.model else "default model"
    print(f"{name}, {ids.shape[1]} tokens of {os.path.basename(args.text)}, {args.draws} draws a row, "
          f"torch {torch.__version__}, {args.threads} threads, CPU flags: {cpu_flags()}")
    print("")
    print("| weights | perplexity (median) | range | vs float32's median (range) |")
    print("| --- | ---: | ---: | ---: |")
    row("`--dequantize` (float32)", reference, reference[0])
    for mode in () if args.model else ("int8", "int4"):
        row(f"`--quantize {mode}`", drawn(load(None, device=torch.device("cpu"), quantize=mode).model, ids,
                                          args.draws), reference[0])
    if not native_kernels():
        sys.exit("the native kernels are not available")
    model = load(args.model, device=torch.device("cpu")).model
    row(f"default: the file's own blocks, as it runs ({torch.ops.rungen_ggml.isa()})", drawn(model, ids, args.draws),
        reference[0])
    # transformers' model class over the same blocks (the own model code gives the same logits: tests), whose
    # products can be taken one by one through GGMLLinear._matmul; the own code's stack is one native call.
    del model
    model = load(args.model, device=torch.device("cpu"), own_model=False).model
    rows = [("default: the file's own blocks, activations not rounded", None)]
    if args.rounding:
        rows += [("the blocks, activations rounded per 32 (in Python)", 32),
                 ("the blocks, k-quant products' activations rounded per 256 (in Python)", 256)]
    for name, superblock in rows:
        GGMLLinear._matmul = exact_products(superblock)
        with products_one_by_one(model):  # the layers' own native calls do not go through _matmul
            row(name, drawn(model, ids, args.draws), reference[0])

if __name__ == "__main__":
    command(main)
