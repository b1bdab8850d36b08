"""GGUF's quantized weights as torch layers: the file's own blocks, multiplied where they lie.

A GGMLLinear holds a weight as the file stores it, uint8 [out_features, bytes per row], never de-quantized ahead of
time; types the kernels multiply have their rows interleaved eight by eight at load (docs/kernels.md). The C++
kernels (rungen/gguf/kernels.py) quantize activations to int8 per block of 32, as llama.cpp does; without them (or
with RUN_GENERATION_KERNELS=torch) a layer converts itself to torch's kernels on its first call, after one warning.
A CUDA GPU's forms of the same blocks are device.py's.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

from ..int4 import INNER_K_TILES, Int4Linear
from .codes import MXFP4_VALUES, int4_parts
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
    GGMLQuantizationType.MXFP4,
)


# Types whose blocks the kernels hold in another layout than the file's, and its bytes a block: MXFP4 (gpt-oss's
# experts: a power-of-two scale byte, then e2m1 codes) as IQ4_NL's blocks of its own table, the scale in float16 (18
# bytes for 17), converted as the blocks are read (held).
HELD_BLOCK_BYTES = {GGMLQuantizationType.MXFP4: 18}
_MXFP4_VALUES = np.array(MXFP4_VALUES, dtype=np.float32)


def held(blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """A tensor's blocks [..., row bytes] as the kernels hold them (HELD_BLOCK_BYTES; the others' as they are)."""
    if qtype not in HELD_BLOCK_BYTES:
        return blocks
    return mxfp4_held(blocks.reshape(-1, blocks.shape[-1])).reshape(*blocks.shape[:-1], -1)


def mxfp4_held(blocks: np.ndarray) -> np.ndarray:
    """MXFP4 blocks [rows, row bytes] (each 32 weights: a scale byte e, 2^(e - 128) times e2m1's doubled values, then
    16 bytes of codes) as held: the scale as float16, then the codes as they are. Exact for scales from 2^-24 to
    2^15; a smaller one (weights under 4e-7) is float16's nearest; GGMLError for a larger one where the block's weights
    are not all zero."""
    if native_kernels():
        try:
            return torch.ops.rungen_ggml.mxfp4_held(torch.from_numpy(np.ascontiguousarray(blocks))).numpy()
        except RuntimeError as error:
            raise GGMLError(str(error).splitlines()[0].removeprefix("rungen_ggml: ")) from None
    return mxfp4_held_reference(blocks)


def mxfp4_held_reference(blocks: np.ndarray) -> np.ndarray:
    """mxfp4_held in numpy (without the native kernels; its tests' reference)."""
    rows = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(-1, 17)
    e, codes = b[:, 0], b[:, 1:]
    scale = np.where(e < 2, np.uint32(0x00200000) << e.astype(np.uint32), (e.astype(np.uint32) - 1) << 23)
    with np.errstate(over="ignore"):
        half = scale.view(np.float32).astype(np.float16)
    overflow = np.isinf(half)
    if overflow.any():
        zero = ((codes & 0x77) == 0).all(1)  # +0 and -0 only
        if (overflow & ~zero).any():
            raise GGMLError(f"an MXFP4 block's scale 2^{int(e[overflow & ~zero][0]) - 128} is beyond float16's range")
        half[overflow] = 0
    out = np.empty((b.shape[0], 18), dtype=np.uint8)
    out[:, :2] = half.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = codes
    return out.reshape(rows, -1)


def _dequantize_held_mxfp4(blocks: np.ndarray) -> np.ndarray:
    """Held MXFP4 blocks' weights (float32 [blocks, 32]): d times the table's value of each code."""
    b = np.ascontiguousarray(blocks).reshape(-1, 18)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    codes = np.concatenate([b[:, 2:] & 15, b[:, 2:] >> 4], axis=1)
    return d * _MXFP4_VALUES[codes]


# Types interleaved eight rows by eight for the kernels, and the flag added to their type number then.
INTERLEAVED_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                     GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
                     GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.IQ4_NL,
                     GGMLQuantizationType.IQ4_XS, GGMLQuantizationType.Q3_K, GGMLQuantizationType.MXFP4)
X8 = 256
# Eight rows' interleaved superblock bytes where the packed 6-bit scales are unpacked (docs/gguf.md).
X8_SUPERBLOCK_BYTES = {GGMLQuantizationType.Q4_K: 1184, GGMLQuantizationType.Q5_K: 1440,
                       GGMLQuantizationType.Q3_K: 912, GGMLQuantizationType.IQ4_XS: 1104}


class GGMLError(ValueError):
    """A tensor this module cannot hold (type or shape)."""


def row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    """Bytes one row of `in_features` weights takes in blocks of `qtype`, as held (HELD_BLOCK_BYTES)."""
    block, size = GGML_QUANT_SIZES[qtype]
    size = HELD_BLOCK_BYTES.get(qtype, size)
    if in_features % block:
        raise GGMLError(f"{qtype.name} rows are made of blocks of {block}; {in_features} is not a multiple")
    return in_features // block * size


def weights_per_row(qtype: GGMLQuantizationType, bytes_per_row: int) -> int:
    """Weights in a row of `bytes_per_row` bytes of `qtype` blocks, as the file holds them."""
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
    """The float32 weight that `blocks` [rows, row_bytes] (as held) encode (the gguf package's reference)."""
    if qtype == GGMLQuantizationType.MXFP4:
        values = _dequantize_held_mxfp4(blocks.contiguous().numpy())
        return torch.from_numpy(values).reshape(blocks.shape[0], in_features)
    values = _gguf_dequantize(blocks.contiguous().numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(blocks.shape[0], in_features)


DEQUANTIZE_CHUNK = 1 << 24  # float32 values de-quantized on the host at a time on the way to a device (64 MB)


def dequantize_to(blocks: np.ndarray, qtype: GGMLQuantizationType, in_features: int, dtype: torch.dtype,
                  device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight that `blocks` [rows, row_bytes] (as held) encode, in `dtype` on `device` (into `out` when given),
    de-quantized a chunk of rows at a time: never a float32 copy of the whole weight."""
    rows = blocks.shape[0]
    if out is None:
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
        if native_products():
            return torch.ops.rungen_ggml.mm_parts(x.float().contiguous(), [p.blocks for p in self.parts],
                                                  [p.code for p in self.parts], self.in_features)
        return torch.cat([p._matmul(x) for p in self.parts], dim=-1)


BLOCKS_MATMUL = GGMLLinear._matmul  # the blocks' own product (tests replace it by the exact one)


def native_products() -> bool:
    """Whether a product over several layers' blocks (GGMLParts, GGMLExperts) may take one native call: the kernels
    are built and GGMLLinear's product is its own, not one a caller put in its place for each layer to take."""
    return native_kernels() and GGMLLinear._matmul is BLOCKS_MATMUL


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

def torch_layer(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> torch.nn.Module:
    """The blocks as one of rungen.quantize's layers: 4-bit types in torch's int4 packing (codes exact), the others
    de-quantized to float16 for fbgemm."""
    from rungen.quantize import head_class

    if qtype not in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K):
        return head_class()(dequantize(blocks, qtype, in_features), None)
    codes, scale, offset = int4_parts(blocks, qtype, in_features)
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
