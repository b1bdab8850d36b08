// Matrix products with GGUF's quantized blocks, as llama.cpp computes them on a CPU: the activations are
// quantized to int8 per block of 32 (one float scale each), each block's dot product is taken in integers,
// and the blocks are summed in float. Output rows are spread over torch's intra-op threads.
//
//   torch.ops.rungen_ggml.mm(x, blocks, qtype, in_features)      auto: integer kernel, or for many tokens
//                                                               de-quantized float tiles and torch's matmul
//   torch.ops.rungen_ggml.mm_parts(x, [blocks], [qtype], in_features)  mm of several weights side by side
//   torch.ops.rungen_ggml.mm_int(x, blocks, qtype, in_features)  integer kernel, any number of tokens
//   torch.ops.rungen_ggml.dequantize(blocks, qtype, in_features) float32 weight
//   torch.ops.rungen_ggml.rms_norm(x, weight, eps)               a decoder layer's small steps, one operator
//   torch.ops.rungen_ggml.rope_split(qkv, cos, sin, heads, kv_heads[, q_norm, k_norm, norm_eps])  each instead
//                                                               of several (see below)
//   torch.ops.rungen_ggml.silu_mul(gate_up), gelu_tanh_mul(gate_up)
//   torch.ops.rungen_ggml.attend(q, k, v, mask, scale, softcap, window)  attention, the same bits with or
//                                                               without padding
//   torch.ops.rungen_ggml.attention_in(...), attention_out_mlp(...)  a decoder layer in two calls (see below)
//   torch.ops.rungen_ggml.decoder_stack(...)                     every decoder layer in one call (see below)
//   torch.ops.rungen_ggml.isa() / set_isa(name)                  the code path in use ("avx512vnni", "avx2",
//                                                               "scalar"); set_isa forces one (tests)
//
// x is float32 [n, in_features]; blocks uint8 [out_features, row bytes] (rows may be strided), as the file
// stores them; qtype is GGML's type number. The instruction set is chosen at run time from the CPU's flags:
// this file is compiled without -march, and each SIMD variant only for its own functions.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <limits>
#include <vector>

namespace {

enum QType : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q5_K = 13, Q4_K = 12, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23
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
// nibble indexes kvalues_iq4nl (-127..113), looked up by a byte shuffle. X8 | IQ4_XS (1104 bytes, 138 a row: the
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
    case IQ4_NL: return 18;
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
         x8_super(base);
}

// Whether an X8 type's blocks have offsets m (acc = fma(m, dx * sum(xq), acc)).
bool x8_offsets(int64_t base) {
  return base != Q8_0 && base != Q6_K && base != IQ4_NL && base != IQ4_XS && base != Q3_K;
}

// The non-linear 4-bit values of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl).
constexpr int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// The activations of n tokens, quantized per block of 32: codes q [n, K], scale d [n, K/32] (q * d ~ x),
// s = d * sum(q) per 32 [n, K/32] (what a block's offset multiplies), s16 = d * sum(q) per 16 [n, K/16], and
// s4: s of each whole group of four tokens, the four side by side [n/4, K/32, 4] (one vector a block), and
// off128: -128 sum(q) per 32 [n, K/32] in integers (where the VNNI kernels whose codes are offset by 128, Q8_0's
// and IQ4's, start a block's sum: a broadcast load a token and block, 1.02-1.07x for their products, rather than
// a load, a multiply and a broadcast from a general register); for X8 | Q3_K's offsets, sum16: sum(q) per 16
// [n, K/16] in integers, and high16: the same sums as (sum16 << 16) + 16384 (where the VNNI kernel starts a half
// block's sum); off16:
// -32 sum16 (where the VNNI kernels start a Q6_K half block's sum of its unsigned codes: one broadcast load a token
// and half block instead of a load, two scalar operations and a broadcast, 1.02-1.05x for its prompts' products).
struct Act {
  int64_t n;
  const int8_t* q;
  const float* d;
  const float* s;
  const float* s16;
  const float* s4;
  const int32_t* off128;
  const int32_t* sum16;
  const int32_t* high16;
  const int32_t* off16;
  const uint8_t* u;  // q + 128 (1..255), on the AVX2 path only (else null): what its Q6_K kernel for prompts reads
};

struct Job {
  const Act* act;
  const uint8_t* blocks;
  int64_t pitch;  // bytes from one row to the next
  int64_t qtype, in_features, out_features;
  float* y;  // [n, out_features]
};

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
// block's order (Q4_0/Q4_1 unsigned 0..15, Q5_0/Q5_1 0..31, Q8_0 and IQ4_NL signed), its scale d and offset m
// (m = -8 d for Q4_0, -16 d for Q5_0, 0 for Q8_0 and IQ4_NL): the weights are d * code + m.
inline void x8_block(const uint8_t* p, int64_t base, int64_t lane, int32_t* codes, float& d, float& m) {
  d = half_bits_to_float(p + 2 * lane);
  if (base == IQ4_NL) {
    m = 0.f;
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = p[16 + 32 * j + 4 * lane + i];
        codes[4 * j + i] = kvalues_iq4nl[byte & 0x0F];
        codes[16 + 4 * j + i] = kvalues_iq4nl[byte >> 4];
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
  return qtype == IQ4_NL || qtype == IQ4_XS ? SIGNED : PLAIN;
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
inline void iq4_codes(const uint8_t* qs, uint8_t* c) {
  for (int i = 0; i < 16; ++i) {
    c[i] = uint8_t(kvalues_iq4nl[qs[i] & 0x0F]);
    c[i + 16] = uint8_t(kvalues_iq4nl[qs[i] >> 4]);
  }
}

// IQ4_NL (d, nibbles; w = d * value) and IQ4_XS (d, 16 high and 8 bytes of low bits of a 6-bit scale per 32,
// nibbles from byte 8; w = (d * (scale - 32)) * value). No offsets: wm stays zero.
inline void unpack_iq4_nl(const uint8_t* p, KRow& r, int64_t e0) {
  r.wd[e0 / 32] = half_bits_to_float(p);
  iq4_codes(p + 2, r.codes + e0);
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

// ---------------------------------------------------------------------------------------------------
// Portable path: the same integer arithmetic, plain loops.
namespace scalar {

int32_t dot32(const uint8_t* w, const int8_t* x) {
  int32_t s = 0;
  for (int i = 0; i < 32; ++i) s += int32_t(w[i]) * x[i];
  return s;
}

float dot_q4(const uint8_t* row, int64_t nb, bool has_min, const int8_t* xq, const float* xd, const float* xs) {
  const int64_t bytes = has_min ? 20 : 18;
  float acc = 0.f, mins = 0.f;
  uint8_t w[32];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * bytes;
    const float d = half_bits_to_float(p);
    const float m = has_min ? half_bits_to_float(p + 2) : -8.f * d;
    const uint8_t* qs = p + bytes - 16;
    for (int i = 0; i < 16; ++i) {
      w[i] = qs[i] & 0x0F;
      w[i + 16] = qs[i] >> 4;
    }
    acc += float(dot32(w, xq + b * 32)) * (d * xd[b]);
    mins += m * xs[b];
  }
  return acc + mins;
}

float dot_q8_0(const uint8_t* row, int64_t nb, const int8_t* xq, const float* xd) {
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * 34;
    const int8_t* w = (const int8_t*)(p + 2);
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) s += int32_t(w[i]) * xq[b * 32 + i];
    acc += float(s) * (half_bits_to_float(p) * xd[b]);
  }
  return acc;
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
    case IQ4_XS: return unpack_iq4_xs(p, r, b * 256);
  }
  TORCH_CHECK(false, "rungen_ggml: GGML type ", qtype, " is not unpacked");
}

// An unpacked row against one token, in the SIMD kernels' order (dot_krow in ggml_simd.h), so that every
// instruction set gives the same bits: eight lanes, lane l of a block holding the exact integer sum of its
// elements 4l .. 4l + 3 (times the sub-block's sc16 for SCALED16), added as acc = fma(sum, wd * dx, acc) into one
// of two accumulators by the block's parity; then the offsets, eight per 16 at a time into the second (the last
// eight padded with zeros); then the lanes summed as the SIMD hsum pairs them.
float dot_krow(const KRow& r, int64_t nb, int kind, bool offsets, const int8_t* xq, const float* xd,
               const float* xs16) {
  float acc[2][8] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const float scale = r.wd[b] * xd[b];
    for (int l = 0; l < 8; ++l) {
      int32_t sum = 0;
      for (int i = 0; i < 4; ++i) {
        const int64_t e = b * 32 + 4 * l + i;
        sum += (kind == SIGNED ? int32_t(int8_t(r.codes[e])) : int32_t(r.codes[e])) * xq[e];
      }
      if (kind == SCALED16) sum *= r.sc16[2 * b + l / 4];
      acc[b & 1][l] = std::fma(float(sum), scale, acc[b & 1][l]);
    }
  }
  if (offsets)
    for (int64_t i = 0; i < 2 * nb; i += 8)
      for (int64_t l = 0; l < 8; ++l) {
        const bool in = i + l < 2 * nb;
        acc[1][l] = std::fma(in ? r.wm[i + l] : 0.f, in ? xs16[i + l] : 0.f, acc[1][l]);
      }
  float half[4];
  for (int l = 0; l < 4; ++l) half[l] = (acc[0][l] + acc[1][l]) + (acc[0][l + 4] + acc[1][l + 4]);
  return (half[0] + half[2]) + (half[1] + half[3]);
}

// Blocks [b0, b1) of activations x quantized: d = max|x| / 127, q = round(x / d) (ties to even), the codes biased
// by 128 into u where it is given (else null), and the sums.
void quantize_blocks(const float* xp, int64_t b0, int64_t b1, int8_t* q, uint8_t* u, float* d, float* s, float* s16,
                     int32_t* off128, int32_t* sum16, int32_t* high16, int32_t* off16) {
  for (int64_t b = b0; b < b1; ++b) {
    const float* v = xp + b * 32;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float scale = amax / 127.f;
    const float inv = scale != 0.f ? 1.f / scale : 0.f;
    int32_t sum0 = 0, sum1 = 0;
    for (int i = 0; i < 32; ++i) {
      const int32_t c = int32_t(std::nearbyint(v[i] * inv));
      q[b * 32 + i] = int8_t(c);
      if (u) u[b * 32 + i] = uint8_t(c + 128);
      (i < 16 ? sum0 : sum1) += c;
    }
    d[b] = scale;
    off128[b] = -128 * (sum0 + sum1);
    sum16[2 * b] = sum0;
    sum16[2 * b + 1] = sum1;
    high16[2 * b] = sum0 * 65536 + 16384;
    high16[2 * b + 1] = sum1 * 65536 + 16384;
    off16[2 * b] = -32 * sum0;
    off16[2 * b + 1] = -32 * sum1;
    s[b] = scale * float(sum0 + sum1);
    s16[2 * b] = scale * float(sum0);
    s16[2 * b + 1] = scale * float(sum1);
  }
}

// X8 groups [g0, g1): each row and token as x8_group computes them, one row at a time.
void x8_rows(const Job& job, int64_t g0, int64_t g1) {
  const Act& a = *job.act;
  const int64_t nb = job.in_features / 32, base = job.qtype & ~X8, bytes = x8_bytes(base);
  const bool kquant = x8_super(base), offsets = x8_offsets(base);
  int32_t codes[32], sc[2];
  float d, m;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = job.blocks + g * job.pitch;
    for (int64_t lane = 0; lane < 8; ++lane)
      for (int64_t t = 0; t < a.n; ++t) {
        const int8_t* xq = a.q + t * job.in_features;
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          int32_t dot = 0;
          if (kquant) {
            kx8_block(group + b / 8 * bytes, base, lane, b % 8, codes, sc, d, m);
            for (int h = 0; h < 2; ++h) {
              int32_t half = 0;
              for (int i = 16 * h; i < 16 * h + 16; ++i) half += codes[i] * xq[b * 32 + i];
              dot += sc[h] * half;
            }
          } else {
            x8_block(group + b * bytes, base, lane, codes, d, m);
            for (int i = 0; i < 32; ++i) dot += codes[i] * xq[b * 32 + i];
          }
          acc = std::fma(float(dot), d * a.d[t * nb + b], acc);
          if (offsets) acc = std::fma(m, a.s[t * nb + b], acc);
        }
        job.y[t * job.out_features + 8 * g + lane] = acc;
      }
  }
}

void rows(const Job& job, int64_t r0, int64_t r1) {
  const Act& a = *job.act;
  const int64_t nb = job.in_features / 32;
  const bool unpacked = krow_type(job.qtype);
  const int kind = code_kind(job.qtype);
  const bool offsets = kind != SIGNED;
  KRow kr(unpacked ? job.in_features : 0);
  const int64_t bytes = block_bytes(job.qtype), nblocks = job.in_features / block_elements(job.qtype);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = job.blocks + r * job.pitch;
    if (unpacked)
      for (int64_t s = 0; s < nblocks; ++s) unpack_block(job.qtype, row + s * bytes, kr, s);
    for (int64_t t = 0; t < a.n; ++t) {
      const int8_t* xq = a.q + t * job.in_features;
      const float* xd = a.d + t * nb;
      float v;
      if (unpacked)
        v = dot_krow(kr, nb, kind, offsets, xq, xd, a.s16 + t * nb * 2);
      else if (job.qtype == Q8_0)
        v = dot_q8_0(row, nb, xq, xd);
      else
        v = dot_q4(row, nb, job.qtype == Q4_1, xq, xd, a.s + t * nb);
      job.y[t * job.out_features + r] = v;
    }
  }
}

}  // namespace scalar

// ---------------------------------------------------------------------------------------------------
// The code path in use, from the CPU's flags (set_isa forces a lesser one): the `amx` path is the VNNI build with
// its prompts through the tiles (ggml_spans.h reads current_isa).
enum Isa { SCALAR = 0, AVX2 = 1, VNNI = 2, AMX = 3 };
const char* isa_names[] = {"scalar", "avx2", "avx512vnni", "amx"};

// AMX-TILE and AMX-INT8 (CPUID leaf 7, EDX bits 24 and 25), and Linux's leave to use their state (tile data is
// off until a process asks for it).
bool amx_usable() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25))) return false;
#ifdef __linux__
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return false;
#endif
}

int detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return amx_usable() ? AMX : VNNI;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
  return SCALAR;
}

const int best_isa = detect_isa();
int current_isa = best_isa;

// SIMD paths: one body, compiled for AVX2 and for AVX-512 VNNI (256-bit registers, dpbusd).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "ggml_simd.h"
#include "ggml_spans.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
#define GGML_VNNI
#include "ggml_simd.h"
#include "ggml_amx.h"
#include "ggml_spans.h"
#undef GGML_VNNI
}  // namespace vnni
#pragma GCC pop_options

using RowsFn = void (*)(const Job&, int64_t, int64_t);

RowsFn rows_fn(int64_t qtype) {
  const bool x8 = qtype & X8;
  switch (current_isa) {
    case AMX:
    case VNNI: return x8 ? vnni::x8_rows : vnni::rows;
    case AVX2: return x8 ? avx2::x8_rows : avx2::rows;
    default: return x8 ? scalar::x8_rows : scalar::rows;
  }
}

// ---------------------------------------------------------------------------------------------------

// Output rows of a weight's blocks (a tensor row holds eight of them in the X8 layout).
int64_t out_rows(const at::Tensor& blocks, int64_t qtype) { return blocks.size(0) * (qtype & X8 ? 8 : 1); }

void check_inputs(const at::Tensor& blocks, int64_t qtype, int64_t in_features) {
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 2, "rungen_ggml: blocks must be uint8 [rows, bytes]");
  TORCH_CHECK(!(qtype & X8) || interleaved_type(qtype & ~X8), "rungen_ggml: only Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
              "Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS rows are interleaved");
  TORCH_CHECK(in_features % block_elements(qtype) == 0, "rungen_ggml: in_features ", in_features,
              " is not a multiple of the block size");
  const int64_t bytes = in_features / block_elements(qtype) * (qtype & X8 ? x8_bytes(qtype & ~X8) : block_bytes(qtype));
  TORCH_CHECK(blocks.size(1) == bytes, "rungen_ggml: blocks have ", blocks.size(1), " bytes a row, expected ", bytes);
  TORCH_CHECK(blocks.stride(1) == 1, "rungen_ggml: each row of blocks must be contiguous");
  TORCH_CHECK(blocks.device().is_cpu(), "rungen_ggml: blocks must be on the CPU");
}

// Quantizes x [n, K] to int8 per block of 32: d = max|x| / 127, q = round(x / d) (ties to even). The codes
// and scales live in one buffer per calling thread, reused from call to call (no allocation a step).
struct QuantizedX {
  std::vector<float> buffer;
  Act act;
};

const Act& quantize_activations(const float* xp, int64_t n, int64_t k) {
  static thread_local QuantizedX r;
  const int64_t nb = k / 32;
  // d, s, s16 (2), s4, sum (int32), sum16, high16 and off16 (int32, 2 each), then the codes, which start on a cache
  // line (64 bytes), and on the AVX2 path the biased codes u, from the next line after them.
  const bool biased = current_isa == AVX2;
  const size_t floats = size_t(n * nb * 12) + (biased ? 2 : 1) * (size_t(n * k + 3) / 4 + 16);
  if (r.buffer.size() < floats) r.buffer.resize(floats);
  const auto line = [](float* p) { return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63)); };
  float* d = r.buffer.data();
  float* s = d + n * nb;
  float* s16 = s + n * nb;
  float* s4 = s16 + 2 * n * nb;
  int32_t* off128 = reinterpret_cast<int32_t*>(s4 + n * nb);
  int32_t* sum16 = off128 + n * nb;
  int32_t* high16 = sum16 + 2 * n * nb;
  int32_t* off16 = high16 + 2 * n * nb;
  int8_t* q = reinterpret_cast<int8_t*>(line(s4 + 8 * n * nb));
  uint8_t* u = biased ? reinterpret_cast<uint8_t*>(line(reinterpret_cast<float*>(q + n * k))) : nullptr;
  const auto blocks_fn = current_isa >= VNNI ? vnni::quantize_blocks
                        : current_isa == AVX2 ? avx2::quantize_blocks
                                              : scalar::quantize_blocks;
  at::parallel_for(0, n * nb, 128, [&](int64_t b0, int64_t b1) {
    blocks_fn(xp, b0, b1, q, u, d, s, s16, off128, sum16, high16, off16);
  });
  for (int64_t g = 0; g < n / 4; ++g)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t i = 0; i < 4; ++i) s4[(g * nb + b) * 4 + i] = s[(4 * g + i) * nb + b];
  r.act = Act{n, q, d, s, s16, s4, off128, sum16, high16, off16, u};
  return r.act;
}

// y [n, width] = x [n, K] times each part's rows (blocks[i] of type qtypes[i]) side by side, part i's outputs in
// the columns after part i - 1's: projections of one input whose weights differ in block type (q/k/v, gate/up
// of a Q4_K_M file) as one product. The activations are quantized once for all parts, and one parallel loop
// covers every part's rows. Job.out_features is y's row stride, so a part writes straight into its own columns;
// each row is the kernel's own arithmetic, so its bits are those of the part multiplied alone. A part of zero
// rows (the callers' padding to a fixed number of parts) costs nothing.
void products_into(const float* x, int64_t n, at::TensorList blocks, at::IntArrayRef qtypes, int64_t in_features,
                   float* y) {
  int64_t width = 0;
  for (size_t i = 0; i < blocks.size(); ++i) width += out_rows(blocks[i], qtypes[i]);
  std::vector<Job> jobs;
  std::vector<RowsFn> fns;
  std::vector<int64_t> starts{0};  // where each job's tasks (tensor rows) start in the one loop
  int64_t column = 0, per = 1;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int64_t out = out_rows(blocks[i], qtypes[i]);
    if (out > 0) {
      jobs.push_back(Job{nullptr, blocks[i].data_ptr<uint8_t>(), blocks[i].stride(0), qtypes[i], in_features, width,
                         y + column});
      fns.push_back(rows_fn(qtypes[i]));
      starts.push_back(starts.back() + blocks[i].size(0));
      if (qtypes[i] & X8) per = 8;  // X8 tasks are groups of eight rows
    }
    column += out;
  }
  if (n == 0 || jobs.empty()) return;
  const Act& act = quantize_activations(x, n, in_features);
  for (Job& job : jobs) job.act = &act;
  // Enough rows a task that a thread's share is worth waking it for (about 64k multiply-adds).
  const int64_t grain = std::max<int64_t>(1, 65536 / (in_features * n * per));
  at::parallel_for(0, starts.back(), grain, [&](int64_t r0, int64_t r1) {
    for (size_t j = 0; j < jobs.size(); ++j) {
      const int64_t a = std::max(r0, starts[j]), b = std::min(r1, starts[j + 1]);
      if (a < b) fns[j](jobs[j], a - starts[j], b - starts[j]);
    }
  });
}

// y [n, out rows] = x [n, K] times the blocks' rows, by the integer kernels (y may be any buffer of that size).
void product_into(const float* x, int64_t n, const at::Tensor& blocks, int64_t qtype, int64_t in_features, float* y) {
  products_into(x, n, at::TensorList(blocks), at::IntArrayRef(qtype), in_features, y);
}

at::Tensor mm_int(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t in_features) {
  check_inputs(blocks, qtype, in_features);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == in_features, "rungen_ggml: x must be [n, ", in_features, "]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), out_rows(blocks, qtype)}, x.options());
  product_into(x.data_ptr<float>(), x.size(0), blocks, qtype, in_features, y.data_ptr<float>());
  return y;
}

void dequantize_rows(const uint8_t* blocks, int64_t pitch, int64_t qtype, int64_t k, int64_t r0, int64_t r1,
                     float* out) {
  if (qtype & X8) {
    const int64_t base = qtype & ~X8, bytes = x8_bytes(base);
    const bool offsets = x8_offsets(base);
    int32_t codes[32], sc[2];
    float d, m;
    for (int64_t r = r0; r < r1; ++r) {
      float* o = out + (r - r0) * k;
      for (int64_t b = 0; b < k / 32; ++b) {
        if (x8_super(base)) {
          // As the row-major path (and the gguf package): (d * scale) * code + offset.
          kx8_block(blocks + (r / 8) * pitch + b / 8 * bytes, base, r % 8, b % 8, codes, sc, d, m);
          for (int i = 0; i < 32; ++i) {
            const float w = (d * float(sc[i / 16])) * float(codes[i]);
            o[b * 32 + i] = offsets ? w + m : w;
          }
          continue;
        }
        x8_block(blocks + (r / 8) * pitch + b * bytes, base, r % 8, codes, d, m);
        for (int i = 0; i < 32; ++i) o[b * 32 + i] = offsets ? d * float(codes[i]) + m : d * float(codes[i]);
      }
    }
    return;
  }
  const int64_t bytes = block_bytes(qtype), elements = block_elements(qtype);
  const bool unpacked = krow_type(qtype);
  const int kind = code_kind(qtype), center = code_center(qtype);
  KRow kr(unpacked ? k : 0);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = blocks + r * pitch;
    float* o = out + (r - r0) * k;
    if (unpacked) {
      for (int64_t s = 0; s < k / elements; ++s) scalar::unpack_block(qtype, row + s * bytes, kr, s);
      // As the gguf package computes it: (d * scale) * code + offset, or for centred and signed codes
      // (d * scale) * (code - center) (sc16 is 1 where a type has no integer scales: the product is exact).
      for (int64_t i = 0; i < k; ++i) {
        const int64_t j16 = i / 16;
        const float w = kr.wd[i / 32] * float(kr.sc16[j16]);
        if (kind == SIGNED)
          o[i] = w * float(int8_t(kr.codes[i]));
        else if (center)
          o[i] = w * float(int32_t(kr.codes[i]) - center);
        else
          o[i] = w * float(kr.codes[i]) + kr.wm[j16];
      }
      continue;
    }
    for (int64_t b = 0; b < k / 32; ++b) {
      const uint8_t* p = row + b * bytes;
      const float d = half_bits_to_float(p);
      if (qtype == Q8_0) {
        const int8_t* q = (const int8_t*)(p + 2);
        for (int i = 0; i < 32; ++i) o[b * 32 + i] = d * float(q[i]);
        continue;
      }
      const float m = qtype == Q4_1 ? half_bits_to_float(p + 2) : -8.f * d;
      const uint8_t* qs = p + bytes - 16;
      for (int i = 0; i < 16; ++i) {
        o[b * 32 + i] = d * float(qs[i] & 0x0F) + m;
        o[b * 32 + 16 + i] = d * float(qs[i] >> 4) + m;
      }
    }
  }
}

at::Tensor dequantize(const at::Tensor& blocks, int64_t qtype, int64_t in_features) {
  check_inputs(blocks, qtype, in_features);
  const int64_t out = out_rows(blocks, qtype);
  at::Tensor w = at::empty({out, in_features}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, out, std::max<int64_t>(1, 16384 / in_features), [&](int64_t r0, int64_t r1) {
    dequantize_rows(bp, blocks.stride(0), qtype, in_features, r0, r1, wp + r0 * in_features);
  });
  return w;
}

// Tokens from which a product goes through de-quantized float tiles and torch's matmul rather than the
// integer kernel. Off by default: the tiles are slower than the interleaved integer kernel at every size
// measured (docs/kernels.md), and their float sums come in another order, while a token's product must not
// depend on how many others share the call (a greedy sequence would change with its batch). Settable for
// benchmarks (benchmarks.perplexity's unrounded activations).
int64_t tile_threshold = std::numeric_limits<int64_t>::max();

at::Tensor mm_tiled(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t in_features) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t out = out_rows(blocks, qtype);
  // y.T = W @ x.T, a tile of W's rows at a time (about 4 MB of float32), each tile's rows of y.T contiguous.
  at::Tensor yt = at::empty({out, x.size(0)}, x.options());
  const int64_t tile = std::max<int64_t>(16, (int64_t(1) << 20) / in_features);
  at::Tensor w = at::empty({std::min(tile, out), in_features}, x.options());
  const at::Tensor xt = x.t();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  for (int64_t r0 = 0; r0 < out; r0 += tile) {
    const int64_t r1 = std::min(out, r0 + tile);
    float* wp = w.data_ptr<float>();
    at::parallel_for(r0, r1, std::max<int64_t>(1, 16384 / in_features), [&](int64_t a, int64_t b) {
      dequantize_rows(bp, blocks.stride(0), qtype, in_features, a, b, wp + (a - r0) * in_features);
    });
    at::Tensor dst = yt.narrow(0, r0, r1 - r0);
    at::mm_out(dst, w.narrow(0, 0, r1 - r0), xt);
  }
  return yt.t().contiguous();
}

// x [n, K] with each block of 32 rounded as quantize_activations rounds it (d = max|x| / 127, q = round(x / d)),
// given back as q * d in float32.
at::Tensor rounded_activations(const at::Tensor& x_in) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor r = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* rp = r.data_ptr<float>();
  at::parallel_for(0, x.numel() / 32, 128, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* v = xp + b * 32;
      float* o = rp + b * 32;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float scale = amax / 127.f;
      const float inv = scale != 0.f ? 1.f / scale : 0.f;
      for (int i = 0; i < 32; ++i) o[i] = float(int32_t(std::nearbyint(v[i] * inv))) * scale;
    }
  });
  return r;
}

// x [n, K] (float32, contiguous) times the parts' rows side by side (products_into) into y, a buffer of
// [n, all their rows]: the integer kernel, or from tile_threshold tokens float tiles, their activations rounded as
// the integer kernel rounds them (a token's product is then the same, up to the order of float sums, alone, in a
// batch of any size and in a prompt, so a greedy sequence does not change with the batch it decodes in).
void mm_parts_into(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef qtypes, int64_t in_features,
                   float* y) {
  TORCH_CHECK(blocks.size() == qtypes.size() && !blocks.empty(), "rungen_ggml: one type for each part's blocks");
  int64_t width = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    check_inputs(blocks[i], qtypes[i], in_features);
    width += out_rows(blocks[i], qtypes[i]);
  }
  const int64_t n = x.size(0);
  if (n >= tile_threshold) {
    const at::Tensor rounded = rounded_activations(x);
    int64_t column = 0;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const int64_t out = out_rows(blocks[i], qtypes[i]);
      if (out == 0) continue;
      const at::Tensor r = mm_tiled(rounded, blocks[i], qtypes[i], in_features);
      const float* rp = r.data_ptr<float>();
      for (int64_t t = 0; t < n; ++t) std::memcpy(y + t * width + column, rp + t * out, out * sizeof(float));
      column += out;
    }
    return;
  }
  products_into(x.data_ptr<float>(), n, blocks, qtypes, in_features, y);
}

void mm_into(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t in_features, float* y) {
  mm_parts_into(x, at::TensorList(blocks), at::IntArrayRef(qtype), in_features, y);
}

at::Tensor mm(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t in_features) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == in_features, "rungen_ggml: x must be [n, ", in_features, "]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), out_rows(blocks, qtype)}, x.options());
  mm_into(x, blocks, qtype, in_features, y.data_ptr<float>());
  return y;
}

// Output features of parts side by side.
int64_t parts_rows(at::TensorList blocks, at::IntArrayRef qtypes) {
  TORCH_CHECK(blocks.size() == qtypes.size(), "rungen_ggml: one type for each part's blocks");
  int64_t rows = 0;
  for (size_t i = 0; i < blocks.size(); ++i) rows += out_rows(blocks[i], qtypes[i]);
  return rows;
}

// x [n, K] times the parts' rows side by side: [n, all their rows] (mm_parts_into).
at::Tensor mm_parts(const at::Tensor& x_in, at::TensorList blocks, at::IntArrayRef qtypes, int64_t in_features) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == in_features, "rungen_ggml: x must be [n, ", in_features, "]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), parts_rows(blocks, qtypes)}, x.options());
  mm_parts_into(x, blocks, qtypes, in_features, y.data_ptr<float>());
  return y;
}

// The small steps of a llama decoder layer around its matmuls. At one token a step each is a few hundred
// floats, and as torch operators each costs several calls of 3-5 microseconds (dispatch, allocation);
// these take one call each. Plain loops: the work is far below what vector code would save.

// RMSNorm as transformers' LlamaRMSNorm: x / sqrt(mean(x^2) + eps) * weight, over the last dimension.
inline void rms_row(const float* v, const float* wp, double eps, int64_t d, float* y) {
  float sum = 0.f;
  for (int64_t i = 0; i < d; ++i) sum += v[i] * v[i];
  const float inv = 1.f / std::sqrt(sum / float(d) + float(eps));
  for (int64_t i = 0; i < d; ++i) y[i] = wp[i] * (v[i] * inv);
}

void rms_norm_rows(const float* xp, const float* wp, double eps, int64_t rows, int64_t d, float* yp) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_row(xp + r * d, wp, eps, d, yp + r * d);
  });
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), weight = weight_in.to(at::kFloat).contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(weight.numel() == d, "rungen_ggml: rms_norm weight must have ", d, " values");
  at::Tensor y = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), eps, rows, d, y.data_ptr<float>());
  return y;
}

// The fused q/k/v product [b, t, (heads + 2 kv_heads) * head_dim] split into q [b, heads, t, head_dim],
// k and v [b, kv_heads, t, head_dim], q and k rotated as transformers' apply_rotary_pos_emb rotates them
// (rotate_half: the first half of the rotated part pairs with the second). cos/sin [.., rot]: a head's first rot
// values are rotated, the rest pass as they are (partial rotary, phi3's partial_rotary_factor); rot = head_dim
// for llama. Where a family normalizes each head of q and k before the rotation (qwen3's q_norm/k_norm: an
// RMSNorm over head_dim), HeadNorms carries their weights; none for llama, whose arithmetic is then unchanged.
// Where rope_rows writes keys or values: [b, kv_heads, positions, head_dim] with these strides (elements), from
// its position 0 (a cache's buffer from the first free position, or a tensor of its own).
struct Rows4 {
  float* p;
  int64_t batch, head, token;
};

struct HeadNorms {
  const float* q = nullptr;  // [head_dim] weights, or none
  const float* k = nullptr;
  double eps = 0.;
};

void rope_rows(const float* src, const float* cp, const float* sp, bool shared, int64_t b, int64_t t, int64_t heads,
               int64_t kv_heads, int64_t dim, int64_t rot, float* qp, const Rows4& k, const Rows4& v,
               const HeadNorms& norms = HeadNorms{}) {
  const int64_t all = heads + 2 * kv_heads, half = rot / 2;
  at::parallel_for(0, b * t, std::max<int64_t>(1, 4096 / (all * dim)), [&](int64_t p0, int64_t p1) {
    std::vector<float> normed(norms.q || norms.k ? dim : 0);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t batch = p / t, token = p % t;
      const float* row = src + p * all * dim;
      const float* c = cp + (shared ? token : p) * rot;
      const float* s = sp + (shared ? token : p) * rot;
      for (int64_t h = 0; h < all; ++h) {
        const float* x = row + h * dim;
        float* out;
        const float* norm;
        if (h < heads) {
          out = qp + ((batch * heads + h) * t + token) * dim;
          norm = norms.q;
        } else if (h < heads + kv_heads) {
          out = k.p + batch * k.batch + (h - heads) * k.head + token * k.token;
          norm = norms.k;
        } else {
          std::memcpy(v.p + batch * v.batch + (h - heads - kv_heads) * v.head + token * v.token, x,
                      dim * sizeof(float));
          continue;
        }
        if (norm) {
          rms_row(x, norm, norms.eps, dim, normed.data());
          x = normed.data();
        }
        for (int64_t i = 0; i < half; ++i) {
          out[i] = x[i] * c[i] - x[i + half] * s[i];
          out[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
        }
        if (rot < dim) std::memcpy(out + rot, x + rot, (dim - rot) * sizeof(float));
      }
    }
  });
}

// cos/sin per sequence [b, t, rot], or one [1, t, rot] for all (positions without padding): whether shared.
bool rope_shared(const at::Tensor& cos, const at::Tensor& sin, int64_t b, int64_t t, int64_t rot) {
  const bool shared = cos.numel() == t * rot;
  TORCH_CHECK((shared || cos.numel() == b * t * rot) && sin.numel() == cos.numel(), "rungen_ggml: cos/sin must be "
              "[b or 1, t, ", rot, "]");
  return shared;
}

// The rotated width of cos (its last dimension): even, at most head_dim.
int64_t rotary_width(const at::Tensor& cos, int64_t dim) {
  const int64_t rot = cos.dim() ? cos.size(-1) : 0;
  TORCH_CHECK(rot > 0 && rot % 2 == 0 && rot <= dim, "rungen_ggml: cos/sin's last dimension must be even and at "
              "most head_dim (", dim, "), not ", rot);
  return rot;
}

// A per-head norm's weights as float32 [head_dim], held by `held` while they are read.
const float* head_norm(const c10::optional<at::Tensor>& weight, int64_t dim, at::Tensor& held) {
  if (!weight.has_value()) return nullptr;
  held = weight->to(at::kFloat).contiguous();
  TORCH_CHECK(held.numel() == dim, "rungen_ggml: a per-head norm must have head_dim (", dim, ") weights");
  return held.data_ptr<float>();
}

std::vector<at::Tensor> rope_split(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                   int64_t heads, int64_t kv_heads, const c10::optional<at::Tensor>& q_norm,
                                   const c10::optional<at::Tensor>& k_norm, double norm_eps) {
  const at::Tensor qkv = qkv_in.to(at::kFloat).contiguous();
  const at::Tensor cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  TORCH_CHECK(qkv.dim() == 3, "rungen_ggml: qkv must be [batch, tokens, features]");
  const int64_t b = qkv.size(0), t = qkv.size(1), all = heads + 2 * kv_heads;
  TORCH_CHECK(qkv.size(2) % all == 0, "rungen_ggml: qkv features are not (heads + 2 kv_heads) * head_dim");
  const int64_t dim = qkv.size(2) / all, rot = rotary_width(cos, dim);
  const bool shared = rope_shared(cos, sin, b, t, rot);
  at::Tensor held_q, held_k;
  const HeadNorms norms{head_norm(q_norm, dim, held_q), head_norm(k_norm, dim, held_k), norm_eps};
  at::Tensor q = at::empty({b, heads, t, dim}, qkv.options());
  at::Tensor k = at::empty({b, kv_heads, t, dim}, qkv.options());
  at::Tensor v = at::empty({b, kv_heads, t, dim}, qkv.options());
  rope_rows(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), shared, b, t, heads, kv_heads, dim,
            rot, q.data_ptr<float>(), Rows4{k.data_ptr<float>(), k.stride(0), k.stride(1), k.stride(2)},
            Rows4{v.data_ptr<float>(), v.stride(0), v.stride(1), v.stride(2)}, norms);
  return {q, k, v};
}

// Attention of t query tokens a sequence over T keys (the cached ones and their own): q [b, heads, t, dim],
// k and v [b, kv_heads, T, dim] (grouped heads: query head h reads kv head h / (heads / kv_heads)). mask None:
// causal, query i sees keys 0 .. T - t + i; else bool [b, 1, t, T] (true: attend) or additive float of that
// shape (0 attends, a large negative value does not). Out [b, t, heads * dim], as transformers' attention
// returns it reshaped. softcap > 0 (gemma2's attn_logit_softcapping) bounds each score to tanh(s / cap) * cap
// before the mask is added, as transformers' gemma2 eager attention does; 0: none. window > 0 (a sliding-window
// layer's): query i, at cache position T - t + i, also skips the keys at or before that position - window, on top
// of the mask (transformers' sliding_window_overlay; the cache keeps every position); 0: none.
//
// Each query's keys are visited in order and the masked ones skipped, so a sequence's result does not depend on
// the padding beside it: a prompt alone and the same prompt left-padded in a batch give the same bits (torch's
// attention kernels block the keys differently once padding shifts them, which moves the last bits). A query
// that sees no key gives zeros, where softmax would give NaN.

// What ggml_attend.h's attend_queries reads: the tensors of attend above, their shapes and strides, its options.
struct AttendJob {
  const float *q, *k, *v;
  const bool* mask_bool;
  const float* mask_add;
  float* out;
  int64_t heads, t, dim, kv, T;
  int64_t k_batch, k_head, k_key, v_batch, v_head, v_key;  // strides (elements) of k and v
  float scale, softcap;  // softcap 0: none
  int64_t window;        // > 0: query i sees only the keys within `window` positions of its own (0: all)
  bool masked;
};

// Queries are taken in blocks of up to ATTEND_BLOCK that read the same keys and values (one sequence, one kv
// head: its grouped query heads, each over the tokens): a group of key or value rows, once loaded, serves the
// whole block from L1, where a query at a time streamed every row from L2 again (at a thousand keys that
// streaming, not the arithmetic, bounded a prompt's attention). Each query's arithmetic is unchanged by its
// block: its scores key by key (dot64x8 and dot64 give the same bits), its exponentials and their sum in order,
// its weighted values added key after key into one chain (kept in memory between groups of keys).
constexpr int64_t ATTEND_BLOCK = 16;
constexpr int64_t VALUE_BLOCK = 32;  // keys whose value rows stay in L1 while the block's queries add them

// The attention's and the gates' loops (ggml_attend.h), compiled for AVX-512 (two queries' scores and sixteen value
// sums a 512-bit register), for AVX2 and for the baseline; the code path in use picks one (scalar: the baseline),
// so set_isa reaches them as it reaches the products.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f")
namespace avx512 {
#define ATTEND_WIDE
#include "ggml_attend.h"
#undef ATTEND_WIDE
}  // namespace avx512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "ggml_attend.h"
}  // namespace avx2
#pragma GCC pop_options
namespace scalar {
#include "ggml_attend.h"
}  // namespace scalar

using AttendFn = void (*)(const AttendJob&, int64_t, int64_t, float*);
AttendFn attend_fn() {
  if (current_isa >= VNNI) return avx512::attend_queries;
  return current_isa >= AVX2 ? avx2::attend_queries : scalar::attend_queries;
}

using GateFn = void (*)(const float*, int64_t, int64_t, int64_t, float*);
GateFn gelu_fn() { return current_isa >= AVX2 ? avx2::gelu_rows : scalar::gelu_rows; }
GateFn silu_fn() { return current_isa >= AVX2 ? avx2::silu_rows : scalar::silu_rows; }

// A gate (silu_fn's or gelu_fn's) over the fused gate/up product [rows, 2 * f] (gate first) into [rows, f], the rows
// spread over the threads, a task about `work` values (the GELU's tanh costs more a value than the SiLU's exp).
void gate_mul_rows(GateFn fn, int64_t work, const float* gp, int64_t rows, int64_t f, float* yp) {
  at::parallel_for(0, rows, std::max<int64_t>(1, work / std::max<int64_t>(f, 1)),
                   [&](int64_t r0, int64_t r1) { fn(gp, r0, r1, f, yp); });
}

constexpr int64_t SILU_WORK = 16384, GELU_WORK = 65536;

at::Tensor gate_mul(const at::Tensor& gu_in, GateFn fn, int64_t work) {
  const at::Tensor gu = gu_in.to(at::kFloat).contiguous();
  const int64_t f = gu.size(-1) / 2, rows = gu.numel() / std::max<int64_t>(2 * f, 1);
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = f;
  at::Tensor y = at::empty(shape, gu.options());
  gate_mul_rows(fn, work, gu.data_ptr<float>(), rows, f, y.data_ptr<float>());
  return y;
}

at::Tensor silu_mul(const at::Tensor& gu) { return gate_mul(gu, silu_fn(), SILU_WORK); }

at::Tensor gelu_tanh_mul(const at::Tensor& gu) { return gate_mul(gu, gelu_fn(), GELU_WORK); }

// attend's mask as the kernel reads it: bool or additive float [b, 1, t, T], or none (causal).
struct AttendMask {
  at::Tensor held;
  const bool* bools = nullptr;
  const float* adds = nullptr;
};

AttendMask attend_mask(const c10::optional<at::Tensor>& mask_in, int64_t b, int64_t t, int64_t T) {
  AttendMask m;
  if (!mask_in.has_value()) return m;
  const bool additive = mask_in->is_floating_point();
  m.held = additive ? mask_in->to(at::kFloat).contiguous() : mask_in->to(at::kBool).contiguous();
  TORCH_CHECK(m.held.numel() == b * t * T, "rungen_ggml: attend's mask must be [b, 1, ", t, ", ", T, "]");
  if (additive)
    m.adds = m.held.data_ptr<float>();
  else
    m.bools = m.held.data_ptr<bool>();
  return m;
}

// attend of q [b, heads, t, dim] (float32, contiguous) over k, v [b, kv, T, dim] (float32, last dimension
// contiguous: read in place), into out [b, t, heads * dim].
void attend_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttendMask& mask, double scale,
                 double softcap, int64_t window, float* op) {
  const int64_t b = q.size(0), heads = q.size(1), t = q.size(2), dim = q.size(3), kv = k.size(1), T = k.size(2);
  TORCH_CHECK(k.size(0) == b && k.size(3) == dim && kv > 0 && heads % kv == 0 && T >= t,
              "rungen_ggml: attend's shapes differ");
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const bool masked = mask.bools != nullptr || mask.adds != nullptr;
  at::parallel_for(0, b * heads * t, std::max<int64_t>(1, 32768 / std::max<int64_t>(T * dim, 1)),
                   [&](int64_t p0, int64_t p1) {
    std::vector<float> w(ATTEND_BLOCK * T);
    attend_fn()(AttendJob{qp, kp, vp, mask.bools, mask.adds, op, heads, t, dim, kv, T, k.stride(0), k.stride(1),
                             k.stride(2), v.stride(0), v.stride(1), v.stride(2), float(scale), float(softcap),
                             window, masked}, p0, p1,
                   w.data());
  });
}

at::Tensor attend(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                  const c10::optional<at::Tensor>& mask_in, double scale, double softcap, int64_t window) {
  // k and v may be views of a cache with room to grow (strided over keys, heads and batch): read in place.
  const auto in_place = [](const at::Tensor& x) {
    return x.scalar_type() == at::kFloat && x.dim() == 4 && x.stride(3) == 1 ? x : x.to(at::kFloat).contiguous();
  };
  const at::Tensor q = q_in.to(at::kFloat).contiguous(), k = in_place(k_in), v = in_place(v_in);
  TORCH_CHECK(softcap >= 0.0, "rungen_ggml: attend's softcap must be positive, or 0 for none");
  TORCH_CHECK(window >= 0, "rungen_ggml: attend's window must be positive, or 0 for none");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(),
              "rungen_ggml: attend takes q [b, h, t, d] and k, v [b, kv, T, d]");
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1) * q.size(3)}, q.options());
  attend_into(q, k, v, attend_mask(mask_in, q.size(0), q.size(2), k.size(2)), scale, softcap, window,
              out.data_ptr<float>());
  return out;
}

// A llama decoder layer in two calls, around the cache update that stays transformers': at one token a step
// each of its dozen operators costs more in dispatch and Python than in arithmetic. The same functions as the
// separate operators, in the same order: the bits are theirs.
//
// The fused products (q/k/v, gate/up) come as parts side by side (mm_parts): the whole weight as one part
// where the projections share a block type, else each run of one type its own part.
//
// attention_in: q, k, v of rms_norm(hidden) (the fused q/k/v product, its bias if any, q and k normalized
// per head where the family does, rotated).
std::vector<at::Tensor> attention_in(const at::Tensor& hidden, const at::Tensor& norm_weight, double eps,
                                     at::TensorList qkv_blocks, at::IntArrayRef qkv_qtypes,
                                     const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& cos,
                                     const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                                     const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                                     double norm_eps) {
  TORCH_CHECK(hidden.dim() == 3, "rungen_ggml: hidden must be [batch, tokens, features]");
  const int64_t b = hidden.size(0), t = hidden.size(1), features = hidden.size(2);
  const at::Tensor x = rms_norm(hidden, norm_weight, eps);
  at::Tensor qkv = mm_parts(x.view({b * t, features}), qkv_blocks, qkv_qtypes, features);
  if (qkv_bias.has_value()) qkv.add_(*qkv_bias);
  return rope_split(qkv.view({b, t, qkv.size(1)}), cos, sin, heads, kv_heads, q_norm, k_norm, norm_eps);
}

// attention_out_mlp: the rest of the layer, k and v the whole cache: h = hidden + o(attend(q, k, v)), then
// h + down(silu(gate) * up) of rms_norm(h).
at::Tensor attention_out_mlp(const at::Tensor& hidden, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const c10::optional<at::Tensor>& mask, double scale, const at::Tensor& o_blocks,
                             int64_t o_qtype, const at::Tensor& norm_weight, double eps,
                             at::TensorList gate_up_blocks, at::IntArrayRef gate_up_qtypes,
                             const at::Tensor& down_blocks,
                             int64_t down_qtype) {
  TORCH_CHECK(hidden.dim() == 3, "rungen_ggml: hidden must be [batch, tokens, features]");
  const int64_t b = hidden.size(0), t = hidden.size(1), features = hidden.size(2);
  const at::Tensor attended = attend(q, k, v, mask, scale, 0.0, 0);
  at::Tensor h = mm(attended.view({b * t, attended.size(2)}), o_blocks, o_qtype, attended.size(2));
  h.add_(hidden.to(at::kFloat).reshape({b * t, features}));  // hidden + o: a float sum is the same either way
  const at::Tensor x = rms_norm(h, norm_weight, eps);
  const at::Tensor gate_up = mm_parts(x, gate_up_blocks, gate_up_qtypes, features);
  const at::Tensor act = silu_mul(gate_up);
  at::Tensor out = mm(act, down_blocks, down_qtype, act.size(1));
  out.add_(h);
  return out.view({b, t, features});
}

// Every decoder layer of a model in one call (the same functions as attention_in and attention_out_mlp, in the
// same order: the same bits), the cache's keys and values written in place: k_buffers[i] and v_buffers[i] are
// layer i's [b, kv_heads, capacity, head_dim] with `length` positions filled and room for this call's tokens.
// qkv: QKV_PARTS parts a layer, gate_up: GATE_UP_PARTS (mm_parts; a layer with fewer passes empty ones: zero
// rows cost nothing); qtypes: seven a layer (the q/k/v parts', o, the gate/up parts', down). q_norms/k_norms:
// each layer's per-head norms of q and k (None for llama; their epsilon is the layers' `eps`). Returns the hidden
// states and each layer's filled keys and values (views of the buffers).
//
// What gemma's layers add, each list empty where no layer has it: attention_out_norms/mlp_out_norms, each layer's
// norm of the attention's and of the MLP's output before its residual sum (None: none); windows, each layer's
// sliding window (0: it attends to every key; the kernel masks what lies outside it, whatever `mask` masks
// besides); local_cos/local_sin, the rotation of the windowed layers where it differs (gemma3's local rope
// base); softcap, the attention logits' soft cap (gemma2; 0: none); gelu, a GELU-tanh gate instead of SiLU.
// Gemma's norms multiply by 1 + weight: the caller passes that sum as the weight.
//
// At one token a step the layers' arithmetic is a few milliseconds, and a torch operator inside them (an
// allocation, a view, a copy) costs a microsecond or more: the call allocates its working buffers once, the
// rotation writes keys and values straight into the cache, and the residual sums are plain loops (hidden + o and
// then + down: a float sum is the same in either order, so the bits are the separate operators').
constexpr size_t QKV_PARTS = 3, GATE_UP_PARTS = 2, LAYER_TYPES = QKV_PARTS + 1 + GATE_UP_PARTS + 1;

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> decoder_stack(
    const at::Tensor& hidden, const at::Tensor& cos_in, const at::Tensor& sin_in,
    const c10::optional<at::Tensor>& mask, at::TensorList input_norms, at::TensorList qkv,
    const c10::List<c10::optional<at::Tensor>>& qkv_bias, const c10::List<c10::optional<at::Tensor>>& q_norms,
    const c10::List<c10::optional<at::Tensor>>& k_norms, at::TensorList o, at::TensorList post_norms,
    at::TensorList gate_up, at::TensorList down, at::IntArrayRef qtypes, double eps, int64_t heads, int64_t kv_heads,
    double scale, at::TensorList k_buffers, at::TensorList v_buffers, int64_t length,
    const c10::List<c10::optional<at::Tensor>>& attention_out_norms,
    const c10::List<c10::optional<at::Tensor>>& mlp_out_norms, at::IntArrayRef windows,
    const c10::optional<at::Tensor>& local_cos_in, const c10::optional<at::Tensor>& local_sin_in, double softcap,
    bool gelu) {
  const size_t layers = o.size();
  const auto per_layer = [&](size_t count) { return count == 0 || count == layers; };
  TORCH_CHECK(per_layer(attention_out_norms.size()) && per_layer(mlp_out_norms.size()) && per_layer(windows.size()),
              "rungen_ggml: decoder_stack's per-layer lists hold one entry a layer, or none");
  TORCH_CHECK(local_cos_in.has_value() == local_sin_in.has_value() && softcap >= 0.0,
              "rungen_ggml: decoder_stack takes local cos and sin together, and a softcap >= 0");
  TORCH_CHECK(input_norms.size() == layers && qkv_bias.size() == layers && q_norms.size() == layers &&
              k_norms.size() == layers && qkv.size() == QKV_PARTS * layers &&
              post_norms.size() == layers && gate_up.size() == GATE_UP_PARTS * layers && down.size() == layers &&
              k_buffers.size() == layers && v_buffers.size() == layers && qtypes.size() == LAYER_TYPES * layers,
              "rungen_ggml: decoder_stack takes the same number of each layer's tensors");
  TORCH_CHECK(hidden.dim() == 3, "rungen_ggml: hidden must be [batch, tokens, features]");
  const int64_t b = hidden.size(0), t = hidden.size(1), features = hidden.size(2), n = b * t;
  at::Tensor h = hidden.to(at::kFloat).contiguous().clone();  // the residual stream, [n, features]
  if (layers == 0) return {h, {}, {}};
  // Layer i's parts and their types.
  const auto qkv_of = [&](size_t i) { return qkv.slice(QKV_PARTS * i, QKV_PARTS); };
  const auto qkv_types = [&](size_t i) { return qtypes.slice(LAYER_TYPES * i, QKV_PARTS); };
  const auto gate_up_of = [&](size_t i) { return gate_up.slice(GATE_UP_PARTS * i, GATE_UP_PARTS); };
  const auto gate_up_types = [&](size_t i) { return qtypes.slice(LAYER_TYPES * i + QKV_PARTS + 1, GATE_UP_PARTS); };
  const int64_t o_type = QKV_PARTS, down_type = LAYER_TYPES - 1;  // within a layer's types
  const int64_t qkv_width = parts_rows(qkv_of(0), qkv_types(0)), all = heads + 2 * kv_heads, dim = qkv_width / all;
  TORCH_CHECK(qkv_width % all == 0, "rungen_ggml: qkv features are not (heads + 2 kv_heads) * head_dim");
  const at::Tensor cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  const int64_t rot = rotary_width(cos, dim);
  const bool shared = rope_shared(cos, sin, b, t, rot);
  const at::Tensor local_cos = local_cos_in.has_value() ? local_cos_in->to(at::kFloat).contiguous() : cos;
  const at::Tensor local_sin = local_sin_in.has_value() ? local_sin_in->to(at::kFloat).contiguous() : sin;
  TORCH_CHECK(local_cos.sizes() == cos.sizes() && local_sin.sizes() == sin.sizes(),
              "rungen_ggml: decoder_stack's local cos/sin differ in shape from cos/sin");
  const AttendMask attend_mask_once = attend_mask(mask, b, t, length + t);
  int64_t ffn = 0;
  for (size_t i = 0; i < layers; ++i) ffn = std::max(ffn, parts_rows(gate_up_of(i), gate_up_types(i)) / 2);
  const auto options = h.options();
  at::Tensor x = at::empty({n, features}, options), part = at::empty({n, features}, options);
  at::Tensor qkv_out = at::empty({n, qkv_width}, options), q = at::empty({b, heads, t, dim}, options);
  at::Tensor attended = at::empty({n, heads * dim}, options);
  at::Tensor gu = at::empty({n, 2 * ffn}, options), act = at::empty({n, ffn}, options);
  float *hp = h.data_ptr<float>(), *xp = x.data_ptr<float>(), *pp = part.data_ptr<float>();
  // Layer i's norm of a product's output (in place) where `norms` holds one.
  const auto out_norm = [&](const c10::List<c10::optional<at::Tensor>>& norms, size_t i, float* yp) {
    if (norms.empty() || !norms.get(i).has_value()) return;
    const at::Tensor weight = norms.get(i)->to(at::kFloat).contiguous();
    TORCH_CHECK(weight.numel() == features, "rungen_ggml: an output norm must have ", features, " weights");
    rms_norm_rows(yp, weight.data_ptr<float>(), eps, n, features, yp);
  };
  std::vector<at::Tensor> keys, values;
  keys.reserve(layers);
  values.reserve(layers);
  for (size_t i = 0; i < layers; ++i) {
    const at::Tensor &kb = k_buffers[i], &vb = v_buffers[i];
    TORCH_CHECK(kb.size(2) >= length + t && vb.size(2) >= length + t && kb.size(3) == dim && vb.size(3) == dim &&
                kb.stride(3) == 1 && vb.stride(3) == 1 && kb.scalar_type() == at::kFloat &&
                vb.scalar_type() == at::kFloat,
                "rungen_ggml: decoder_stack's cache buffers must be float32 [b, kv_heads, room for ", length + t,
                ", ", dim, "]");
    TORCH_CHECK(parts_rows(qkv_of(i), qkv_types(i)) == qkv_width,
                "rungen_ggml: decoder_stack's layers differ in q/k/v");
    const int64_t width = parts_rows(gate_up_of(i), gate_up_types(i)) / 2;
    const int64_t* types = qtypes.data() + LAYER_TYPES * i;
    // attention_in: norm, the q/k/v product (and bias), rotation; keys and values into the cache.
    rms_norm_rows(hp, input_norms[i].to(at::kFloat).contiguous().data_ptr<float>(), eps, n, features, xp);
    mm_parts_into(x, qkv_of(i), qkv_types(i), features, qkv_out.data_ptr<float>());
    if (qkv_bias.get(i).has_value()) qkv_out.add_(*qkv_bias.get(i));
    at::Tensor held_q, held_k;
    const HeadNorms norms{head_norm(q_norms.get(i), dim, held_q), head_norm(k_norms.get(i), dim, held_k), eps};
    const int64_t window = windows.empty() ? 0 : windows[i];
    TORCH_CHECK(window >= 0, "rungen_ggml: decoder_stack's windows must be positive, or 0 for none");
    const at::Tensor &c = window ? local_cos : cos, &s = window ? local_sin : sin;
    rope_rows(qkv_out.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), shared, b, t, heads, kv_heads,
              dim, rot, q.data_ptr<float>(),
              Rows4{kb.data_ptr<float>() + length * kb.stride(2), kb.stride(0), kb.stride(1), kb.stride(2)},
              Rows4{vb.data_ptr<float>() + length * vb.stride(2), vb.stride(0), vb.stride(1), vb.stride(2)}, norms);
    keys.push_back(kb.narrow(2, 0, length + t));
    values.push_back(vb.narrow(2, 0, length + t));
    // attention_out_mlp: attention, the output product, the residual; norm, gate/up, SiLU, down, the residual.
    attend_into(q, keys.back(), values.back(), attend_mask_once, scale, softcap, window, attended.data_ptr<float>());
    mm_into(attended, o[i], types[o_type], heads * dim, pp);
    out_norm(attention_out_norms, i, pp);
    for (int64_t j = 0; j < n * features; ++j) hp[j] += pp[j];
    rms_norm_rows(hp, post_norms[i].to(at::kFloat).contiguous().data_ptr<float>(), eps, n, features, xp);
    // A layer narrower than the widest (models whose MLP width varies) uses the start of the buffers.
    const at::Tensor act_i = width == ffn ? act : act.view({-1}).narrow(0, 0, n * width).view({n, width});
    mm_parts_into(x, gate_up_of(i), gate_up_types(i), features, gu.data_ptr<float>());
    gate_mul_rows(gelu ? gelu_fn() : silu_fn(), gelu ? GELU_WORK : SILU_WORK, gu.data_ptr<float>(), n, width,
                  act_i.data_ptr<float>());
    mm_into(act_i, down[i], types[down_type], width, pp);
    out_norm(mlp_out_norms, i, pp);
    for (int64_t j = 0; j < n * features; ++j) hp[j] += pp[j];
  }
  return {h.view({b, t, features}), keys, values};
}

// Group g's superblocks of k-quant rows (pitch bytes apart from src) in the X8 layout at dst (see X8).
void interleave_kquant(const uint8_t* src, int64_t pitch, int64_t qtype, int64_t nsb, int64_t g, uint8_t* dst,
                       KRow& kr) {
  const int64_t bytes = block_bytes(qtype), block = qtype == Q6_K ? 192 : qtype == Q5_K ? 160 : 128;
  for (int64_t s = 0; s < nsb; ++s) {
    uint8_t* o = dst + (g * nsb + s) * x8_bytes(qtype);
    uint8_t* codes_out = o + (qtype == Q6_K ? 144 : 160);
    for (int64_t r = 0; r < 8; ++r) {
      const uint8_t* sb = src + (8 * g + r) * pitch + s * bytes;
      scalar::unpack_k(qtype, sb, kr, 0);
      const uint8_t* c = kr.codes;
      if (qtype == Q6_K) {
        std::memcpy(o + 2 * r, sb + 208, 2);
        for (int h = 0; h < 16; ++h) o[16 + 8 * h + r] = sb[192 + h];
      } else {
        uint8_t sc[8], mn[8];
        kquant_scales(sb + 4, sc, mn);
        std::memcpy(o + 2 * r, sb, 2);
        std::memcpy(o + 16 + 2 * r, sb + 2, 2);
        for (int j = 0; j < 8; ++j) {
          o[32 + 8 * j + r] = sc[j];
          o[96 + 8 * j + r] = mn[j];
        }
      }
      for (int j = 0; j < 8; ++j) {
        const uint8_t* cj = c + 32 * j;
        uint8_t* nib = codes_out + block * j;
        for (int k = 0; k < 4; ++k)
          for (int i = 0; i < 4; ++i)
            nib[32 * k + 4 * r + i] = (cj[4 * k + i] & 0x0F) | ((cj[16 + 4 * k + i] & 0x0F) << 4);
        uint8_t* high = nib + 128 + 4 * r;
        for (int i = 0; i < 4 && qtype != Q4_K; ++i) {
          uint8_t first = 0, second = 0;
          for (int k = 0; k < 4; ++k) {
            const int lo = cj[4 * k + i] >> 4, hi = cj[16 + 4 * k + i] >> 4;
            if (qtype == Q5_K) {
              first |= (lo << k) | (hi << (4 + k));
            } else {
              first |= lo << (2 * k);
              second |= hi << (2 * k);
            }
          }
          high[i] = first;
          if (qtype == Q6_K) high[32 + i] = second;
        }
      }
    }
  }
}

// Group g's IQ4_XS superblocks (pitch bytes apart from src) in the X8 layout at dst (see X8): the 6-bit scales
// unpacked to a signed byte (scale - 32), the nibbles rearranged as X8 | Q4_0's.
void interleave_iq4_xs(const uint8_t* src, int64_t pitch, int64_t nsb, int64_t g, uint8_t* dst) {
  for (int64_t s = 0; s < nsb; ++s) {
    uint8_t* o = dst + (g * nsb + s) * x8_bytes(IQ4_XS);
    for (int64_t r = 0; r < 8; ++r) {
      const uint8_t* sb = src + (8 * g + r) * pitch + s * block_bytes(IQ4_XS);
      // d and the scales' bytes copied to a local first: read straight from sb, GCC 12.2 at -O3 (its induction
      // variable optimization) compiles this loop into one that writes nothing.
      uint8_t head[8];
      std::memcpy(head, sb, 8);
      const int high = head[2] | (head[3] << 8);
      o[2 * r] = head[0];
      o[2 * r + 1] = head[1];
      for (int j = 0; j < 8; ++j) {
        const int scale = ((head[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4);
        o[16 + 8 * j + r] = uint8_t(scale - 32);
      }
      for (int j = 0; j < 8; ++j)
        for (int k = 0; k < 4; ++k) std::memcpy(o + 80 + 128 * j + 32 * k + 4 * r, sb + 8 + 16 * j + 4 * k, 4);
    }
  }
}

// Group g's Q3_K superblocks (pitch bytes apart from src) in the X8 layout at dst (see X8): d as it is, the 6-bit
// scales unpacked to a signed byte (scale - 32), the codes' low bits and high bits regrouped for the kernels' loads.
void interleave_q3_k(const uint8_t* src, int64_t pitch, int64_t nsb, int64_t g, uint8_t* dst, KRow& kr) {
  for (int64_t s = 0; s < nsb; ++s) {
    uint8_t* o = dst + (g * nsb + s) * x8_bytes(Q3_K);
    for (int64_t r = 0; r < 8; ++r) {
      const uint8_t* sb = src + (8 * g + r) * pitch + s * block_bytes(Q3_K);
      unpack_q3_k(sb, kr, 0);  // codes 0..7 (the high bit at bit 2), sc16 = scale - 32
      std::memcpy(o + 2 * r, sb + 108, 2);
      for (int h = 0; h < 16; ++h) o[16 + 8 * h + r] = uint8_t(int8_t(kr.sc16[h]));
      for (int j = 0; j < 8; ++j) {
        const uint8_t* c = kr.codes + 32 * j;
        uint8_t* block = o + 144 + 96 * j;
        for (int i = 0; i < 4; ++i) {
          uint8_t first = 0, second = 0, high = 0;
          for (int k = 0; k < 4; ++k) {
            const uint8_t lo = c[4 * k + i], hi = c[16 + 4 * k + i];
            first |= (lo & 3) << (2 * k);
            second |= (hi & 3) << (2 * k);
            high |= ((lo >> 2) << k) | ((hi >> 2) << (4 + k));
          }
          block[4 * r + i] = first;
          block[32 + 4 * r + i] = second;
          block[64 + 4 * r + i] = high;
        }
      }
    }
  }
}

// Blocks [rows, row bytes] (rows a multiple of 8; rows may be strided) in the X8 layout [rows / 8, 8 row bytes
// as X8 holds them]: Q4_0/Q4_1/Q8_0/IQ4_NL the same bytes rearranged, Q5_0/Q5_1 too with their fifth bits regrouped,
// IQ4_XS with its scales unpacked, the
// k-quants with their scales unpacked (see X8); into `out` when given (contiguous, that shape).
at::Tensor interleave(const at::Tensor& blocks, int64_t qtype, const c10::optional<at::Tensor>& out_in) {
  TORCH_CHECK(interleaved_type(qtype), "rungen_ggml: only Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, "
              "IQ4_NL and IQ4_XS rows are interleaved");
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 2 && blocks.stride(1) == 1 && blocks.size(0) % 8 == 0,
              "rungen_ggml: interleave takes uint8 [rows, bytes] with rows a multiple of 8");
  const bool five = qtype == Q5_0 || qtype == Q5_1;
  const int64_t bytes = block_bytes(qtype), head = qtype == Q4_1 || qtype == Q5_1 ? 4 : 2, nb = blocks.size(1) / bytes;
  const int64_t groups_of_4 = qtype == Q8_0 ? 8 : 4;  // four-byte pieces of a row's codes
  TORCH_CHECK(blocks.size(1) == nb * bytes, "rungen_ggml: rows are not whole blocks");
  const int64_t out_bytes = nb * x8_bytes(qtype);
  at::Tensor out = out_in.has_value() ? *out_in : at::empty({blocks.size(0) / 8, out_bytes}, blocks.options());
  TORCH_CHECK(out.dtype() == at::kByte && out.dim() == 2 && out.size(0) == blocks.size(0) / 8 &&
              out.size(1) == out_bytes && out.is_contiguous(),
              "rungen_ggml: interleave's out must be contiguous uint8 [rows / 8, ", out_bytes, "]");
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t pitch = blocks.stride(0);
  if (qtype == IQ4_XS) {
    at::parallel_for(0, out.size(0), 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) interleave_iq4_xs(src, pitch, nb, g, dst);
    });
    return out;
  }
  if (qtype == Q3_K) {
    at::parallel_for(0, out.size(0), 1, [&](int64_t g0, int64_t g1) {
      KRow kr(256);
      for (int64_t g = g0; g < g1; ++g) interleave_q3_k(src, pitch, nb, g, dst, kr);
    });
    return out;
  }
  if (x8_kquant(qtype)) {
    at::parallel_for(0, out.size(0), 1, [&](int64_t g0, int64_t g1) {
      KRow kr(256);
      for (int64_t g = g0; g < g1; ++g) interleave_kquant(src, pitch, qtype, nb, g, dst, kr);
    });
    return out;
  }
  at::parallel_for(0, out.size(0), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* o = dst + (g * nb + b) * 8 * bytes;
        for (int64_t lane = 0; lane < 8; ++lane) {
          const uint8_t* p = src + (8 * g + lane) * pitch + b * bytes;
          std::memcpy(o + 2 * lane, p, 2);                                        // d
          if (head == 4) std::memcpy(o + 16 + 2 * lane, p + 2, 2);                // m
          if (five) {  // the fifth bits' plane, then the nibbles
            uint32_t qh;
            std::memcpy(&qh, p + head, 4);
            for (int i = 0; i < 4; ++i) {
              uint8_t bits = 0;
              for (int j = 0; j < 4; ++j)
                bits |= uint8_t(((qh >> (4 * j + i)) & 1) << j | ((qh >> (16 + 4 * j + i)) & 1) << (4 + j));
              o[8 * head + 4 * lane + i] = bits;
            }
            for (int j = 0; j < 4; ++j) std::memcpy(o + 8 * head + 32 + 32 * j + 4 * lane, p + head + 4 + 4 * j, 4);
            continue;
          }
          for (int j = 0; j < groups_of_4; ++j) std::memcpy(o + 8 * head + 32 * j + 4 * lane, p + head + 4 * j, 4);
        }
      }
  });
  return out;
}

// The rows `ids` of a weight's blocks (either layout), de-quantized: an embedding's lookup [ids, in_features].
at::Tensor embed(const at::Tensor& blocks, int64_t qtype, int64_t in_features, const at::Tensor& ids_in) {
  check_inputs(blocks, qtype, in_features);
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n = ids.numel(), rows = out_rows(blocks, qtype);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "rungen_ggml: embed: id ", ip[i], " is not below ", rows);
  at::Tensor out = at::empty({n, in_features}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / in_features), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      dequantize_rows(bp, blocks.stride(0), qtype, in_features, ip[i], ip[i] + 1, op + i * in_features);
  });
  return out;
}

std::string isa() { return isa_names[current_isa]; }

std::string set_isa(const std::string& name) {
  int want = -1;
  for (int i = 0; i < 4; ++i)
    if (name == isa_names[i]) want = i;
  if (name == "best") want = best_isa;
  TORCH_CHECK(want >= 0, "rungen_ggml: unknown instruction set ", name);
  TORCH_CHECK(want <= best_isa, "rungen_ggml: this CPU cannot run ", name);
  current_isa = want;
  return isa_names[current_isa];
}

int64_t set_tile_threshold(int64_t n) {
  const int64_t old = tile_threshold;
  tile_threshold = n;
  return old;
}

}  // namespace

TORCH_LIBRARY(rungen_ggml, m) {
  m.def("mm(Tensor x, Tensor blocks, int qtype, int in_features) -> Tensor", &mm);
  m.def("mm_parts(Tensor x, Tensor[] blocks, int[] qtypes, int in_features) -> Tensor", &mm_parts);
  m.def("mm_int(Tensor x, Tensor blocks, int qtype, int in_features) -> Tensor", &mm_int);
  m.def("mm_tiled(Tensor x, Tensor blocks, int qtype, int in_features) -> Tensor", &mm_tiled);
  m.def("dequantize(Tensor blocks, int qtype, int in_features) -> Tensor", &dequantize);
  m.def("interleave(Tensor blocks, int qtype, Tensor? out=None) -> Tensor", &interleave);
  m.def("embed(Tensor blocks, int qtype, int in_features, Tensor ids) -> Tensor", &embed);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("rope_split(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor? q_norm=None, "
        "Tensor? k_norm=None, float norm_eps=0.) -> Tensor[]", &rope_split);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor", &gelu_tanh_mul);
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float softcap=0., int window=0) -> Tensor",
        &attend);
  m.def("attention_in(Tensor hidden, Tensor norm_weight, float eps, Tensor[] qkv_blocks, int[] qkv_qtypes, "
        "Tensor? qkv_bias, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor? q_norm=None, Tensor? k_norm=None, "
        "float norm_eps=0.) -> Tensor[]", &attention_in);
  m.def("attention_out_mlp(Tensor hidden, Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, "
        "Tensor o_blocks, int o_qtype, Tensor norm_weight, float eps, Tensor[] gate_up_blocks, int[] gate_up_qtypes, "
        "Tensor down_blocks, int down_qtype) -> Tensor", &attention_out_mlp);
  m.def("decoder_stack(Tensor hidden, Tensor cos, Tensor sin, Tensor? mask, Tensor[] input_norms, Tensor[] qkv, "
        "Tensor?[] qkv_bias, Tensor?[] q_norms, Tensor?[] k_norms, Tensor[] o, Tensor[] post_norms, Tensor[] gate_up, "
        "Tensor[] down, int[] qtypes, float eps, "
        "int heads, int kv_heads, float scale, Tensor[] k_buffers, Tensor[] v_buffers, int length, "
        "Tensor?[] attention_out_norms, Tensor?[] mlp_out_norms, int[] windows, Tensor? local_cos, Tensor? local_sin, "
        "float softcap, bool gelu) -> (Tensor, Tensor[], Tensor[])", &decoder_stack);
  m.def("isa() -> str", &isa);
  m.def("set_isa(str name) -> str", &set_isa);
  m.def("set_tile_threshold(int n) -> int", &set_tile_threshold);
}
