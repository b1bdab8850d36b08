"""int8 weights, one symmetric scale per output channel (--quantize int8), on torch's CPU kernel (Int8Linear) and
on a CUDA GPU (CudaInt8Linear). On the GPU the codes stay int8 and a small Triton kernel reads them, widening them in
registers, so a decode step reads one byte a weight: torch's own CUDA int8 kernel (`_weight_int8pack_mm`, torch 2.11
to 2.13) computes one output a thread in float32 over rows read across threads, far from the bandwidth a step needs.
Where Triton is missing or disagrees with the plain product, and for prompts (many rows: compute-bound), the codes
are widened to the activations' dtype for the GPU's own matrix product, one layer at a time. The same layer and
kernel hold a GGUF file's blocks on a GPU wherever their values are an integer code times a group's scale (plus an
offset): rungen/gguf/device.py's int8 forms. How the kernels launch, tune and are timed: rungen/code_kernels.py.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from .code_kernels import GEMV_PRODUCTS, MOST_ROWS, autotune, choose_gemv, launcher, with_gemv

logger = logging.getLogger(__name__)

TRITON_ENV = "RUN_GENERATION_TRITON_INT8"  # 0: never the Triton kernel (the widened product alone)
CHECKED_CHANNELS = 1024  # output channels a check of the kernel multiplies at most
WIDEN_BYTES = 1 << 28  # a widened weight's bytes at most at a time (256 MB; a head's table is gigabytes)
WIDEN_BLOCK = 1024  # codes a program of the widening kernel writes
# (dtype, group or 0, offsets or not) -> whether the widening kernel gave torch's widening on its first weight of that
# form here (False too where it failed: torch's operators widen those from then on)
WIDEN_CHECKED = {}
QUANTIZE_ROWS = 4096  # a weight's output channels quantized at a time: its float32 working copies stay a slice of it
INT8_GEMV_ENV = "RUN_GENERATION_INT8_GEMV"  # 0: a step's rows on the tiled kernel always (never the GEMV kernel)
# The int8 GEMV kernel's tuned configurations (BLOCK_N, BLOCK_K, warps): a program's channels and inputs a step, from
# wide channel blocks of short rows to 4-8 channels over 1,024-2,048 inputs (N/4-N/8 programs, 4-8 KiB a step each:
# the bytes in flight one row's bandwidth needs), none spilling on sm_90 (benchmarks/int8_kernel_resources.py; 2
# channels over 2,048 spilled with a scale a channel). rows x BLOCK_N x BLOCK_K within GEMV_PRODUCTS serve those rows.
INT8_GEMV_CONFIGS = ((16, 128, 4), (8, 256, 4), (16, 256, 4), (32, 128, 4), (8, 512, 2), (16, 512, 4),
                     (4, 1024, 2), (4, 2048, 4), (8, 1024, 4))
@functools.cache
def triton_kernel():
    """The Triton kernel, or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # any failure: the widened product serves
        return None

    @triton.jit(do_not_specialize=["M", "M_BUCKET"])  # one compilation for every decode batch
    def int8_matmul(x, codes, scales, offsets, y, tiles, sources, M, N, K, M_BUCKET, GROUP: tl.constexpr,
                    OFFSET: tl.constexpr, GROUPED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        # y[m, n] = sum_k x[m, k] * (codes[n, k] * scale + offset): a block of rows and output channels a program; the
        # scale is scales[n] (GROUP 0), applied to the sums, or scales[n, k // GROUP], applied to the codes, as the
        # group's offset (OFFSET: offsets[n, k // GROUP], else none) is. Row blocks are the grid's first axis, so
        # the programs reading one block of codes are launched together and all but the first read it from L2: the
        # codes leave memory once however many row blocks there are. GROUPED: a mixture's experts stacked
        # [experts, N, ...], a block of rows one expert's (tiles[block]; -1: none), y's row m = x[sources[m]] times
        # that expert's weight (sources[m] -1: no row).
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        if GROUPED:
            expert = tl.load(tiles + tl.program_id(0)).to(tl.int64)
            if expert < 0:
                return
            codes += expert * N * K
            scales += expert * N * (K // GROUP if GROUP else 1)
            if OFFSET:
                offsets += expert * N * (K // GROUP)
            reads = tl.load(sources + rows).to(tl.int64)
            held_rows = reads >= 0
        else:
            reads, held_rows = rows, rows < M
        channels = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # channels x K: past 2^31
        inner = tl.arange(0, BLOCK_K)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            at = start + inner
            a = tl.load(x + reads[:, None] * K + at[None, :], mask=held_rows[:, None] & (at[None, :] < K), other=0.0)
            b = tl.load(codes + channels[None, :] * K + at[:, None], mask=(channels[None, :] < N) & (at[:, None] < K),
                        other=0)
            if GROUP:
                # One scale (and offset) a group, spread over its codes in registers: loaded a code each, they
                # would pass 2-8 bytes a weight through shared memory beside the code's one.
                group = start // GROUP + tl.arange(0, BLOCK_K // GROUP)
                held = (channels[None, :] < N) & (group[:, None] < K // GROUP)
                where = channels[None, :] * (K // GROUP) + group[:, None]
                scale = tl.load(scales + where, mask=held, other=0.0).to(tl.float32)
                w = tl.reshape(b.to(tl.float32), (BLOCK_K // GROUP, GROUP, BLOCK_N)) * scale[:, None, :]
                if OFFSET:
                    w += tl.load(offsets + where, mask=held, other=0.0).to(tl.float32)[:, None, :]
                b = tl.reshape(w, (BLOCK_K, BLOCK_N))
            total += tl.dot(a, b.to(a.dtype), input_precision="ieee")  # float32 stays float32 (no tf32)
        if not GROUP:
            total = total * tl.load(scales + channels, mask=channels < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y + rows[:, None] * N + channels[None, :], total.to(y.dtype.element_ty),
                 mask=held_rows[:, None] & (channels[None, :] < N))

    # x @ (scales * codes + offsets).T, scales [out] (a channel's) or [out, groups] (a group of inputs': GGUF's Q8_0
    # 32, Q6_K 16), offsets None or [out, groups] (Q5_K's, Q2_K's)
    def constants(inner, codes, scales, offsets):
        return {"GROUP": inner // scales.shape[1] if scales.dim() == 2 else 0, "OFFSET": offsets is not None}

    tiled = launcher(triton, int8_matmul, constants)

    def fitting(configs, named_args, **kwargs):  # rows x a tile's codes within GEMV_PRODUCTS (registers)
        rows = kwargs.get("ROWS", named_args.get("ROWS", 1))
        return [config for config in configs
                if rows * config.kwargs["BLOCK_N"] * config.kwargs["BLOCK_K"] <= GEMV_PRODUCTS]

    @autotune(triton, [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in INT8_GEMV_CONFIGS],
              ["N", "K", "ROWS", "GROUP", "OFFSET", "GROUPED"], fitting)
    @triton.jit(do_not_specialize=["M"])
    def int8_gemv(x, codes, scales, offsets, y, pairs, M, N, K, GROUP: tl.constexpr, OFFSET: tl.constexpr,
                  ROWS: tl.constexpr, GROUPED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # int8_matmul's product for a decode step's few rows (M <= ROWS) without the tensor cores, whose tiles of 16
        # rows a row would waste: BLOCK_N output channels a program over all K inputs, BLOCK_K at a time, the codes
        # widened with their group's scale (and offset) in registers and multiplied into every row. GROUPED: a
        # mixture's experts stacked [experts, N, ...]; program_id(1) a pair p (pairs[p]: its expert and its row of
        # x), y[p] = x[row] times that expert's weight.
        if GROUPED:
            pair = tl.program_id(1)
            expert = tl.load(pairs + 2 * pair).to(tl.int64)
            codes += expert * N * K
            if GROUP:
                scales += expert * N * (K // GROUP)
            else:
                scales += expert * N
            if OFFSET:
                offsets += expert * N * (K // GROUP)
            x += tl.load(pairs + 2 * pair + 1).to(tl.int64) * K
            y += pair * N
        channels = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rows = tl.arange(0, ROWS)
        inner = tl.arange(0, BLOCK_K)
        total = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            at = start + inner
            w = tl.load(codes + channels[:, None] * K + at[None, :], mask=(channels[:, None] < N) & (at[None, :] < K),
                        other=0).to(tl.float32)
            if GROUP:
                group = start // GROUP + tl.arange(0, BLOCK_K // GROUP)
                held = (channels[:, None] < N) & (group[None, :] < K // GROUP)
                where = channels[:, None] * (K // GROUP) + group[None, :]
                scale = tl.load(scales + where, mask=held, other=0.0).to(tl.float32)
                w = tl.reshape(w, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * scale[:, :, None]
                if OFFSET:
                    w += tl.load(offsets + where, mask=held, other=0.0).to(tl.float32)[:, :, None]
                w = tl.reshape(w, (BLOCK_N, BLOCK_K))
            a = tl.load(x + rows[:, None] * K + at[None, :], mask=(rows[:, None] < M) & (at[None, :] < K),
                        other=0.0).to(tl.float32)
            total += tl.sum(a[:, None, :] * w[None, :, :], axis=2)
        if not GROUP:
            total = total * tl.load(scales + channels, mask=channels < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y + rows[:, None] * N + channels[None, :], total.to(y.dtype.element_ty),
                 mask=(rows[:, None] < M) & (channels[None, :] < N))

    return with_gemv(triton, tiled, int8_gemv, constants, INT8_GEMV_ENV)


def float32_rows(weight: torch.Tensor):
    """(slice, a float32 copy of those rows) for each QUANTIZE_ROWS output channels of `weight`: what a quantizer
    works on in place, the weight given left as it is."""
    for start in range(0, weight.shape[0], QUANTIZE_ROWS):
        part = slice(start, start + QUANTIZE_ROWS)
        yield part, weight[part].detach().to(torch.float32, copy=True)


def int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [out, in] as int8 codes and one scale an output channel (bfloat16): weight ~ scale * code. The
    scale is rounded to bfloat16 first, as the kernels use it, so the codes match it."""
    codes = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.bfloat16, device=weight.device)
    for part, rows in float32_rows(weight):
        scale[part] = rows.abs().amax(dim=1).clamp(min=1e-12) / 127
        codes[part] = rows.div_(scale[part].float()[:, None]).round_().clamp_(-128, 127)
    return codes, scale


class Int8Linear(torch.nn.Module):
    """y = x @ (scale * codes).T (+ bias) by torch's CPU kernel, in bfloat16."""

    format = "int8"

    def __init__(self, weight, bias):
        super().__init__()
        codes, scale = int8_codes(weight)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scale)
        self.bias = bias
        self.out_features, self.in_features = codes.shape

    def forward(self, x):
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scales)
        y = y.reshape(x.shape[:-1] + (self.out_features,)).to(x.dtype)
        return y if self.bias is None else y + self.bias


def widened(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None,
            packing: tuple | None = None) -> torch.Tensor:
    """The plain product: the codes widened to x's dtype [out, in] and scaled there, per output channel (scales
    [out]) or per group (scales [out, groups], and each group's offset where `offsets` [out, groups] are given), one
    layer's weight at a time (two bytes a weight in half precision), at most WIDEN_BYTES of it at once. `packing`:
    (chunk, unpack, table) for 4-bit codes two a byte (rungen/int4_kernel.py's layout, unpack its inverse to what the
    codes stand for; table: None, or the level_pairs the codes index)."""
    step = max(1, WIDEN_BYTES // (x.shape[-1] * x.element_size()))
    if codes.shape[0] > step:  # a head's table: a slice of output channels at a time
        return torch.cat([widened(x, codes[start:start + step], scales[start:start + step],
                                  None if offsets is None else offsets[start:start + step], packing)
                          for start in range(0, codes.shape[0], step)], dim=-1)
    return torch.nn.functional.linear(x, widened_weight(codes, scales, offsets, x.dtype, packing, x.shape[-1]))


def widened_weight(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, dtype: torch.dtype,
                   packing: tuple | None = None, inputs: int | None = None) -> torch.Tensor:
    """The weight [out, in] in `dtype` the codes stand for (scaled before any product: the codes' own product is
    127 / max|w| times larger, past float16's range): on a GPU by widen_kernel where Triton imports and the kernel
    gave torch's widening on its first weight of the form (WIDEN_CHECKED), each weight computed in float32 and
    rounded once; else torch's operators, in `dtype` (three passes over the weight; packed codes unpacked first).
    `packing`: widened's; `inputs`: the weight's (None: a byte a code, or two where packed)."""
    kernel = widen_kernel() if codes.is_cuda and os.environ.get(TRITON_ENV, "1") != "0" else None
    chunk, unpack, table = packing or (0, None, None)
    inputs = inputs or codes.shape[1] * (2 if chunk else 1)
    group = inputs // scales.shape[1] if scales.dim() == 2 else 0
    form = (dtype, group, offsets is not None, chunk, table is not None, codes.dtype, codes.shape[1] * 8 // inputs)
    plain = (lambda rows: unpack(codes[rows])) if chunk else (lambda rows: codes[rows])
    if kernel is not None and WIDEN_CHECKED.get(form, True):
        try:
            weight = kernel(codes, scales, offsets, dtype, chunk, table, inputs)
        except Exception as failure:  # a compile or launch failure: torch's operators widen from now on
            WIDEN_CHECKED[form] = False
            logger.warning("int8 weights on the GPU: the widening kernel failed (%s); torch's operators widen them",
                           (str(failure).splitlines() or [type(failure).__name__])[0])
        else:
            if form not in WIDEN_CHECKED:  # its first weight of this form against torch's operators, in float32
                rows = slice(0, 16)
                exact = torch_widened(plain(rows), scales[rows], None if offsets is None else offsets[rows])
                WIDEN_CHECKED[form] = bool(((weight[rows].float() - exact).abs() <= torch.finfo(dtype).eps
                                            * exact.abs() + 1e-6 * exact.abs().max()).all())
                if not WIDEN_CHECKED[form]:
                    logger.warning("int8 weights on the GPU: the widening kernel disagrees with torch's operators "
                                   "on this GPU; they widen the weights instead")
            if WIDEN_CHECKED[form]:
                return weight
    return torch_widened(plain(slice(None)), scales, offsets, dtype)


def torch_widened(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """widened_weight by torch's operators, in `dtype`."""
    weight = codes.to(dtype)
    if scales.dim() == 1:
        weight.mul_(scales.to(dtype)[:, None])
    else:
        weight.view(*scales.shape, -1).mul_(scales.to(dtype)[..., None])
    if offsets is not None:
        weight.view(*offsets.shape, -1).add_(offsets.to(dtype)[..., None])
    return weight


def low_bits(bits: int) -> int:
    """The bits of a `bits`-wide code rungen/int4_kernel.py's packed() holds side by side in a chunk's bytes (4: two
    codes a byte; 2: four), the rest going to the row's plane (here: the widening kernel reads them too)."""
    return 2 if bits < 4 else 4


@functools.cache
def widen_kernel():
    """run(codes, scales, offsets, dtype, chunk=0, table=None, inputs=None) -> the weight: a Triton kernel reading
    each code, its scale and offset once and writing the weight once (on an H200, torch's three passes over an 8B
    layer's 14336 x 4096 codes took 0.35 ms, 8x what the bytes need); `chunk` > 0: codes packed in chunks of that many
    inputs (rungen/int4_kernel.py's packing: two a byte, or 2- and 3-bit ones four, `inputs` wide with their bits above
    those in a plane after them), read as they lie, int8 ones signed, without offsets MXFP4's e2m1 bits, with a `table`
    the indices of its levels (level_pairs: each byte's two); None where Triton does not import."""
    try:
        import triton

        from .code_triton import widen
    except Exception:  # any failure: torch's operators serve
        return None

    def run(codes, scales, offsets, dtype, chunk=0, table=None, inputs=None):
        rows, inner = codes.shape[0], inputs or codes.shape[1] * (2 if chunk else 1)
        out = torch.empty(rows, inner, dtype=dtype, device=codes.device)
        codes, scales = codes.contiguous(), scales.contiguous()  # (indexed by row * K + column: no-ops as held)
        bits = codes.shape[1] * 8 // inner
        low = low_bits(bits)
        widen[(rows, triton.cdiv(inner, WIDEN_BLOCK))](
            codes, scales, scales if offsets is None else offsets.contiguous(), scales if table is None else table,
            out, inner, GROUP=inner // scales.shape[1] if scales.dim() == 2 else 0, OFFSET=offsets is not None,
            CHUNK=chunk, TABLE=table is not None, LOW=low, HIGH=bits - low if chunk else 0,
            SIGNED=bool(chunk) and codes.dtype == torch.int8, BLOCK=WIDEN_BLOCK)
        return out

    return run


class CodesLinear(torch.nn.Module):
    """A layer of integer codes on a CUDA GPU (codes, scales, offsets, bias): a Triton kernel for a step's few rows
    once checked (use_kernel), else `plain`, the codes widened for the GPU's own product."""

    plain = staticmethod(widened)
    kernel = None  # set by use_kernel once the kernel has been checked on this GPU

    def use_kernel(self, kernel) -> None:
        self.kernel = kernel

    @classmethod
    def concatenated(cls, layers: list[CodesLinear]) -> CodesLinear | None:
        """One layer whose output is the layers' side by side (a fused step's q/k/v or gate/up: one launch), its
        codes, scales and offsets those the layers now hold views of (the rows of one buffer each: nothing held
        twice); None where they differ in form (types, groups, kernel) or hold a bias."""
        first = layers[0]
        table = first.offsets is not None and first.offsets.dim() == 1  # (codes indexing one table's levels)
        forms = {(type(layer), layer.in_features, layer.codes.dtype, layer.scales.dtype, layer.scales.shape[1:],
                  None if layer.offsets is None else layer.offsets.dim(), layer.kernel) for layer in layers}
        if table and len({layer.offsets.data_ptr() for layer in layers}) > 1:
            return None
        if len(forms) > 1 or any(layer.bias is not None for layer in layers):
            return None
        one = object.__new__(cls)
        torch.nn.Module.__init__(one)
        one.in_features, one.bias, one.format = first.in_features, None, first.format
        one.out_features = sum(layer.out_features for layer in layers)
        shared = ("offsets",) if table else ()  # (a table: the one every layer reads)
        for name in ("codes", "scales", "offsets"):
            parts = [getattr(layer, name) for layer in layers]
            one.register_buffer(name, None if parts[0] is None else parts[0] if name in shared else torch.cat(parts))
        one.use_kernel(first.kernel)
        start = 0
        for layer in layers:
            end = start + layer.out_features
            for name in ("codes", "scales", "offsets")[:3 - len(shared)]:
                whole = getattr(one, name)
                setattr(layer, name, None if whole is None else whole[start:end])
            start = end
        return one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.kernel is not None and flat.shape[0] <= MOST_ROWS:
            y = self.kernel(flat.contiguous(), self.codes, self.scales, offsets=self.offsets)
        else:
            y = self.plain(flat, self.codes, self.scales, self.offsets)
        y = y.reshape(x.shape[:-1] + (self.out_features,))
        return y if self.bias is None else y + self.bias


class CudaInt8Linear(CodesLinear):
    """y = x @ (scale * codes + offset).T (+ bias) on a CUDA GPU, in the activations' dtype: codes int8 [out, in],
    one scale an output channel (scales [out]) or a group of inputs (scales [out, groups]: GGUF's int8 forms), and
    where the blocks have minimums an offset a group (offsets [out, groups], else None)."""

    format = "int8"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 offsets: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("offsets", None if offsets is None else offsets.contiguous())
        self.bias = bias


class CodesEmbedding(torch.nn.Module):
    """The input embedding of a tied model whose head is a CudaInt8Linear (a GGUF file's table in an int8 form): a
    lookup scales (and offsets) its rows' codes, so one copy of the table, a byte a weight, serves both."""

    def __init__(self, head: CudaInt8Linear, dtype: torch.dtype, scale: float | torch.Tensor | None = None):
        super().__init__()
        self.head, self.dtype = head, dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.embed_scale = scale  # Gemma-style scaled embeddings multiply the looked-up rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        codes = self.head.codes.index_select(0, flat).float()
        scales = self.head.scales.index_select(0, flat).float()
        if scales.dim() == 1:
            rows = codes * scales[:, None]
        else:
            rows = codes.view(flat.shape[0], scales.shape[1], -1) * scales[..., None]
            if self.head.offsets is not None:
                rows = rows + self.head.offsets.index_select(0, flat).float()[..., None]
            rows = rows.view(flat.shape[0], -1)
        out = rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)
        return out if self.embed_scale is None else out * self.embed_scale


def checked_kernel(layer: CudaInt8Linear, dtype: torch.dtype, instead: str):
    """The Triton kernel where it imports, is allowed (RUN_GENERATION_TRITON_INT8 not 0) and multiplies as the
    plain product does on `layer`; else None, one warning saying why and what the caller does `instead`. The first
    layer checked on a GPU also decides whether a step's few rows go to the GEMV kernel: where it multiplies that
    layer at one row faster than the tiled kernel does (choose_gemv)."""
    if layer.codes.device.type != "cuda" or os.environ.get(TRITON_ENV, "1") == "0":
        return None
    kernel = triton_kernel()
    why = disagreement(kernel, layer, dtype)
    if why is None:
        choose_gemv(kernel, layer, dtype)
        return kernel
    logger.warning("int8 weights on the GPU: %s; %s", why, instead)
    return None


def disagreement(kernel, layer: CodesLinear, dtype: torch.dtype) -> str | None:
    """Why `kernel` cannot serve `layer` (None: at one row and at MOST_ROWS of `dtype` it gives the layer's plain
    product to the dtype's rounding, on the layer's first CHECKED_CHANNELS output channels; a kernel of None: Triton
    did not import)."""
    if kernel is None:
        return "Triton does not import"
    generator = torch.Generator(layer.codes.device).manual_seed(0)
    # Copies of its first output channels: a head's whole table widened to float32 would be gigabytes at load, and a
    # launch that fails leaves its arguments in Triton's autotuner (a view would keep the layer's codes on the GPU).
    codes, scales = layer.codes[:CHECKED_CHANNELS].clone(), layer.scales[:CHECKED_CHANNELS].clone()
    offsets = None if layer.offsets is None else layer.offsets[:CHECKED_CHANNELS].clone()
    for rows in (1, MOST_ROWS):
        x = torch.randn(rows, layer.in_features, dtype=dtype, device=layer.codes.device, generator=generator)
        reference = layer.plain(x.float(), codes, scales, offsets)
        try:
            error = (kernel(x, codes, scales, offsets=offsets).float() - reference).abs().max()
        except torch.OutOfMemoryError:  # the model does not fit, whatever the kernel: the user must hear that
            raise
        except Exception as failure:  # a compile or launch failure: the caller's other way serves
            return f"the Triton kernel failed ({(str(failure).splitlines() or [type(failure).__name__])[0]})"
        if not bool(error <= 0.02 * reference.abs().max()):
            return "the Triton kernel disagrees with the plain product on this GPU"
    return None


def cuda_int8_layers():
    """quantize_model's layer maker on a CUDA GPU: (weight, bias, check) -> CudaInt8Linear on the weight's device;
    the layer made with check=True (the first) decides whether the Triton kernel serves every layer."""
    kernel = None

    def make(weight, bias, check=False):
        nonlocal kernel
        layer = CudaInt8Linear(*int8_codes(weight), bias)
        if check:
            kernel = checked_kernel(layer, weight.dtype, "--quantize int8 widens the codes a layer at a time for each "
                                    "product (slower than bfloat16 at one token a step)")
        layer.use_kernel(kernel)
        return layer

    return make
