// X16 (the VNNI build's prompts): ggml_vnni.cpp includes this file after ggml_x8.h.

#ifdef GGML_VNNI
// ---------------------------------------------------------------------------------------------------
// X16: two X8 groups side by side in the 16 lanes of a zmm register (VNNI build: AVX-512's 32 registers), for
// several tokens. One broadcast of a token's four activations and one dpbusd feed 16 rows, and each block's
// float conversion, scale product and multiply-adds cover 16 rows a token: per dpbusd half the instructions of
// the X8 kernels, which spent as many issue slots on those as on the dot products (docs/kernels.md, "What bounds
// the VNNI kernels"). Each lane computes what the X8 kernel computes for its row, in the same order: the same bits.
// Group g's bytes are in the low half, g + 1's (pitch bytes on) in the high half.

static inline __m512i pair_load(const uint8_t* p, int64_t pitch) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p)),
                            _mm256_loadu_si256((const __m256i*)(p + pitch)), 1);
}

// Eight float16 of each group (its rows' scales) as 16 floats.
static inline __m512 pair_halves(const uint8_t* p, int64_t pitch) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)p)),
                                                 _mm_loadu_si128((const __m128i*)(p + pitch)), 1));
}

// Eight bytes of each group as the 16 int32 lanes, unsigned or signed.
static inline __m128i pair_bytes(const uint8_t* p, int64_t pitch) {
  return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)p), _mm_loadl_epi64((const __m128i*)(p + pitch)));
}
static inline __m512i pair_lanes_u8(const uint8_t* p, int64_t pitch) { return _mm512_cvtepu8_epi32(pair_bytes(p, pitch)); }
static inline __m512i pair_lanes_s8(const uint8_t* p, int64_t pitch) { return _mm512_cvtepi8_epi32(pair_bytes(p, pitch)); }

static inline __m512i broadcast4_16(const int8_t* x) {
  int32_t v;
  memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

static inline __m512 broadcast_f16(const float* p) { return _mm512_set1_ps(*p); }

// dpbusd_block for 16 rows.
static inline void dpbusd_block16(__m512i& c0, __m512i& c1, const __m512i* w0, const __m512i* w1, const int8_t* x) {
  for (int k = 0; k < 4; ++k) {
    c0 = _mm512_dpbusd_epi32(c0, w0[k], broadcast4_16(x + 4 * k));
    c1 = _mm512_dpbusd_epi32(c1, w1[k], broadcast4_16(x + 16 + 4 * k));
  }
}

// Block b of two groups (their codes lo/hi, scales d, offsets m) for the NT tokens of a pass, as Q4_0/Q4_1 and
// Q5_0/Q5_1 weigh it: the exact integer dot, then its scale and the offset.
template <int NT>
static inline void x16_tokens_q4(__m512* acc, const __m512i* lo, const __m512i* hi, __m512 d, __m512 m,
                                 const int8_t* const* xq, const float* const* xd, const float* const* xs, int64_t b) {
  for (int t = 0; t < NT; ++t) {
    __m512i dot0 = _mm512_setzero_si512(), dot1 = _mm512_setzero_si512();
    dpbusd_block16(dot0, dot1, lo, hi, xq[t] + b * 32);
    const __m512i dot = _mm512_add_epi32(dot0, dot1);
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, broadcast_f16(xd[t] + b)), acc[t]);
    acc[t] = _mm512_fmadd_ps(m, broadcast_f16(xs[t] + b), acc[t]);
  }
}

// The codes of a 4-bit block of two groups (its nibbles at nib): lo[j] holds codes 4j .. 4j + 3 of the 16 rows,
// hi[j] codes 16 + 4j .. 16 + 4j + 3.
static inline void x16_codes_q4(const uint8_t* nib, int64_t pitch, __m512i* lo, __m512i* hi) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = pair_load(nib + 32 * j, pitch);
    lo[j] = _mm512_and_si512(v, low);
    hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  }
}

// Q5_0/Q5_1's: the nibbles with their fifth bits (the plane).
static inline void x16_codes_q5(const uint8_t* nib, const uint8_t* planep, int64_t pitch, __m512i* lo, __m512i* hi) {
  const __m512i low = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
  const __m512i plane = pair_load(planep, pitch);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = pair_load(nib + 32 * j, pitch);
    lo[j] = _mm512_or_si512(_mm512_and_si512(v, low), _mm512_and_si512(_mm512_slli_epi16(plane, 4 - j), sixteen));
    hi[j] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                            _mm512_and_si512(_mm512_srli_epi16(plane, j), sixteen));
  }
}

// Q4_0/Q4_1: x8_group for two groups.
template <bool HAS_MIN, int NT>
static void x16_group(const uint8_t* group, int64_t pitch, int64_t nblocks, const int8_t* const* xq,
                      const float* const* xd, const float* const* xs, float* const* out) {
  constexpr int64_t BYTES = HAS_MIN ? 160 : 144, HEAD = HAS_MIN ? 32 : 16;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* p = group + b * BYTES;
    __m512i lo[4], hi[4];
    x16_codes_q4(p + HEAD, pitch, lo, hi);
    const __m512 d = pair_halves(p, pitch);
    const __m512 m = HAS_MIN ? pair_halves(p + 16, pitch) : _mm512_mul_ps(_mm512_set1_ps(-8.f), d);
    x16_tokens_q4<NT>(acc, lo, hi, d, m, xq, xd, xs, b);
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out[t], acc[t]);
}

// Q5_0/Q5_1: x8_group_q5 for two groups.
template <bool HAS_MIN, int NT>
static void x16_group_q5(const uint8_t* group, int64_t pitch, int64_t nblocks, const int8_t* const* xq,
                         const float* const* xd, const float* const* xs, float* const* out) {
  constexpr int64_t BYTES = HAS_MIN ? 192 : 176, HEAD = HAS_MIN ? 64 : 48, PLANE = HAS_MIN ? 32 : 16;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* p = group + b * BYTES;
    __m512i lo[4], hi[4];
    x16_codes_q5(p + HEAD, p + PLANE, pitch, lo, hi);
    const __m512 d = pair_halves(p, pitch);
    const __m512 m = HAS_MIN ? pair_halves(p + 16, pitch) : _mm512_mul_ps(_mm512_set1_ps(-16.f), d);
    x16_tokens_q4<NT>(acc, lo, hi, d, m, xq, xd, xs, b);
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out[t], acc[t]);
}

// Q8_0: x8_group_q8 for two groups. AVX-512 has no byte sign instruction: the codes offset by 128 (unsigned
// 0..255) against the activations, less 128 times the token's integer sum of the block (Act's off128), the same
// exact sum.
template <int NT>
static void x16_group_q8(const uint8_t* group, int64_t pitch, int64_t nblocks, const int8_t* const* xq,
                         const float* const* xd, const int32_t* const* xoff128, float* const* out) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* p = group + b * 272;
    __m512i w[8];
    for (int j = 0; j < 8; ++j) w[j] = _mm512_xor_si512(pair_load(p + 16 + 32 * j, pitch), flip);
    const __m512 d = pair_halves(p, pitch);
    for (int t = 0; t < NT; ++t) {
      const int8_t* x = xq[t] + b * 32;
      __m512i dot0 = _mm512_set1_epi32(xoff128[t][b]), dot1 = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        dot0 = _mm512_dpbusd_epi32(dot0, w[2 * j], broadcast4_16(x + 8 * j));
        dot1 = _mm512_dpbusd_epi32(dot1, w[2 * j + 1], broadcast4_16(x + 8 * j + 4));
      }
      const __m512i dot = _mm512_add_epi32(dot0, dot1);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, broadcast_f16(xd[t] + b)), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out[t], acc[t]);
}

// Bytes of a group's superblock of Q4_K, Q5_K or Q6_K in the X8 layout (the second group of a pair one pitch on).
template <int64_t BASE>
constexpr int64_t kx16_bytes() { return BASE == Q6_K ? 1680 : BASE == Q5_K ? 1440 : 1184; }

// The codes of block j of two groups' superblock p (Q4_K, Q5_K 0..31, Q6_K 0..63, unsigned): lo[k] holds codes
// 4k .. 4k + 3 of the 16 rows, hi[k] codes 16 + 4k .. 16 + 4k + 3.
template <int64_t BASE>
static inline void kx16_codes(const uint8_t* p, int64_t pitch, int64_t j, __m512i* lo, __m512i* hi) {
  constexpr bool Q6 = BASE == Q6_K, Q5 = BASE == Q5_K;
  constexpr int64_t BLOCK = Q6 ? 192 : Q5 ? 160 : 128, CODES = Q6 ? 144 : 160;
  const uint8_t* nib = p + CODES + BLOCK * j;
  x16_codes_q4(nib, pitch, lo, hi);
  if (Q5) {
    const __m512i h = pair_load(nib + 128, pitch), bit = _mm512_set1_epi8(16);
    for (int k = 0; k < 4; ++k) {
      lo[k] = _mm512_or_si512(lo[k], _mm512_and_si512(_mm512_slli_epi32(h, 4 - k), bit));
      hi[k] = _mm512_or_si512(hi[k], _mm512_and_si512(_mm512_srli_epi32(h, k), bit));
    }
  }
  if (Q6) {
    const __m512i h0 = pair_load(nib + 128, pitch), h1 = pair_load(nib + 160, pitch);
    const __m512i bits = _mm512_set1_epi8(0x30);
    for (int k = 0; k < 4; ++k) {
      const __m512i t0 = k < 2 ? _mm512_slli_epi32(h0, 4 - 2 * k) : _mm512_srli_epi32(h0, 2 * k - 4);
      const __m512i t1 = k < 2 ? _mm512_slli_epi32(h1, 4 - 2 * k) : _mm512_srli_epi32(h1, 2 * k - 4);
      lo[k] = _mm512_or_si512(lo[k], _mm512_and_si512(t0, bits));
      hi[k] = _mm512_or_si512(hi[k], _mm512_and_si512(t1, bits));
    }
  }
}

// -dmin of two groups' Q4_K/Q5_K superblock, by its sign bit, as kx8_group's xor (AVX-512F has no float xor).
static inline __m512 kx16_neg_dmin(const uint8_t* p, int64_t pitch) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(pair_halves(p + 16, pitch)),
                                              _mm512_set1_epi32(int32_t(0x80000000u))));
}

// A block of 32 of two groups, unpacked for the X16 kernels (their passes read it when the pair's blocks are
// unpacked once for all of them): the codes (w[k], w[4 + k]: codes 4k .. 4k + 3 and 16 + 4k .. 16 + 4k + 3 of the 16
// rows), Q6_K's halves' integer scales as floats, the offset m (Q4_K/Q5_K: -dmin mn) and the scale d (IQ4_NL:
// d; Q4_K, Q5_K and IQ4_XS: d * sc, exact; Q6_K: unused, its superblock's d).
struct K16Block {
  __m512i w[8];
  __m512 sc0, sc1, m, d;
};

template <int64_t BASE>
static inline void kx16_unpack(const uint8_t* p, int64_t pitch, int64_t j, K16Block& u) {
  kx16_codes<BASE>(p, pitch, j, u.w, u.w + 4);
  // Q6_K's integer scales as floats: each weighted sum is an integer below 2^24 (docs/kernels.md), so the float
  // products and their sum are exact, the value the integer multiply gave, in fewer and cheaper instructions.
  // Q4_K's and Q5_K's one scale a block goes into d instead (exact), once for all tokens.
  if constexpr (BASE == Q6_K) {
    u.sc0 = _mm512_cvtepi32_ps(pair_lanes_s8(p + 16 + 16 * j, pitch));
    u.sc1 = _mm512_cvtepi32_ps(pair_lanes_s8(p + 24 + 16 * j, pitch));
    u.m = _mm512_setzero_ps();
  } else {
    u.d = _mm512_mul_ps(pair_halves(p, pitch), _mm512_cvtepi32_ps(pair_lanes_u8(p + 32 + 8 * j, pitch)));
    u.m = _mm512_mul_ps(kx16_neg_dmin(p, pitch), _mm512_cvtepi32_ps(pair_lanes_u8(p + 96 + 8 * j, pitch)));
  }
}

// Q4_K/Q5_K/Q6_K: kx8_group's VNNI arithmetic for two groups (Q5_K's halves share a scale: its two chains summed,
// as Q4_K's). READY: the blocks unpacked once for all passes, into `ready`.
template <int64_t BASE, int NT, bool READY>
static void kx16_group(const uint8_t* group, int64_t pitch, int64_t nsb, const K16Block* ready,
                       const int8_t* const* xq, const float* const* xd, const float* const* xs,
                       const int32_t* const* xoff16, float* const* out) {
  constexpr bool Q6 = BASE == Q6_K;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* p = group + s * kx16_bytes<BASE>();
    const __m512 d = pair_halves(p, pitch);
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t b = 8 * s + j;
      K16Block local;
      if (!READY) kx16_unpack<BASE>(p, pitch, j, local);
      const K16Block& u = READY ? ready[b] : local;
      for (int t = 0; t < NT; ++t) {
        const int8_t* x = xq[t] + b * 32;
        __m512 dot;
        if (Q6) {
          __m512i dot0 = _mm512_set1_epi32(xoff16[t][2 * b]);
          __m512i dot1 = _mm512_set1_epi32(xoff16[t][2 * b + 1]);
          dpbusd_block16(dot0, dot1, u.w, u.w + 4, x);
          dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), u.sc0, _mm512_mul_ps(_mm512_cvtepi32_ps(dot1), u.sc1));
        } else {
          __m512i dot0 = _mm512_setzero_si512(), dot1 = _mm512_setzero_si512();
          dpbusd_block16(dot0, dot1, u.w, u.w + 4, x);
          dot = _mm512_cvtepi32_ps(_mm512_add_epi32(dot0, dot1));
        }
        acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(Q6 ? d : u.d, broadcast_f16(xd[t] + b)), acc[t]);
        if (!Q6) acc[t] = _mm512_fmadd_ps(u.m, broadcast_f16(xs[t] + b), acc[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out[t], acc[t]);
}

// The values of an IQ4 block of two groups (its nibbles at nib) by `table` (the 16 values, in each 128-bit lane):
// w[k] holds values 4k .. 4k + 3 of the 16 rows, w[4 + k] values 16 + 4k .. 16 + 4k + 3.
static inline void x16_codes_iq4(const uint8_t* nib, int64_t pitch, __m512i table, __m512i* w) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int k = 0; k < 4; ++k) {
    const __m512i v = pair_load(nib + 32 * k, pitch);
    w[k] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
    w[4 + k] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
  }
}

// Block b of two groups of IQ4_NL/IQ4_XS rows, unpacked: the table's values offset by 128 (unsigned), the scale
// (IQ4_XS's times the block's scale: exact).
template <int64_t BASE>
static inline void iq4x16_unpack(const uint8_t* group, int64_t pitch, int64_t b, K16Block& u) {
  constexpr bool XS = BASE == IQ4_XS;
  const __m512i table = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)iq4_table(BASE))),
                                         _mm512_set1_epi8(char(0x80)));
  const uint8_t* p = XS ? group + (b / 8) * 1104 : group + b * 144;
  x16_codes_iq4(XS ? p + 80 + 128 * (b % 8) : p + 16, pitch, table, u.w);
  u.m = _mm512_setzero_ps();
  u.d = pair_halves(p, pitch);
  if (XS) u.d = _mm512_mul_ps(u.d, _mm512_cvtepi32_ps(pair_lanes_s8(p + 16 + 8 * (b % 8), pitch)));
}

// IQ4_NL/IQ4_XS: x8_group_iq4's VNNI arithmetic for two groups. READY: the blocks unpacked once for all passes.
template <int64_t BASE, int NT, bool READY>
static void x16_group_iq4(const uint8_t* group, int64_t pitch, int64_t nblocks, const K16Block* ready,
                          const int8_t* const* xq, const float* const* xd, const int32_t* const* xoff128,
                          float* const* out) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    K16Block local;
    if (!READY) iq4x16_unpack<BASE>(group, pitch, b, local);
    const K16Block& u = READY ? ready[b] : local;
    for (int t = 0; t < NT; ++t) {
      __m512i dot0 = _mm512_set1_epi32(xoff128[t][b]), dot1 = _mm512_setzero_si512();
      dpbusd_block16(dot0, dot1, u.w, u.w + 4, xq[t] + b * 32);
      __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(dot0, dot1));
      acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(u.d, broadcast_f16(xd[t] + b)), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out[t], acc[t]);
}

// Q3_K: q3kx8_unpack and q3kx8_group's VNNI arithmetic for two groups.
struct Q3kBlock16 {
  __m512i w[8], pair0, pair1, start;
};

// Block j's codes (q = 0..7) of two groups' superblock p: w[k] codes 4k .. 4k + 3 of each row's lane, w[4 + k]
// codes 16 + 4k .. 16 + 4k + 3 (the AMX path folds its scales into them: ggml_amx.h).
static inline void q3kx16_codes(const uint8_t* p, int64_t pitch, int64_t j, __m512i* w) {
  const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
  const uint8_t* codes = p + 144 + 96 * j;
  const __m512i l0 = pair_load(codes, pitch), l1 = pair_load(codes + 32, pitch), h = pair_load(codes + 64, pitch);
  for (int k = 0; k < 4; ++k) {
    const __m512i hl = _mm512_and_si512(k < 3 ? _mm512_slli_epi32(h, 2 - k) : _mm512_srli_epi32(h, 1), four);
    const __m512i hh = _mm512_and_si512(_mm512_srli_epi32(h, 2 + k), four);
    const __m512i ll = k ? _mm512_srli_epi32(l0, 2 * k) : l0, lh = k ? _mm512_srli_epi32(l1, 2 * k) : l1;
    w[k] = _mm512_ternarylogic_epi32(ll, hl, three, 0xEC);
    w[4 + k] = _mm512_ternarylogic_epi32(lh, hh, three, 0xEC);
  }
}

static inline void q3kx16_unpack(const uint8_t* p, int64_t pitch, int64_t j, Q3kBlock16& u) {
  q3kx16_codes(p, pitch, j, u.w);
  const __m512i sc0 = pair_lanes_s8(p + 16 + 16 * j, pitch), sc1 = pair_lanes_s8(p + 24 + 16 * j, pitch);
  const __m512i low16 = _mm512_set1_epi32(0xFFFF), zero = _mm512_setzero_si512();
  u.pair0 = _mm512_or_si512(_mm512_and_si512(sc0, low16), _mm512_slli_epi32(_mm512_sub_epi32(zero, sc0), 18));
  u.pair1 = _mm512_or_si512(_mm512_and_si512(sc1, low16), _mm512_slli_epi32(_mm512_sub_epi32(zero, sc1), 18));
  u.start = _mm512_sub_epi32(zero, _mm512_slli_epi32(_mm512_add_epi32(sc0, sc1), 14));
}

template <int NT, bool READY>
static void q3kx16_group(const uint8_t* group, int64_t pitch, int64_t nsb, const Q3kBlock16* ready,
                         const int8_t* const* xq, const float* const* xd, const int32_t* const* high16,
                         float* const* out) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* p = group + s * 912;
    const __m512 d = pair_halves(p, pitch);
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t b = 8 * s + j;
      Q3kBlock16 local;
      if (!READY) q3kx16_unpack(p, pitch, j, local);
      const Q3kBlock16& u = READY ? ready[b] : local;
      for (int t = 0; t < NT; ++t) {
        __m512i c0 = _mm512_set1_epi32(high16[t][2 * b]), c1 = _mm512_set1_epi32(high16[t][2 * b + 1]);
        dpbusd_block16(c0, c1, u.w, u.w + 4, xq[t] + b * 32);
        const __m512i dot = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(u.start, c0, u.pair0), c1, u.pair1);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, broadcast_f16(xd[t] + b)), acc[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out[t], acc[t]);
}

// X16's kernels whose passes can read the pair's blocks unpacked (as unpacked_tokens describes), from where the
// unpacking once pays (docs/kernels.md, "Measured choices"): three passes of four, IQ4_NL's (the cheapest to
// unpack, a block five times its packed size) from 25 tokens, Q3_K's from two passes.
template <int64_t BASE>
struct K16 {
  const uint8_t* group;
  int64_t pitch;
  static constexpr bool IQ4 = iq4_type(BASE);
  using Block = K16Block;
  static constexpr int64_t unbuffered = BASE == IQ4_NL || BASE == MXFP4 ? 24 : 8;
  void unpack(int64_t b, Block& u) const {
    if constexpr (IQ4)
      iq4x16_unpack<BASE>(group, pitch, b, u);
    else
      kx16_unpack<BASE>(group + (b / 8) * kx16_bytes<BASE>(), pitch, b % 8, u);
  }
  template <int NT, bool READY>
  void run(const Block* ready, int64_t nb, const Tokens<NT>& x) const {
    if constexpr (IQ4)
      x16_group_iq4<BASE, NT, READY>(group, pitch, nb, ready, x.xq, x.xd, x.xoff128, x.out);
    else
      kx16_group<BASE, NT, READY>(group, pitch, nb / 8, ready, x.xq, x.xd, x.xs, x.xoff16, x.out);
  }
};

struct Q3kX16 {
  const uint8_t* group;
  int64_t pitch;
  using Block = Q3kBlock16;
  static constexpr int64_t unbuffered = 4;
  void unpack(int64_t b, Block& u) const { q3kx16_unpack(group + (b / 8) * 912, pitch, b % 8, u); }
  template <int NT, bool READY>
  void run(const Block* ready, int64_t nb, const Tokens<NT>& x) const {
    q3kx16_group<NT, READY>(group, pitch, nb / 8, ready, x.xq, x.xd, x.xhigh16, x.out);
  }
};

// The types whose blocks are cheap enough to unpack in every pass (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).
template <int64_t BASE, int NT>
static int64_t x16_pass(const uint8_t* group, int64_t pitch, int64_t nb, const Act& a, int64_t k, float* y,
                        int64_t stride, int64_t t) {
  for (; t + NT <= a.n; t += NT) {
    const Tokens<NT> x(a, k, nb, y, stride, t);
    if constexpr (BASE == Q8_0)
      x16_group_q8<NT>(group, pitch, nb, x.xq, x.xd, x.xoff128, x.out);
    else if constexpr (BASE == Q5_0 || BASE == Q5_1)
      x16_group_q5<BASE == Q5_1, NT>(group, pitch, nb, x.xq, x.xd, x.xs, x.out);
    else
      x16_group<BASE == Q4_1, NT>(group, pitch, nb, x.xq, x.xd, x.xs, x.out);
  }
  return t;
}

// Two groups (pitch bytes apart) against tokens [t0, a.n).
template <int64_t BASE>
static void x16_tokens(const uint8_t* group, int64_t pitch, int64_t nb, const Act& a, int64_t k, float* y,
                       int64_t stride, int64_t t0 = 0) {
  if constexpr (BASE == Q3_K) {
    unpacked_tokens(Q3kX16{group, pitch}, nb, a, k, y, stride, t0);
  } else if constexpr (BASE == Q4_K || BASE == Q5_K || BASE == Q6_K || iq4_type(BASE)) {
    unpacked_tokens(K16<BASE>{group, pitch}, nb, a, k, y, stride, t0);
  } else {
    int64_t t = x16_pass<BASE, 4>(group, pitch, nb, a, k, y, stride, t0);
    t = x16_pass<BASE, 2>(group, pitch, nb, a, k, y, stride, t);
    x16_pass<BASE, 1>(group, pitch, nb, a, k, y, stride, t);
  }
}

#endif
