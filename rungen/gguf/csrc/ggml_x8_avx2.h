// AVX2's own X8 kernels for prompts, which read a group's blocks unpacked once into a buffer of the thread's
// (Q4_K/Q5_K/Q6_K and IQ4; VNNI takes the shared ones, or X16 from eight tokens on): ggml_avx2.cpp includes this
// file after ggml_x8.h.

#ifndef GGML_VNNI
// Q6_K on AVX2 (the VNNI build takes kx8_group), in two forms: q6kx8_group for a few tokens (decode), unpacking
// each block itself, and q6kx8_ready for more, reading the blocks unpacked once into a buffer (Q6kBlock).

// The half's scale in both int16 of each row's lane (madd's form).
static inline __m256i q6k_scale(const uint8_t* p, int64_t j, int h) {
  return scale_pairs(lanes_s8(p + 16 + 8 * h + 16 * j));
}

// The lane's pair (-32 sc0, -32 sc1): the offset of its two halves.
static inline __m256i q6k_offset(const uint8_t* p, int64_t j) {
  const __m256i neg32 = _mm256_set1_epi32(-32);
  const __m256i first = _mm256_mullo_epi16(lanes_s8(p + 16 + 16 * j), neg32);
  const __m256i second = _mm256_mullo_epi16(lanes_s8(p + 24 + 16 * j), neg32);
  return _mm256_or_si256(_mm256_and_si256(first, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(second, 16));
}

// Q6_K rows interleaved eight by eight against NT tokens (1 to 4) a pass, each block unpacked once for the pass's
// tokens, a half block of 16 columns at a time, so that a half's four code registers, its scale and the tokens'
// sums and accumulators fit the sixteen registers. The codes unsigned against the activations: two maddubs pairs
// (at most 2 x 2 x 63 x 127 = 32004) add in int16 before the half's scale weighs them in madd; the offset, -32
// times each half's scale times the token's integer sum of that half's activations, is one madd of the token's
// two half sums (at most 16 x 127: int16) against the lane's pair of -32 sc (at most 4096). The same integer as
// kx8_group's (the scalar path's), so the same bits.
template <int NT>
static void q6kx8_group(const uint8_t* group, int64_t nsb, const int8_t* const* xq, const float* const* xd,
                        const int32_t* const* xsum16, float* const* out) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* p = group + s * 1680;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t b = 8 * s + j;
      __m256i dot[NT];
      const __m256i offset = q6k_offset(p, j);
      for (int t = 0; t < NT; ++t) {
        const __m128i sums = _mm_packs_epi32(_mm_loadl_epi64((const __m128i*)(xsum16[t] + 2 * b)), _mm_setzero_si128());
        dot[t] = _mm256_madd_epi16(_mm256_broadcastd_epi32(sums), offset);
      }
      for (int h = 0; h < 2; ++h) {
        __m256i w[4];
        q6k_half_codes(p + 144 + 192 * j, h, w);
        const __m256i scale = q6k_scale(p, j, h);
        for (int t = 0; t < NT; ++t) {
          const int8_t* x = xq[t] + b * 32 + 16 * h;
          const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], broadcast4(x)),
                                               _mm256_maddubs_epi16(w[1], broadcast4(x + 4)));
          const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], broadcast4(x + 8)),
                                               _mm256_maddubs_epi16(w[3], broadcast4(x + 12)));
          const __m256i half = _mm256_add_epi32(_mm256_madd_epi16(s01, scale), _mm256_madd_epi16(s23, scale));
          dot[t] = _mm256_add_epi32(dot[t], half);
        }
      }
      for (int t = 0; t < NT; ++t)
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), _mm256_mul_ps(d, _mm256_broadcast_ss(xd[t] + b)), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out[t], acc[t]);
}

// A block unpacked for q6kx8_ready: w[k] (k < 4) codes 4k .. 4k + 3 of each row's lane less 32 (signed, -32..31),
// w[4 + k] codes 16 + 4k .. 16 + 4k + 3 less 32; the halves' scale pairs; start = -128 (sc0 sum(q - 32 over
// 0..15) + sc1 sum(q - 32 over 16..31)) per lane (at most 128 x 128 x 32 x 32 = 2^24), what the activations'
// bias of 128 adds to the block's sum, whatever the token.
struct Q6kBlock {
  __m256i w[8], pair0, pair1, start;
};

static inline void q6kx8_unpack(const uint8_t* p, int64_t j, Q6kBlock& u) {
  const __m256i c32 = _mm256_set1_epi8(32), ones = _mm256_set1_epi8(1);
  kx8_codes<Q6_K>(p + 144 + 192 * j, u.w, u.w + 4);
  for (int k = 0; k < 8; ++k) u.w[k] = _mm256_sub_epi8(u.w[k], c32);
  u.pair0 = q6k_scale(p, j, 0);
  u.pair1 = q6k_scale(p, j, 1);
  __m256i sum[2];
  for (int h = 0; h < 2; ++h) {
    __m256i s = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(ones, u.w[4 * h + k]));
    sum[h] = _mm256_madd_epi16(s, h ? u.pair1 : u.pair0);
  }
  u.start = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_add_epi32(sum[0], sum[1])), 7);
}

// Q6_K rows interleaved eight by eight against NT tokens a pass, the blocks read unpacked from `ready`. The
// activations biased by 128 (Act's u: 1..255, unsigned) against the signed codes, so that the codes are maddubs's
// second operand, read from memory rather than held in registers (which left the sixteen too few for four tokens'
// sums and accumulators), and no token's own offset is computed: sc (q - 32) . x = sc (q - 32) . (x + 128) - 128 sc
// sum(q - 32), the last term the block's start. Two maddubs pairs (at most 2 x 2 x 255 x 32 = 32640) add in int16
// before the half's scale weighs them in madd. The same integer as q6kx8_group's, so the same bits.
template <int NT>
static void q6kx8_ready(const uint8_t* group, int64_t nsb, const Q6kBlock* ready, const uint8_t* const* xu,
                        const float* const* xd, float* const* out) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(group + s * 1680)));
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t b = 8 * s + j;
      const Q6kBlock& u = ready[b];
      __m256i dot[NT];
      for (int t = 0; t < NT; ++t) dot[t] = u.start;
      for (int h = 0; h < 2; ++h) {
        const __m256i scale = h ? u.pair1 : u.pair0;
        const __m256i* w = u.w + 4 * h;
        for (int t = 0; t < NT; ++t) {
          const int8_t* x = reinterpret_cast<const int8_t*>(xu[t] + b * 32 + 16 * h);
          const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(broadcast4(x), w[0]),
                                               _mm256_maddubs_epi16(broadcast4(x + 4), w[1]));
          const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(broadcast4(x + 8), w[2]),
                                               _mm256_maddubs_epi16(broadcast4(x + 12), w[3]));
          const __m256i half = _mm256_add_epi32(_mm256_madd_epi16(s01, scale), _mm256_madd_epi16(s23, scale));
          dot[t] = _mm256_add_epi32(dot[t], half);
        }
      }
      for (int t = 0; t < NT; ++t)
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), _mm256_mul_ps(d, _mm256_broadcast_ss(xd[t] + b)), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out[t], acc[t]);
}
#endif


#ifndef GGML_VNNI
// Q4_K and Q5_K on AVX2 for more than sixteen tokens: a group's blocks unpacked once into the thread's buffer
// (Kx8Block), then q.x against the activations biased by 128 (Act's u, unsigned 1..255), the codes (0..15 or
// 0..31, as they are: non-negative, so valid as signed bytes) maddubs's second operand, read from memory: a pass's
// four tokens keep their sums and accumulators in the sixteen registers, and the block's codes are not unpacked
// again for every four tokens. (q . (x + 128)) - 128 sum(q) is the same integer as kx8_group's q . x, so the same
// bits; start holds -128 sum(q), the same for every token.
struct Kx8Block {
  __m256i w[8], start;
  __m256 ds, m;
};

template <int64_t BASE>
static inline void kx8_unpack(const uint8_t* group, int64_t b, Kx8Block& u) {
  constexpr bool Q5 = BASE == Q5_K;
  constexpr int64_t BYTES = Q5 ? 1440 : 1184, BLOCK = Q5 ? 160 : 128;
  const uint8_t* p = group + (b / 8) * BYTES;
  const int64_t j = b % 8;
  kx8_codes<BASE>(p + 160 + BLOCK * j, u.w, u.w + 4);
  // A lane's 32 codes summed: eight maddubs pairs of at most 2 x 31 in int16.
  const __m256i ones = _mm256_set1_epi8(1);
  __m256i sum = _mm256_setzero_si256();
  for (int k = 0; k < 8; ++k) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(ones, u.w[k]));
  const __m256i total = _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
  u.start = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), total), 7);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)));
  const __m256 neg_dmin = _mm256_xor_ps(dmin, _mm256_set1_ps(-0.f));
  u.ds = _mm256_mul_ps(d, _mm256_cvtepi32_ps(lanes_u8(p + 32 + 8 * j)));
  u.m = _mm256_mul_ps(neg_dmin, _mm256_cvtepi32_ps(lanes_u8(p + 96 + 8 * j)));
}

// Q4_K's maddubs pairs (at most 2 x 15 x 255 = 7650) add four to an int16 sum, Q5_K's (2 x 31 x 255 = 15810) two;
// each sum widened by a madd. Then per block and token kx8_group's two multiply-adds.
template <int64_t BASE, int NT>
static void kx8_ready(int64_t nblocks, const Kx8Block* ready, const uint8_t* const* xu, const float* const* xd,
                      const float* const* xs, float* const* out) {
  constexpr int RUN = BASE == Q5_K ? 2 : 4;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const Kx8Block& u = ready[b];
    for (int t = 0; t < NT; ++t) {
      const int8_t* x = reinterpret_cast<const int8_t*>(xu[t] + b * 32);
      __m256i dot = u.start;
      for (int r = 0; r < 8; r += RUN) {
        __m256i sum = _mm256_setzero_si256();
        for (int k = r; k < r + RUN; ++k)
          sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(broadcast4(x + 4 * k), u.w[k]));
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(sum, ones));
      }
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(u.ds, _mm256_broadcast_ss(xd[t] + b)), acc[t]);
      acc[t] = _mm256_fmadd_ps(u.m, _mm256_broadcast_ss(xs[t] + b), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out[t], acc[t]);
}
#endif

#ifndef GGML_VNNI
// IQ4_NL and IQ4_XS rows interleaved eight by eight (X8) on AVX2. A block unpacked: w[k] the signed values of codes
// 4k' + i (k = k' < 4) or 16 + 4k' + i (k = 4 + k') of each row's lane (a byte shuffle through the table), m[k]
// their magnitudes, d the rows' scales (IQ4_XS: d * sc, exact).
struct Iq4Block {
  __m256i w[8], m[8];
  __m256 d;
};

template <int64_t BASE>
static inline void iq4x8_unpack(const uint8_t* group, int64_t b, Iq4Block& u) {
  constexpr bool XS = BASE == IQ4_XS;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m128i table128 = _mm_loadu_si128((const __m128i*)iq4_table(BASE));
  const __m256i table = _mm256_set_m128i(table128, table128);
  const uint8_t* p = XS ? group + (b / 8) * 1104 : group + b * 144;
  const uint8_t* nib = XS ? p + 80 + 128 * (b % 8) : p + 16;
  for (int k = 0; k < 4; ++k) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(nib + 32 * k));
    u.w[k] = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
    u.w[4 + k] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
  }
  for (int k = 0; k < 8; ++k) u.m[k] = _mm256_abs_epi8(u.w[k]);
  u.d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  if (XS) u.d = _mm256_mul_ps(u.d, _mm256_cvtepi32_ps(lanes_s8(p + 16 + 8 * (b % 8))));
}

// Against NT tokens a pass (READY: the blocks unpacked once for all passes, into `ready`; else each block once a
// pass): the signed values multiply as Q8_0's codes, |w| times x with w's sign (maddubs's pairs at most
// 2 * 127 * 127: each widened to int32 at once by a madd, where two would not fit int16). Then per block and
// token one multiply-add for eight rows, as x8_rows row by row.
template <int64_t BASE, int NT, bool READY>
static void iq4x8_group(const uint8_t* group, int64_t nblocks, const Iq4Block* ready, const int8_t* const* xq,
                        const float* const* xd, float* const* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    Iq4Block local;
    if (!READY) iq4x8_unpack<BASE>(group, b, local);
    const Iq4Block& u = READY ? ready[b] : local;
    __m256i dot[NT];
    for (int t = 0; t < NT; ++t) dot[t] = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
      const __m256i w = u.w[k], m = u.m[k];
      for (int t = 0; t < NT; ++t) {
        const __m256i xs = _mm256_sign_epi8(broadcast4(xq[t] + b * 32 + (k < 4 ? 4 * k : 16 + 4 * (k - 4))), w);
        dot[t] = _mm256_add_epi32(dot[t], _mm256_madd_epi16(_mm256_maddubs_epi16(m, xs), ones));
      }
    }
    for (int t = 0; t < NT; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), _mm256_mul_ps(u.d, _mm256_broadcast_ss(xd[t] + b)), acc[t]);
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out[t], acc[t]);
}
#endif


#ifndef GGML_VNNI
// Q4_K, Q5_K and Q6_K on AVX2. Q6_K's blocks are buffered from five tokens; Q4_K's and Q5_K's, cheaper to unpack
// again, from 17, where buffering starts to pay (docs/kernels.md, "Measured choices").
template <int64_t BASE>
struct Kx8 {
  const uint8_t* group;
  static constexpr bool Q6 = BASE == Q6_K;
  using Block = std::conditional_t<Q6, Q6kBlock, Kx8Block>;
  static constexpr int64_t unbuffered = Q6 ? 4 : 16;
  void unpack(int64_t b, Block& u) const {
    if constexpr (Q6)
      q6kx8_unpack(group + (b / 8) * 1680, b % 8, u);
    else
      kx8_unpack<BASE>(group, b, u);
  }
  template <int NT, bool READY>
  void run(const Block* ready, int64_t nb, const Tokens<NT>& x) const {
    if constexpr (Q6 && READY)
      q6kx8_ready<NT>(group, nb / 8, ready, x.xu, x.xd, x.out);
    else if constexpr (Q6)
      q6kx8_group<NT>(group, nb / 8, x.xq, x.xd, x.xsum16, x.out);
    else if constexpr (READY)
      kx8_ready<BASE, NT>(nb, ready, x.xu, x.xd, x.xs, x.out);
    else
      kx8_group<BASE, NT>(group, nb / 8, x.xq, x.xd, x.xs, x.xoff16, x.out);
  }
};

template <int64_t BASE>
struct Iq4X8 {
  const uint8_t* group;
  using Block = Iq4Block;
  // Its block is four times the packed one and its unpacking cheap: buffered only from 25 tokens (docs/kernels.md).
  static constexpr int64_t unbuffered = 24;
  void unpack(int64_t b, Block& u) const { iq4x8_unpack<BASE>(group, b, u); }
  template <int NT, bool READY>
  void run(const Block* ready, int64_t nb, const Tokens<NT>& x) const {
    iq4x8_group<BASE, NT, READY>(group, nb, ready, x.xq, x.xd, x.out);
  }
};
#endif

