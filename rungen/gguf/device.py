"""A GGUF file's weights in the forms a CUDA GPU keeps them (build.py's build_model given a device): 4-bit types as
torch's int4 kernel takes them (TinyGemmLinear) or, where it cannot run or is asked for, as rungen/int4_kernel.py's
Triton kernel reads them (CudaInt4Linear), which alone takes TRITON_TYPES' packed codes (MXFP4's e2m1 codes, IQ4's
codes of levels, the 5- and 6-bit types' codes with a plane of their top bits, Q3_K's and Q2_K's groups of 16);
Q8_0 (and TRITON_TYPES where the packed form fails its check) as int8 codes and group scales for rungen/int8.py's
Triton kernel (CudaInt8Linear); and an embedding table in its blocks (DeviceRowsEmbedding).
The codes are the file's (codes.py), never re-quantized, and so are the scales but tinygemm's, which it takes in
bfloat16 only: a float16 scale (Q4_0, Q4_1) or a K-quant's float32 product of scales loses its last bits there
(checked_tinygemm holds the kernel to the de-quantized weight).
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ..code_kernels import one_row_ms
from ..int4 import GPU_INT4_ENV, TinyGemmLinear, checked_tinygemm
from ..int4_kernel import (
    IQ4_LEVELS,
    CudaInt4Linear,
    checked_int4_kernel,
    gpu_int4_form,
    level_pairs,
    packed,
    timed_int4_choice,
)
from ..int8 import CodesEmbedding, CudaInt8Linear, checked_kernel
from .codes import (
    GROUPED_TYPES,
    INT4_TYPES,
    dequantize_rows,
    grouped_parts,
    int4_parts,
    iq4_nibbles,
    iq4_parts,
    k_mins,
    k_scales,
    low_k_parts,
    q6_k_parts,
    q8_0_parts,
)

logger = logging.getLogger("run_generation")


def in_order(order, *tensors: torch.Tensor | None) -> tuple:
    """`tensors` (a weight's codes, scales, offsets) with their rows permuted by `order` (a numpy index; None: as
    they are); a None stays None."""
    if order is None:
        return tensors
    order = torch.from_numpy(order)
    return tuple(None if t is None else t[order] for t in tensors)


# --- On a CUDA GPU: 4-bit types as torch's int4 weight-only kernel (tinygemm) takes them ---

# The 4-bit types whose codes are no affine integers, which the Triton form alone takes (tinygemm cannot): MXFP4's
# e2m1 values and IQ4_NL's and IQ4_XS's levels; where it does not serve, their int8 codes (INT8_TYPES).
LEVEL_TYPES = (GGMLQuantizationType.MXFP4, GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS)
# The types of 5 and 6 bits, and those of groups of 16, which the Triton form alone takes too: their low four bits
# two a byte and the bits above in a plane beside them (Q5_0, Q5_1, Q5_K, Q6_K), or their low two bits four a byte
# (Q2_K; Q3_K with its third in a plane) with a scale a group of 16; where it does not serve, their int8 codes.
PLANE_TYPES = (GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q5_K,
               GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q2_K)
TRITON_TYPES = (*LEVEL_TYPES, *PLANE_TYPES)


def gpu_int4(qtype: GGMLQuantizationType, in_features: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """The form a weight of `qtype` keeps its packed codes in on `device` for a model in `dtype` (int4_kernel.py's
    gpu_int4_form; TRITON_TYPES the Triton form in any dtype), or None: no packed form (TRITON_TYPES then int8
    codes, the others de-quantized; RUN_GENERATION_GPU_INT4=0 turns the packed forms off)."""
    if qtype in TRITON_TYPES:
        fits = device.type == "cuda" and CudaInt4Linear.fits(in_features)
        return "triton" if fits and os.environ.get(GPU_INT4_ENV) != "0" else None
    return gpu_int4_form(in_features, dtype, device) if qtype in INT4_TYPES else None


def tinygemm_of_blocks(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int, device: torch.device,
                       order=None) -> TinyGemmLinear:
    """A 4-bit weight's blocks (`order`: its rows permuted) as a TinyGemmLinear on `device`, the codes exact."""
    codes, scale, offset = in_order(order, *int4_parts(blocks, qtype, in_features))
    return TinyGemmLinear(codes, scale, offset, device)


def int4_codes_of_blocks(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int, device: torch.device,
                         order=None) -> CudaInt4Linear:
    """A weight's blocks of a 4-bit type or of TRITON_TYPES (`order`: its rows permuted) as a CudaInt4Linear on
    `device`, exact (bytes a weight against the file's: docs/usage.md): the codes two a byte and a group's scale and
    offset, float16 for Q4_0 and Q4_1 (their blocks' own), Q4_K's as its blocks hold them (k_mins);
    MXFP4's (as held) e2m1 codes and a group's power-of-two float16 scale, no offset (gpt-oss-20b's experts about
    11 GB, gpt-oss-120b's about 65); IQ4_NL's and IQ4_XS's codes of IQ4_LEVELS and a group's scale, IQ4_NL's float16
    as held, IQ4_XS's float32 (its superblock's float16 times the group's 6-bit integer); PLANE_TYPES as
    plane_parts gives them."""
    if qtype in LEVEL_TYPES:
        nibbles, scale = in_order(order, *iq4_nibbles(blocks, qtype, in_features))
        table = None if qtype == GGMLQuantizationType.MXFP4 else level_pairs(IQ4_LEVELS, device)
        return CudaInt4Linear(packed(nibbles).to(device), scale.to(device), table)
    if qtype in PLANE_TYPES:
        codes, bits, signed, scale, offset = plane_parts(blocks, qtype, in_features)
        codes, scale, offset = in_order(order, codes, scale, offset)
        return CudaInt4Linear(packed(codes, bits, signed).to(device), scale.to(device),
                              None if offset is None else offset.to(device), in_features)
    codes, scale, offset = int4_parts(blocks, qtype, in_features)
    if qtype == GGMLQuantizationType.Q4_K:  # (its scales and minimums as its blocks hold them: k_mins)
        scale, offset = k_mins(blocks, qtype)
    codes, scale, offset = in_order(order, codes, scale, offset)
    exact = {} if qtype == GGMLQuantizationType.Q4_K else {"dtype": torch.float16}
    return CudaInt4Linear(packed(codes).to(device), scale.to(device, **exact), offset.to(device, **exact))


def plane_parts(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int):
    """PLANE_TYPES' blocks as (codes [rows, in_features], their bits, whether signed, scales, offsets), exact, as
    int4_kernel.py's levels_of reads them: Q5_0's codes less 16 (signed) and its float16 scale, Q5_1's codes with
    its float16 scale and offset; Q6_K's signed codes with each group of 16's int8 scale and each superblock's
    float16 (as offsets), Q3_K's (-4..3) likewise; Q5_K's (a group of 32) and Q2_K's (0..3, a group of 16) with each
    group's integer scale and minimum and each superblock's float16 two (k_mins)."""
    Q = GGMLQuantizationType
    if qtype in (Q.Q6_K, Q.Q3_K):
        codes = (q6_k_parts(blocks, in_features) if qtype == Q.Q6_K else low_k_parts(blocks, qtype, in_features))[0]
        return codes, 6 if qtype == Q.Q6_K else 3, True, *k_scales(blocks, qtype)
    if qtype in (Q.Q2_K, Q.Q5_K):
        codes = (low_k_parts if qtype == Q.Q2_K else grouped_parts)(blocks, qtype, in_features)[0]
        return codes, 2 if qtype == Q.Q2_K else 5, False, *k_mins(blocks, qtype)
    codes, scales, offsets = grouped_parts(blocks, qtype, in_features)
    if qtype == Q.Q5_0:
        return codes - 16, 5, True, scales.to(torch.float16), None
    return codes, 5, False, scales.to(torch.float16), offsets.to(torch.float16)  # (Q5_1's, as held)


# --- On a CUDA GPU: the types that fit int8 codes and group scales, for rungen/int8.py's Triton kernel ---
INT8_TYPES = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q5_0,
              GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q5_K, GGMLQuantizationType.IQ4_NL,
              GGMLQuantizationType.IQ4_XS, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q2_K,
              GGMLQuantizationType.MXFP4)


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
    and a scale a group of 32, IQ4_NL's float16, IQ4_XS's float32 (1.06 or 1.13 bytes, against 0.56 or 0.53); MXFP4
    as IQ4_NL (its held blocks: e2m1's doubled values, a power-of-two float16 scale; against 0.53); Q3_K
    and Q2_K as their codes and a float32 scale (Q2_K: and offset) a group of 16 (1.25 or 1.5 bytes, against 0.43
    or 0.33). Read CODES_CHUNK_ROWS rows at a time: a head's table read whole would take gigabytes of intermediates.
    The layer has no kernel yet: DeviceForms gives it the checked one (use_kernel)."""
    chunks = [_int8_parts(blocks[start:start + CODES_CHUNK_ROWS], qtype, in_features)
              for start in range(0, blocks.shape[0], CODES_CHUNK_ROWS)]
    codes, scales = torch.cat([chunk[0] for chunk in chunks]), torch.cat([chunk[1] for chunk in chunks])
    offsets = None if chunks[0][2] is None else torch.cat([chunk[2] for chunk in chunks])
    del chunks
    codes, scales, offsets = in_order(order, codes, scales, offsets)
    return CudaInt8Linear(codes.to(device), scales.to(device), None,
                          None if offsets is None else offsets.to(device))


CODES_CHUNK_ROWS = 4096


def _int8_parts(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int):
    """(int8 codes, scales, offsets or None) of INT8_TYPES' blocks."""
    if qtype == GGMLQuantizationType.Q8_0:
        return (*q8_0_parts(blocks, in_features), None)
    if qtype == GGMLQuantizationType.Q6_K:
        return (*q6_k_parts(blocks, in_features), None)
    if qtype in (GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS, GGMLQuantizationType.MXFP4):
        return (*iq4_parts(blocks, qtype, in_features), None)
    if qtype in (GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K):
        return low_k_parts(blocks, qtype, in_features)
    codes, scales, offsets = grouped_parts(blocks, qtype, in_features)
    return codes.to(torch.int8), scales, offsets


# --- On a CUDA GPU: an embedding table in its blocks, the rows looked up de-quantized by torch operators ---
DEVICE_ROW_TYPES = (*GROUPED_TYPES, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q3_K,
                    GGMLQuantizationType.Q2_K)


def gpu_embedding(qtype: GGMLQuantizationType, device: torch.device) -> bool:
    """Whether an embedding table of `qtype` keeps its blocks on `device` (DeviceRowsEmbedding)."""
    return qtype in DEVICE_ROW_TYPES and device.type == "cuda"


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


class JoinedRows(torch.nn.Module):
    """y = [x @ W_1.T, x @ W_2.T, ...] (+ bias): a weight joined by rows from several of the file's tensors (Granite
    4.0's shared MLP's gate and up), each part in its own form on the device (codes), the outputs concatenated."""

    def __init__(self, parts: list[torch.nn.Module]):
        super().__init__()
        self.parts, self.bias = torch.nn.ModuleList(parts), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias


class DeviceForms:
    """What one load keeps a GGUF file's quantized weights in on a GPU: 4-bit codes for torch's int4 kernel or the
    Triton one (packed codes of TRITON_TYPES too), int8 codes for the Triton kernel, an embedding's blocks, else the
    weight de-quantized. Each kernel is checked on its first weight (the int8 kernel once a type, the 4-bit one once
    for each kind of codes, codes_kind: they compile apart); one that fails leaves every later weight of its kind
    de-quantized (TRITON_TYPES' in int8 codes)."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.tinygemm = None  # whether 4-bit weights take torch's int4 kernel: None until the first is checked
        # the codes' kind (int4_kernel.py's levels_of) -> the Triton 4-bit kernel once checked on such codes (False:
        # it does not serve them)
        self.int4 = {}
        self.int8 = {}  # qtype -> the checked Triton kernel, or False where it does not serve the type
        # The Triton form, where it fits, in place of tinygemm's (the faster at one row), as the first 4-bit weight
        # timed the two; None until one has.
        self.prefer_triton = None

    def keep(self, reader, entry, qtype: GGMLQuantizationType, in_features: int, module: torch.nn.Module, order,
             tied_table: bool) -> torch.nn.Module | torch.Tensor:
        """The layer holding `entry`'s weight (rows permuted by `order`) in codes or blocks for `module`, or the
        weight de-quantized to set in its place; `tied_table`: the input embedding, which the head reads too."""
        from transformers.pytorch_utils import Conv1D

        # GPT-2's Conv1D too: the file's rows are its output channels, as a linear layer's are
        linear, table = isinstance(module, (torch.nn.Linear, Conv1D)), isinstance(module, torch.nn.Embedding)
        scale = getattr(module, "embed_scale", None)
        if linear or tied_table:
            layer = self.codes_layer(reader.blocks(entry), qtype, in_features, order,
                                     lambda: reader.dequantized(entry, self.dtype, self.device, order), int4=linear)
            if layer is not None:
                # A tied table becomes the head (build.py's _tie_head), its lookup reading the same codes.
                return CodesEmbedding(layer, self.dtype, scale) if tied_table else layer
        elif table and gpu_embedding(qtype, self.device):
            return DeviceRowsEmbedding(reader.rows(entry, False, order).to(self.device), qtype, in_features,
                                       self.dtype, scale)
        return reader.dequantized(entry, self.dtype, self.device, order)

    def codes_layer(self, blocks: np.ndarray, qtype: GGMLQuantizationType, in_features: int, order, dequantized,
                    int4: bool = True, grouped: bool = False) -> torch.nn.Module | None:
        """A weight's `blocks` [rows, row bytes] (`order`: its rows permuted) as a layer of codes that a checked
        kernel multiplies on the GPU, or None where its type has no such form here (the caller de-quantizes it).
        `dequantized()`: the weight de-quantized, which the first 4-bit weight checks torch's int4 kernel against;
        `int4`: whether a 4-bit form may hold it (a linear layer's; a table that the head reads takes int8 codes
        alone); `grouped`: a mixture's expert, in the Triton form wherever it runs unless RUN_GENERATION_GPU_INT4
        names a form (its grouped launch takes a decode step's chosen experts at once, which tinygemm cannot)."""
        form = gpu_int4(qtype, in_features, self.dtype, self.device) if int4 else None
        timed = form == "tinygemm" and timed_int4_choice(in_features, self.dtype, self.device)
        if grouped and timed:
            form = "triton"
        elif timed and self.prefer_triton is None:
            self.prefer_triton = self.triton_faster(blocks, qtype, in_features, order, dequantized)
        if timed and self.prefer_triton:
            form = "triton"
        if form == "triton" and self.int4.get(codes_kind(qtype)) is not False:
            instead = ("the experts keep tinygemm's form" if grouped and timed else
                       f"{qtype.name} weights take int8 codes instead" if qtype in INT8_TYPES else None)
            layer = self.int4_codes(blocks, qtype, in_features, order, instead)
            if layer is not None or not (grouped and timed or qtype in INT8_TYPES):
                return layer
            form = "tinygemm" if grouped and timed else None
        if form == "tinygemm" and self.tinygemm is not False:
            make = functools.partial(tinygemm_of_blocks, torch.from_numpy(blocks), qtype, in_features, self.device,
                                     order)
            if self.tinygemm is not None:
                return make()
            layer, why = checked_tinygemm(make, dequantized())  # the first, checked against its weight
            self.tinygemm = layer is not None
            if not self.tinygemm:
                logger.warning("torch's int4 GPU kernel %s here; the 4-bit weights run de-quantized to bfloat16 "
                               "instead", why)
            return layer
        if self.int8.get(qtype) is not False and gpu_int8(qtype, self.device):
            layer = int8_of_blocks(torch.from_numpy(blocks), qtype, in_features, self.device, order)
            if qtype not in self.int8:  # no kernel, no codes: widening each product is slower than bfloat16
                self.int8[qtype] = checked_kernel(layer, self.dtype, f"{qtype.name} weights de-quantized to "
                                                  f"{self.dtype} instead") or False
            if self.int8[qtype]:
                layer.use_kernel(self.int8[qtype])
                return layer
            del layer  # its codes go before the weight is de-quantized: never both forms on the GPU at once
        return None

    def triton_faster(self, blocks: np.ndarray, qtype: GGMLQuantizationType, in_features: int, order, dequantized
                      ) -> bool:
        """Whether the Triton form multiplies one row by this first 4-bit weight faster than tinygemm (by a tenth at
        least: near a tie the load keeps tinygemm's form, and its bits), each form checked first (the checks a later
        weight of its form then skips); one line says what each took."""
        tinygemm, why = checked_tinygemm(functools.partial(tinygemm_of_blocks, torch.from_numpy(blocks), qtype,
                                                           in_features, self.device, order), dequantized())
        self.tinygemm = tinygemm is not None
        triton = int4_codes_of_blocks(torch.from_numpy(blocks), qtype, in_features, self.device, order)
        kernel, why_not = checked_int4_kernel(triton, self.dtype)  # (and the GEMV or the tiled kernel at one row)
        self.int4[codes_kind(qtype)] = kernel or False
        if tinygemm is None and kernel is None:
            logger.warning("torch's int4 GPU kernel %s here, and the 4-bit Triton kernel: %s; the 4-bit weights run "
                           "de-quantized to %s instead", why, why_not, self.dtype)
        elif tinygemm is None:
            logger.warning("torch's int4 GPU kernel %s here; the 4-bit weights run in the Triton form", why)
        elif kernel is None:
            logger.info("the 4-bit Triton kernel: %s; the 4-bit weights keep tinygemm's form", why_not)
        if kernel is None or tinygemm is None:
            return kernel is not None
        triton.use_kernel(kernel)
        x = torch.randn(1, in_features, dtype=self.dtype, device=self.device)
        times = {name: one_row_ms(layer, x) for name, layer in (("tinygemm", tinygemm), ("Triton", triton))}
        faster = times["Triton"] < 0.9 * times["tinygemm"]
        logger.info("4-bit forms at one row on a %d x %d weight: tinygemm %.4f ms, Triton %.4f ms; the load keeps %s",
                    triton.out_features, in_features, times["tinygemm"], times["Triton"],
                    "Triton's" if faster else "tinygemm's")
        return faster

    def int4_codes(self, blocks: np.ndarray, qtype: GGMLQuantizationType, in_features: int, order,
                   instead: str | None = None) -> torch.nn.Module | None:
        """A 4-bit weight as CudaInt4Linear where the Triton kernel checks out on the first of its kind of codes
        (codes_kind), else None (`instead`: what the caller then does, which a failed check's warning says; by
        default, de-quantize)."""
        layer = int4_codes_of_blocks(torch.from_numpy(blocks), qtype, in_features, self.device, order)
        kind = codes_kind(qtype)
        if kind not in self.int4:
            kernel, why = checked_int4_kernel(layer, self.dtype)
            self.int4[kind] = kernel or False
            if kernel is None:
                logger.warning("the 4-bit Triton kernel: %s; %s", why,
                               instead or f"the 4-bit weights run de-quantized to {self.dtype} instead")
        if not self.int4[kind]:
            return None  # (its codes go with the layer: never both forms on the GPU at once)
        layer.use_kernel(self.int4[kind])
        return layer


def codes_kind(qtype: GGMLQuantizationType) -> int | str:
    """What a type's codes are in the Triton form (int4_kernel.py's levels_of), a key of the forms checked apart (they
    compile apart): 0 affine 4-bit integers (Q4_0, Q4_1, Q4_K), 1 e2m1 values (MXFP4), 2 levels of a table (IQ4_NL,
    IQ4_XS), PLANE_TYPES each its own (their bits, groups, signs and scales' dtypes differ)."""
    if qtype in PLANE_TYPES:
        return qtype.name
    return 1 if qtype == GGMLQuantizationType.MXFP4 else 2 if qtype in LEVEL_TYPES else 0
