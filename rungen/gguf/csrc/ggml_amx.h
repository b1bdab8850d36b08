// AMX: the X16 products of sixteen tokens at a time on Intel's tile unit (AMX-INT8: Sapphire Rapids and later).
// ggml_vnni.cpp includes this file after ggml_x16.h (whose X16 helpers it uses); there the
// tokens of x8_span (ggml_spans.h) go sixteen at a time through amx_pair on the `amx` path (current_isa),
// the rest through the X16 passes.
//
// The integer dot products move to the tiles; the float arithmetic stays the VNNI kernels' own. A pair of X8
// groups (16 rows) is unpacked once into a panel, a block of 32 columns at a time: the 16 rows' codes in the tile
// unit's layout (a tile row of 64 bytes holds four consecutive codes of each of the 16 rows, which is what one
// X16 register of codes already is), signed where the VNNI kernels offset them to unsigned, and the block's
// scales as the X16 kernels load them. Then for each 16 tokens and each block: one tile product (TDPBSSD or
// TDPBSUD) gives the exact integer sums of 16 tokens x 16 rows, and each token's row of them is scaled and added
// as x16_group's: the same integers, the same float operations in the same order, so the same bits as every other
// path. The integer scale of a Q4_K, Q5_K or IQ4_XS block is in its d, as on every path (d * sc is exact in float).
// Q3_K's scales go into its codes instead (q3k_fold), so its blocks take one product each and no
// float scaling. Q6_K stays on the X16 kernels (amx_takes).

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8")

// The tile registers (palette 1), configured by amx_configure: the activations and codes of a whole block (16
// tokens x 32 bytes, 8 x 64 bytes) in 0 and 4, or 1 and 5 for the next block, their int32 sums (16 tokens x 16
// rows) in 2 or 3.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
constexpr TileConfig whole_blocks = {1, 0, {}, {32, 32, 64, 64, 64, 64}, {16, 16, 16, 16, 8, 8}};

// One block of a pair of groups, unpacked for the tiles: codes as tile rows r = 0..7 (row r holds the 16 rows'
// codes 4r .. 4r + 3), the block's d and offset m as the X16 kernels hold them.
struct alignas(64) AmxBlock {
  uint8_t codes[512];
  __m512 d, m;
};

// Whether a type's prompts go through the tiles. Not Q6_K's: its scales per 16 columns cost two tile products a
// block, and the X16 kernels are faster for it (docs/kernels.md, "Measured choices"). Not MXFP4's: its tile path
// (IQ4_NL's with its table) has not run on an AMX machine yet.
constexpr bool amx_takes(int64_t t) { return t != Q6_K && t != MXFP4; }

// Whether a type's codes go to the tiles signed (Q8_0, IQ4, Q3_K's scaled codes) or unsigned, and whether it has
// offsets m.
constexpr bool amx_signed(int64_t t) { return t == Q8_0 || t == IQ4_NL || t == IQ4_XS || t == Q3_K; }
constexpr bool amx_offset(int64_t t) { return !amx_signed(t); }

// Q3_K's codes w (q = 0..7, four a lane as q3kx16_codes leaves them) times minus their half's scale sc (-32..31,
// a lane's row): -(q - 4) sc lies in -128..124, so it fits a signed byte where (q - 4) sc (up to 128) would not.
// The tiles then sum minus the VNNI kernel's integer dot exactly, and amx_unpack negates d to match: the float
// product of the two negations is the same number.
static inline __m512i q3k_fold(__m512i w, __m512i sc) {
  const __m512i c = _mm512_sub_epi8(w, _mm512_set1_epi8(4)), neg = _mm512_sub_epi32(_mm512_setzero_si512(), sc);
  const __m512i neg16 = _mm512_or_si512(_mm512_and_si512(neg, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(neg, 16));
  const __m512i even = _mm512_mullo_epi16(_mm512_srai_epi16(_mm512_slli_epi16(c, 8), 8), neg16);
  const __m512i odd = _mm512_mullo_epi16(_mm512_srai_epi16(c, 8), neg16);
  return _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, even, _mm512_slli_epi16(odd, 8));
}

// Block b of the pair of groups at `group` (the second pitch bytes on) into `out`.
template <int64_t BASE>
static void amx_unpack(const uint8_t* group, int64_t pitch, int64_t b, AmxBlock& out) {
  __m512i w[8];
  __m512 d, m = _mm512_setzero_ps();
  if constexpr (BASE == Q4_0 || BASE == Q4_1 || BASE == Q5_0 || BASE == Q5_1) {
    constexpr bool HAS_MIN = BASE == Q4_1 || BASE == Q5_1, Q5 = BASE == Q5_0 || BASE == Q5_1;
    const uint8_t* p = group + b * (Q5 ? (HAS_MIN ? 192 : 176) : (HAS_MIN ? 160 : 144));
    if (Q5)
      x16_codes_q5(p + (HAS_MIN ? 64 : 48), p + (HAS_MIN ? 32 : 16), pitch, w, w + 4);
    else
      x16_codes_q4(p + (HAS_MIN ? 32 : 16), pitch, w, w + 4);
    d = pair_halves(p, pitch);
    m = HAS_MIN ? pair_halves(p + 16, pitch) : _mm512_mul_ps(_mm512_set1_ps(Q5 ? -16.f : -8.f), d);
  } else if constexpr (BASE == Q8_0) {
    const uint8_t* p = group + b * 272;
    for (int j = 0; j < 8; ++j) w[j] = pair_load(p + 16 + 32 * j, pitch);
    d = pair_halves(p, pitch);
  } else if constexpr (BASE == IQ4_NL || BASE == IQ4_XS) {
    constexpr bool XS = BASE == IQ4_XS;
    const uint8_t* p = XS ? group + (b / 8) * 1104 : group + b * 144;
    x16_codes_iq4(XS ? p + 80 + 128 * (b % 8) : p + 16, pitch,
                  _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)kvalues_iq4nl)), w);
    d = pair_halves(p, pitch);
    if (XS) d = _mm512_mul_ps(d, _mm512_cvtepi32_ps(pair_lanes_s8(p + 16 + 8 * (b % 8), pitch)));
  } else if constexpr (BASE == Q3_K) {
    const int64_t j = b % 8;
    const uint8_t* p = group + (b / 8) * 912;
    q3kx16_codes(p, pitch, j, w);
    const __m512i s0 = pair_lanes_s8(p + 16 + 16 * j, pitch), s1 = pair_lanes_s8(p + 24 + 16 * j, pitch);
    for (int k = 0; k < 4; ++k) {
      w[k] = q3k_fold(w[k], s0);
      w[4 + k] = q3k_fold(w[4 + k], s1);
    }
    d = _mm512_sub_ps(_mm512_setzero_ps(), pair_halves(p, pitch));
  } else {
    static_assert(BASE == Q4_K || BASE == Q5_K);  // unsigned codes, d * sc and m as the X16 kernels unpack them
    K16Block u;
    kx16_unpack<BASE>(group + (b / 8) * kx16_bytes<BASE>(), pitch, b % 8, u);
    for (int k = 0; k < 8; ++k) w[k] = u.w[k];
    d = u.d;
    m = u.m;
  }
  for (int r = 0; r < 8; ++r) _mm512_store_si512((__m512i*)(out.codes + 64 * r), w[r]);
  out.d = d;
  out.m = m;
}

// The integer sums of a pair's panel blocks [0, n) (at most AMX_RUN) against tokens [t, t + 16) (their codes xq
// from the panel's first block on, k bytes a token) into sums: per block 16 x 16 int32, token-major.
constexpr int64_t AMX_RUN = 4;
template <int64_t BASE>
static inline void amx_sums(const AmxBlock* panel, int64_t n, const int8_t* xq, int64_t k, int32_t* sums) {
  for (int64_t b = 0; b < n; ++b, sums += 256) {
    const uint8_t* codes = panel[b].codes;
    if (b % 2 == 0) {  // two blocks in flight: their tiles apart
      _tile_loadd(0, xq + 32 * b, k);
      _tile_loadd(4, codes, 64);
      _tile_zero(2);
      if constexpr (amx_signed(BASE)) _tile_dpbssd(2, 0, 4); else _tile_dpbsud(2, 0, 4);
      _tile_stored(2, sums, 64);
    } else {
      _tile_loadd(1, xq + 32 * b, k);
      _tile_loadd(5, codes, 64);
      _tile_zero(3);
      if constexpr (amx_signed(BASE)) _tile_dpbssd(3, 1, 5); else _tile_dpbsud(3, 1, 5);
      _tile_stored(3, sums, 64);
    }
  }
}

// Tokens [t, t + 16) against a pair's blocks [b0, b0 + n) (panel): each token's 16 outputs of the pair in y
// carried on from the blocks before b0 (none: from zero), as x16_group carries its accumulators. The tiles run
// AMX_RUN blocks ahead of the float work, which takes their sums as x16_group takes dpbusd's.
template <int64_t BASE>
static void amx_tokens16(const AmxBlock* panel, int64_t b0, int64_t n, const Act& a, int64_t k, int64_t nb,
                         int64_t t, float* y, int64_t stride) {
  alignas(64) int32_t sums[AMX_RUN * 256];
  const Tokens<16> x(a, k, nb, y, stride, t);
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = b0 ? _mm512_loadu_ps(x.out[i]) : _mm512_setzero_ps();
  const int8_t* xq = a.q + t * k + 32 * b0;
  for (int64_t r = 0; r < n; r += AMX_RUN) {
    const int64_t run = std::min(n - r, AMX_RUN);
    amx_sums<BASE>(panel + r, run, xq + 32 * r, k, sums);
    const int32_t* s = sums;
    for (int64_t b = b0 + r; b < b0 + r + run; ++b, s += 256) {
      const AmxBlock& w = panel[b - b0];
      for (int i = 0; i < 16; ++i) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512((const __m512i*)(s + 16 * i)));
        acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(w.d, broadcast_f16(x.xd[i] + b)), acc[i]);
        if constexpr (amx_offset(BASE)) acc[i] = _mm512_fmadd_ps(w.m, broadcast_f16(x.xs[i] + b), acc[i]);
      }
    }
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(x.out[i], acc[i]);
}

// A pair of groups against tokens [0, end) (end a multiple of 16), AMX_TOKENS tokens and AMX_SPAN blocks at a
// time: the span unpacked into the panel (10 KB: it stays in the L1 cache), then each sixteen of the tokens through
// it, their outputs carried in y from one span to the next (stored and reloaded floats: the same bits; 4 KB of y
// for the tokens, which stay in the cache too).
constexpr int64_t AMX_SPAN = 16, AMX_TOKENS = 64;
template <int64_t BASE>
static void amx_pair(const uint8_t* group, int64_t pitch, int64_t nb, const Act& a, int64_t k, float* y,
                     int64_t stride, int64_t end) {
  AmxBlock panel[AMX_SPAN];
  for (int64_t t0 = 0; t0 < end; t0 += AMX_TOKENS)
    for (int64_t b0 = 0; b0 < nb; b0 += AMX_SPAN) {
      const int64_t n = std::min(nb - b0, AMX_SPAN);
      for (int64_t b = 0; b < n; ++b) amx_unpack<BASE>(group, pitch, b0 + b, panel[b]);
      for (int64_t t = t0; t < std::min(end, t0 + AMX_TOKENS); t += 16)
        amx_tokens16<BASE>(panel, b0, n, a, k, nb, t, y, stride);
    }
}

static void amx_configure() { _tile_loadconfig(&whole_blocks); }

static void amx_release() { _tile_release(); }

#pragma GCC pop_options
