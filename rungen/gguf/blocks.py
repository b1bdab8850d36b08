"""GGUF's quantized weights as torch layers: the file's own blocks, multiplied where they lie.

A GGMLLinear holds a weight as the file stores it, uint8 [out_features, bytes per row], never de-quantized ahead of
time; types the kernels multiply have their rows interleaved eight by eight at load (docs/kernels.md). The C++
kernels (rungen/gguf/kernels.py) quantize activations to int8 per block of 32, as llama.cpp does; without them (or
with RUN_GENERATION_KERNELS=torch) a layer converts itself to torch's kernels on its first call, after one warning.
On a CUDA GPU, 4-bit types can run as torch's int4 kernel (TinyGemmLinear), Q8_0 as rungen/int8.py's Triton kernel
(CudaInt8Linear), and a Q4_0/Q4_1/Q8_0 embedding table keeps its blocks there (DeviceRowsEmbedding).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

from ..int4 import INNER_K_TILES, Int4Linear, TinyGemmLinear
from ..int8 import CudaInt8Linear
from .kernels import native_kernels

# Block types a GGMLLinear holds; F16/BF16/F32 tensors load as plain tensors of their dtype instead.
SUPPORTED = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.IQ4_NL,
    GGMLQuantizationType.IQ4_XS,
)


# Types interleaved eight rows by eight for the kernels, and the flag added to their type number then.
INTERLEAVED_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                     GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
                     GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.IQ4_NL,
                     GGMLQuantizationType.IQ4_XS, GGMLQuantizationType.Q3_K)
X8 = 256
# Eight rows' interleaved superblock bytes where the packed 6-bit scales are unpacked (docs/gguf.md).
X8_SUPERBLOCK_BYTES = {GGMLQuantizationType.Q4_K: 1184, GGMLQuantizationType.Q5_K: 1440,
                       GGMLQuantizationType.Q3_K: 912, GGMLQuantizationType.IQ4_XS: 1104}


class GGMLError(ValueError):
    """A tensor this module cannot hold (type or shape)."""


def row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    """Bytes one row of `in_features` weights takes in blocks of `qtype`."""
    block, size = GGML_QUANT_SIZES[qtype]
    if in_features % block:
        raise GGMLError(f"{qtype.name} rows are made of blocks of {block}; {in_features} is not a multiple")
    return in_features // block * size


def weights_per_row(qtype: GGMLQuantizationType, bytes_per_row: int) -> int:
    """Weights in a row of `bytes_per_row` bytes of `qtype` blocks."""
    block, size = GGML_QUANT_SIZES[qtype]
    return bytes_per_row // size * block


def interleaved_row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    """Bytes a row of interleaved blocks takes: eight rows of `in_features` weights of `qtype`."""
    block, _ = GGML_QUANT_SIZES[qtype]
    if qtype in X8_SUPERBLOCK_BYTES:
        row_bytes(qtype, in_features)  # the same check of the width
        return in_features // block * X8_SUPERBLOCK_BYTES[qtype]
    return 8 * row_bytes(qtype, in_features)


def dequantize(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> torch.Tensor:
    """The float32 weight that `blocks` [rows, row_bytes] encode (the gguf package's reference)."""
    values = _gguf_dequantize(blocks.contiguous().numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(blocks.shape[0], in_features)


DEQUANTIZE_CHUNK = 1 << 24  # float32 values de-quantized on the host at a time on the way to a device (64 MB)


def dequantize_to(blocks: np.ndarray, qtype: GGMLQuantizationType, in_features: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """The weight that `blocks` [rows, row_bytes] encode, in `dtype` on `device`, de-quantized a chunk of rows at a
    time: never a float32 copy of the whole weight."""
    rows = blocks.shape[0]
    out = torch.empty(rows, in_features, dtype=dtype, device=device)
    step = max(1, DEQUANTIZE_CHUNK // in_features)
    native = qtype in SUPPORTED and native_kernels()
    source = torch.from_numpy(blocks) if native else None
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        if native:
            ids = torch.arange(start, stop, dtype=torch.int64)
            values = torch.ops.rungen_ggml.embed(source, int(qtype), in_features, ids)
        else:
            values = dequantize(torch.from_numpy(np.ascontiguousarray(blocks[start:stop])), qtype, in_features)
        out[start:stop].copy_(values.to(dtype))
    return out


class GGMLLinear(torch.nn.Module):
    """y = x @ W.T (+ bias), W in the file's blocks of `qtype` (`interleaved`: their rows eight by eight, as
    interleave() leaves them)."""

    def __init__(self, blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
                 bias: torch.Tensor | None = None, interleaved: bool = False):
        super().__init__()
        qtype = GGMLQuantizationType(qtype)
        if qtype not in SUPPORTED:
            raise GGMLError(f"tensor type {qtype.name} is not supported")
        group = 8 if interleaved else 1
        if interleaved and qtype not in INTERLEAVED_TYPES:
            raise GGMLError(f"{qtype.name} rows are never interleaved")
        expected = interleaved_row_bytes(qtype, in_features) if interleaved else row_bytes(qtype, in_features)
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != expected:
            raise GGMLError(f"{qtype.name} blocks for {in_features} inputs must be uint8 [rows{' / 8' * interleaved}, "
                            f"{expected}], got {blocks.dtype} {list(blocks.shape)}")
        self.register_buffer("blocks", blocks, persistent=False)
        self.qtype, self.in_features, self.out_features = qtype, in_features, blocks.shape[0] * group
        self.interleaved, self.bias = interleaved, bias

    @property
    def code(self) -> int:
        """The type number the native kernels take for these blocks (X8 added when interleaved)."""
        return int(self.qtype) | (X8 if self.interleaved else 0)

    def interleave(self) -> bool:
        """Interleaves the blocks' rows eight by eight, in place, where the kernels take them so; returns whether."""
        if not self.interleaved and interleavable(self.qtype, self.out_features):
            self.blocks = torch.ops.rungen_ggml.interleave(self.blocks, int(self.qtype))
            self.interleaved = True
        return self.interleaved

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype.name}"
                + (", rows interleaved by 8" if self.interleaved else ""))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if native_kernels():  # always, for interleaved blocks (interleave() needs the kernels)
            return torch.ops.rungen_ggml.mm(x.float().contiguous(), self.blocks, self.code, self.in_features)
        fallback = self.__dict__.get("_fallback")  # kept out of the module tree: not a layer of the model
        if fallback is None:
            fallback = self.__dict__["_fallback"] = torch_layer(self.blocks, self.qtype, self.in_features)
        return fallback(x.float()).float()


class GGMLEmbedding(torch.nn.Module):
    """An embedding table held in GGUF blocks; a lookup de-quantizes only the rows it returns."""

    def __init__(self, blocks: torch.Tensor, qtype: int, embedding_dim: int, dtype: torch.dtype,
                 scale: float | torch.Tensor | None = None, interleaved: bool = False):
        super().__init__()
        self.qtype = GGMLQuantizationType(qtype)
        self.register_buffer("blocks", blocks, persistent=False)
        # interleaved: rows eight by eight (GGMLLinear.interleave), for a tied output head that multiplies them.
        self.interleaved = interleaved
        self.num_embeddings = blocks.shape[0] * (8 if interleaved else 1)
        self.embedding_dim, self.dtype = embedding_dim, dtype
        self.embed_scale = scale  # Gemma-style scaled embeddings multiply the looked-up rows

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}"
                + (", rows interleaved by 8" if self.interleaved else ""))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if native_kernels():  # torch operators only, so that --jit can trace the lookup
            code = int(self.qtype) | (X8 if self.interleaved else 0)
            rows = torch.ops.rungen_ggml.embed(self.blocks, code, self.embedding_dim, ids.reshape(-1))
            out = rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)
        else:
            unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
            rows = dequantize(self.blocks[unique.cpu()], self.qtype, self.embedding_dim).to(self.dtype)
            out = rows[inverse.cpu()].reshape(*ids.shape, self.embedding_dim).to(ids.device)
        return out if self.embed_scale is None else out * self.embed_scale


class CastLinear(torch.nn.Module):
    """A linear layer whose weight keeps the file's float dtype, cast to the input's dtype per call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), bias)


class CastEmbedding(torch.nn.Module):
    """An embedding table in the file's float dtype; looked-up rows are cast to the model's dtype."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, scale=None):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype, self.embed_scale = dtype, scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.embedding(ids, self.weight).to(self.dtype)
        return out if self.embed_scale is None else out * self.embed_scale


def interleavable(qtype: GGMLQuantizationType, rows: int) -> bool:
    """Whether a weight of `rows` rows of `qtype` blocks runs interleaved (GGMLLinear.interleave)."""
    return qtype in INTERLEAVED_TYPES and rows % 8 == 0 and native_kernels()


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_freed_memory() -> None:
    """glibc's malloc_trim: fusing frees weight-sized buffers that glibc would keep (docs/gguf.md)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def holds_blocks(model: torch.nn.Module) -> bool:
    """Whether any layer of `model` multiplies GGUF blocks."""
    return any(isinstance(module, GGMLLinear) for module in model.modules())


def concat(layers: list[GGMLLinear]) -> GGMLLinear | None:
    """One layer of the given layers' rows, in order, or None when they differ in type, layout or input width."""
    first = layers[0]
    if any(layer.code != first.code or layer.in_features != first.in_features for layer in layers):
        return None
    biases = [layer.bias for layer in layers]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(layer.out_features)
                          for layer, b in zip(layers, biases)])
    return GGMLLinear(torch.cat([layer.blocks for layer in layers]), first.qtype, first.in_features, bias,
                      interleaved=first.interleaved)


class GGMLParts(torch.nn.Module):
    """y = x @ [W_1; W_2; ...].T (+ bias): projections of one input whose blocks differ in type, as one product
    (rungen_ggml.mm_parts), each output the same bits as its part multiplied alone."""

    def __init__(self, parts: list[GGMLLinear], bias: torch.Tensor | None = None):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        self.bias = bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        # A replaced GGMLLinear._matmul (products_one_by_one) applies to each part.
        if native_kernels() and GGMLLinear._matmul is _BLOCKS_MATMUL:
            return torch.ops.rungen_ggml.mm_parts(x.float().contiguous(), [p.blocks for p in self.parts],
                                                  [p.code for p in self.parts], self.in_features)
        return torch.cat([p._matmul(x) for p in self.parts], dim=-1)


_BLOCKS_MATMUL = GGMLLinear._matmul


def join(layers: list[GGMLLinear]) -> GGMLLinear | GGMLParts | None:
    """One product of the given layers' rows, in order: concatenated, or a GGMLParts of runs of one type; None when
    their input widths differ."""
    joined = concat(layers)
    if joined is not None or any(layer.in_features != layers[0].in_features for layer in layers):
        return joined
    runs = [[layers[0]]]
    for layer in layers[1:]:
        if layer.code == runs[-1][-1].code:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    parts = []
    for run in runs:  # a run of one keeps its blocks (no copy); the biases go to the whole product, added once
        part = concat(run) if len(run) > 1 else GGMLLinear(run[0].blocks, run[0].qtype, run[0].in_features,
                                                             interleaved=run[0].interleaved)
        part.bias = None
        parts.append(part)
    bias = None
    if any(layer.bias is not None for layer in layers):
        bias = torch.cat([layer.bias if layer.bias is not None else torch.zeros(layer.out_features)
                          for layer in layers])
    return GGMLParts(parts, bias)


# --- Fallback: torch's own kernels, converted from the blocks ---

def _halves(pairs: torch.Tensor) -> torch.Tensor:
    """Byte pairs [..., 2] read as float16, in float32 [...]."""
    return pairs.contiguous().view(torch.float16)[..., 0].float()


def _q8_0_parts(blocks: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks [rows, row bytes] as their int8 codes [rows, in_features] and float16 scales [rows, in_features /
    32], by torch operators on the blocks' device."""
    b = blocks.reshape(blocks.shape[0], -1, 34)
    return (b[..., 2:].contiguous().view(torch.int8).reshape(blocks.shape[0], in_features),
            b[..., 0:2].contiguous().view(torch.float16)[..., 0])


def _nibbles(qs: torch.Tensor, rows: int) -> torch.Tensor:
    """Packed 4-bit codes [rows, blocks, chunks, bytes] as values [rows, blocks * chunks * 2 * bytes]: each chunk's
    low nibbles, then its high ones (Q4_0's 16 bytes a block of 32, Q4_K's four 32-byte chunks a superblock)."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=-2).reshape(rows, -1)


def _bit_planes(bits: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] as their bits [..., 8, n]: plane s holds bit s of every byte (shifts by Python ints: no
    host-to-device copy, so a CUDA graph can hold it)."""
    return torch.stack([(bits >> s) & 1 for s in range(8)], dim=-2)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's twelve bytes of 6-bit scales and mins [..., 12] as ([..., 8], [..., 8]) float32 (gguf's
    get_scale_min)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


GROUPED_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                 GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K)


def _grouped_parts(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int):
    """Codes [rows, in_features] (4-bit types 0..15, 5-bit ones 0..31) and per group of 32 the scale and offset
    (float32) of GROUPED_TYPES' blocks, by torch operators on the blocks' device: code * scale + offset is the gguf
    package's float."""
    rows = blocks.shape[0]
    Q = GGMLQuantizationType
    b = blocks.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])
    if qtype in (Q.Q4_K, Q.Q5_K):  # superblocks of 256: eight groups, 6-bit scales and mins of two float16s
        sc, mn = _k_scales(b[..., 4:16])
        scale, offset = _halves(b[..., 0:2])[..., None] * sc, -(_halves(b[..., 2:4])[..., None] * mn)
        codes = _nibbles(b[..., -128:].reshape(rows, -1, 4, 32), rows)
        if qtype == Q.Q5_K:  # bit s of high byte p: group s, position p
            codes = codes | (_bit_planes(b[..., 16:48]).reshape(rows, -1) << 4)
        return codes.reshape(rows, in_features), scale.reshape(rows, -1), offset.reshape(rows, -1)
    d = _halves(b[..., 0:2])  # blocks of 32: one group each
    codes = _nibbles(b[..., -16:].unsqueeze(-2), rows)
    if qtype in (Q.Q5_0, Q.Q5_1):  # bit i of the block's four high bytes (little-endian): value i
        high = b[..., -20:-16]
        codes = codes | (_bit_planes(high).transpose(-1, -2).reshape(rows, -1) << 4)
    if qtype in (Q.Q4_1, Q.Q5_1):
        offset = _halves(b[..., 2:4])
    else:
        offset = (-16 if qtype == Q.Q5_0 else -8) * d
    return codes.reshape(rows, in_features), d, offset


def _low_k_parts(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int):
    """Q2_K or Q3_K blocks as their codes [rows, in_features] (Q2_K 0..3, Q3_K -4..3; int8) and per group of 16 the
    scale and (Q2_K) the offset, float32, by torch operators on the blocks' device (code * scale + offset is the gguf
    package's float)."""
    rows = blocks.shape[0]

    def fields(packed, width):  # bytes [..., n] -> [..., 8 // width, n]: each `width`-bit field, lowest first
        return torch.stack([(packed >> s) & ((1 << width) - 1) for s in range(0, 8, width)], dim=-2)

    if qtype == GGMLQuantizationType.Q2_K:
        b = blocks.reshape(rows, -1, 84)
        codes = fields(b[..., 16:80].reshape(rows, -1, 2, 32), 2)  # [rows, blocks, 2, 4, 32]: 16 groups of 16
        scales = _halves(b[..., 80:82])[..., None] * (b[..., 0:16] & 0x0F).float()
        offsets = -(_halves(b[..., 82:84])[..., None] * (b[..., 0:16] >> 4).float())
        return codes.reshape(rows, in_features).to(torch.int8), scales.reshape(rows, -1), offsets.reshape(rows, -1)
    b = blocks.reshape(rows, -1, 110)
    low = fields(b[..., 32:96].reshape(rows, -1, 2, 32), 2).reshape(rows, -1, 16, 16).to(torch.int8)
    high = fields(b[..., 0:32].unsqueeze(-2), 1).reshape(rows, -1, 16, 16).to(torch.int8)  # 1: no offset of 4
    codes = low - 4 * (1 - high)
    sixteen = fields(b[..., 96:104].unsqueeze(-2), 4).reshape(rows, -1, 16)  # group g < 8: byte g's low nibble
    top = fields(b[..., 104:108].unsqueeze(-2), 2).reshape(rows, -1, 16)  # group g: byte g % 4, bits 2 (g // 4)
    groups = (sixteen | (top << 4)).float() - 32
    scales = _halves(b[..., 108:110])[..., None] * groups
    return codes.reshape(rows, in_features), scales.reshape(rows, -1), None


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL/IQ4_XS's 16 levels


def _iq4_parts(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int):
    """IQ4_NL or IQ4_XS blocks as their levels' int8 codes [rows, in_features] (IQ4_VALUES) and per group of 32 the
    scale: IQ4_NL's float16 as the file has it, IQ4_XS's superblock float16 scale times the group's 6-bit one less
    32, in float32 (exact); by torch operators on the blocks' device."""
    rows = blocks.shape[0]
    levels = torch.tensor(IQ4_VALUES, dtype=torch.int8, device=blocks.device)
    if qtype == GGMLQuantizationType.IQ4_NL:
        b = blocks.reshape(rows, -1, 18)
        nibbles = _nibbles(b[..., 2:].unsqueeze(-2), rows)
        scales = b[..., 0:2].contiguous().view(torch.float16)[..., 0]
    else:
        b = blocks.reshape(rows, -1, 136)
        low = torch.stack([b[..., 4:8] & 0x0F, b[..., 4:8] >> 4], dim=-1)  # group 2j, 2j+1: byte j's nibbles
        high = torch.stack([(b[..., 2:4] >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)  # group i: bits 2i of 16
        groups = (low.reshape(rows, -1, 8) | (high.reshape(rows, -1, 8) << 4)).float() - 32
        scales = (_halves(b[..., 0:2])[..., None] * groups).reshape(rows, -1)
        nibbles = _nibbles(b[..., 8:].reshape(rows, -1, 8, 16), rows)
    return levels[nibbles.long()].reshape(rows, in_features), scales


def _int4_parts(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int):
    """_grouped_parts of a 4-bit type (INT4_TYPES: Q4_0, Q4_1, Q4_K), codes 0..15."""
    if qtype not in INT4_TYPES:
        raise GGMLError(f"{qtype.name} is not a 4-bit type")
    return _grouped_parts(blocks, qtype, in_features)


def _q6_k_parts(blocks: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks as their codes [rows, in_features] (-32..31, int8) and per group of 16 the scale (float32), by
    torch operators on the blocks' device."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 210)
    low = _nibbles(b[..., 0:128].reshape(rows, -1, 2, 64), rows).reshape(rows, -1, 8, 32)
    high_bytes = b[..., 128:192].reshape(rows, -1, 2, 32)  # each half's 2-bit fields: four groups
    high = torch.stack([(high_bytes >> s) & 3 for s in (0, 2, 4, 6)], dim=-2).reshape(rows, -1, 8, 32)
    codes = (low | (high << 4)).to(torch.int8) - 32
    scale = _halves(b[..., 208:210])[..., None] * b[..., 192:208].contiguous().view(torch.int8).float()
    return codes.reshape(rows, in_features), scale.reshape(rows, -1)


def torch_layer(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> torch.nn.Module:
    """The blocks as one of rungen.quantize's layers: 4-bit types in torch's int4 packing (codes exact), the others
    de-quantized to float16 for fbgemm."""
    from rungen.quantize import head_class

    if qtype not in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K):
        return head_class()(dequantize(blocks, qtype, in_features), None)
    codes, scale, offset = _int4_parts(blocks, qtype, in_features)
    rows = codes.shape[0]
    padded = -rows % 16  # the packing wants output channels in multiples of 16
    codes = torch.nn.functional.pad(codes.to(torch.int32), (0, 0, 0, padded))
    scale, offset = (torch.nn.functional.pad(t, (0, 0, 0, padded)) for t in (scale, offset))
    layer = Int4Linear.__new__(Int4Linear)  # its forward, these buffers: codes and scales as the file has them
    torch.nn.Module.__init__(layer)
    layer.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES))
    # The kernel computes (code - 8) * scale + zero.
    scales_and_zeros = torch.stack([scale, offset + 8 * scale], dim=-1).transpose(0, 1)
    layer.register_buffer("scales_and_zeros", scales_and_zeros.contiguous().to(torch.bfloat16))
    layer.bias, layer.out_features, layer.in_features = None, rows, in_features
    return layer


# --- On a CUDA GPU: 4-bit types as torch's int4 weight-only kernel (tinygemm) takes them ---

INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)


def gpu_int4(qtype: GGMLQuantizationType, in_features: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a weight of `qtype` keeps its 4-bit codes on `device` for a model in `dtype` (TinyGemmLinear)."""
    return qtype in INT4_TYPES and TinyGemmLinear.runs_on(in_features, dtype, device)


def tinygemm_of_blocks(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int, device: torch.device,
                       order=None) -> TinyGemmLinear:
    """A 4-bit weight's blocks (`order`: its rows permuted) as a TinyGemmLinear on `device`, the codes exact."""
    codes, scale, offset = _int4_parts(blocks, qtype, in_features)
    if order is not None:
        order = torch.from_numpy(order)
        codes, scale, offset = codes[order], scale[order], offset[order]
    return TinyGemmLinear(codes, scale, offset, device)


# --- On a CUDA GPU: the types that fit int8 codes and group scales, for rungen/int8.py's Triton kernel ---
INT8_TYPES = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q5_0,
              GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q5_K, GGMLQuantizationType.IQ4_NL,
              GGMLQuantizationType.IQ4_XS, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q2_K)


def gpu_int8(qtype: GGMLQuantizationType, device: torch.device) -> bool:
    """Whether a weight of `qtype` keeps its int8 codes on `device` (CudaInt8Linear, once its kernel is checked)."""
    return qtype in INT8_TYPES and device.type == "cuda"


def int8_of_blocks(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int, device: torch.device,
                   order=None) -> CudaInt8Linear:
    """A weight's INT8_TYPES blocks (`order`: its rows permuted) as a CudaInt8Linear on `device`, exact: Q8_0 as
    each block's 32 int8 codes and its float16 scale (1.06 bytes a weight, the file's); Q6_K as its codes (-32..31)
    and a float32 scale a group of 16, its superblock's float16 scale times the group's int8 one (1.25 bytes a
    weight, against the file's 0.82 and bfloat16's 2); Q5_0, Q5_1 and Q5_K as their codes (0..31) and a float32
    scale and offset a group of 32 (1.25 bytes, against 0.69-0.75); IQ4_NL and IQ4_XS as their levels (IQ4_VALUES)
    and a scale a group of 32, IQ4_NL's float16, IQ4_XS's float32 (1.06 or 1.13 bytes, against 0.56 or 0.53); Q3_K
    and Q2_K as their codes and a float32 scale (Q2_K: and offset) a group of 16 (1.25 or 1.5 bytes, against 0.43
    or 0.33). No kernel yet: see rungen/int8.py's use_kernel."""
    offsets = None
    if qtype == GGMLQuantizationType.Q8_0:
        codes, scales = _q8_0_parts(blocks, in_features)
    elif qtype == GGMLQuantizationType.Q6_K:
        codes, scales = _q6_k_parts(blocks, in_features)
    elif qtype in (GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS):
        codes, scales = _iq4_parts(blocks, qtype, in_features)
    elif qtype in (GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K):
        codes, scales, offsets = _low_k_parts(blocks, qtype, in_features)
    else:
        codes, scales, offsets = _grouped_parts(blocks, qtype, in_features)
        codes = codes.to(torch.int8)
    if order is not None:
        order = torch.from_numpy(order)
        codes, scales = codes[order], scales[order]
        offsets = None if offsets is None else offsets[order]
    return CudaInt8Linear(codes.to(device), scales.to(device), None,
                          None if offsets is None else offsets.to(device))


# --- On a CUDA GPU: an embedding table in its blocks, the rows looked up de-quantized by torch operators ---
DEVICE_ROW_TYPES = (*GROUPED_TYPES, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0)


def gpu_embedding(qtype: GGMLQuantizationType, device: torch.device) -> bool:
    """Whether an embedding table of `qtype` keeps its blocks on `device` (DeviceRowsEmbedding)."""
    return qtype in DEVICE_ROW_TYPES and device.type == "cuda"


def dequantize_rows(rows: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> torch.Tensor:
    """The float32 values [n, in_features] of DEVICE_ROW_TYPES' rows of blocks [n, row bytes], by torch operators
    on the rows' device (the gguf package's arithmetic: the same floats)."""
    n = rows.shape[0]
    if qtype == GGMLQuantizationType.Q8_0:
        codes, scales = _q8_0_parts(rows, in_features)
        return (codes.float().view(n, -1, 32) * scales.float()[..., None]).reshape(n, in_features)
    if qtype == GGMLQuantizationType.Q6_K:
        codes, scale = _q6_k_parts(rows, in_features)
        return (codes.float().view(n, -1, 16) * scale[..., None]).reshape(n, in_features)
    codes, scale, offset = _grouped_parts(rows, qtype, in_features)
    return (codes.float().view(n, -1, 32) * scale[..., None] + offset[..., None]).reshape(n, in_features)


class DeviceRowsEmbedding(torch.nn.Module):
    """An embedding table kept in its GGUF blocks on a GPU (DEVICE_ROW_TYPES: 0.28 to 0.53 of bfloat16's bytes); a
    lookup gathers its rows' blocks and de-quantizes them there, with torch operators a CUDA graph can
    hold."""

    def __init__(self, blocks: torch.Tensor, qtype: GGMLQuantizationType, embedding_dim: int, dtype: torch.dtype,
                 scale: float | torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("blocks", blocks, persistent=False)
        self.qtype, self.embedding_dim, self.dtype = GGMLQuantizationType(qtype), embedding_dim, dtype
        self.num_embeddings = blocks.shape[0]
        self.embed_scale = scale  # Gemma-style scaled embeddings multiply the looked-up rows

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}, on {self.blocks.device}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_rows(self.blocks.index_select(0, ids.reshape(-1)), self.qtype, self.embedding_dim)
        out = rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)
        return out if self.embed_scale is None else out * self.embed_scale

