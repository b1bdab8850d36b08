// The SIMD kernels of the row-major layout and the activations' quantization, compiled once per instruction set:
// ggml_avx2.cpp and ggml_vnni.cpp include this file inside a namespace under `#pragma GCC target(...)`, with
// GGML_VNNI defined (AVX-512 VNNI, 256-bit registers) or not (AVX2). Only the 8-bit dot products differ between
// the two (maddubs and madd, or vpdpbusd); everything else is AVX2.
// It relies on ggml_kernels.h (Act, Job) and ggml_formats.h (KRow, the block sizes, the code kinds, the IQ4 table
// and the unpacked types' scale helpers).

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight int32 sums of four products each: unsigned codes (0..63) times signed activations (-127..127).
// maddubs's int16 pairs cannot saturate: 2 * 63 * 127 < 32767.
static inline __m256i dot_u8s8(__m256i w, __m256i x) {
#ifdef GGML_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

static inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_0 (d, 16 bytes of nibbles; w = d * (q - 8)) and Q4_1 (d, m, nibbles; w = d * q + m) against the
// activations of NT tokens (1 or 4): for each, sum over blocks of d * dx * (q . xq) + m * (dx * sum xq), with
// m = -8 d for Q4_0. A block's nibbles are unpacked once for the NT tokens; each token's arithmetic is the same
// sequence of operations whatever NT is (the file is built with -ffp-contract=off), so a token's product has
// the same bits alone and in a batch. Per block and token the work is the integer dot product and three vector
// operations: the token's scale is broadcast from memory (a load, no shuffle), and the offsets' products of
// four tokens are one vector (xs: the token's s [nb] when NT is 1, its group's s4 [nb][4] when 4).
template <bool HAS_MIN, int NT>
static void dot_q4(const uint8_t* row, int64_t nblocks, const int8_t* const* xq, const float* const* xd,
                   const float* xs, float* out) {
  static_assert(NT == 1 || NT == 4, "one token or a group of four");
  const int64_t bytes = HAS_MIN ? 20 : 18;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc0[NT], acc1[NT];
  for (int t = 0; t < NT; ++t) {
    acc0[t] = _mm256_setzero_ps();
    acc1[t] = _mm256_setzero_ps();
  }
  float mins1 = 0.f;
  __m128 mins4 = _mm_setzero_ps();
  int64_t b = 0;
  // Two blocks a turn on two accumulators: the fmadd chains do not wait on each other.
  for (; b + 1 < nblocks; b += 2) {
    const uint8_t* p0 = row + b * bytes;
    const uint8_t* p1 = p0 + bytes;
    const float d0 = half_to_float(p0), d1 = half_to_float(p1);
    const float m0 = HAS_MIN ? half_to_float(p0 + 2) : -8.f * d0;
    const float m1 = HAS_MIN ? half_to_float(p1 + 2) : -8.f * d1;
    const __m128i n0 = _mm_loadu_si128((const __m128i*)(p0 + bytes - 16));
    const __m128i n1 = _mm_loadu_si128((const __m128i*)(p1 + bytes - 16));
    const __m256i w0 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(n0, 4), n0), low);
    const __m256i w1 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(n1, 4), n1), low);
    const __m256 d0v = _mm256_set1_ps(d0), d1v = _mm256_set1_ps(d1);
    for (int t = 0; t < NT; ++t) {
      const __m256i s0 = dot_u8s8(w0, _mm256_loadu_si256((const __m256i*)(xq[t] + b * 32)));
      const __m256i s1 = dot_u8s8(w1, _mm256_loadu_si256((const __m256i*)(xq[t] + b * 32 + 32)));
      acc0[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0v, _mm256_broadcast_ss(xd[t] + b)), acc0[t]);
      acc1[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1v, _mm256_broadcast_ss(xd[t] + b + 1)),
                                acc1[t]);
    }
    if (NT == 4)
      mins4 = _mm_add_ps(mins4, _mm_add_ps(_mm_mul_ps(_mm_set1_ps(m0), _mm_loadu_ps(xs + 4 * b)),
                                           _mm_mul_ps(_mm_set1_ps(m1), _mm_loadu_ps(xs + 4 * b + 4))));
    else
      mins1 += m0 * xs[b] + m1 * xs[b + 1];
  }
  for (; b < nblocks; ++b) {
    const uint8_t* p = row + b * bytes;
    const float d = half_to_float(p);
    const float m = HAS_MIN ? half_to_float(p + 2) : -8.f * d;
    const __m128i n = _mm_loadu_si128((const __m128i*)(p + bytes - 16));
    const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(n, 4), n), low);
    const __m256 dv = _mm256_set1_ps(d);
    for (int t = 0; t < NT; ++t) {
      const __m256i s = dot_u8s8(w, _mm256_loadu_si256((const __m256i*)(xq[t] + b * 32)));
      acc0[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dv, _mm256_broadcast_ss(xd[t] + b)), acc0[t]);
    }
    if (NT == 4)
      mins4 = _mm_add_ps(mins4, _mm_mul_ps(_mm_set1_ps(m), _mm_loadu_ps(xs + 4 * b)));
    else
      mins1 += m * xs[b];
  }
  float mins[4];
  _mm_storeu_ps(mins, mins4);
  if (NT == 1) mins[0] = mins1;
  for (int t = 0; t < NT; ++t) out[t] = hsum(_mm256_add_ps(acc0[t], acc1[t])) + mins[t];
}


// One row of Q4_0/Q4_1 against tokens [first, end) (first a multiple of four), four tokens a pass; token u's
// output goes to y[(u - first) * stride].
template <bool HAS_MIN>
static void q4_row(const uint8_t* row, int64_t nb, const Act& a, int64_t k, float* y, int64_t stride,
                   const int64_t first, int64_t end) {
  int64_t t = first;
  for (; t + 4 <= end; t += 4) {
    const int8_t* xq[4];
    const float* xd[4];
    for (int i = 0; i < 4; ++i) {
      xq[i] = a.q + (t + i) * k;
      xd[i] = a.d + (t + i) * nb;
    }
    float out[4];
    dot_q4<HAS_MIN, 4>(row, nb, xq, xd, a.s4 + t * nb, out);
    for (int i = 0; i < 4; ++i) y[(t + i - first) * stride] = out[i];
  }
  for (; t < end; ++t) {
    const int8_t* xq[1] = {a.q + t * k};
    const float* xd[1] = {a.d + t * nb};
    dot_q4<HAS_MIN, 1>(row, nb, xq, xd, a.s + t * nb, y + (t - first) * stride);
  }
}

// Q8_0 (d, 32 signed codes): the unsigned x signed product is |q| times x with q's sign (2 * 128 * 127 < 32767).
static inline __m256i dot_s8s8(__m256i w, __m256i x) {
  return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

static float dot_q8_0(const uint8_t* row, int64_t nblocks, const int8_t* xq, const float* xd) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < nblocks; b += 2) {
    const uint8_t* p0 = row + b * 34;
    const uint8_t* p1 = p0 + 34;
    const __m256i s0 = dot_s8s8(_mm256_loadu_si256((const __m256i*)(p0 + 2)),
                                _mm256_loadu_si256((const __m256i*)(xq + b * 32)));
    const __m256i s1 = dot_s8s8(_mm256_loadu_si256((const __m256i*)(p1 + 2)),
                                _mm256_loadu_si256((const __m256i*)(xq + b * 32 + 32)));
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_set1_ps(half_to_float(p0) * xd[b]), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_set1_ps(half_to_float(p1) * xd[b + 1]), acc1);
  }
  for (; b < nblocks; ++b) {
    const uint8_t* p = row + b * 34;
    const __m256i s = dot_s8s8(_mm256_loadu_si256((const __m256i*)(p + 2)),
                               _mm256_loadu_si256((const __m256i*)(xq + b * 32)));
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(half_to_float(p) * xd[b]), acc0);
  }
  return hsum(_mm256_add_ps(acc0, acc1));
}

// k-quants: a row is first unpacked (once for all tokens) into unsigned codes, one float scale per 32
// (d * sub-block scale; Q6_K: d alone, its int8 scales per 16 stay integers in `sc16`), and one float
// offset per 16 (-dmin * min, Q6_K: -32 * d * scale) that multiplies the activations' sums.
static void unpack_q4_k(const uint8_t* sb, KRow& r, int64_t s) {
  uint8_t sc[8], mn[8];
  kquant_scales(sb + 4, sc, mn);
  const float d = half_to_float(sb), dmin = half_to_float(sb + 2);
  const uint8_t* qs = sb + 16;
  uint8_t* codes = r.codes + s * 256;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
    _mm256_storeu_si256((__m256i*)(codes + 64 * c), _mm256_and_si256(v, low));
    _mm256_storeu_si256((__m256i*)(codes + 64 * c + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
  }
  for (int j = 0; j < 8; ++j) {
    r.wd[s * 8 + j] = d * sc[j];
    r.wm[s * 16 + 2 * j] = r.wm[s * 16 + 2 * j + 1] = -dmin * mn[j];
  }
}

static void unpack_q5_k(const uint8_t* sb, KRow& r, int64_t s) {
  uint8_t sc[8], mn[8];
  kquant_scales(sb + 4, sc, mn);
  const float d = half_to_float(sb), dmin = half_to_float(sb + 2);
  const __m256i qh = _mm256_loadu_si256((const __m256i*)(sb + 16));
  const uint8_t* qs = sb + 48;
  uint8_t* codes = r.codes + s * 256;
  const __m256i low = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16);
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
    for (int h = 0; h < 2; ++h) {
      const int j = 2 * c + h;
      const __m256i bit = _mm256_set1_epi8((char)(1 << j));
      const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), sixteen);
      const __m256i nib = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, low);
      _mm256_storeu_si256((__m256i*)(codes + 32 * j), _mm256_or_si256(nib, high));
    }
  }
  for (int j = 0; j < 8; ++j) {
    r.wd[s * 8 + j] = d * sc[j];
    r.wm[s * 16 + 2 * j] = r.wm[s * 16 + 2 * j + 1] = -dmin * mn[j];
  }
}

static void unpack_q6_k(const uint8_t* sb, KRow& r, int64_t s) {
  const uint8_t* ql = sb;
  const uint8_t* qh = sb + 128;
  const int8_t* scales = (const int8_t*)(sb + 192);
  const float d = half_to_float(sb + 208);
  uint8_t* codes = r.codes + s * 256;
  const __m256i low = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    const __m256i l0 = _mm256_loadu_si256((const __m256i*)(ql + 64 * h));
    const __m256i l1 = _mm256_loadu_si256((const __m256i*)(ql + 64 * h + 32));
    const __m256i hb = _mm256_loadu_si256((const __m256i*)(qh + 32 * h));
    const __m256i nibs[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                             _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                             _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
    for (int k = 0; k < 4; ++k) {
      // Masked before the left shift, so no bit crosses into the neighbouring byte.
      const __m256i two = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * k), three);
      _mm256_storeu_si256((__m256i*)(codes + 128 * h + 32 * k), _mm256_or_si256(nibs[k], _mm256_slli_epi16(two, 4)));
    }
  }
  for (int j = 0; j < 8; ++j) r.wd[s * 8 + j] = d;
  for (int k = 0; k < 16; ++k) {
    r.sc16[s * 16 + k] = scales[k];
    r.wm[s * 16 + k] = -32.f * d * scales[k];
  }
}

// The other unpacked types' codes (their scales: ggml_formats.h's helpers), the plain loops' results.

// Q5_0/Q5_1: the 32 high bits, bit i to byte i (as 16): each 128-bit lane of the broadcast holds the four bytes of
// qh, byte i takes byte i / 8 of them and keeps its bit i % 8.
static void unpack_q5_simd(const uint8_t* p, bool has_min, KRow& r, int64_t e0) {
  const int64_t head = has_min ? 4 : 2;
  uint32_t qh;
  memcpy(&qh, p + head, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(qh)), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                                   2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
  const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
  const __m128i n = _mm_loadu_si128((const __m128i*)(p + head + 4));
  const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(n, 4), n), _mm256_set1_epi8(0x0F));
  _mm256_storeu_si256((__m256i*)(r.codes + e0), _mm256_or_si256(nib, high));
  const float d = half_to_float(p);  // q5_scales' values, by F16C
  r.wd[e0 / 32] = d;
  r.wm[e0 / 16] = r.wm[e0 / 16 + 1] = has_min ? half_to_float(p + 2) : -16.f * d;
}

// Q2_K and Q3_K: four 2-bit codes a byte, masked after the shift (no bit crosses between bytes); Q3_K's high bit
// masked before its shift left.
static void unpack_q2_k_simd(const uint8_t* p, KRow& r, int64_t e0) {
  const __m256i three = _mm256_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 16 + 32 * h));
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256((__m256i*)(r.codes + e0 + 128 * h + 32 * j), _mm256_and_si256(_mm256_srli_epi16(v, 2 * j), three));
  }
  q2_k_scales(p, r, e0);
}

static void unpack_q3_k_simd(const uint8_t* p, KRow& r, int64_t e0) {
  const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  const __m256i hmask = _mm256_loadu_si256((const __m256i*)p);
  for (int h = 0; h < 2; ++h) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 32 + 32 * h));
    for (int j = 0; j < 4; ++j) {
      const __m256i low = _mm256_and_si256(_mm256_srli_epi16(v, 2 * j), three);
      const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hmask, 4 * h + j), one), 2);
      _mm256_storeu_si256((__m256i*)(r.codes + e0 + 128 * h + 32 * j), _mm256_or_si256(low, high));
    }
  }
  q3_k_scales(p, r, e0);
}

// IQ4: the nibbles as indices into the 16-value table, one byte shuffle.
static inline __m256i iq4_values(const uint8_t* qs, const int8_t* values = kvalues_iq4nl) {
  const __m128i table = _mm_loadu_si128((const __m128i*)values);
  const __m128i n = _mm_loadu_si128((const __m128i*)qs);
  const __m256i index = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(n, 4), n), _mm256_set1_epi8(0x0F));
  return _mm256_shuffle_epi8(_mm256_set_m128i(table, table), index);
}

static void unpack_iq4_nl_simd(const uint8_t* p, KRow& r, int64_t e0, const int8_t* values = kvalues_iq4nl) {
  _mm256_storeu_si256((__m256i*)(r.codes + e0), iq4_values(p + 2, values));
  r.wd[e0 / 32] = half_to_float(p);
}

static void unpack_iq4_xs_simd(const uint8_t* p, KRow& r, int64_t e0) {
  for (int j = 0; j < 8; ++j) _mm256_storeu_si256((__m256i*)(r.codes + e0 + 32 * j), iq4_values(p + 8 + 16 * j));
  iq4_xs_scales(p, r, e0);
}

// One unpacked row against one token (scalar::dot_krow computes the same bits lane by lane). KIND SCALED16
// (Q2_K, Q3_K, Q6_K): the int16 products of maddubs are weighted by the sub-block's integer scale in madd
// (2 * 16002 * 128 fits int32); SIGNED (IQ4's values): as Q8_0's codes, |w| times x with w's sign (maddubs's pairs
// at most 2 * 127 * 127). OFFSETS: whether the row has wm to add (all but the signed types).
template <int KIND>
static float dot_krow(const KRow& r, int64_t nblocks, bool offsets, const int8_t* xq, const float* xd,
                      const float* xs16) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const __m256i w = _mm256_loadu_si256((const __m256i*)(r.codes + b * 32));
    const __m256i x = _mm256_loadu_si256((const __m256i*)(xq + b * 32));
    __m256i s;
    if (KIND == SCALED16) {
      const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(r.sc16[2 * b + 1]), _mm_set1_epi16(r.sc16[2 * b]));
      s = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), scale);
    } else if (KIND == SIGNED) {
      s = dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    } else {
      s = dot_u8s8(w, x);
    }
    if (b & 1)
      acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(r.wd[b] * xd[b]), acc1);
    else
      acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(r.wd[b] * xd[b]), acc0);
  }
  if (offsets) {
    const int64_t n16 = nblocks * 2;
    int64_t i = 0;
    for (; i + 8 <= n16; i += 8)
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(r.wm + i), _mm256_loadu_ps(xs16 + i), acc1);
    if (i < n16) {  // rows of blocks of 32 end on any even number of offsets: the last ones padded with zeros
      float wm[8] = {}, xs[8] = {};
      memcpy(wm, r.wm + i, (n16 - i) * sizeof(float));
      memcpy(xs, xs16 + i, (n16 - i) * sizeof(float));
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(wm), _mm256_loadu_ps(xs), acc1);
    }
  }
  return hsum(_mm256_add_ps(acc0, acc1));
}

void rows(const Job& job, int64_t r0, int64_t r1) {
  const Act& a = *job.act;
  const int64_t nb = job.in_features / 32;
  if (job.qtype == Q4_0 || job.qtype == Q4_1) {
    // Sixteen tokens' activations (with their scales, about 30 KB at 576 inputs) stay in the L1 cache while a
    // chunk of rows goes past them; the chunk's outputs gather in `tile` and leave token by token, a run of
    // consecutive floats each (written one by one, a row's outputs for sixteen tokens lie out_features apart,
    // in one set of the L1 cache for the usual widths, evicting each other).
    constexpr int64_t TOKENS = 16, ROWS = 64;
    float tile[TOKENS * ROWS];
    for (int64_t t = 0; t < a.n; t += TOKENS) {
      const int64_t end = std::min<int64_t>(a.n, t + TOKENS);
      for (int64_t c = r0; c < r1; c += ROWS) {
        const int64_t rows_here = std::min<int64_t>(ROWS, r1 - c);
        for (int64_t r = c; r < c + rows_here; ++r) {
          const uint8_t* row = job.blocks + r * job.pitch;
          if (job.qtype == Q4_1)
            q4_row<true>(row, nb, a, job.in_features, tile + (r - c), ROWS, t, end);
          else
            q4_row<false>(row, nb, a, job.in_features, tile + (r - c), ROWS, t, end);
        }
        for (int64_t u = t; u < end; ++u)
          memcpy(job.y + u * job.out_features + c, tile + (u - t) * ROWS, rows_here * sizeof(float));
      }
    }
    return;
  }
  if (job.qtype == Q8_0) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = job.blocks + r * job.pitch;
      for (int64_t t = 0; t < a.n; ++t)
        job.y[t * job.out_features + r] = dot_q8_0(row, nb, a.q + t * job.in_features, a.d + t * nb);
    }
    return;
  }
  KRow kr(job.in_features);
  const int64_t nblocks = job.in_features / block_elements(job.qtype), bytes = block_bytes(job.qtype);
  const int kind = code_kind(job.qtype);
  const bool offsets = kind != SIGNED;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = job.blocks + r * job.pitch;
    for (int64_t s = 0; s < nblocks; ++s) {
      const uint8_t* p = row + s * bytes;
      switch (job.qtype) {
        case Q4_K: unpack_q4_k(p, kr, s); break;
        case Q5_K: unpack_q5_k(p, kr, s); break;
        case Q6_K: unpack_q6_k(p, kr, s); break;
        case Q5_0:
        case Q5_1: unpack_q5_simd(p, job.qtype == Q5_1, kr, 32 * s); break;
        case Q2_K: unpack_q2_k_simd(p, kr, 256 * s); break;
        case Q3_K: unpack_q3_k_simd(p, kr, 256 * s); break;
        case IQ4_NL: unpack_iq4_nl_simd(p, kr, 32 * s); break;
        case MXFP4: unpack_iq4_nl_simd(p, kr, 32 * s, kvalues_mxfp4); break;
        default: unpack_iq4_xs_simd(p, kr, 256 * s);
      }
    }
    for (int64_t t = 0; t < a.n; ++t) {
      const int8_t* xq = a.q + t * job.in_features;
      const float* xd = a.d + t * nb;
      const float* xs16 = a.s16 + t * nb * 2;
      float& y = job.y[t * job.out_features + r];
      if (kind == SCALED16)
        y = dot_krow<SCALED16>(kr, nb, offsets, xq, xd, xs16);
      else if (kind == SIGNED)
        y = dot_krow<SIGNED>(kr, nb, offsets, xq, xd, xs16);
      else
        y = dot_krow<PLAIN>(kr, nb, offsets, xq, xd, xs16);
    }
  }
}

// Activations quantized per block of 32 (quantize_into): the scalar loop's results, eight lanes at a time
// (the maximum of |x| is exact in any order, x * inv is the same product, and the rounding the same: to nearest,
// ties to even, as nearbyint in the default mode). A NaN is passed over in the maximum, as std::max passes it.
void quantize_blocks(const float* x, int64_t b0, int64_t b1, int8_t* q, uint8_t* u, float* d, float* s,
                     float* s16, int32_t* off128, int32_t* sum16, int32_t* high16, int32_t* off16) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = b0; b < b1; ++b) {
    const float* v = x + b * 32;
    __m256 part[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      part[i] = _mm256_loadu_ps(v + 8 * i);
      top = _mm256_max_ps(_mm256_andnot_ps(sign, part[i]), top);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float scale = _mm_cvtss_f32(m) / 127.f;
    const __m256 inv = _mm256_set1_ps(scale != 0.f ? 1.f / scale : 0.f);
    __m256i c[4];
    for (int i = 0; i < 4; ++i)
      c[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(part[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // int32 -> int8 in order: the packs interleave 128-bit lanes, the permutation puts them back.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    const __m256i codes = _mm256_permutevar8x32_epi32(bytes, order);
    _mm256_storeu_si256((__m256i*)(q + b * 32), codes);
    if (u) _mm256_storeu_si256((__m256i*)(u + b * 32), _mm256_xor_si256(codes, _mm256_set1_epi8(char(0x80))));
    int32_t halves[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i sum8 = _mm256_add_epi32(c[2 * h], c[2 * h + 1]);
      __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
      sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
      sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1));
      halves[h] = _mm_cvtsi128_si32(sum4);
    }
    d[b] = scale;
    off128[b] = -128 * (halves[0] + halves[1]);
    sum16[2 * b] = halves[0];
    sum16[2 * b + 1] = halves[1];
    high16[2 * b] = halves[0] * 65536 + 16384;
    high16[2 * b + 1] = halves[1] * 65536 + 16384;
    off16[2 * b] = -32 * halves[0];
    off16[2 * b + 1] = -32 * halves[1];
    s[b] = scale * float(halves[0] + halves[1]);
    s16[2 * b] = scale * float(halves[0]);
    s16[2 * b + 1] = scale * float(halves[1]);
  }
}
