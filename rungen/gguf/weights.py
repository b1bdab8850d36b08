"""A GGUF file's tensors as the model builders take them (WeightReader over the file's memory map).

Blocks stay views of the map unless copied anyway (interleaved, permuted, joined): those are read into memory
instead, since a copy of mapped pages would count twice in the process's memory.
"""

from __future__ import annotations

import re
import typing

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ..errors import UsageError
from .blocks import (
    HELD_BLOCK_BYTES,
    GGMLError,
    GGMLLinear,
    GGMLParts,
    dequantize_to,
    held,
    interleavable,
    interleaved_row_bytes,
    join,
    weights_per_row,
)

FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # GGMLQuantizationType F32, F16, BF16
READ_CHUNK = 4 << 20  # bytes of a weight read and interleaved at a time


class GGUFError(UsageError):
    """A GGUF file this loader cannot run (corrupt, truncated, unsupported type or architecture); one line."""


# llama-gguf-split's parts: NAME-00001-of-00003.gguf
SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def split_hint(path: str) -> str:
    """What to do with one part of a split GGUF file (its tensors are spread over the parts), or ""."""
    part = SPLIT_PART.search(path)
    if part is None:
        return ""
    return (f": it is part {int(part[1])} of {int(part[2])} of a split file; merge the parts into one with "
            "llama.cpp's llama-gguf-split --merge")


# A layer's expert part held a tensor an expert (llama.cpp's converter before April 2024: Mixtral's first files).
EXPERT_APART = re.compile(r"(blk\.\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")


def with_experts_stacked(path: str, rows: list) -> list:
    """The tensor table `rows` (the header's) with a row for each layer's expert part held a tensor an expert
    (blk.N.ffn_gate.E.weight), as the 3-D tensor files since hold (blk.N.ffn_gate_exps.weight [experts, rows, row
    bytes]) at offset -1: WeightReader reads each expert from its own tensor. GGUFError where a part's experts are
    not numbered from 0 or differ in type or shape."""
    parts = {}
    for row in rows:
        if match := EXPERT_APART.fullmatch(row[0]):
            parts.setdefault(f"{match[1]}.ffn_{match[2]}_exps.weight", {})[int(match[3])] = row
    stacked = []
    for name, experts in parts.items():
        first = experts.get(0)
        if sorted(experts) != list(range(len(experts))) or any(
                (row[1], row[2]) != (first[1], first[2]) for row in experts.values()):
            raise GGUFError(f"{path}: the experts of {name.removesuffix('_exps.weight')} (a tensor each) are not "
                            "numbered from 0 or differ in type or shape")
        stacked.append([name, first[1], [len(experts), *first[2]], first[3], -1,
                        sum(row[5] for row in experts.values())])
    return rows + stacked


# Gemma 4's experts' gate and up in one tensor (blk.N.ffn_gate_up_exps.weight [experts, gate; up, row bytes]): each
# taken as a part of its own (blk.N.ffn_gate_exps.weight, ffn_up_exps) at this offset, its half of every expert's rows.
HALF_OF_GATE_UP = -2


def with_gate_up_apart(rows: list) -> list:
    """The tensor table `rows` with a row for the gate half and one for the up half of each layer's experts' gate
    and up tensor in blocks (ffn_gate_up_exps [experts, 2 x rows, row bytes]), at offset HALF_OF_GATE_UP:
    WeightReader reads each expert's half of its rows, so the experts take the parts apart as any mixture's (a
    float one is the Experts module's gate_up_proj as it is)."""
    halves = []
    for row in rows:
        if row[0].endswith(".ffn_gate_up_exps.weight") and row[1] not in FLOAT_TYPES and len(row[2]) == 3 \
                and row[2][1] % 2 == 0:
            experts, both, *rest = row[2]
            layer = row[0].removesuffix(".ffn_gate_up_exps.weight")
            halves += [[f"{layer}.ffn_{part}_exps.weight", row[1], [experts, both // 2, *rest], row[3],
                        HALF_OF_GATE_UP, row[5] // 2] for part in ("gate", "up")]
    return rows + halves


class Tensor(typing.NamedTuple):
    """A row of the header cache's tensor table: the tensor's bytes as the loader views them."""

    name: str
    code: int  # GGMLQuantizationType
    shape: list  # numpy's: values for F32/F16, bytes of blocks (and of BF16) in the last dimension
    dtype: str  # numpy's
    offset: int  # in the file
    nbytes: int


class WeightReader:
    """The tensors of the GGUF file at `path` by GGUF name, or by HF name given `weights_map`."""

    def __init__(self, path: str, tensors: list, weights_map: dict | None = None):
        self.path = path
        self.map = np.memmap(path, dtype=np.uint8, mode="c")  # private and writable: torch warns on read-only
        self.tensors = [Tensor(*row) for row in tensors]
        self.table = {tensor.name: tensor for tensor in self.tensors}
        self.by_hf = {hf: gguf for gguf, hf in (weights_map or {}).items() if gguf in self.table}
        self.scratch = np.empty(READ_CHUNK, dtype=np.uint8)  # read_interleaved's buffer, for every weight

    def tensor(self, hf_name: str, required: bool = True) -> Tensor | None:
        """The tensor the weights map gives `hf_name`; GGUFError (None where not `required`) when there is none."""
        name = self.by_hf.get(hf_name)
        if name is None:
            if required:
                raise GGUFError(f"{self.path}: the file has no tensor for {hf_name}{split_hint(self.path)}")
            return None
        return self.table[name]

    def expert(self, tensor: Tensor, index: int) -> Tensor:
        """Expert `index`'s part of a layer's expert tensor [experts, rows, row bytes]: its slice, the tensor of its
        own where the file holds the experts apart, or its half of the expert's gate and up (HALF_OF_GATE_UP)."""
        if tensor.offset == HALF_OF_GATE_UP:
            layer, _, part = tensor.name.removesuffix("_exps.weight").rpartition(".")
            both = self.expert(self.table[f"{layer}.ffn_gate_up_exps.weight"], index)
            half = both.nbytes // 2
            return both._replace(name=f"{tensor.name}[{index}]", shape=[both.shape[0] // 2, *both.shape[1:]],
                                 offset=both.offset + (half if part == "ffn_up" else 0), nbytes=half)
        if tensor.offset < 0:
            layer, _, part = tensor.name.removesuffix("_exps.weight").rpartition(".")
            return self.table[f"{layer}.{part}.{index}.weight"]
        size = tensor.nbytes // tensor.shape[0]
        return tensor._replace(name=f"{tensor.name}[{index}]", shape=list(tensor.shape[1:]),
                               offset=tensor.offset + index * size, nbytes=size)

    def values(self, tensor: Tensor) -> np.ndarray:
        """A float tensor's values, a view of the map (experts held apart: copied into one); BF16's bits as int16
        (numpy has no bfloat16)."""
        if tensor.offset < 0:
            return np.stack([self.values(self.expert(tensor, e)) for e in range(tensor.shape[0])])
        array = self.map[tensor.offset:tensor.offset + tensor.nbytes]
        if tensor.code == GGMLQuantizationType.BF16:
            return array.view(np.int16).reshape(*tensor.shape[:-1], tensor.shape[-1] // 2)
        return array.view(tensor.dtype).reshape(tensor.shape)

    def float_tensor(self, tensor: Tensor) -> torch.Tensor:
        """A float tensor in its own dtype, a view of the map."""
        return as_torch(self.values(tensor), tensor.code)

    def blocks(self, tensor: Tensor) -> np.ndarray:
        """A quantized tensor's blocks [rows, row bytes] as the kernels hold them, a view of the map (experts held
        apart, or a type held in another layout than the file's: read into memory)."""
        if tensor.offset < 0 or tensor.code in HELD_BLOCK_BYTES:
            return self.read(tensor)
        return self.map[tensor.offset:tensor.offset + tensor.nbytes].reshape(tensor.shape)

    def rows(self, tensor: Tensor, interleave: bool, order: np.ndarray | None = None, read: bool = False
             ) -> torch.Tensor:
        """A quantized 2-D weight's blocks, rows in `order` (None: the file's), maybe `interleave`d: read into memory
        where copied (or `read`), else a view of the map."""
        qtype = GGMLQuantizationType(tensor.code)
        if interleave and order is None:
            return read_interleaved(self.path, tensor.offset, tensor.shape, qtype, self.scratch, name=tensor.name)
        blocks = self.read(tensor) if read or interleave else self.blocks(tensor)
        rows = torch.from_numpy(blocks if order is None else np.ascontiguousarray(blocks[order]))
        return torch.ops.rungen_ggml.interleave(rows, int(qtype)) if interleave else rows

    def read(self, tensor: Tensor) -> np.ndarray:
        """A quantized tensor's blocks read into memory, as the kernels hold them (held)."""
        if tensor.offset < 0:
            return np.stack([self.read(self.expert(tensor, e)) for e in range(tensor.shape[0])])
        blocks = np.fromfile(self.path, dtype=np.uint8, count=tensor.nbytes, offset=tensor.offset)
        try:
            return held(blocks.reshape(tensor.shape), tensor.code)
        except GGMLError as error:  # (a block MXFP4 cannot hold)
            raise GGUFError(f"{self.path}: tensor {tensor.name}: {error}") from None

    def linear(self, tensor: Tensor, order: np.ndarray | None = None, read: bool = False) -> GGMLLinear:
        """A quantized 2-D weight as a layer: its rows interleaved where the kernels take them so (rows())."""
        qtype = GGMLQuantizationType(tensor.code)
        interleave = interleavable(qtype, tensor.shape[0])
        return GGMLLinear(self.rows(tensor, interleave, order, read), qtype, weights_per_row(qtype, tensor.shape[-1]),
                          interleaved=interleave)

    def joined(self, tensors: list[Tensor], orders: list, biases: list) -> GGMLLinear | GGMLParts | None:
        """One product of these weights' rows, in order: one interleaved type read straight into one buffer (no
        concat copy), else join's; None when their input widths differ."""
        qtype = GGMLQuantizationType(tensors[0].code)
        widths = {weights_per_row(qtype, tensor.shape[-1]) for tensor in tensors}
        if len({tensor.code for tensor in tensors}) > 1 or len(widths) > 1 or not all(
                interleavable(qtype, tensor.shape[0]) for tensor in tensors):
            parts = [self.linear(tensor, order, read=True) for tensor, order in zip(tensors, orders)]
            for part, bias in zip(parts, biases):
                part.bias = bias
            return join(parts)
        in_features = widths.pop()
        blocks = torch.empty(sum(tensor.shape[0] for tensor in tensors) // 8,
                             interleaved_row_bytes(qtype, in_features), dtype=torch.uint8)
        start = 0
        for tensor, order in zip(tensors, orders):
            rows = blocks[start:start + tensor.shape[0] // 8]
            if order is None:
                read_interleaved(self.path, tensor.offset, tensor.shape, qtype, self.scratch, out=rows,
                                 name=tensor.name)
            else:
                torch.ops.rungen_ggml.interleave(torch.from_numpy(np.ascontiguousarray(self.read(tensor)[order])),
                                                 int(qtype), rows)
            start += tensor.shape[0] // 8
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else torch.zeros(tensor.shape[0])
                              for tensor, b in zip(tensors, biases)])
        return GGMLLinear(blocks, qtype, in_features, bias, interleaved=True)

    def dequantized(self, tensor: Tensor, dtype: torch.dtype, device: torch.device, order: np.ndarray | None = None
                    ) -> torch.Tensor:
        """A quantized weight de-quantized to `dtype` onto `device` a chunk of rows at a time."""
        qtype = GGMLQuantizationType(tensor.code)
        weight = dequantize_to(self.blocks(tensor), qtype, weights_per_row(qtype, tensor.shape[-1]), dtype, device)
        return weight if order is None else weight[torch.from_numpy(order).to(device)]


def check_shape(path: str, name: str, module: torch.nn.Module, attr: str, shape) -> None:
    """GGUFError when tensor `name` is not the shape of the parameter it replaces (the metadata's model is not the
    file's)."""
    expected = getattr(module, attr, None)
    if isinstance(expected, torch.Tensor) and tuple(expected.shape) != tuple(shape):
        raise GGUFError(f"{path}: tensor {name} is {list(shape)}, where the model its metadata describes has "
                        f"{list(expected.shape)}")


def as_torch(values: np.ndarray, code: int) -> torch.Tensor:
    """values() (or a transform of them that kept their dtype) as a tensor of the file's float dtype."""
    tensor = torch.from_numpy(values)
    return tensor.view(torch.bfloat16) if code == GGMLQuantizationType.BF16 else tensor


def unpermuted_order(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation (LlamaTensorProcessor._reverse_permute_weights)."""
    order = np.arange(rows)
    dim = rows // heads // 2
    return order.reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)


def read_interleaved(path: str, offset: int, shape, qtype, scratch: np.ndarray | None = None,
                     out: torch.Tensor | None = None, name: str = "") -> torch.Tensor:
    """The blocks [rows, row bytes] at `offset`, interleaved, read a chunk at a time through `scratch` (into `out`
    when given): never a whole copy in the file's order (its freed space would stay in the heap). A type held in
    another layout than the file's (MXFP4) is converted a chunk at a time; `name`: the tensor's, for a block it cannot
    hold."""
    rows, row_bytes = shape
    if out is None:
        out = torch.empty(rows // 8, interleaved_row_bytes(qtype, weights_per_row(qtype, row_bytes)),
                          dtype=torch.uint8)
    step = max(8, READ_CHUNK // row_bytes // 8 * 8)
    if scratch is None or len(scratch) < step * row_bytes:
        scratch = np.empty(step * row_bytes, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        for start in range(0, rows, step):
            count = min(step, rows - start)
            part = memoryview(scratch)[: count * row_bytes]
            f.seek(offset + start * row_bytes)
            done = 0
            while done < len(part):
                got = f.readinto(part[done:])
                if not got:
                    raise GGUFError(f"{path}: truncated (a tensor ends at byte {offset + rows * row_bytes}, "
                                    f"after the end of the file)")
                done += got
            try:
                chunk = held(scratch[: count * row_bytes].reshape(count, row_bytes), qtype)
            except GGMLError as error:  # (a block MXFP4 cannot hold)
                raise GGUFError(f"{path}: tensor {name or f'at byte {offset}'}: {error}") from None
            torch.ops.rungen_ggml.interleave(torch.from_numpy(chunk), int(qtype),
                                             out[start // 8 : (start + count) // 8])
    return out
