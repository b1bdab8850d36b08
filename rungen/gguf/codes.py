"""GGUF blocks read as codes and scales by torch operators, on whatever device the blocks are: what the GPU forms
(device.py) and the CPU's int4 fallback (blocks.py's torch_layer) hold. Every reader gives the gguf package's floats:
code * scale (+ offset) is the value its de-quantization computes, in float32, bit for bit (tests/unit).
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..int4_kernel import E2M1_LEVELS, IQ4_LEVELS


def _float16s(pairs: torch.Tensor) -> torch.Tensor:
    """Byte pairs [..., 2] read as float16 [...]."""
    return pairs.contiguous().view(torch.float16)[..., 0]


def _halves(pairs: torch.Tensor) -> torch.Tensor:
    """Byte pairs [..., 2] read as float16, in float32 [...]."""
    return _float16s(pairs).float()


def q8_0_parts(blocks: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks [rows, row bytes] as their int8 codes [rows, in_features] and float16 scales [rows, in_features /
    32], by torch operators on the blocks' device."""
    b = blocks.reshape(blocks.shape[0], -1, 34)
    return (b[..., 2:].contiguous().view(torch.int8).reshape(blocks.shape[0], in_features),
            _float16s(b[..., 0:2]))


def _fields(packed: torch.Tensor, width: int, dim: int = -2) -> torch.Tensor:
    """Bytes [..., n] as their `width`-bit fields, lowest first, stacked at `dim` ([..., 8 // width, n] by default;
    shifts by Python ints: no host-to-device copy, so a CUDA graph can hold it)."""
    return torch.stack([(packed >> s) & ((1 << width) - 1) for s in range(0, 8, width)], dim=dim)


def _nibbles(qs: torch.Tensor, rows: int) -> torch.Tensor:
    """Packed 4-bit codes [rows, blocks, chunks, bytes] as values [rows, blocks * chunks * 2 * bytes]: each chunk's
    low nibbles, then its high ones (Q4_0's 16 bytes a block of 32, Q4_K's four 32-byte chunks a superblock)."""
    return _fields(qs, 4).reshape(rows, -1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's twelve bytes of 6-bit scales and mins [..., 12] as ([..., 8], [..., 8]) uint8 (gguf's
    get_scale_min)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


GROUPED_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                 GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K)


def grouped_parts(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int):
    """Codes [rows, in_features] (4-bit types 0..15, 5-bit ones 0..31) and per group of 32 the scale and offset
    (float32) of GROUPED_TYPES' blocks, by torch operators on the blocks' device: code * scale + offset is the gguf
    package's float."""
    rows = blocks.shape[0]
    Q = GGMLQuantizationType
    b = blocks.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])
    if qtype in (Q.Q4_K, Q.Q5_K):  # superblocks of 256: eight groups, 6-bit scales and mins of two float16s
        sc, mn = _k_scales(b[..., 4:16])
        scale, offset = _halves(b[..., 0:2])[..., None] * sc.float(), -(_halves(b[..., 2:4])[..., None] * mn.float())
        codes = _nibbles(b[..., -128:].reshape(rows, -1, 4, 32), rows)
        if qtype == Q.Q5_K:  # bit s of high byte p: group s, position p
            codes = codes | (_fields(b[..., 16:48], 1).reshape(rows, -1) << 4)
        return codes.reshape(rows, in_features), scale.reshape(rows, -1), offset.reshape(rows, -1)
    d = _halves(b[..., 0:2])  # blocks of 32: one group each
    codes = _nibbles(b[..., -16:].unsqueeze(-2), rows)
    if qtype in (Q.Q5_0, Q.Q5_1):  # bit i of the block's four high bytes (little-endian): value i
        high = b[..., -20:-16]
        codes = codes | (_fields(high, 1).transpose(-1, -2).reshape(rows, -1) << 4)
    if qtype in (Q.Q4_1, Q.Q5_1):
        offset = _halves(b[..., 2:4])
    else:
        offset = (-16 if qtype == Q.Q5_0 else -8) * d
    return codes.reshape(rows, in_features), d, offset


INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)


def int4_parts(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int):
    """grouped_parts of a 4-bit type (INT4_TYPES: Q4_0, Q4_1, Q4_K), codes 0..15."""
    if qtype not in INT4_TYPES:
        raise ValueError(f"{qtype.name} is not a 4-bit type")
    return grouped_parts(blocks, qtype, in_features)


def low_k_parts(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int):
    """Q2_K or Q3_K blocks as their codes [rows, in_features] (Q2_K 0..3, Q3_K -4..3; int8) and per group of 16 the
    scale and (Q2_K) the offset, float32, by torch operators on the blocks' device (code * scale + offset is the gguf
    package's float)."""
    rows = blocks.shape[0]
    if qtype == GGMLQuantizationType.Q2_K:
        b = blocks.reshape(rows, -1, 84)
        codes = _fields(b[..., 16:80].reshape(rows, -1, 2, 32), 2)  # [rows, blocks, 2, 4, 32]: 16 groups of 16
        scales = _halves(b[..., 80:82])[..., None] * (b[..., 0:16] & 0x0F).float()
        offsets = -(_halves(b[..., 82:84])[..., None] * (b[..., 0:16] >> 4).float())
        return codes.reshape(rows, in_features).to(torch.int8), scales.reshape(rows, -1), offsets.reshape(rows, -1)
    b = blocks.reshape(rows, -1, 110)
    low = _fields(b[..., 32:96].reshape(rows, -1, 2, 32), 2).reshape(rows, -1, 16, 16).to(torch.int8)
    high = _fields(b[..., 0:32].unsqueeze(-2), 1).reshape(rows, -1, 16, 16).to(torch.int8)  # 1: no offset of 4
    codes = low - 4 * (1 - high)
    groups, superblocks = k_scales(blocks, qtype)
    scales = superblocks.float()[..., None] * groups.view(rows, -1, 16).float()
    return codes.reshape(rows, in_features), scales.reshape(rows, -1), None


def k_mins(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's, Q5_K's or Q2_K's scales and minimums as their blocks hold them: each group's integer scale and
    minimum side by side (uint8 [rows, 2 x groups]: Q4_K's and Q5_K's 6-bit ones a group of 32, Q2_K's 4-bit ones a
    group of 16) and each superblock's float16 scale and minimum side by side ([rows, 2 x in_features / 256]); a
    value is code x d x scale - dmin x minimum. By torch operators on the blocks' device."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])
    if qtype == GGMLQuantizationType.Q2_K:
        groups, superblocks = (b[..., 0:16] & 0x0F, b[..., 0:16] >> 4), (b[..., 80:82], b[..., 82:84])
    else:
        groups, superblocks = _k_scales(b[..., 4:16]), (b[..., 0:2], b[..., 2:4])
    return (torch.stack(groups, dim=-1).reshape(rows, -1),
            torch.stack([_float16s(pair) for pair in superblocks], dim=-1).reshape(rows, -1))


def k_scales(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K's or Q3_K's scales as their blocks hold them: each group of 16's integer (int8 [rows, in_features / 16];
    Q3_K's 6-bit one less 32) and each superblock's float16 ([rows, in_features / 256]), a group's scale their
    product; by torch operators on the blocks' device."""
    rows = blocks.shape[0]
    if qtype == GGMLQuantizationType.Q6_K:
        b = blocks.reshape(rows, -1, 210)
        return b[..., 192:208].contiguous().view(torch.int8).reshape(rows, -1), _float16s(b[..., 208:210])
    b = blocks.reshape(rows, -1, 110)
    sixteen = _fields(b[..., 96:104].unsqueeze(-2), 4).reshape(rows, -1, 16)  # group g < 8: byte g's low nibble
    top = _fields(b[..., 104:108].unsqueeze(-2), 2).reshape(rows, -1, 16)  # group g: byte g % 4, bits 2 (g // 4)
    groups = ((sixteen | (top << 4)).to(torch.int16) - 32).to(torch.int8)
    return groups.reshape(rows, -1), _float16s(b[..., 108:110])


IQ4_VALUES = IQ4_LEVELS  # IQ4_NL/IQ4_XS's 16 levels
MXFP4_VALUES = E2M1_LEVELS  # e2m1's values doubled


def iq4_nibbles(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int):
    """IQ4_NL, IQ4_XS or MXFP4 (as held: IQ4_NL's layout) blocks as their 4-bit indices [rows, in_features] (uint8,
    into IQ4_VALUES or MXFP4_VALUES: for MXFP4 e2m1's own bits, the sign high) and per group of 32 the scale:
    IQ4_NL's and MXFP4's float16 as held, IQ4_XS's superblock float16 scale times the group's 6-bit one less 32, in
    float32 (exact); by torch operators on the blocks' device."""
    rows = blocks.shape[0]
    if qtype in (GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.MXFP4):
        b = blocks.reshape(rows, -1, 18)
        return _nibbles(b[..., 2:].unsqueeze(-2), rows), _float16s(b[..., 0:2])
    b = blocks.reshape(rows, -1, 136)
    low = _fields(b[..., 4:8], 4, dim=-1)  # group 2j, 2j+1: byte j's nibbles
    high = _fields(b[..., 2:4], 2, dim=-1)  # group i: bits 2i of 16
    groups = (low.reshape(rows, -1, 8) | (high.reshape(rows, -1, 8) << 4)).float() - 32
    scales = (_halves(b[..., 0:2])[..., None] * groups).reshape(rows, -1)
    return _nibbles(b[..., 8:].reshape(rows, -1, 8, 16), rows), scales


def iq4_parts(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int):
    """iq4_nibbles' blocks as their levels' int8 codes [rows, in_features] (IQ4_VALUES, MXFP4_VALUES) and its
    scales."""
    table = MXFP4_VALUES if qtype == GGMLQuantizationType.MXFP4 else IQ4_VALUES
    levels = torch.tensor(table, dtype=torch.int8, device=blocks.device)
    nibbles, scales = iq4_nibbles(blocks, qtype, in_features)
    return levels[nibbles.long()].reshape(blocks.shape[0], in_features), scales


def q6_k_parts(blocks: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks as their codes [rows, in_features] (-32..31, int8) and per group of 16 the scale (float32), by
    torch operators on the blocks' device."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 210)
    low = _nibbles(b[..., 0:128].reshape(rows, -1, 2, 64), rows).reshape(rows, -1, 8, 32)
    high_bytes = b[..., 128:192].reshape(rows, -1, 2, 32)  # each half's 2-bit fields: four groups
    high = _fields(high_bytes, 2).reshape(rows, -1, 8, 32)
    codes = (low | (high << 4)).to(torch.int8) - 32
    groups, superblocks = k_scales(blocks, GGMLQuantizationType.Q6_K)
    scale = superblocks.float()[..., None] * groups.view(rows, -1, 16).float()
    return codes.reshape(rows, in_features), scale.reshape(rows, -1)


def dequantize_rows(rows: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> torch.Tensor:
    """The float32 values [n, in_features] of DEVICE_ROW_TYPES' rows of blocks [n, row bytes], by torch operators
    on the rows' device (the gguf package's arithmetic: the same floats)."""
    n = rows.shape[0]
    if qtype == GGMLQuantizationType.Q8_0:
        codes, scales = q8_0_parts(rows, in_features)
        return (codes.float().view(n, -1, 32) * scales.float()[..., None]).reshape(n, in_features)
    if qtype == GGMLQuantizationType.Q6_K:
        codes, scale = q6_k_parts(rows, in_features)
        return (codes.float().view(n, -1, 16) * scale[..., None]).reshape(n, in_features)
    if qtype in (GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K):
        codes, scale, offset = low_k_parts(rows, qtype, in_features)
        weight = codes.float().view(n, -1, 16) * scale[..., None]
        return (weight if offset is None else weight + offset[..., None]).reshape(n, in_features)
    codes, scale, offset = grouped_parts(rows, qtype, in_features)
    return (codes.float().view(n, -1, 32) * scale[..., None] + offset[..., None]).reshape(n, in_features)
