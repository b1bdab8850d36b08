"""Per-layer speed of the GGUF block kernels on the default model's own weights, beside torch's kernels.

    python -m benchmarks.ggml_kernels [--threads 2] [--repeats 200] [--crossover] [--layouts] [--attention]
                                      [--isa avx2]

Each row is one of the default model's weight shapes (Q4_1 linears, the Q8_0 tied head), as the tool holds it
(rows interleaved eight by eight, rungen.gguf.blocks.GGMLLinear.interleave): microseconds per call at one token, and
the weight bytes read per second. Beside it,
torch's int4 kernel on the same weight (rungen.quantize's Int4Linear, bfloat16 activations) and, for
the head, fbgemm's float16 (Fp16Linear). Calls of the modes alternate, each figure a median, as the
machine may be shared. --crossover times the integer kernel against de-quantized float tiles with torch's
matmul for growing numbers of tokens: where the second wins is where rungen_ggml.mm switches. --layouts times
the file's row-major blocks against the interleaved ones at 1, 4, 16 and 64 tokens: the default model's weights,
then k-quant and IQ4 weights of a 1.1B llama's shapes (TinyLlama's, as a Q4_K_M/Q5_K_M/Q3_K_M/IQ4_XS file holds them:
random blocks with valid scales, as the default model has none; the kernels' speed does not depend on the values).
--attention times rungen_ggml.attend over a 512-token prompt in the default model's heads (9 over 3 key/value
heads of 64) beside torch's scaled_dot_product_attention, for three kinds of scores: random (N(0, 1)), one key
scored far above the rest (an attention sink: the others' weights below e^-87, at the end of float's normal range),
and scores spread evenly down to 100 below the top; then random scores in the heads of the other families'
published shapes (qwen3-1.7B's 16 over 8 of 128, gemma-3-1b's 4 over 1 of 256, Phi-3-mini's 32 over 32 of 96).
"""

import argparse
import functools
import statistics
import sys
import time

import gguf
import torch

from benchmarks.common import cpu_flags
from benchmarks.gguf_files import place_scales
from rungen.gguf.blocks import X8, dequantize, interleavable, native_kernels
from rungen.loading import default_model_file
from rungen.quantize import Int4Linear, head_class

SHAPES = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight",
          "token_embd.weight")
Q = gguf.GGMLQuantizationType
# (name, type, rows, inputs): a 1.1B llama's (TinyLlama's) weights in a Q4_K_M file, and Q5_K_M's gate.
K_SHAPES = (("attn_q", Q.Q4_K, 2048, 2048), ("attn_k", Q.Q4_K, 256, 2048), ("ffn_gate", Q.Q4_K, 5632, 2048),
            ("ffn_gate", Q.Q5_K, 5632, 2048), ("ffn_down", Q.Q6_K, 2048, 5632), ("ffn_gate", Q.IQ4_XS, 5632, 2048),
            ("ffn_gate", Q.IQ4_NL, 5632, 2048), ("attn_q", Q.Q3_K, 2048, 2048), ("ffn_gate", Q.Q3_K, 5632, 2048))


def random_k_blocks(qtype, rows, in_features, seed=0):
    """uint8 [rows, row bytes] of random k-quant (or IQ4) blocks whose float16 scales are small and finite."""
    import numpy as np

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, in_features // block, size), dtype=np.uint8)
    place_scales(raw, qtype, (rng.random((rows, in_features // block, 2)) * 1e-3).astype(np.float16))
    return torch.from_numpy(raw.reshape(rows, -1))


def layouts_row(name, qtype, blocks, in_features, repeats):
    """Prints the row-major and interleaved products of one weight at 1, 4, 16 and 64 tokens."""
    ops = torch.ops.rungen_ggml
    x8 = ops.interleave(blocks, int(qtype))
    for n in (1, 4, 16, 64):
        x = torch.randn(n, in_features)
        a, b = interleaved([functools.partial(ops.mm_int, x, blocks, int(qtype), in_features),
                            functools.partial(ops.mm_int, x, x8, int(qtype) | X8, in_features)],
                           max(10, repeats // max(1, n // 4)))
        print(f"| {name} | {qtype.name} | {blocks.shape[0]} x {in_features} | {n} | {a * 1e6:.0f} | {b * 1e6:.0f} | "
              f"{a / b:.2f}x |")


def timed(function, repeats):
    """Median seconds per call over `repeats` calls (after two uncounted)."""
    function(), function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(functions, repeats, rounds=5):
    """Median seconds per call of each function, the functions taking turns in rounds."""
    results = [[] for _ in functions]
    for _ in range(rounds):
        for result, function in zip(results, functions):
            result.append(timed(function, max(1, repeats // rounds)))
    return [statistics.median(r) for r in results]


def attend_and_torch(q, k, v, repeats):
    """Median seconds of attend and of torch's causal scaled_dot_product_attention on q, k, v, taking turns."""
    scale = q.shape[-1] ** -0.5
    return interleaved([
        functools.partial(torch.ops.rungen_ggml.attend, q, k, v, None, scale),
        functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True,
                          scale=scale)], repeats)


def attention_rows(repeats):
    """Prints attend's and torch's milliseconds for a 512-token prompt under three kinds of scores."""
    tokens, dim = 512, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, tokens, dim, generator=g) for heads in (9, 3, 3))
    sink_q, sink_k = q.clone(), k.clone()
    sink_q[..., 0], sink_k[:, :, 0, 0] = 30.0, 30.0  # key 0 scores about 110 above the others
    spread_q, spread_k = q.clone(), k.clone()
    spread_q[..., 0], spread_k[..., 0] = 10.0, torch.linspace(-80.0, 0.0, tokens)  # scores down to -100
    for name, (qq, kk) in (("random", (q, k)), ("a sink", (sink_q, sink_k)), ("spread to -100", (spread_q, spread_k))):
        ours, theirs = attend_and_torch(qq, kk, v, repeats)
        print(f"| {name} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | {theirs / ours:.2f}x |")


# (name, heads, key/value heads, head size) of the families' published shapes beside the default model's.
HEAD_SHAPES = (("qwen3 1.7B", 16, 8, 128), ("gemma3 1B", 4, 1, 256), ("phi3 3.8B", 32, 32, 96))


def head_shape_rows(repeats):
    """Prints attend's and torch's milliseconds for a 512-token prompt of random scores in each of HEAD_SHAPES."""
    for name, heads, kv, dim in HEAD_SHAPES:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, 512, dim, generator=g) for h in (heads, kv, kv))
        ours, theirs = attend_and_torch(q, k, v, repeats)
        print(f"| {name}: {heads} heads over {kv} of {dim} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | "
              f"{theirs / ours:.2f}x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--crossover", action="store_true")
    parser.add_argument("--layouts", action="store_true")
    parser.add_argument("--attention", action="store_true")
    parser.add_argument("--isa", help="the kernels' instruction set (amx, avx512vnni, avx2, scalar): the CPU's best "
                        "unless given, as the tool runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not native_kernels():
        sys.exit("native kernels unavailable")
    ops = torch.ops.rungen_ggml
    if args.isa:
        try:
            ops.set_isa(args.isa)
        except RuntimeError as error:
            sys.exit(f"--isa {args.isa}: {str(error).splitlines()[0]}")
    tensors = {t.name: t for t in gguf.GGUFReader(default_model_file()).tensors}
    print(f"CPU flags: {cpu_flags()}; kernel path: {ops.isa()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; one token; median µs per call")
    print("")
    print("| weight | type | out x in | rungen_ggml µs | GB/s | torch µs | torch kernel | GB/s | ratio |")
    print("| --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---: |")
    with torch.inference_mode():
        for name in SHAPES:
            tensor = tensors[name]
            blocks = torch.from_numpy(tensor.data.copy())
            qtype, rows, in_features = tensor.tensor_type, blocks.shape[0], int(tensor.shape[0])
            weight = dequantize(blocks, qtype, in_features)
            if qtype == gguf.GGMLQuantizationType.Q8_0:
                theirs, label = head_class()(weight, None), "fbgemm float16"
                their_bytes = weight.numel() * 2
            else:
                theirs, label = Int4Linear(weight, None), "int4pack (bf16)"
                their_bytes = theirs.packed.numel() + theirs.scales_and_zeros.numel() * 2  # uint8, bfloat16
            x = torch.randn(1, in_features)
            held, code = blocks, int(qtype)
            if interleavable(qtype, rows):
                held, code = ops.interleave(blocks, int(qtype)), int(qtype) | X8
            mine, torchs = interleaved([functools.partial(ops.mm, x, held, code, in_features),
                                        functools.partial(theirs, x)], args.repeats)
            print(f"| {name} | {qtype.name} | {rows} x {in_features} | {mine * 1e6:.0f} | "
                  f"{blocks.numel() / mine / 1e9:.1f} | {torchs * 1e6:.0f} | {label} | "
                  f"{their_bytes / torchs / 1e9:.1f} | {torchs / mine:.2f}x |")
        if args.layouts:
            print("")
            print("| weight | type | out x in | tokens | row-major µs | interleaved µs | ratio |")
            print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
            for name in SHAPES:
                tensor = tensors[name]
                blocks = torch.from_numpy(tensor.data.copy())
                layouts_row(name, tensor.tensor_type, blocks, int(tensor.shape[0]), args.repeats)
            for seed, (name, qtype, rows, in_features) in enumerate(K_SHAPES):
                layouts_row(f"1.1B {name}", qtype, random_k_blocks(qtype, rows, in_features, seed), in_features,
                            args.repeats)
        if args.crossover:
            print("")
            print("| weight | tokens | integer kernel µs | float tiles + matmul µs | tiles / integer |")
            print("| --- | ---: | ---: | ---: | ---: |")
            for name in ("blk.0.ffn_gate.weight", "blk.0.ffn_down.weight"):
                tensor = tensors[name]
                blocks = torch.from_numpy(tensor.data.copy())
                qtype, in_features = int(tensor.tensor_type) | X8, int(tensor.shape[0])
                blocks = ops.interleave(blocks, qtype & ~X8)  # as the tool holds them
                for n in (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256):
                    x = torch.randn(n, in_features)
                    a, b = interleaved([functools.partial(ops.mm_int, x, blocks, qtype, in_features),
                                        functools.partial(ops.mm_tiled, x, blocks, qtype, in_features)],
                                       max(10, args.repeats // 4))
                    print(f"| {name} | {n} | {a * 1e6:.0f} | {b * 1e6:.0f} | {b / a:.2f} |")
        if args.attention:
            print("")
            print("| scores (512-token prompt, 9 heads over 3) | attend ms | torch sdpa ms | torch / attend |")
            print("| --- | ---: | ---: | ---: |")
            attention_rows(max(10, args.repeats // 20))
            head_shape_rows(max(10, args.repeats // 20))


if __name__ == "__main__":
    main()
