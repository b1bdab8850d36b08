// GGUF's block formats as the kernels read them: the GGML type numbers, the X8 layout (rows interleaved eight by
// eight), the block sizes, and the plain unpacking of a row's blocks that every path shares. Included by every
// translation unit; the functions are internal to each (an anonymous namespace), so that each inlines them as
// it did when they all lived in one file.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace rungen_ggml {

enum QType : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q5_K = 13, Q4_K = 12, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23, MXFP4 = 39
};

// X8 | Q4_0, X8 | Q4_1 or X8 | Q8_0 (and Q5_0/Q5_1, below): the same blocks with the rows interleaved eight by
// eight (interleave() makes them), a tensor [rows / 8, 8 * row bytes]: for each group of eight rows and each block
// of 32 columns, the eight rows' float16 scales d, then (Q4_1) their float16 offsets m, then the codes, four bytes
// of every row in turn: bytes 4j .. 4j + 3 of rows 0..7 for j = 0..3 (4-bit: 128 bytes of nibbles) or j = 0..7
// (Q8_0: 256 bytes). A 32-byte load then holds four codes of each of the eight rows (4-bit: and in their high
// nibbles four more), so that one register's eight lanes are eight rows' sums: a block's integer dot product takes
// no horizontal additions, and its scaling one multiply-add for eight rows. Arithmetic per row and token, the same
// on every path: acc = fma(float(dot), d * dx, acc), then for Q4_0/Q4_1 acc = fma(m, dx * sum(xq), acc) (m = -8 d
// for Q4_0), for each block in order (dot: the block's exact integer dot product).
// X8 | Q5_0 and X8 | Q5_1 likewise, their fifth bits as a 32-byte plane between the scales (and offsets) and the
// nibbles: byte 4 * row + i holds in bit j the fifth bit of code 4j + i (the low nibble of the nibbles' byte 4j +
// i) and in bit 4 + j that of code 16 + 4j + i (its high nibble), j = 0..3; the same size as the blocks, the same
// arithmetic with m = -16 d for Q5_0.
//
// X8 | Q4_K, X8 | Q5_K, X8 | Q6_K: a group of eight rows' superblock of 256 columns as its eight blocks of 32
// want it (kx8_block reads one row's block, interleave() writes them): the codes packed as the file packs them
// (4 bits, and Q5_K's fifth or Q6_K's two high bits apart), the 6-bit scales and mins unpacked to a byte each.
// Q4_K (1184 bytes, 148 a row: the file's 144 and 4 for the unpacked scales), Q5_K (1440; 180 for 176):
//   d[8], dmin[8] (float16, one a row), sc[8 blocks][8 rows], mn[8][8] (bytes), then per block 128 bytes of
//   nibbles as X8 | Q4_0 lays them (bytes 4j .. 4j + 3 of rows 0..7 for j = 0..3; a row's byte i holds its
//   codes i and 16 + i), and for Q5_K 32 bytes of fifth bits, a 32-bit word a row: bit k of byte i is the bit
//   of code 4k + i, bit 4 + k that of code 16 + 4k + i (what load j's lanes need, by one shift).
// Q6_K (1680 bytes, 210 a row: the file's size): d[8] (float16), sc[16 halves][8 rows] (int8), then per block
//   the nibbles as above and 64 bytes of high bit pairs, two 32-bit words a row (the first for codes 0..15,
//   the second for 16..31): bits 2k, 2k + 1 of byte i are those of code 4k + i (or 16 + 4k + i).
// A block's integer sum is exact: Q4_K/Q5_K dot = q . xq (at most 32 * 31 * 127 < 2^24); Q6_K dot = sc0 * ((q - 32)
// . xq over 0..15) + sc1 * (... over 16..31), weighted by its scales in integers, the offset -32 kept in the
// integers (at most 2 * 128 * 16 * 32 * 127 < 2^24): q . xq less 32 times the half's integer sum of xq, or on
// AVX2 for prompts (q - 32) . (xq + 128) less 128 times the codes' sum (see q6kx8_ready). Then per row and token,
// for each block in order: acc = fma(float(dot), ds * dx, acc), where ds = d * sc for Q4_K/Q5_K (a float16 times a
// 6-bit integer: exact in float, the row-major path's arithmetic, and one multiplication a block and token fewer
// than weighting the integer sum) and d for Q6_K, and for Q4_K/Q5_K acc = fma(-dmin * mn, dx * sum(xq), acc): the
// same bits on every path, alone or
// among other tokens.
//
// X8 | IQ4_NL (144 bytes, 18 a row: the file's size): d[8] (float16), then the nibbles as X8 | Q4_0 lays them; a
// nibble indexes kvalues_iq4nl (-127..113), looked up by a byte shuffle. MXFP4 (gpt-oss's experts) is held as
// IQ4_NL's blocks of its own table, kvalues_mxfp4 (e2m1's values doubled, -12..12): its file's scale byte e, 2^(e -
// 128), becomes the block's float16 d where the weights are read (rungen/gguf/blocks.py), 18 bytes for 17; every
// IQ4_NL path then takes it with that table. X8 | IQ4_XS (1104 bytes, 138 a row: the
// file's 136 and 2 for the unpacked scales): d[8] (float16), sc[8 blocks][8 rows] (int8: the 6-bit scale - 32),
// then per block the nibbles as X8 | Q4_0 lays them. The table's values are signed: multiplied as Q8_0's codes
// (|w| times x with w's sign), or on VNNI offset by 128 (unsigned), less 128 times the activations' integer sum.
// Per block dot = values . xq, exact in integers (at most 32 * 127 * 127 < 2^24), then per row and token
// acc = fma(float(dot), (d * sc) * dx, acc) (IQ4_NL: d * dx), no offsets. d * sc, a float16 times a 6-bit integer,
// is exact in float: the row-major path's arithmetic (dot_krow), and one multiplication a block and token fewer
// than weighting the integer sum by sc.
//
// X8 | Q3_K (912 bytes, 114 a row: the file's 110 and 4 for the unpacked scales): d[8] (float16), sc[16 halves][8
// rows] (int8: the 6-bit scale - 32), then per block of 32, 96 bytes: two planes of low bits, 32 bytes each (the
// first for codes 0..15, the second for 16..31), bits 2k, 2k + 1 of a row's byte i those of code 4k + i (or
// 16 + 4k + i), then 32 bytes of high bits, a 32-bit word a row: bit k of byte i is the high bit of code 4k + i,
// bit 4 + k that of code 16 + 4k + i (Q5_K's arrangement). The code is q = low | high << 2 (0..7; the file's
// "high bit set: no -4"), the weight d * sc * (q - 4). Per block dot = sc0 * ((q - 4) . xq)_0..15 + sc1 * (...)_16..31,
// the offset taken in integers as 4 times the activations' integer sum of each half (at most
// 2 * 32 * 16 * 4 * 127 = 520192 < 2^24), then per row and token acc = fma(float(dot), d * dx, acc).
constexpr int64_t X8 = 256;

namespace {

int64_t block_elements(int64_t qtype) {
  qtype &= ~X8;
  return (qtype == Q2_K || qtype == Q3_K || qtype == Q4_K || qtype == Q5_K || qtype == Q6_K || qtype == IQ4_XS) ? 256
                                                                                                             : 32;
}

int64_t block_bytes(int64_t qtype) {
  switch (qtype & ~X8) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case IQ4_NL:
    case MXFP4: return 18;
    case IQ4_XS: return 136;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
  }
  TORCH_CHECK(false, "rungen_ggml: unsupported GGML type ", qtype);
}

// Bytes of a group of eight rows' block (or superblock) in the X8 layout.
int64_t x8_bytes(int64_t base) {
  switch (base) {
    case Q4_K: return 1184;
    case Q5_K: return 1440;
    case Q6_K: return 1680;
    case IQ4_XS: return 1104;
    case Q3_K: return 912;
  }
  return 8 * block_bytes(base);
}

bool x8_kquant(int64_t base) { return base == Q4_K || base == Q5_K || base == Q6_K; }

// The X8 types read a superblock of 256 at a time (kx8_block).
bool x8_super(int64_t base) { return x8_kquant(base) || base == IQ4_XS || base == Q3_K; }

bool interleaved_type(int64_t base) {
  return base == Q4_0 || base == Q4_1 || base == Q5_0 || base == Q5_1 || base == Q8_0 || base == IQ4_NL ||
         base == MXFP4 || x8_super(base);
}

// Whether an X8 type's blocks have offsets m (acc = fma(m, dx * sum(xq), acc)).
bool x8_offsets(int64_t base) {
  return base != Q8_0 && base != Q6_K && base != IQ4_NL && base != IQ4_XS && base != MXFP4 && base != Q3_K;
}

// The non-linear 4-bit values of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl), and MXFP4's (kvalues_mxfp4).
constexpr int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int8_t kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// The types whose 4-bit codes index a table (IQ4_NL's blocks and superblocks, MXFP4's held as IQ4_NL's), and it.
constexpr bool iq4_type(int64_t base) { return base == IQ4_NL || base == IQ4_XS || base == MXFP4; }
constexpr const int8_t* iq4_table(int64_t base) { return base == MXFP4 ? kvalues_mxfp4 : kvalues_iq4nl; }

// One row unpacked (every type but Q4_0, Q4_1 and Q8_0, which the kernels read as stored): codes [K] (unsigned,
// or for IQ4 the signed values of its table), wd [K/32], sc16 [K/16] (integer scales per 16: Q2_K, Q3_K, Q6_K),
// wm [K/16]. A weight is (wd * sc16) * code + wm, or (wd * sc16) * (code - center) for the types whose codes are
// centred (wm = -center * wd * sc16 is then what the product adds).
struct KRow {
  std::vector<uint8_t> codes_v;
  std::vector<float> wd_v, wm_v;
  std::vector<int16_t> sc16_v;
  uint8_t* codes;
  float *wd, *wm;
  int16_t* sc16;
  explicit KRow(int64_t k) : codes_v(k), wd_v(k / 32), wm_v(k / 16), sc16_v(k / 16, 1) {
    codes = codes_v.data();
    wd = wd_v.data();
    wm = wm_v.data();
    sc16 = sc16_v.data();
  }
};

// Q4_K/Q5_K's eight 6-bit scales and mins, packed in 12 bytes.
inline void kquant_scales(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    mn[j] = q[j + 4] & 63;
    sc[j + 4] = (q[j + 8] & 0x0F) | ((q[j] >> 6) << 4);
    mn[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
  }
}

inline float half_bits_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// One row's block in the X8 layout (p: the group's block, lane: the row in the group): its 32 codes in the
// block's order (Q4_0/Q4_1 unsigned 0..15, Q5_0/Q5_1 0..31, Q8_0, IQ4_NL and MXFP4 signed), its scale d and offset
// m (m = -8 d for Q4_0, -16 d for Q5_0, 0 for Q8_0, IQ4_NL and MXFP4): the weights are d * code + m.
inline void x8_block(const uint8_t* p, int64_t base, int64_t lane, int32_t* codes, float& d, float& m) {
  d = half_bits_to_float(p + 2 * lane);
  if (base == IQ4_NL || base == MXFP4) {
    const int8_t* table = iq4_table(base);
    m = 0.f;
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = p[16 + 32 * j + 4 * lane + i];
        codes[4 * j + i] = table[byte & 0x0F];
        codes[16 + 4 * j + i] = table[byte >> 4];
      }
    return;
  }
  if (base == Q8_0) {
    m = 0.f;
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 4; ++i) codes[4 * j + i] = int8_t(p[16 + 32 * j + 4 * lane + i]);
    return;
  }
  const bool has_min = base == Q4_1 || base == Q5_1, five = base == Q5_0 || base == Q5_1;
  const uint8_t* high = p + (has_min ? 32 : 16);  // Q5's plane of fifth bits
  const int64_t head = (has_min ? 32 : 16) + (five ? 32 : 0);
  m = has_min ? half_bits_to_float(p + 16 + 2 * lane) : (five ? -16.f : -8.f) * d;
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < 4; ++i) {
      const uint8_t byte = p[head + 32 * j + 4 * lane + i], bits = five ? high[4 * lane + i] : 0;
      codes[4 * j + i] = (byte & 0x0F) | (((bits >> j) & 1) << 4);
      codes[16 + 4 * j + i] = (byte >> 4) | (((bits >> (4 + j)) & 1) << 4);
    }
}

// One row's block j (0..7) of a group's superblock p in the X8 k-quant or IQ4_XS layout: its 32 codes (Q4_K/Q5_K
// unsigned, Q6_K signed: q - 32, Q3_K signed: q - 4, IQ4_XS the table's values), the integer scales of its two halves of 16
// (Q6_K's and Q3_K's; Q4_K/Q5_K/IQ4_XS: 1, the block's scale in d), d and the offset m (-dmin * mn; 0 for Q6_K,
// Q3_K and IQ4_XS): the weights are d * sc * code + m.
inline void kx8_block(const uint8_t* p, int64_t base, int64_t lane, int64_t j, int32_t* codes, int32_t* sc, float& d,
                      float& m) {
  d = half_bits_to_float(p + 2 * lane);
  if (base == Q3_K) {
    sc[0] = int8_t(p[16 + 16 * j + lane]);
    sc[1] = int8_t(p[16 + 16 * j + 8 + lane]);
    m = 0.f;
    const uint8_t* low = p + 144 + 96 * j + 4 * lane;
    const uint8_t* high = p + 144 + 96 * j + 64 + 4 * lane;
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < 4; ++i) {
        codes[4 * k + i] = (((low[i] >> (2 * k)) & 3) | (((high[i] >> k) & 1) << 2)) - 4;
        codes[16 + 4 * k + i] = (((low[32 + i] >> (2 * k)) & 3) | (((high[i] >> (4 + k)) & 1) << 2)) - 4;
      }
    return;
  }
  const uint8_t* nib;
  if (base == IQ4_XS) {  // the scale in d (exact), the sums unweighted
    d *= float(int8_t(p[16 + 8 * j + lane]));
    sc[0] = sc[1] = 1;
    m = 0.f;
    nib = p + 80 + 128 * j;
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = nib[32 * k + 4 * lane + i];
        codes[4 * k + i] = kvalues_iq4nl[byte & 0x0F];
        codes[16 + 4 * k + i] = kvalues_iq4nl[byte >> 4];
      }
    return;
  }
  if (base == Q6_K) {
    sc[0] = int8_t(p[16 + 16 * j + lane]);
    sc[1] = int8_t(p[16 + 16 * j + 8 + lane]);
    m = 0.f;
    nib = p + 144 + 192 * j;
  } else {  // the scale in d (exact), the sums unweighted
    d *= float(p[32 + 8 * j + lane]);
    sc[0] = sc[1] = 1;
    m = -half_bits_to_float(p + 16 + 2 * lane) * float(p[96 + 8 * j + lane]);
    nib = p + 160 + (base == Q5_K ? 160 : 128) * j;
  }
  const uint8_t* high = nib + 128 + 4 * lane;
  for (int k = 0; k < 4; ++k)
    for (int i = 0; i < 4; ++i) {
      const uint8_t byte = nib[32 * k + 4 * lane + i];
      int32_t lo = byte & 0x0F, hi = byte >> 4;
      if (base == Q5_K) {
        lo |= ((high[i] >> k) & 1) << 4;
        hi |= ((high[i] >> (4 + k)) & 1) << 4;
      } else if (base == Q6_K) {
        lo = (lo | (((high[i] >> (2 * k)) & 3) << 4)) - 32;
        hi = (hi | (((high[32 + i] >> (2 * k)) & 3) << 4)) - 32;
      }
      codes[4 * k + i] = lo;
      codes[16 + 4 * k + i] = hi;
    }
}

// Whether a type's rows are unpacked into a KRow, and how its codes multiply: unsigned codes (their products
// summed per 32, then scaled by wd), unsigned codes whose products are weighted per 16 by sc16 in integers, or
// signed codes (IQ4's table values, -127..113).
enum CodeKind { PLAIN = 0, SCALED16 = 1, SIGNED = 2 };

inline bool krow_type(int64_t qtype) { return qtype != Q4_0 && qtype != Q4_1 && qtype != Q8_0 && !(qtype & X8); }

inline int code_kind(int64_t qtype) {
  if (qtype == Q2_K || qtype == Q3_K || qtype == Q6_K) return SCALED16;
  return iq4_type(qtype) ? SIGNED : PLAIN;
}

// The code a centred type's zero is (its weights d * (code - center)), 0 for the others.
inline int code_center(int64_t qtype) {
  switch (qtype) {
    case Q5_0: return 16;
    case Q3_K: return 4;
    case Q6_K: return 32;
  }
  return 0;
}

// The blocks of the types below unpacked into a KRow, at element e0 of the row. Their scales and offsets here,
// shared by every path; their codes by the plain loops below (scalar path, de-quantization) and by SIMD twins in
// ggml_simd.h (the codes are exact: any unpacking gives the same KRow).

// Q5_0 (d, 32 high bits, 16 bytes of nibbles; w = d * (q - 16)) and Q5_1 (d, m, high bits, nibbles;
// w = d * q + m): element i < 16 is the low nibble of byte i with high bit i, element 16 + i its high nibble with
// high bit 16 + i.
inline void q5_scales(const uint8_t* p, bool has_min, KRow& r, int64_t e0) {
  const float d = half_bits_to_float(p);
  r.wd[e0 / 32] = d;
  r.wm[e0 / 16] = r.wm[e0 / 16 + 1] = has_min ? half_bits_to_float(p + 2) : -16.f * d;
}

inline void unpack_q5(const uint8_t* p, bool has_min, KRow& r, int64_t e0) {
  const int64_t head = has_min ? 4 : 2;
  uint32_t qh;
  std::memcpy(&qh, p + head, 4);
  const uint8_t* qs = p + head + 4;
  uint8_t* c = r.codes + e0;
  for (int i = 0; i < 16; ++i) {
    c[i] = (qs[i] & 0x0F) | (((qh >> i) & 1) << 4);
    c[i + 16] = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
  }
  q5_scales(p, has_min, r, e0);
}

// Q2_K (16 bytes of 4-bit scale | 4-bit min per 16, 64 bytes of 2-bit codes, d, dmin): element 128 h + 32 j + l
// is bits 2j of byte 16 + 32 h + l; w = (d * scale) * q - dmin * min.
inline void q2_k_scales(const uint8_t* p, KRow& r, int64_t e0) {
  const float d = half_bits_to_float(p + 80), dmin = half_bits_to_float(p + 82);
  for (int j = 0; j < 8; ++j) r.wd[e0 / 32 + j] = d;
  for (int k = 0; k < 16; ++k) {
    r.sc16[e0 / 16 + k] = p[k] & 0x0F;
    r.wm[e0 / 16 + k] = -(dmin * float(p[k] >> 4));
  }
}

inline void unpack_q2_k(const uint8_t* p, KRow& r, int64_t e0) {
  const uint8_t* qs = p + 16;
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) r.codes[e0 + 128 * h + 32 * j + l] = (qs[32 * h + l] >> (2 * j)) & 3;
  q2_k_scales(p, r, e0);
}

// Q3_K (32 bytes of high bits, 64 bytes of 2-bit codes, 12 bytes of 6-bit scales, d): element 128 h + 32 j + l
// is bits 2j of byte 32 + 32 h + l, its high bit bit 4h + j of byte l; w = (d * (scale - 32)) * (q - 4).
inline void q3_k_scales(const uint8_t* p, KRow& r, int64_t e0) {
  const uint8_t* sc = p + 96;
  const float d = half_bits_to_float(p + 108);
  for (int j = 0; j < 8; ++j) r.wd[e0 / 32 + j] = d;
  for (int k = 0; k < 16; ++k) {
    const int scale = ((sc[k % 8] >> (4 * (k / 8))) & 0x0F) | (((sc[8 + k % 4] >> (2 * (k / 4))) & 3) << 4);
    r.sc16[e0 / 16 + k] = int16_t(scale - 32);
    r.wm[e0 / 16 + k] = -4.f * d * float(scale - 32);
  }
}

inline void unpack_q3_k(const uint8_t* p, KRow& r, int64_t e0) {
  const uint8_t *hmask = p, *qs = p + 32;
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l)
        r.codes[e0 + 128 * h + 32 * j + l] =
            ((qs[32 * h + l] >> (2 * j)) & 3) | (((hmask[l] >> (4 * h + j)) & 1) << 2);
  q3_k_scales(p, r, e0);
}

// IQ4's 16 bytes of nibbles: element i < 16 the table's value at the low nibble of byte i, 16 + i at its high one.
inline void iq4_codes(const uint8_t* qs, uint8_t* c, const int8_t* table = kvalues_iq4nl) {
  for (int i = 0; i < 16; ++i) {
    c[i] = uint8_t(table[qs[i] & 0x0F]);
    c[i + 16] = uint8_t(table[qs[i] >> 4]);
  }
}

// IQ4_NL (d, nibbles; w = d * value) and IQ4_XS (d, 16 high and 8 bytes of low bits of a 6-bit scale per 32,
// nibbles from byte 8; w = (d * (scale - 32)) * value). No offsets: wm stays zero.
inline void unpack_iq4_nl(const uint8_t* p, KRow& r, int64_t e0, const int8_t* table = kvalues_iq4nl) {
  r.wd[e0 / 32] = half_bits_to_float(p);
  iq4_codes(p + 2, r.codes + e0, table);
}

inline void iq4_xs_scales(const uint8_t* p, KRow& r, int64_t e0) {
  const float d = half_bits_to_float(p);
  uint16_t high;
  std::memcpy(&high, p + 2, 2);
  for (int j = 0; j < 8; ++j) {
    const int scale = ((p[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4);
    r.wd[e0 / 32 + j] = d * float(scale - 32);
  }
}

inline void unpack_iq4_xs(const uint8_t* p, KRow& r, int64_t e0) {
  for (int j = 0; j < 8; ++j) iq4_codes(p + 8 + 16 * j, r.codes + e0 + 32 * j);
  iq4_xs_scales(p, r, e0);
}

void unpack_k(int64_t qtype, const uint8_t* sb, KRow& r, int64_t s) {
  uint8_t* codes = r.codes + s * 256;
  if (qtype == Q6_K) {
    const uint8_t* ql = sb;
    const uint8_t* qh = sb + 128;
    const int8_t* scales = (const int8_t*)(sb + 192);
    const float d = half_bits_to_float(sb + 208);
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const uint8_t hb = qh[32 * h + l];
        uint8_t* c = codes + 128 * h;
        c[l] = (ql[64 * h + l] & 0x0F) | ((hb & 3) << 4);
        c[l + 32] = (ql[64 * h + l + 32] & 0x0F) | (((hb >> 2) & 3) << 4);
        c[l + 64] = (ql[64 * h + l] >> 4) | (((hb >> 4) & 3) << 4);
        c[l + 96] = (ql[64 * h + l + 32] >> 4) | (((hb >> 6) & 3) << 4);
      }
    for (int j = 0; j < 8; ++j) r.wd[s * 8 + j] = d;
    for (int k = 0; k < 16; ++k) {
      r.sc16[s * 16 + k] = scales[k];
      r.wm[s * 16 + k] = -32.f * d * scales[k];
    }
    return;
  }
  uint8_t sc[8], mn[8];
  kquant_scales(sb + 4, sc, mn);
  const float d = half_bits_to_float(sb), dmin = half_bits_to_float(sb + 2);
  const uint8_t* qh = qtype == Q5_K ? sb + 16 : nullptr;
  const uint8_t* qs = sb + (qtype == Q5_K ? 48 : 16);
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      uint8_t lo = qs[32 * c + l] & 0x0F, hi = qs[32 * c + l] >> 4;
      if (qh) {
        lo |= ((qh[l] >> (2 * c)) & 1) << 4;
        hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
      }
      codes[64 * c + l] = lo;
      codes[64 * c + 32 + l] = hi;
    }
  for (int j = 0; j < 8; ++j) {
    r.wd[s * 8 + j] = d * sc[j];
    r.wm[s * 16 + 2 * j] = r.wm[s * 16 + 2 * j + 1] = -dmin * mn[j];
  }
}

// Block b (of the type's blocks, at element offset b * block_elements) of a row into the KRow.
void unpack_block(int64_t qtype, const uint8_t* p, KRow& r, int64_t b) {
  switch (qtype) {
    case Q4_K:
    case Q5_K:
    case Q6_K: return unpack_k(qtype, p, r, b);
    case Q5_0:
    case Q5_1: return unpack_q5(p, qtype == Q5_1, r, b * 32);
    case Q2_K: return unpack_q2_k(p, r, b * 256);
    case Q3_K: return unpack_q3_k(p, r, b * 256);
    case IQ4_NL: return unpack_iq4_nl(p, r, b * 32);
    case MXFP4: return unpack_iq4_nl(p, r, b * 32, kvalues_mxfp4);
    case IQ4_XS: return unpack_iq4_xs(p, r, b * 256);
  }
  TORCH_CHECK(false, "rungen_ggml: GGML type ", qtype, " is not unpacked");
}

}  // namespace
}  // namespace rungen_ggml
