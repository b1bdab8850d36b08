"""One layer's matrix product in each weight form the tool keeps on a GPU, at the rows of a decode step and of a
prompt: where each form's kernel wins decides where it serves.

    python -m benchmarks.gpu_products                      # on a CUDA GPU (benchmarks/gpu.py runs it too)
    python -m benchmarks.gpu_products --quick --device cpu # the script's own check here: small matrices, the CPU's
                                                           # forms only

On Llama-3.1-8B's gate (14336 x 4096) and down (4096 x 14336) projections, random weights, bfloat16 activations of
1, 16, 64, 512 and 4096 rows, the forms are

- bfloat16: the weight itself, cuBLAS (a checkpoint's form, and what the others are measured against);
- int4 tinygemm: 4-bit codes in groups of 32 on torch's int4 kernel (rungen/int4.py's TinyGemmLinear: --quantize
  int4, and a GGUF file's Q4_0, Q4_1 and Q4_K on a GPU), at every row count, as the tool runs it;
- int4 Triton kernel: the same codes two a byte with a float16 scale and offset a group of 32 on
  rungen/int4_kernel.py's tiled kernel (RUN_GENERATION_GPU_INT4=triton), to its MOST_ROWS rows; int4 GEMV kernel:
  the same codes on its GEMV kernel (no tensor cores), to its GEMV_ROWS rows, which its layer takes at those rows
  where it is the faster at one row; int4 widened: those codes widened to bfloat16 for cuBLAS, what its layer does
  past MOST_ROWS;
- e2m1 Triton kernel, e2m1 GEMV kernel, e2m1 widened: MXFP4's form (gpt-oss's experts): e2m1 codes two a byte and a
  power-of-two float16 scale a group of 32, no offsets, on the same kernels and widening (random codes: the time is
  the point); levels Triton kernel, levels GEMV kernel: IQ4_NL's form, codes two a byte whose 16 levels the kernels
  look up a byte at a time in a 1 KB table, and a float16 scale a group of 32 (against int8 kernel's rows: the form
  IQ4 took before, twice the bytes); Q5_K and Q6_K Triton and GEMV kernels, Q6_K widened: the 5- and 6-bit forms,
  each code's low four bits two a byte and its top bits in a plane after them, with their blocks' own scales:
  Q5_K's 6-bit scale and minimum a group of 32, Q6_K's signed codes with an int8 scale a group of 16, each with
  float16s a superblock (0.70 and 0.82 bytes a weight, against the int8 kernel's 1.25 those types take where the
  form fails its check); Q2_K Triton and GEMV kernels: the 2-bit form, four codes a byte with a 4-bit scale and
  minimum a group of 16, each in a byte, and two float16s a superblock (0.39 bytes a weight, against 1.5 in int8
  codes);
- int8 kernel: int8 codes with a scale a group of 32 (GGUF Q8_0's form) on rungen/int8.py's tiled Triton kernel, to
  its MOST_ROWS rows, where the layer uses it; int8 GEMV kernel: the same codes on its GEMV kernel, to GEMV_ROWS
  rows, which the layer takes at those rows where it is the faster at one row;
- int8 widened: the same codes widened to bfloat16 for cuBLAS, what the layer does past MOST_ROWS (and where the
  kernel is off).

Each product is timed in a CUDA graph that runs it over enough copies of the weight to be read from memory rather
than from L2 (as a decode step's layers are), replayed 20 times after one uncounted replay: milliseconds a product,
the weight's bytes over that time (GB/s), and the time against bfloat16's at the same rows (`vs_bfloat16` below 1:
faster), measured side by side.
"""

import argparse
import copy
import functools
import math
import statistics
import sys
import time

import torch

MATRICES = {"gate 14336x4096": (14336, 4096), "down 4096x14336": (4096, 14336)}
ROWS = (1, 16, 64, 512, 4096)
QUICK_MATRICES = {"gate 512x256": (512, 256), "down 256x512": (256, 512)}
QUICK_ROWS = (1, 16, 64)
REPLAYS = 20
GROUP = 32


def int8_group_layer(weight):
    """The weight as int8 codes with a scale a group of GROUP inputs (Q8_0's form), on rungen/int8.py's layer; its
    Triton kernel where it imports and agrees with the widened product (None: widened only)."""
    from rungen.int8 import CudaInt8Linear, checked_kernel

    groups = weight.float().reshape(weight.shape[0], -1, GROUP)
    scales = (groups.abs().amax(dim=-1).clamp(min=1e-12) / 127).to(torch.bfloat16)
    codes = torch.round(groups / scales.float()[..., None]).clamp(-128, 127).to(torch.int8).reshape(weight.shape)
    layer = CudaInt8Linear(codes, scales, None)
    kernel = checked_kernel(layer, torch.bfloat16, "its rows are the widened product's")
    return layer, kernel


def random_4_bit_layer(weight, kind):
    """Random packed codes of the weight's shape on rungen/int4_kernel.py's layer in the form of a type the Triton form
    alone takes (the time is the point): `kind` "e2m1" MXFP4's (gpt-oss's experts: a power-of-two float16 scale a
    group of 32, no offsets), "levels" IQ4_NL's (the codes index IQ4's levels in a table, a float16 scale a group),
    "q5_k" Q5_K's (5-bit codes, their top bits in a plane after the nibbles, a 6-bit scale and minimum a group of 32
    and two float16s a superblock of 256), "q6_k" Q6_K's (signed 6-bit codes, an int8 scale a group of 16 and a
    float16 one a superblock), "q2_k" Q2_K's (2-bit codes four a byte, a 4-bit scale and minimum a group of 16 and
    two float16s a superblock); and its checked Triton kernel (None: widened only)."""
    from rungen.int4_kernel import IQ4_LEVELS, CudaInt4Linear, checked_int4_kernel, level_pairs

    generator = torch.Generator(weight.device).manual_seed(1)
    out_features, in_features = weight.shape
    bits, group = {"q5_k": (5, 32), "q6_k": (6, 16), "q2_k": (2, 16)}.get(kind, (4, GROUP))
    codes = torch.randint(0, 256, (out_features, in_features * bits // 8), dtype=torch.uint8, device=weight.device,
                          generator=generator)
    groups = (out_features, in_features // group)
    scales = (torch.rand(groups, device=weight.device, generator=generator) / 2000).half()
    offsets = None
    if kind == "e2m1":
        exponents = torch.randint(6, 10, groups, device=weight.device, generator=generator)
        scales = torch.exp2(-exponents.float()).half()
    elif kind == "levels":
        offsets = level_pairs(IQ4_LEVELS, weight.device)
    elif kind in ("q5_k", "q2_k"):  # (a group's scale and minimum, a superblock's two float16s, as blocks hold them)
        scales = torch.randint(0, 64 if kind == "q5_k" else 16, (out_features, 2 * in_features // group),
                               dtype=torch.uint8, device=weight.device, generator=generator)
        superblocks = (out_features, 2 * in_features // 256)
        offsets = (torch.rand(superblocks, device=weight.device, generator=generator) / 6e4).half()
    else:  # (int8 bytes: signed codes; a group's int8 scale and a superblock's float16, as Q6_K's blocks hold them)
        codes = codes.view(torch.int8)
        scales = torch.randint(-32, 32, groups, dtype=torch.int8, device=weight.device, generator=generator)
        superblocks = (out_features, in_features // 256)
        offsets = (torch.rand(superblocks, device=weight.device, generator=generator) / 6e4).half()
    layer = CudaInt4Linear(codes, scales, offsets, in_features)
    kernel = checked_int4_kernel(layer, torch.bfloat16)[0] if weight.device.type == "cuda" else None
    return layer, kernel


def int4_layer(weight):
    """The weight as 4-bit codes two a byte with a float16 scale and offset a group of 32 (Q4_0's and Q4_1's form
    under RUN_GENERATION_GPU_INT4=triton) on rungen/int4_kernel.py's layer, and its checked Triton kernel (None:
    widened only)."""
    from rungen.int4_kernel import CudaInt4Linear, checked_int4_kernel

    layer = CudaInt4Linear.of_weight(weight)
    kernel = checked_int4_kernel(layer, torch.bfloat16)[0] if weight.device.type == "cuda" else None
    return layer, kernel


class Dense(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight)


def forms(weight, device):
    """(name, a function making the layer, the rows it serves at most) of each form that runs on `device`."""
    from rungen.code_kernels import GEMV_ROWS, MOST_ROWS
    from rungen.quantize import gpu_int4_linear

    def coded(layer_of, kernel):
        def make():
            layer, checked = layer_of(weight)
            if kernel and checked is None:
                raise RuntimeError("the Triton kernel is not available here (rungen's warning says why)")
            layer.use_kernel(checked if kernel else None)
            return layer
        return make

    def kernel_of(layer_and_kernel, which):
        def layer_of(weight):
            layer, kernel = layer_and_kernel(weight)
            if kernel is None:
                return layer, None
            if which == "tiled":
                return layer, lambda x, codes, scales, offsets=None: kernel.tiled(x, codes, scales, None, offsets)
            return layer, lambda x, codes, scales, offsets=None: kernel.gemv_launch(x, codes, scales, offsets)
        return layer_of

    e2m1_layer, levels_layer, q5_k_layer, q6_k_layer, q2_k_layer = (
        functools.partial(random_4_bit_layer, kind=kind) for kind in ("e2m1", "levels", "q5_k", "q6_k", "q2_k"))
    made = [("bfloat16", lambda: Dense(weight), None)]
    if device.type == "cuda":
        made += [("int4 tinygemm", lambda: gpu_int4_linear(weight, None, check=True), None),
                 ("int4 Triton kernel", coded(kernel_of(int4_layer, "tiled"), True), MOST_ROWS),
                 ("int4 GEMV kernel", coded(kernel_of(int4_layer, "gemv"), True), GEMV_ROWS),
                 ("e2m1 Triton kernel", coded(kernel_of(e2m1_layer, "tiled"), True), MOST_ROWS),
                 ("e2m1 GEMV kernel", coded(kernel_of(e2m1_layer, "gemv"), True), GEMV_ROWS),
                 ("levels Triton kernel", coded(kernel_of(levels_layer, "tiled"), True), MOST_ROWS),
                 ("levels GEMV kernel", coded(kernel_of(levels_layer, "gemv"), True), GEMV_ROWS),
                 ("Q5_K Triton kernel", coded(kernel_of(q5_k_layer, "tiled"), True), MOST_ROWS),
                 ("Q5_K GEMV kernel", coded(kernel_of(q5_k_layer, "gemv"), True), GEMV_ROWS),
                 ("Q6_K Triton kernel", coded(kernel_of(q6_k_layer, "tiled"), True), MOST_ROWS),
                 ("Q6_K GEMV kernel", coded(kernel_of(q6_k_layer, "gemv"), True), GEMV_ROWS),
                 ("Q2_K Triton kernel", coded(kernel_of(q2_k_layer, "tiled"), True), MOST_ROWS),
                 ("Q2_K GEMV kernel", coded(kernel_of(q2_k_layer, "gemv"), True), GEMV_ROWS),
                 ("int8 kernel", coded(kernel_of(int8_group_layer, "tiled"), True), MOST_ROWS),
                 ("int8 GEMV kernel", coded(kernel_of(int8_group_layer, "gemv"), True), GEMV_ROWS)]
    made += [("int4 widened", coded(int4_layer, False), None), ("e2m1 widened", coded(e2m1_layer, False), None),
             ("levels widened", coded(levels_layer, False), None), ("Q6_K widened", coded(q6_k_layer, False), None),
             ("int8 widened", coded(int8_group_layer, False), None)]
    return made


def product_ms(calls, device):
    """Milliseconds a call of `calls` takes: on CUDA all of them captured as one graph, replayed REPLAYS times after
    one uncounted replay; elsewhere a timed loop."""
    if device.type != "cuda":
        for call in calls:
            call()
        start = time.perf_counter()
        for _ in range(REPLAYS):
            for call in calls:
                call()
        return (time.perf_counter() - start) * 1e3 / (REPLAYS * len(calls))
    # Kernel selection, Triton's tuning and the libraries' lazy set-up, on a side stream before the capture (as
    # torch.cuda.graph's documentation has it).
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / len(calls))
    del graph
    return statistics.median(times)


def copies_past_l2(size, device):
    """How many copies of `size` bytes a graph reads so that they pass through memory: four times the L2 (one
    on a CPU)."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(32, math.ceil(4 * l2 / size)))


def product_rows(add, device, quick=False, left=lambda: math.inf):
    """A row a matrix, form and row count through add(**row); `left()`: seconds of the caller's budget left (a
    matrix starts with 10 left)."""
    matrices, counts = (QUICK_MATRICES, QUICK_ROWS) if quick else (MATRICES, ROWS)
    generator = torch.Generator(device).manual_seed(0)
    for matrix, (out_features, in_features) in matrices.items():
        if left() < 10:
            add(shape=matrix, path="products", error=f"skipped: {left():.0f} s of the budget left")
            continue
        weight = (torch.randn(out_features, in_features, device=device, generator=generator) / 50).to(torch.bfloat16)
        dense_ms = {}
        for name, make, most in forms(weight, device):
            try:
                first = make()
                size = sum(t.numel() * t.element_size() for t in first.buffers())
                held = [first] + [copy.deepcopy(first) for _ in range(copies_past_l2(size, device) - 1)]
            except Exception as error:
                add(shape=matrix, path=f"product {name}", error=f"{type(error).__name__}: {str(error)[:200]}")
                continue
            for rows in counts:
                if most is not None and rows > most:
                    continue
                x = torch.randn(rows, in_features, device=device, generator=generator, dtype=torch.bfloat16)
                try:
                    ms = product_ms([lambda layer=layer, x=x: layer(x) for layer in held], device)
                except Exception as error:
                    add(shape=matrix, path=f"product {name}", batch=rows,
                        error=f"{type(error).__name__}: {str(error)[:200]}")
                    continue
                if name == "bfloat16":
                    dense_ms[rows] = ms
                add(shape=matrix, path=f"product {name}", batch=rows, product_ms=ms, weight_mb=size / 1e6,
                    gb_per_s=size / ms / 1e6, vs_bfloat16=ms / dense_ms[rows] if rows in dense_ms else None)
            del held
            if device.type == "cuda":
                torch.cuda.empty_cache()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small matrices, few rows (checks the script on a CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available; --quick --device cpu checks the script here", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch "
          f"{torch.__version__}", flush=True)

    def add(**row):
        print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                               if v is not None), flush=True)

    with torch.inference_mode():
        product_rows(add, device, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
