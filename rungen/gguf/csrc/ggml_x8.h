// The X8 kernels (rows interleaved eight by eight: ggml_formats.h), one body for AVX2 and VNNI as ggml_simd.h's:
// included after it, in the same namespace and target (ggml_avx2.cpp, ggml_vnni.cpp).


// Four int8 activations in every 32-bit lane (one load, a vbroadcastss).
static inline __m256i broadcast4(const int8_t* x) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(x)));
}

#ifdef GGML_VNNI
// A block of 32 codes of eight interleaved rows against one token's activations x, in two dpbusd chains added into
// c0 (the block's first 16 values: w0[0..3]) and c1 (its last 16: w1[0..3]): a token alone (decode) waits on two
// chains of four half as long as on one of eight; an integer sum is the same in any order. The callers start the
// chains where their offsets need them (zero, or minus the offset times the activations' integer sums).
static inline void dpbusd_block(__m256i& c0, __m256i& c1, const __m256i* w0, const __m256i* w1, const int8_t* x) {
  for (int k = 0; k < 4; ++k) {
    c0 = _mm256_dpbusd_epi32(c0, w0[k], broadcast4(x + 4 * k));
    c1 = _mm256_dpbusd_epi32(c1, w1[k], broadcast4(x + 16 + 4 * k));
  }
}
#endif

// Q4_0/Q4_1 rows interleaved eight by eight (X8: see ggml_formats.h), against NT tokens (1 to 4) a pass over
// a group's blocks. A register's eight 32-bit lanes are the group's eight rows: a block's codes are four loads of
// 32 bytes (each four codes of every row, and in their high nibbles four more), unpacked once for the NT tokens;
// a token's four activations at a time are broadcast to every lane, and the block's 32 products of each row are
// summed in integers (on AVX2 in int16: eight maddubs sums of at most 2 * 15 * 127 fit; on VNNI dpbusd adds into
// int32: the same exact sums). Then per block and token two fused multiply-adds for eight rows: acc = fma(dot, d * dx, acc) and
// acc = fma(m, dx * sum(xq), acc), m = -8 d for Q4_0, as the scalar reference does row by row.
template <bool HAS_MIN, int NT>
static void x8_group(const uint8_t* group, int64_t nblocks, const int8_t* const* xq, const float* const* xd,
                     const float* const* xs, float* const* out) {
  constexpr int64_t BYTES = HAS_MIN ? 160 : 144, HEAD = HAS_MIN ? 32 : 16;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* p = group + b * BYTES;
    __m256i lo[4], hi[4];
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(p + HEAD + 32 * j));
      lo[j] = _mm256_and_si256(v, low);
      hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    const __m256 m = HAS_MIN ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)))
                             : _mm256_mul_ps(_mm256_set1_ps(-8.f), d);
    for (int t = 0; t < NT; ++t) {
      const int8_t* x = xq[t] + b * 32;
#ifdef GGML_VNNI
      __m256i dot0 = _mm256_setzero_si256(), dot1 = _mm256_setzero_si256();
      dpbusd_block(dot0, dot1, lo, hi, x);
      const __m256i dot = _mm256_add_epi32(dot0, dot1);
#else
      __m256i sum = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j)
        sum = _mm256_add_epi16(sum, _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], broadcast4(x + 4 * j)),
                                                     _mm256_maddubs_epi16(hi[j], broadcast4(x + 16 + 4 * j))));
      const __m256i dot = _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
#endif
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_broadcast_ss(xd[t] + b)), acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs[t] + b), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out[t], acc[t]);
}

// Q8_0 rows interleaved eight by eight (X8), against NT tokens a pass: as x8_group, with signed codes (the
// unsigned x signed product is |w| times x with w's sign; maddubs's pairs stay below 2 * 128 * 127, and each
// four codes' sums go to int32 at once, where two would not fit int16), eight loads of 32 bytes a block, and no
// offsets.
template <int NT>
static void x8_group_q8(const uint8_t* group, int64_t nblocks, const int8_t* const* xq, const float* const* xd,
                        float* const* out) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* p = group + b * 272;
    __m256i sum[NT];
    for (int t = 0; t < NT; ++t) sum[t] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(p + 16 + 32 * j));
      const __m256i magnitude = _mm256_sign_epi8(w, w);
      for (int t = 0; t < NT; ++t) {
        const __m256i x = _mm256_sign_epi8(broadcast4(xq[t] + b * 32 + 4 * j), w);
#ifdef GGML_VNNI
        sum[t] = _mm256_dpbusd_epi32(sum[t], magnitude, x);
#else
        sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), _mm256_set1_epi16(1)));
#endif
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    for (int t = 0; t < NT; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(d, _mm256_broadcast_ss(xd[t] + b)), acc[t]);
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out[t], acc[t]);
}

// Q5_0/Q5_1 rows interleaved eight by eight (X8), against NT tokens a pass: as x8_group, each nibble's fifth bit
// (bit j or 4 + j of its plane byte: see X8) shifted to bit 4 and or-ed in; on AVX2 four maddubs sums of codes up
// to 31 (4 x 2 x 31 x 127 = 31496) fit int16 before widening, eight would not. m = -16 d for Q5_0.
template <bool HAS_MIN, int NT>
static void x8_group_q5(const uint8_t* group, int64_t nblocks, const int8_t* const* xq, const float* const* xd,
                        const float* const* xs, float* const* out) {
  constexpr int64_t BYTES = HAS_MIN ? 192 : 176, HEAD = HAS_MIN ? 64 : 48, PLANE = HAS_MIN ? 32 : 16;
  const __m256i low = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16);
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* p = group + b * BYTES;
    const __m256i plane = _mm256_loadu_si256((const __m256i*)(p + PLANE));
    __m256i lo[4], hi[4];
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(p + HEAD + 32 * j));
      // Bit j to bit 4 (left by 4 - j), bit 4 + j to bit 4 (right by j): within each byte, then masked.
      lo[j] = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(_mm256_slli_epi16(plane, 4 - j), sixteen));
      hi[j] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                              _mm256_and_si256(_mm256_srli_epi16(plane, j), sixteen));
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    const __m256 m = HAS_MIN ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)))
                             : _mm256_mul_ps(_mm256_set1_ps(-16.f), d);
    for (int t = 0; t < NT; ++t) {
      const int8_t* x = xq[t] + b * 32;
#ifdef GGML_VNNI
      __m256i dot0 = _mm256_setzero_si256(), dot1 = _mm256_setzero_si256();
      dpbusd_block(dot0, dot1, lo, hi, x);
      const __m256i dot = _mm256_add_epi32(dot0, dot1);
#else
      __m256i sum_lo = _mm256_setzero_si256(), sum_hi = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        sum_lo = _mm256_add_epi16(sum_lo, _mm256_maddubs_epi16(lo[j], broadcast4(x + 4 * j)));
        sum_hi = _mm256_add_epi16(sum_hi, _mm256_maddubs_epi16(hi[j], broadcast4(x + 16 + 4 * j)));
      }
      const __m256i one = _mm256_set1_epi16(1);
      const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(sum_lo, one), _mm256_madd_epi16(sum_hi, one));
#endif
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_broadcast_ss(xd[t] + b)), acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs[t] + b), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out[t], acc[t]);
}

// Eight bytes as the eight int32 lanes, unsigned or signed.
static inline __m256i lanes_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline __m256i lanes_s8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }

// A block's integer sums weighted by per-lane scales sc (int32 lanes of int16 values), exactly. On AVX2 the
// maddubs pairs gather in int16 (at most four of them for 5-bit codes or 6-bit magnitudes, eight for 4-bit ones,
// see kx8_group) and madd weights them by the scale in both halves of the lane; on VNNI dpbusd sums in int32 and
// a multiply weights the sum.
static inline __m256i scale_pairs(__m256i sc) {
  return _mm256_or_si256(_mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(sc, 16));
}

// Sixteen codes of each lane (four of them in each 32-bit lane for activations x + 4k: w[k], unsigned) against
// one token's activations (Q5_K's halves: on AVX2 four maddubs pairs of at most 2 * 31 * 127 each fit int16,
// eight would not).
static inline __m256i kx8_half(const __m256i* w, const int8_t* x) {
#ifdef GGML_VNNI
  __m256i dot = _mm256_setzero_si256();
  for (int k = 0; k < 4; ++k) dot = _mm256_dpbusd_epi32(dot, w[k], broadcast4(x + 4 * k));
  return dot;
#else
  __m256i sum = _mm256_setzero_si256();
  for (int k = 0; k < 4; ++k) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[k], broadcast4(x + 4 * k)));
  return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
#endif
}

// Half h of a Q6_K block whose nibbles are at nib: four loads of nibbles (low ones for h = 0, high ones for h = 1)
// and one of high bits, bits 2k, 2k + 1 of each byte moved to bits 4, 5 (masked after the shift: no bit of a
// neighbour stays). w[k]: codes 4k .. 4k + 3 of the half (0..63, unsigned) in each row's lane.
static inline void q6k_half_codes(const uint8_t* nib, int h, __m256i* w) {
  const __m256i low = _mm256_set1_epi8(0x0F), bits = _mm256_set1_epi8(0x30);
  const __m256i high = _mm256_loadu_si256((const __m256i*)(nib + 128 + 32 * h));
  for (int k = 0; k < 4; ++k) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(nib + 32 * k));
    const __m256i t = k < 2 ? _mm256_slli_epi32(high, 4 - 2 * k) : _mm256_srli_epi32(high, 2 * k - 4);
    w[k] = _mm256_or_si256(_mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, low), _mm256_and_si256(t, bits));
  }
}

// A Q4_K/Q5_K/Q6_K block's codes from its nibbles at nib (and the planes after them): lo[k] codes 4k .. 4k + 3 of
// each row's lane, hi[k] codes 16 + 4k .. 16 + 4k + 3 (unsigned), Q5_K's fifth bits and Q6_K's two high bits
// shifted into place from one or two more loads.
template <int64_t BASE>
static inline void kx8_codes(const uint8_t* nib, __m256i* lo, __m256i* hi) {
  if constexpr (BASE == Q6_K) {
    q6k_half_codes(nib, 0, lo);
    q6k_half_codes(nib, 1, hi);
    return;
  }
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int k = 0; k < 4; ++k) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(nib + 32 * k));
    lo[k] = _mm256_and_si256(v, low);
    hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  }
  if (BASE == Q5_K) {
    const __m256i h = _mm256_loadu_si256((const __m256i*)(nib + 128)), bit = _mm256_set1_epi8(16);
    for (int k = 0; k < 4; ++k) {
      lo[k] = _mm256_or_si256(lo[k], _mm256_and_si256(_mm256_slli_epi32(h, 4 - k), bit));
      hi[k] = _mm256_or_si256(hi[k], _mm256_and_si256(_mm256_srli_epi32(h, k), bit));
    }
  }
}

// Q4_K/Q5_K/Q6_K rows interleaved eight by eight (X8, see ggml_formats.h), against NT tokens a pass over a
// group's superblocks. Per block of 32, its codes are unpacked once for the NT tokens: four loads of nibbles
// (codes i and 16 + i of each row's lane), Q5_K's fifth bits and Q6_K's two high bits shifted into place from
// one or two more loads. The integer sum per row (Q4_K: eight maddubs pairs of at most 2 * 15 * 127 in int16,
// widened once; Q5_K: each half's four pairs of at most 2 * 31 * 127; Q6_K, VNNI build only (AVX2 takes
// q6kx8_group): the unsigned codes by dpbusd, less 32 times the half's integer sum of activations (Act's off16,
// loaded rather than computed a token and block), each half by its own scale) is exact, and then per block and
// token one multiply-add for eight rows (Q4_K/Q5_K: by (d * sc) * dx, the block's scale in d once for the pass's
// tokens, exact), and one more for the mins of Q4_K/Q5_K: the arithmetic x8_rows of the scalar path does row by
// row.
template <int64_t BASE, int NT>
static void kx8_group(const uint8_t* group, int64_t nsb, const int8_t* const* xq, const float* const* xd,
                      const float* const* xs, const int32_t* const* xoff16, float* const* out) {
  constexpr bool Q6 = BASE == Q6_K, Q5 = BASE == Q5_K;
#ifndef GGML_VNNI
  static_assert(!Q6, "AVX2's Q6_K is q6kx8_group's");
#endif
  constexpr int64_t BYTES = Q6 ? 1680 : Q5 ? 1440 : 1184, BLOCK = Q6 ? 192 : Q5 ? 160 : 128, CODES = Q6 ? 144 : 160;
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* p = group + s * BYTES;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    const __m256 neg_dmin = Q6 ? d : _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16))),
                                                    _mm256_set1_ps(-0.f));
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t b = 8 * s + j;
      __m256i lo[4], hi[4];
      kx8_codes<BASE>(p + CODES + BLOCK * j, lo, hi);
      __m256i sc0 = _mm256_setzero_si256(), sc1 = sc0;
      __m256 m = d, ds = d;
      if (Q6) {
        sc0 = lanes_s8(p + 16 + 16 * j);
        sc1 = lanes_s8(p + 24 + 16 * j);
      } else {
        ds = _mm256_mul_ps(d, _mm256_cvtepi32_ps(lanes_u8(p + 32 + 8 * j)));
        m = _mm256_mul_ps(neg_dmin, _mm256_cvtepi32_ps(lanes_u8(p + 96 + 8 * j)));
      }
      for (int t = 0; t < NT; ++t) {
        const int8_t* x = xq[t] + b * 32;
        __m256i dot;
        if (BASE == Q4_K) {
#ifdef GGML_VNNI
          // Two chains: a token alone waits on two chains half as long.
          __m256i dot0 = _mm256_setzero_si256(), dot1 = _mm256_setzero_si256();
          dpbusd_block(dot0, dot1, lo, hi, x);
          dot = _mm256_add_epi32(dot0, dot1);
#else
          __m256i sum = _mm256_setzero_si256();
          for (int k = 0; k < 4; ++k)
            sum = _mm256_add_epi16(sum, _mm256_add_epi16(_mm256_maddubs_epi16(lo[k], broadcast4(x + 4 * k)),
                                                         _mm256_maddubs_epi16(hi[k], broadcast4(x + 16 + 4 * k))));
          dot = _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
#endif
        } else if (Q6) {
#ifdef GGML_VNNI
          // The unsigned codes (0..63) as they are, less 32 times the half's integer sum of activations: the
          // same integer as (q - 32) . xq, with no sign instruction per token.
          __m256i dot0 = _mm256_set1_epi32(xoff16[t][2 * b]);
          __m256i dot1 = _mm256_set1_epi32(xoff16[t][2 * b + 1]);
          dpbusd_block(dot0, dot1, lo, hi, x);
          dot = _mm256_add_epi32(_mm256_mullo_epi32(dot0, sc0), _mm256_mullo_epi32(dot1, sc1));
#endif
        } else {
          dot = _mm256_add_epi32(kx8_half(lo, x), kx8_half(hi, x + 16));
        }
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ds, _mm256_broadcast_ss(xd[t] + b)), acc[t]);
        if (!Q6) acc[t] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs[t] + b), acc[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out[t], acc[t]);
}


#ifdef GGML_VNNI
// IQ4_NL and IQ4_XS rows interleaved eight by eight (X8), against NT tokens a pass: per block of 32, four loads of
// nibbles (codes i and 16 + i of each row's lane) looked up in the table by a byte shuffle, once for the NT tokens.
// VNNI build (AVX2's: iq4x8_group): the table is offset by 128 (unsigned 1..241: dpbusd's sums of four stay far
// from int32's limit) and 128 times the token's integer sum of the block is taken off (the sum starts from Act's
// off128): the same exact sum with no sign instruction per token. Then per block and token one multiply-add for
// eight rows, by d * dx (IQ4_XS: by (d * sc) * dx, the block's signed scale per lane in d once for the pass's
// tokens): the arithmetic x8_rows of the scalar path does row by row.
template <int64_t BASE, int NT>
static void x8_group_iq4(const uint8_t* group, int64_t nblocks, const int8_t* const* xq, const float* const* xd,
                         const int32_t* const* xoff128, float* const* out) {
  constexpr bool XS = BASE == IQ4_XS;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m128i table128 = _mm_loadu_si128((const __m128i*)iq4_table(BASE));
  const __m256i table = _mm256_xor_si256(_mm256_set_m128i(table128, table128), _mm256_set1_epi8(char(0x80)));
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  __m256 d = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* p = XS ? group + (b / 8) * 1104 : group + b * 144;
    const uint8_t* nib = XS ? p + 80 + 128 * (b % 8) : p + 16;
    if (!XS || b % 8 == 0) d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    const __m256 ds = XS ? _mm256_mul_ps(d, _mm256_cvtepi32_ps(lanes_s8(p + 16 + 8 * (b % 8)))) : d;
    // w[k] holds codes 4k' + i (k = k' < 4) or 16 + 4k' + i (k = 4 + k') of each row (on VNNI offset by 128).
    __m256i w[8];
    for (int k = 0; k < 4; ++k) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(nib + 32 * k));
      w[k] = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
      w[4 + k] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
    }
    for (int t = 0; t < NT; ++t) {
      const int8_t* x = xq[t] + b * 32;
      __m256i dot = _mm256_set1_epi32(xoff128[t][b]), dot1 = _mm256_setzero_si256();
      dpbusd_block(dot, dot1, w, w + 4, x);
      dot = _mm256_add_epi32(dot, dot1);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ds, _mm256_broadcast_ss(xd[t] + b)), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out[t], acc[t]);
}
#endif

// A pass's NT tokens from token t on: their activations (codes, scales, the offsets' sums) and outputs.
template <int NT>
struct Tokens {
  const int8_t* xq[NT];
  const float *xd[NT], *xs[NT];
  const int32_t *xoff128[NT], *xsum16[NT], *xhigh16[NT], *xoff16[NT];
  const uint8_t* xu[NT];
  float* out[NT];
  Tokens(const Act& a, int64_t k, int64_t nb, float* y, int64_t stride, int64_t t) {
    for (int i = 0; i < NT; ++i) {
      xq[i] = a.q + (t + i) * k;
      xd[i] = a.d + (t + i) * nb;
      xs[i] = a.s + (t + i) * nb;
      xoff128[i] = a.off128 + (t + i) * nb;
      xsum16[i] = a.sum16 + (t + i) * nb * 2;
      xhigh16[i] = a.high16 + (t + i) * nb * 2;
      xoff16[i] = a.off16 + (t + i) * nb * 2;
      xu[i] = a.u ? a.u + (t + i) * k : nullptr;
      out[i] = y + (t + i) * stride;
    }
  }
};

// NT tokens a pass over one group, for tokens [t, end); BASE: the blocks' type.
template <int64_t BASE, int NT>
static int64_t x8_pass(const uint8_t* group, int64_t nb, const Act& a, int64_t k, float* y, int64_t stride,
                       int64_t t, int64_t end) {
  for (; t + NT <= end; t += NT) {
    const Tokens<NT> x(a, k, nb, y, stride, t);
    if constexpr (BASE == Q8_0)
      x8_group_q8<NT>(group, nb, x.xq, x.xd, x.out);
#ifdef GGML_VNNI
    else if constexpr (iq4_type(BASE))
      x8_group_iq4<BASE, NT>(group, nb, x.xq, x.xd, x.xoff128, x.out);
#endif
    else if constexpr (BASE == Q5_0 || BASE == Q5_1)
      x8_group_q5<BASE == Q5_1, NT>(group, nb, x.xq, x.xd, x.xs, x.out);
    else if constexpr (BASE == Q4_K || BASE == Q5_K || BASE == Q6_K)
      kx8_group<BASE, NT>(group, nb / 8, x.xq, x.xd, x.xs, x.xoff16, x.out);
    else
      x8_group<BASE == Q4_1, NT>(group, nb, x.xq, x.xd, x.xs, x.out);
  }
  return t;
}

// A per-thread buffer for n unpacked blocks, 64-byte aligned by hand (the blocks are read with aligned loads, and a
// vector of them was not aligned here): grown as needed, kept for the thread's later calls.
template <class Block>
static Block* thread_blocks(int64_t n) {
  static thread_local std::vector<uint8_t> buffer;
  if (buffer.size() < n * sizeof(Block) + 64) buffer.resize(n * sizeof(Block) + 64);
  return reinterpret_cast<Block*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
}

// ---------------------------------------------------------------------------------------------------
// X8 | Q3_K (see X8 in ggml_formats.h).

// A block of 32 of a group of eight Q3_K rows, unpacked for the kernel: w[k] (k < 4) codes 4k .. 4k + 3 of each
// row's lane, w[4 + k] codes 16 + 4k .. 16 + 4k + 3 (q = 0..7), and the scales in the form the products take them
// (see q3kx8_group).
struct Q3kBlock {
  __m256i w[8], pair0, pair1, start;
};

// Block j of a group's superblock p: two loads of low bits (each four codes of every row in each of four bit pairs)
// and one of high bits, each code's high bit shifted to bit 2.
static inline void q3kx8_unpack(const uint8_t* p, int64_t j, Q3kBlock& u) {
  const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
  const uint8_t* codes = p + 144 + 96 * j;
  const __m256i l0 = _mm256_loadu_si256((const __m256i*)codes);
  const __m256i l1 = _mm256_loadu_si256((const __m256i*)(codes + 32));
  const __m256i h = _mm256_loadu_si256((const __m256i*)(codes + 64));
  for (int k = 0; k < 4; ++k) {
    // Masked after each shift: bit 2 comes from bit k (2 - k left, or 1 right) or 4 + k (2 + k right) of the
    // same byte, bits 0, 1 from bits 2k, 2k + 1.
    const __m256i hl = _mm256_and_si256(k < 3 ? _mm256_slli_epi32(h, 2 - k) : _mm256_srli_epi32(h, 1), four);
    const __m256i hh = _mm256_and_si256(_mm256_srli_epi32(h, 2 + k), four);
    const __m256i ll = k ? _mm256_srli_epi32(l0, 2 * k) : l0, lh = k ? _mm256_srli_epi32(l1, 2 * k) : l1;
#ifdef GGML_VNNI
    // (low & 3) | high in one instruction.
    u.w[k] = _mm256_ternarylogic_epi32(ll, hl, three, 0xEC);
    u.w[4 + k] = _mm256_ternarylogic_epi32(lh, hh, three, 0xEC);
#else
    u.w[k] = _mm256_or_si256(_mm256_and_si256(ll, three), hl);
    u.w[4 + k] = _mm256_or_si256(_mm256_and_si256(lh, three), hh);
#endif
  }
  const __m256i sc0 = lanes_s8(p + 16 + 16 * j), sc1 = lanes_s8(p + 24 + 16 * j);
#ifdef GGML_VNNI
  const __m256i low16 = _mm256_set1_epi32(0xFFFF), zero = _mm256_setzero_si256();
  u.pair0 = _mm256_or_si256(_mm256_and_si256(sc0, low16), _mm256_slli_epi32(_mm256_sub_epi32(zero, sc0), 18));
  u.pair1 = _mm256_or_si256(_mm256_and_si256(sc1, low16), _mm256_slli_epi32(_mm256_sub_epi32(zero, sc1), 18));
  u.start = _mm256_sub_epi32(zero, _mm256_slli_epi32(_mm256_add_epi32(sc0, sc1), 14));
#else
  u.pair0 = scale_pairs(sc0);
  u.pair1 = scale_pairs(sc1);
#endif
}

// Q3_K rows interleaved eight by eight, against NT tokens a pass over a group's superblocks, each block's codes
// unpacked once for the NT tokens (READY: once for all passes, into `ready`, one Q3kBlock a block). Per token and
// half of 16 the integer sum sc * ((q - 4) . x), exactly, the offset taken as 4 times the activations' integer
// sum S:
// - AVX2: the four maddubs sums of a half gather in int16 (at most 4 * 2 * 7 * 127 = 7112), each of a lane's two
//   int16 halves gives up 2 S (|S| <= 16 * 127: 11176 in all), and madd weights both by the scale.
// - VNNI: dpbusd sums the half's codes from (S << 16) + 16384 (Act's high16), so that a lane's low int16 holds the
//   codes' sum plus 16384 (2160..30608: no borrow from the high half, which holds S), and dpwssd multiplies the pair
//   by (sc, -4 sc): sc (q . x) - 4 sc S + 16384 sc, the last term taken off once a block for all tokens (the
//   block's dot starts from -16384 (sc0 + sc1)). One instruction weights a half and takes its offset.
// Then one multiply-add for eight rows: the arithmetic x8_rows of the scalar path does row by row. xsum: the
// tokens' sum16 (AVX2) or high16 (VNNI).
template <int NT, bool READY>
static void q3kx8_group(const uint8_t* group, int64_t nsb, const Q3kBlock* ready, const int8_t* const* xq,
                        const float* const* xd, const int32_t* const* xsum, float* const* out) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* p = group + s * 912;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t b = 8 * s + j;
      Q3kBlock local;
      if (!READY) q3kx8_unpack(p, j, local);
      const Q3kBlock& u = READY ? ready[b] : local;
      for (int t = 0; t < NT; ++t) {
        const int8_t* x = xq[t] + b * 32;
#ifdef GGML_VNNI
        __m256i c0 = _mm256_set1_epi32(xsum[t][2 * b]), c1 = _mm256_set1_epi32(xsum[t][2 * b + 1]);
        dpbusd_block(c0, c1, u.w, u.w + 4, x);
        const __m256i dot = _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(u.start, c0, u.pair0), c1, u.pair1);
#else
        __m256i s0 = _mm256_maddubs_epi16(u.w[0], broadcast4(x));
        __m256i s1 = _mm256_maddubs_epi16(u.w[4], broadcast4(x + 16));
        for (int k = 1; k < 4; ++k) {
          s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(u.w[k], broadcast4(x + 4 * k)));
          s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(u.w[4 + k], broadcast4(x + 16 + 4 * k)));
        }
        s0 = _mm256_sub_epi16(s0, _mm256_set1_epi16(int16_t(2 * xsum[t][2 * b])));
        s1 = _mm256_sub_epi16(s1, _mm256_set1_epi16(int16_t(2 * xsum[t][2 * b + 1])));
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(s0, u.pair0), _mm256_madd_epi16(s1, u.pair1));
#endif
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_broadcast_ss(xd[t] + b)), acc[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out[t], acc[t]);
}

// The kernels whose passes can read their blocks unpacked (X8: Q3_K, and on AVX2 the other k-quants and IQ4;
// X16: the k-quants and IQ4). A Kernel value says where its rows are (one group, or two pitch apart) and gives:
// Kernel::Block, one block unpacked; unpack(b, block); run<NT, READY>(ready, nb, tokens), one pass of NT tokens
// over the rows (READY: from `ready`, else unpacking each block itself); Kernel::unbuffered, up to how many tokens
// the passes unpack for themselves.
template <class Kernel, int NT, bool READY>
static int64_t unpacked_pass(const Kernel& kernel, const typename Kernel::Block* ready, int64_t nb, const Act& a,
                             int64_t k, float* y, int64_t stride, int64_t t) {
  for (; t + NT <= a.n; t += NT) kernel.template run<NT, READY>(ready, nb, Tokens<NT>(a, k, nb, y, stride, t));
  return t;
}

// The rows against tokens [t0, a.n), four, two, then one a pass. More than Kernel::unbuffered of them: the blocks
// unpacked once, into a buffer of the thread's that the passes read, rather than once a pass (X8: the k-quants'
// 352 bytes a block of 32, 22 KB for 2048 columns, IQ4's 576; X16: 768 and 48 KB).
template <class Kernel>
static void unpacked_tokens(const Kernel& kernel, int64_t nb, const Act& a, int64_t k, float* y, int64_t stride,
                            int64_t t0 = 0) {
  if (a.n - t0 <= Kernel::unbuffered) {
    int64_t t = unpacked_pass<Kernel, 4, false>(kernel, nullptr, nb, a, k, y, stride, t0);
    t = unpacked_pass<Kernel, 2, false>(kernel, nullptr, nb, a, k, y, stride, t);
    unpacked_pass<Kernel, 1, false>(kernel, nullptr, nb, a, k, y, stride, t);
    return;
  }
  typename Kernel::Block* ready = thread_blocks<typename Kernel::Block>(nb);
  for (int64_t b = 0; b < nb; ++b) kernel.unpack(b, ready[b]);
  int64_t t = unpacked_pass<Kernel, 4, true>(kernel, ready, nb, a, k, y, stride, t0);
  t = unpacked_pass<Kernel, 2, true>(kernel, ready, nb, a, k, y, stride, t);
  unpacked_pass<Kernel, 1, true>(kernel, ready, nb, a, k, y, stride, t);
}

struct Q3kX8 {
  const uint8_t* group;
  using Block = Q3kBlock;
  static constexpr int64_t unbuffered = 4;
  void unpack(int64_t b, Block& u) const { q3kx8_unpack(group + (b / 8) * 912, b % 8, u); }
  template <int NT, bool READY>
  void run(const Block* ready, int64_t nb, const Tokens<NT>& x) const {
#ifdef GGML_VNNI
    q3kx8_group<NT, READY>(group, nb / 8, ready, x.xq, x.xd, x.xhigh16, x.out);
#else
    q3kx8_group<NT, READY>(group, nb / 8, ready, x.xq, x.xd, x.xsum16, x.out);
#endif
  }
};
