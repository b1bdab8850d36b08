"""GGUF's quantized weights as torch layers: the file's own blocks, multiplied where they lie.

A GGMLLinear holds a weight exactly as a GGUF file stores it: a uint8 tensor of shape
[out_features, bytes per row], one row of blocks per output channel (a view of the memory-mapped file
where possible). Nothing is de-quantized ahead of time.

The reference forward here de-quantizes with the gguf package on every call: correct for every type,
slow. Faster paths replace `_matmul` without changing the layer's interface.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

# Block types a GGMLLinear holds; F16/BF16/F32 tensors load as plain tensors of their dtype instead.
SUPPORTED = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)


class GGMLError(ValueError):
    """A tensor this module cannot hold (type or shape)."""


def row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    """Bytes one row of `in_features` weights takes in blocks of `qtype`."""
    block, size = GGML_QUANT_SIZES[qtype]
    if in_features % block:
        raise GGMLError(f"{qtype.name} rows are made of blocks of {block}; {in_features} is not a multiple")
    return in_features // block * size


def dequantize(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> torch.Tensor:
    """The float32 weight [rows, in_features] that `blocks` [rows, row_bytes] encode (the gguf package's
    reference de-quantization)."""
    values = _gguf_dequantize(blocks.contiguous().numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(blocks.shape[0], in_features)


class GGMLLinear(torch.nn.Module):
    """y = x @ W.T (+ bias), W in the file's blocks of `qtype`."""

    def __init__(self, blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        qtype = GGMLQuantizationType(qtype)
        if qtype not in SUPPORTED:
            raise GGMLError(f"tensor type {qtype.name} is not supported")
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(qtype, in_features):
            raise GGMLError(f"{qtype.name} blocks for {in_features} inputs must be uint8 [rows, "
                            f"{row_bytes(qtype, in_features)}], got {blocks.dtype} {list(blocks.shape)}")
        self.register_buffer("blocks", blocks, persistent=False)
        self.qtype, self.in_features, self.out_features = qtype, in_features, blocks.shape[0]
        self.bias = bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype.name}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ dequantize(self.blocks, self.qtype, self.in_features).T


def concat(layers: list[GGMLLinear]) -> GGMLLinear | None:
    """One layer whose rows are the given layers' rows, in order (q/k/v, gate/up: one matmul for
    projections of the same input), or None when they differ in type or input width."""
    first = layers[0]
    if any(layer.qtype != first.qtype or layer.in_features != first.in_features for layer in layers):
        return None
    biases = [layer.bias for layer in layers]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(layer.out_features)
                          for layer, b in zip(layers, biases)])
    return GGMLLinear(torch.cat([layer.blocks for layer in layers]), first.qtype, first.in_features, bias)
