"""4-bit weights on a CUDA GPU as their codes two a byte, with a scale and an offset a group of 32 inputs, read by a
Triton kernel (CudaInt4Linear): a GGUF file's (Q4_0, Q4_1, Q4_K) and --quantize int4's, where torch's int4 kernel
(tinygemm, rungen/int4.py) does not run in half precision (float16, GPUs before Ampere) and where
RUN_GENERATION_GPU_INT4=triton asks for it instead (gpu_int4_form). The kernel reads half a byte a weight and the
group's two numbers, widens the codes in registers and multiplies on the tensor cores, for a step's few rows; a
prompt's many rows widen the codes to the activations' dtype a slice of the layer at a time for the GPU's own
product, as rungen/int8.py does for its codes.

Codes are packed in chunks of CHUNK inputs: byte j of a chunk holds input j in its low nibble and input j + CHUNK/2
in its high one, so that the low and the high nibbles of a kernel's tile each multiply a contiguous run of inputs.

Codes need not be affine (levels_of): a layer without offsets holds MXFP4's codes (gpt-oss's experts), each nibble
e2m1's own bits (sign, two of exponent, one of mantissa) standing for E2M1_LEVELS' doubled value, times the group's
power-of-two scale. The kernels widen them as bits: shifted into a float16's sign, exponent and mantissa they make
the value times 2^-14 exactly (the exponent's 0 a subnormal, as e2m1's is), the scale taking the 2^15 back, so a
nibble costs a few integer operations more than an affine code. A layer whose offsets are a table of 256 (IQ4_NL's
and IQ4_XS's, whose 16 levels no bits make: level_pairs) holds codes that index levels: the kernels look each byte's
two levels up at once in that table (1 KB, which stays in the GPU's L1 cache) and scale them.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from .code_kernels import GEMV_PRODUCTS, autotune, choose_gemv, launcher, with_gemv
from .int4 import GPU_INT4_ENV, TinyGemmLinear, int4_groups
from .int8 import CodesLinear, disagreement, widened

logger = logging.getLogger(__name__)

CHUNK = 64  # inputs a packing chunk spans (in_features must be a multiple): two groups, as Q4_K packs them
GEMV_ENV = "RUN_GENERATION_INT4_GEMV"  # 0: a step's rows on the tiled kernel always (never the GEMV kernel)
# The GEMV kernel's tuned configurations (BLOCK_N, BLOCK_K, warps): a program's channels and inputs a step. Wide
# channel blocks read a few short rows each; narrow ones with long input steps (2-8 channels, 1,024-2,048 inputs)
# make N/2-N/8 programs that each load 1-8 KiB a step, the bytes in flight a GPU's bandwidth needs at one row
# (4096 x 4096 codes at 32 channels a program: 128 programs, about one an SM).
GEMV_CONFIGS = ((8, 256, 2), (16, 256, 4), (16, 512, 4), (32, 256, 4), (32, 128, 4), (64, 128, 4),
                (2, 2048, 2), (4, 1024, 2), (4, 2048, 4), (8, 1024, 4), (8, 2048, 8))


def gpu_int4_form(in_features: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """The kernel 4-bit codes of a layer with `in_features` inputs take on `device` for a model in `dtype`: "tinygemm"
    (TinyGemmLinear) where torch's kernel runs (Ampere on, bfloat16), else in half precision "triton" (CudaInt4Linear:
    float16, GPUs before Ampere; in any dtype where RUN_GENERATION_GPU_INT4=triton asks for it), or None (float32,
    the checks' exact dtype; inputs that fill no chunk; RUN_GENERATION_GPU_INT4=0). A GGUF file's load may time the
    two forms where both run (timed_int4_choice)."""
    form = os.environ.get(GPU_INT4_ENV)
    if form == "0":
        return None
    tinygemm = TinyGemmLinear.runs_on(in_features, dtype, device)
    if device.type == "cuda" and CudaInt4Linear.fits(in_features) and (
            form == "triton" or not tinygemm and dtype != torch.float32):
        return "triton"
    return "tinygemm" if tinygemm else None


def timed_int4_choice(in_features: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a GGUF file's first 4-bit weight times tinygemm against the Triton form at one row to choose the 4-bit
    form of the load (rungen/gguf/device.py): where both run (tinygemm's form chosen, the Triton kernel's chunks
    filled, Triton imported) and RUN_GENERATION_GPU_INT4 names no form (tinygemm or triton pins one)."""
    return (os.environ.get(GPU_INT4_ENV) is None and gpu_int4_form(in_features, dtype, device) == "tinygemm"
            and CudaInt4Linear.fits(in_features) and os.environ.get("TRITON_INTERPRET") != "1"
            and triton_kernel() is not None)


def packed(codes: torch.Tensor) -> torch.Tensor:
    """Codes [out, in] (0..15, in a multiple of CHUNK) as bytes [out, in / 2] in the kernel's layout."""
    rows, inputs = codes.shape
    chunks = codes.to(torch.uint8).reshape(rows, inputs // CHUNK, 2, CHUNK // 2)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(rows, inputs // 2)


def unpacked(packed_codes: torch.Tensor) -> torch.Tensor:
    """packed()'s inverse: bytes [out, in / 2] as codes [out, in] (uint8)."""
    rows, half = packed_codes.shape
    chunks = packed_codes.reshape(rows, half * 2 // CHUNK, 1, CHUNK // 2)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(rows, half * 2)


E2M1_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1's values doubled, by their bits
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL/IQ4_XS's levels


def levels_of(offsets: torch.Tensor | None) -> int:
    """What a 4-bit layer's codes stand for, by its offsets (the kernels' LEVELS): 0 the code times the scale plus
    the offset (offsets [out, groups]), 1 MXFP4's e2m1 value (None), 2 a level of a table (offsets level_pairs')."""
    return 1 if offsets is None else 2 if offsets.dim() == 1 else 0


@functools.cache
def level_pairs(levels: tuple, device: torch.device) -> torch.Tensor:
    """The table a table's 4-bit codes look their levels up in, a byte at a time: for each of the 256 bytes, its low
    nibble's level in the low 16 bits and its high nibble's in the high 16 (int32 [256] on `device`, one a
    process and device)."""
    values, byte = torch.tensor(levels, dtype=torch.int32), torch.arange(256)
    return ((values[byte & 15] & 0xFFFF) | (values[byte >> 4] << 16)).to(torch.int32).to(device)


def table_levels(pairs: torch.Tensor) -> torch.Tensor:
    """level_pairs' 16 levels (int32)."""
    return (pairs[:16] << 16) >> 16


def e2m1_unpacked(packed_codes: torch.Tensor) -> torch.Tensor:
    """MXFP4's codes packed() as their doubled values [out, in] (int8, -12..12)."""
    levels = torch.tensor(E2M1_LEVELS, dtype=torch.int8, device=packed_codes.device)
    return levels[unpacked(packed_codes).long()]


def widened4(x: torch.Tensor, packed_codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
             ) -> torch.Tensor:
    """The plain product x @ (codes * scale + offset).T (no offsets: MXFP4's codes, their doubled values times the
    scale; a table: the codes' levels times the scale), the codes widened to x's dtype a slice of output channels at a
    time (rungen/int8.py's widened: on a GPU its kernel reads them packed as they lie)."""
    kind = levels_of(offsets)
    if kind == 2:
        levels = table_levels(offsets)
        return widened(x, packed_codes, scales, None,
                       (CHUNK, lambda codes: levels[unpacked(codes).long()], offsets))
    return widened(x, packed_codes, scales, offsets, (CHUNK, unpacked if kind == 0 else e2m1_unpacked, None))


@functools.cache
def triton_kernel():
    """The Triton kernel (x, packed codes, scales, offsets) -> y, or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # any failure: the widened product serves
        return None

    @triton.jit(do_not_specialize=["M", "M_BUCKET"])  # one compilation for every decode batch
    def int4_matmul(x, codes, scales, offsets, y, tiles, sources, M, N, K, M_BUCKET, LEVELS: tl.constexpr,
                    GROUPED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # y[m, n] = sum_k x[m, k] * (code[n, k] * scales[n, k // 32] + offsets[n, k // 32]), BLOCK_K inputs (whole
        # chunks of 64) at a time: the bytes' low nibbles hold each chunk's first group of 32 and the high ones its
        # second, so each is a product over whole groups. LEVELS (levels_of): 1, each code e2m1's bits (MXFP4's); 2,
        # each byte's two levels looked up in offsets (level_pairs). Grid, rows and GROUPED as rungen/int8.py's
        # kernel's.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        if GROUPED:
            expert = tl.load(tiles + tl.program_id(0)).to(tl.int64)
            if expert < 0:
                return
            codes += expert * N * (K // 2)
            scales += expert * N * (K // 32)
            if LEVELS == 0:
                offsets += expert * N * (K // 32)
            reads = tl.load(sources + rows).to(tl.int64)
            held_rows = reads >= 0
        else:
            reads, held_rows = rows, rows < M
        channels = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        half = tl.arange(0, BLOCK_K // 2)
        low_inputs = (half // 32) * 64 + half % 32  # a tile's inputs in its bytes' low nibbles
        low_groups = 2 * tl.arange(0, BLOCK_K // 64)  # their groups: each chunk's first
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            low_at = start + low_inputs
            held_x = held_rows[:, None] & (low_at[None, :] < K)
            byte_at = start // 2 + half
            b = tl.load(codes + channels[None, :] * (K // 2) + byte_at[:, None],
                        mask=(channels[None, :] < N) & (byte_at[:, None] < K // 2), other=0)
            if LEVELS == 2:  # both nibbles' levels at once (a byte past the weight: 0's, times a scale of 0)
                pairs = tl.load(offsets + b.to(tl.int32))
            group = start // 32 + low_groups
            held = (channels[None, :] < N) & (group[:, None] < K // 32)
            where = channels[None, :] * (K // 32) + group[:, None]
            for part in tl.static_range(2):  # the low nibbles (each chunk's first group), then the high ones
                a = tl.load(x + reads[:, None] * K + 32 * part + low_at[None, :], mask=held_x, other=0.0)
                # each group's one scale and offset spread over its 32 codes in registers
                scale = tl.load(scales + where + part, mask=held, other=0.0).to(tl.float32)
                nibbles = (b >> (4 * part)) & 0x0F
                if LEVELS == 1:  # sign and three bits in a float16's sign, exponent and mantissa: e2m1's value x 2^-14
                    bits = nibbles.to(tl.uint16)
                    bits = (((bits & 8) << 12) | ((bits & 7) << 9)).to(tl.uint16)  # (16 bits whatever Triton promotes)
                    w = bits.to(tl.float16, bitcast=True).to(tl.float32)
                    w = tl.reshape(w, (BLOCK_K // 64, 32, BLOCK_N)) * (scale * 32768.0)[:, None, :]
                elif LEVELS == 2:  # the low nibble's level in the pair's low half, the high one's in its high half
                    if part == 0:
                        w = (pairs << 16) >> 16
                    else:
                        w = pairs >> 16
                    w = tl.reshape(w.to(tl.float32), (BLOCK_K // 64, 32, BLOCK_N)) * scale[:, None, :]
                else:
                    w = tl.reshape(nibbles.to(tl.float32), (BLOCK_K // 64, 32, BLOCK_N)) * scale[:, None, :] + \
                        tl.load(offsets + where + part, mask=held, other=0.0).to(tl.float32)[:, None, :]
                total += tl.dot(a, tl.reshape(w, (BLOCK_K // 2, BLOCK_N)).to(a.dtype), input_precision="ieee")
        tl.store(y + rows[:, None] * N + channels[None, :], total.to(y.dtype.element_ty),
                 mask=held_rows[:, None] & (channels[None, :] < N))

    # x @ (unpacked(codes) * scales + offsets).T; codes [out, in / 2] (packed()), scales and offsets [out, in / 32];
    # no offsets: x @ (e2m1_unpacked(codes) * scales).T; a table: its levels of the codes times the scales.
    # int8's configurations but (16, 256, 4), which spills 8 bytes here with float16 scales on sm_90
    # (python -m benchmarks.int8_kernel_resources).
    def constants(inner, scales, offsets):
        return {"LEVELS": levels_of(offsets)}

    tiled = launcher(triton, int4_matmul, constants, leave_out=[(16, 256, 4)])

    def fitting(configs, named_args, **kwargs):  # rows x a tile's codes within GEMV_PRODUCTS (registers)
        rows = kwargs.get("ROWS", named_args.get("ROWS", 1))
        return [config for config in configs
                if rows * config.kwargs["BLOCK_N"] * config.kwargs["BLOCK_K"] // 2 <= GEMV_PRODUCTS]

    @autotune(triton, [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in GEMV_CONFIGS],
              ["N", "K", "ROWS", "LEVELS", "GROUPED"], fitting)
    @triton.jit(do_not_specialize=["M"])
    def int4_gemv(x, codes, scales, offsets, y, pairs, M, N, K, LEVELS: tl.constexpr, ROWS: tl.constexpr,
                  GROUPED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # y[m, n] for a decode step's few rows (M <= ROWS) without the tensor cores, whose tiles of 16 rows a row
        # would waste: BLOCK_N output channels a program over all K inputs, BLOCK_K (whole chunks) at a time, each
        # nibble's codes widened with their group's scale and offset in registers and multiplied into every row.
        # GROUPED: a mixture's experts stacked [experts, N, ...]; program_id(1) a pair p (pairs[p]: its expert and
        # its row of x), y[p] = x[row] times that expert's weight.
        if GROUPED:
            pair = tl.program_id(1)
            expert = tl.load(pairs + 2 * pair).to(tl.int64)
            codes += expert * N * (K // 2)
            scales += expert * N * (K // 32)
            if LEVELS == 0:
                offsets += expert * N * (K // 32)
            x += tl.load(pairs + 2 * pair + 1).to(tl.int64) * K
            y += pair * N
        channels = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rows = tl.arange(0, ROWS)
        half = tl.arange(0, BLOCK_K // 2)
        low_inputs = (half // 32) * 64 + half % 32  # as int4_matmul's
        chunk = tl.arange(0, BLOCK_K // 64)
        total = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            byte_at = start // 2 + half
            b = tl.load(codes + channels[:, None] * (K // 2) + byte_at[None, :],
                        mask=(channels[:, None] < N) & (byte_at[None, :] < K // 2), other=0)
            if LEVELS == 2:  # as int4_matmul's
                levels = tl.load(offsets + b.to(tl.int32))
            group = start // 32 + 2 * chunk
            held = (channels[:, None] < N) & (group[None, :] < K // 32)
            where = channels[:, None] * (K // 32) + group[None, :]
            for part in tl.static_range(2):  # the low nibbles (each chunk's first group), then the high ones
                scale = tl.load(scales + where + part, mask=held, other=0.0).to(tl.float32)
                nibbles = (b >> (4 * part)) & 0x0F
                if LEVELS == 1:  # as int4_matmul's
                    bits = nibbles.to(tl.uint16)
                    bits = (((bits & 8) << 12) | ((bits & 7) << 9)).to(tl.uint16)  # (16 bits whatever Triton promotes)
                    w = bits.to(tl.float16, bitcast=True).to(tl.float32)
                    w = tl.reshape(w, (BLOCK_N, BLOCK_K // 64, 32)) * (scale * 32768.0)[:, :, None]
                elif LEVELS == 2:
                    if part == 0:
                        w = (levels << 16) >> 16
                    else:
                        w = levels >> 16
                    w = tl.reshape(w.to(tl.float32), (BLOCK_N, BLOCK_K // 64, 32)) * scale[:, :, None]
                else:
                    w = tl.reshape(nibbles.to(tl.float32), (BLOCK_N, BLOCK_K // 64, 32)) * scale[:, :, None] + \
                        tl.load(offsets + where + part, mask=held, other=0.0).to(tl.float32)[:, :, None]
                w = tl.reshape(w, (BLOCK_N, BLOCK_K // 2))
                at = start + 32 * part + low_inputs
                a = tl.load(x + rows[:, None] * K + at[None, :], mask=(rows[:, None] < M) & (at[None, :] < K),
                            other=0.0).to(tl.float32)
                total += tl.sum(a[:, None, :] * w[None, :, :], axis=2)
        tl.store(y + rows[:, None] * N + channels[None, :], total.to(y.dtype.element_ty),
                 mask=(rows[:, None] < M) & (channels[None, :] < N))

    return with_gemv(triton, tiled, int4_gemv, constants, GEMV_ENV)


class CudaInt4Linear(CodesLinear):
    """y = x @ (code * scale + offset).T on a CUDA GPU, in the activations' dtype: codes packed two a byte (packed()),
    a scale and an offset a group of 32 inputs (offsets None: MXFP4's e2m1 codes, their doubled values times the
    scale; offsets a level_pairs table: the codes' levels times the scale); the Triton kernel for a few rows once
    checked, else widened4."""

    format = "int4"
    plain = staticmethod(widened4)

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * 2
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("offsets", None if offsets is None else offsets.contiguous())
        self.bias = None
        self.format = ("int4", "e2m1", "int4 levels")[levels_of(offsets)]

    @classmethod
    def of_weight(cls, weight: torch.Tensor) -> CudaInt4Linear:
        """A float weight [out, in] as its 4-bit codes and groups (rungen/int4.py's int4_groups, --quantize int4's)
        two a byte, each group's scale and least value in float16 (0.625 bytes a weight), on the weight's device."""
        codes, scales, low = int4_groups(weight)
        return cls(packed(codes), scales.to(torch.float16), low.to(torch.float16))

    @staticmethod
    def fits(in_features: int) -> bool:
        return in_features % CHUNK == 0


def checked_int4_kernel(layer: CudaInt4Linear, dtype: torch.dtype) -> tuple[object | None, str | None]:
    """(the Triton kernel, None) where it imports and multiplies `layer`'s first output channels as the
    widened product does (rungen/int8.py's disagreement), else (None, why). On a GPU a step's rows then go to the
    GEMV kernel only if it multiplies `layer` at one row faster than the tiled kernel does (choose_gemv)."""
    kernel = triton_kernel()
    why = disagreement(kernel, layer, dtype)
    if why is None:
        choose_gemv(kernel, layer, dtype)
    return (kernel, None) if why is None else (None, why)
