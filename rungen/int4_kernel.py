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

Codes may be wider or narrower than a nibble, and groups smaller (form_of): 5- and 6-bit codes (GGUF's Q5_0, Q5_1,
Q5_K, Q6_K) keep their low four bits as above and the bits above in a plane after each row's nibbles, the top bits of
a byte's two codes side by side, so a tile loads its bytes and their plane's bytes and joins them in registers; 2- and
3-bit codes (Q2_K, Q3_K) keep their low two bits four a byte (byte j of a chunk: inputs j, j + 16, j + 32, j + 48)
and Q3_K's third in a plane likewise; int8 bytes mark signed codes (two's complement of their width: Q5_0's, Q6_K's,
Q3_K's), which take no offsets; a scale may serve 16 inputs (Q6_K's, Q3_K's, Q2_K's groups) rather than 32; and
integer scales are a K-quant's own, a group's integer times its superblock's float16 (LEVELS 4, Q6_K's and Q3_K's),
with its minimum likewise (LEVELS 5, Q4_K's, Q5_K's and Q2_K's): about the file's bytes, where a float32 a group took
1-4 bits a weight more.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from .code_kernels import GEMV_PRODUCTS, autotune, choose_gemv, launcher, with_gemv
from .int4 import GPU_INT4_ENV, TinyGemmLinear, int4_groups
from .int8 import CodesLinear, disagreement, low_bits, widened

logger = logging.getLogger(__name__)

SCALED_ROWS = 4096  # output channels whose LEVELS 4 scales widened4 multiplies out at a time
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


def packed(codes: torch.Tensor, bits: int = 4, signed: bool = False) -> torch.Tensor:
    """Codes [out, in] (`bits` wide, 2 to 6; `signed`: two's complement, -2^(bits-1)..; in a multiple of CHUNK) as
    bytes [out, in * bits / 8] in the kernels' layout: their low bits (low_bits: four, or two below 4 bits) 8 / low
    a byte, byte j of a chunk holding inputs j, j + run, ... (run = CHUNK x low / 8), then the bits above, each
    byte's codes' side by side, as many bytes' worth as fit in a byte of the row's plane of them. Signed codes come
    back as int8 (the kernels' sign for them), the others as uint8."""
    rows, inputs = codes.shape
    low = low_bits(bits)
    per, high = 8 // low, bits - low
    codes = codes.to(torch.int16) & ((1 << bits) - 1)
    chunks = (codes & ((1 << low) - 1)).to(torch.uint8).reshape(rows, inputs // CHUNK, per, CHUNK // per)
    out = torch.zeros_like(chunks[:, :, 0])
    for i in range(per):
        out |= chunks[:, :, i] << (low * i)
    out = out.reshape(rows, inputs * low // 8)
    if high:
        tops = (codes >> low).to(torch.uint8).reshape(rows, inputs // CHUNK, per, CHUNK // per)
        joined = torch.zeros_like(tops[:, :, 0])
        for i in range(per):  # a byte's codes' tops side by side
            joined |= tops[:, :, i] << (high * i)
        joined = joined.reshape(rows, -1, 8 // (per * high))
        plane = torch.zeros_like(joined[..., 0])
        for i in range(8 // (per * high)):
            plane |= joined[..., i] << (per * high * i)
        out = torch.cat([out, plane], dim=1)
    return out.view(torch.int8) if signed else out


def unpacked(packed_codes: torch.Tensor, inputs: int | None = None) -> torch.Tensor:
    """packed()'s inverse: bytes [out, in * bits / 8] (`inputs`: in; None: 4-bit codes) as codes [out, in] (uint8;
    int8 bytes: signed codes, int16)."""
    rows, width = packed_codes.shape
    inputs = inputs or width * 2
    bits = width * 8 // inputs
    low = low_bits(bits)
    per, high = 8 // low, bits - low
    raw = packed_codes.view(torch.uint8)
    chunks = raw[:, :inputs * low // 8].reshape(rows, inputs // CHUNK, 1, CHUNK // per)
    codes = torch.cat([(chunks >> (low * i)) & ((1 << low) - 1) for i in range(per)], dim=2).reshape(rows, inputs)
    if high:
        plane = raw[:, inputs * low // 8:]
        joined = torch.stack([(plane >> (per * high * i)) & ((1 << per * high) - 1)
                              for i in range(8 // (per * high))], dim=-1)
        joined = joined.reshape(rows, inputs // CHUNK, 1, CHUNK // per)
        tops = torch.cat([(joined >> (high * i)) & ((1 << high) - 1) for i in range(per)], dim=2)
        codes = codes | (tops.reshape(rows, inputs) << low)
    if packed_codes.dtype == torch.int8:
        codes = codes.to(torch.int16)
        codes = codes - ((codes >> (bits - 1)) << bits)
    return codes


E2M1_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1's values doubled, by their bits
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL/IQ4_XS's levels


SUPERBLOCK = 256  # inputs a K-quant's float16 scale serves (LEVELS 4)


def levels_of(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None) -> int:
    """What a layer's packed codes stand for (the kernels' LEVELS): 0 the code times the scale plus the offset
    (offsets [out, groups]), 1 MXFP4's e2m1 value (uint8 codes, no offsets), 2 a level of a table (offsets
    level_pairs'), 3 a signed code times the scale (int8 codes, no offsets: Q5_0's), 4 a signed code times the
    group's int8 scale times its superblock's float16 one (int8 scales, offsets [out, in / SUPERBLOCK]: Q6_K's and
    Q3_K's, as their blocks hold them), 5 the code times the group's integer scale times its superblock's float16
    one, less the same of their minimums (uint8 scales [out, 2 x groups], each group's scale and minimum side by
    side; offsets [out, 2 x in / SUPERBLOCK], each superblock's two: Q4_K's, Q5_K's and Q2_K's, as their blocks
    hold them)."""
    if scales.dtype in (torch.int8, torch.uint8):
        return 4 if scales.dtype == torch.int8 else 5
    if offsets is not None:
        return 2 if offsets.dim() == 1 else 0
    return 3 if codes.dtype == torch.int8 else 1


def form_of(inner: int, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None) -> dict:
    """The kernels' constexprs for packed codes of `inner` inputs (a mixture's: one expert's): LEVELS (levels_of),
    LOW (each code's bits side by side in the bytes: 4 or 2, low_bits), HIGH (its bits above them in the plane: 0
    to 2; both from the row's bytes) and GROUP (inputs a scale, 16 or 32)."""
    levels, bits = levels_of(codes, scales, offsets), codes.shape[-1] * 8 // inner
    groups = scales.shape[-1] // (2 if levels == 5 else 1)
    return {"LEVELS": levels, "LOW": low_bits(bits), "HIGH": bits - low_bits(bits), "GROUP": inner // groups}


def superblock_scales(scales: torch.Tensor, superblocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LEVELS 4's and 5's scales as float32 ones a group (exact: integers of 8 bits at most times float16s): the
    group's scale, and LEVELS 5's offset (its minimum, negated), else None. (Views spread the superblocks' over
    their groups: repeat_interleave, which may read its count back, failed the played GPU's capture check in
    benchmarks/gpu_products.py's graphs.)"""
    pairs = scales.dtype == torch.uint8
    groups = scales.float().unflatten(-1, (-1, 2 if pairs else 1))  # [..., groups, 1 or 2]
    wholes = superblocks.float().unflatten(-1, (-1, 1, 2 if pairs else 1))  # [..., superblocks, 1, 1 or 2]
    spread = wholes.expand(*wholes.shape[:-2], groups.shape[-2] // wholes.shape[-3], wholes.shape[-1])
    products = groups * spread.reshape(groups.shape)
    return products[..., 0], -products[..., 1] if pairs else None


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
    return e2m1_levels(packed_codes.device)[unpacked(packed_codes).long()]


@functools.cache
def e2m1_levels(device: torch.device) -> torch.Tensor:
    """E2M1_LEVELS on `device` (int8), one a process and device: made at a call inside a CUDA graph's capture, its
    copy from the host would fail there."""
    return torch.tensor(E2M1_LEVELS, dtype=torch.int8).to(device)


def widened4(x: torch.Tensor, packed_codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
             ) -> torch.Tensor:
    """The plain product x @ (codes * scale + offset).T (no offsets: MXFP4's codes, their doubled values times the
    scale, or signed codes times it; a table: the codes' levels times the scale), the codes widened to x's dtype a
    slice of output channels at a time (rungen/int8.py's widened: on a GPU its kernel reads them packed as they
    lie)."""
    kind, inputs = levels_of(packed_codes, scales, offsets), x.shape[-1]
    if kind >= 4:  # (the float32 scales a slice of rows at a time: a head's would be a quarter byte a weight)
        rows = [slice(start, start + SCALED_ROWS) for start in range(0, packed_codes.shape[0], SCALED_ROWS)]
        return torch.cat([widened4(x, packed_codes[r], *superblock_scales(scales[r], offsets[r])) for r in rows],
                         dim=-1)
    if kind == 2:
        levels = table_levels(offsets)
        return widened(x, packed_codes, scales, None,
                       (CHUNK, lambda codes: levels[unpacked(codes).long()], offsets))
    unpack = e2m1_unpacked if kind == 1 else functools.partial(unpacked, inputs=inputs)
    return widened(x, packed_codes, scales, offsets, (CHUNK, unpack, None))


@functools.cache
def triton_kernel():
    """The Triton kernels (rungen/code_triton.py's int4_matmul and int4_gemv) as one run(x, codes, scales, ...) -> y,
    or None where Triton does not import."""
    try:
        import triton

        from . import code_triton
    except Exception:  # any failure: the widened product serves
        return None

    # x @ (unpacked(codes) * scales + offsets).T; codes [out, in * bits / 8] (packed()), scales and offsets [out, in /
    # GROUP]; no offsets: x @ (e2m1_unpacked(codes) * scales).T, or signed codes times the scales; a table: its levels
    # of the codes times the scales. int8's configurations but (16, 256, 4), which spills 8 bytes here with float16
    # scales on sm_90 (python -m benchmarks.int8_kernel_resources). Constexprs: form_of.
    tiled = launcher(triton, code_triton.int4_matmul, form_of, leave_out=[(16, 256, 4)])

    def fitting(configs, named_args, **kwargs):  # rows x a tile's codes within GEMV_PRODUCTS (registers)
        rows = kwargs.get("ROWS", named_args.get("ROWS", 1))
        return [config for config in configs
                if rows * config.kwargs["BLOCK_N"] * config.kwargs["BLOCK_K"] // 2 <= GEMV_PRODUCTS]

    gemv = autotune(triton, [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in GEMV_CONFIGS],
                    ["N", "K", "ROWS", "LEVELS", "LOW", "HIGH", "GROUP", "GROUPED"], fitting)(code_triton.int4_gemv)
    return with_gemv(triton, tiled, gemv, form_of, GEMV_ENV)


class CudaInt4Linear(CodesLinear):
    """y = x @ (code * scale + offset).T on a CUDA GPU, in the activations' dtype: codes packed (packed(): two a byte,
    2- and 3-bit ones four, and a plane of the bits above those where they are 3, 5 or 6 bits wide), a scale and an
    offset a group of 32 or 16 inputs (offsets None: MXFP4's e2m1 codes, their doubled values times the scale, or
    signed codes, int8, times it; offsets a level_pairs table: the codes' levels times the scale; integer scales: a
    K-quant's, as its blocks hold them, the superblocks' float16 ones as offsets: levels_of); the Triton kernel for a
    few rows once checked, else widened4."""

    format = "int4"
    plain = staticmethod(widened4)

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 in_features: int | None = None):
        super().__init__()
        self.out_features, self.in_features = codes.shape[0], in_features or codes.shape[1] * 2
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("offsets", None if offsets is None else offsets.contiguous())
        self.bias = None
        form = form_of(self.in_features, codes, scales, offsets)
        bits = form["LOW"] + form["HIGH"]
        self.format = (f"int{bits}", "e2m1", "int4 levels", f"signed int{bits}", f"signed int{bits}", f"int{bits}")[
            form["LEVELS"]]

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
