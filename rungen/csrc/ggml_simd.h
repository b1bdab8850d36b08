// The SIMD kernels, compiled once per instruction set: ggml_kernels.cpp includes this file inside a
// namespace under `#pragma GCC target(...)`, with GGML_VNNI defined (AVX-512 VNNI, 256-bit registers) or
// not (AVX2). Only the 8-bit dot products differ between the two (maddubs and madd, or vpdpbusd); everything
// else is AVX2.
// It relies on what ggml_kernels.cpp defines before including it: Act, KRow, the block sizes, the code kinds,
// the IQ4 table and the unpacked types' scale helpers.

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

// The other unpacked types' codes (their scales: ggml_kernels.cpp's helpers), the plain loops' results.

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
static inline __m256i iq4_values(const uint8_t* qs) {
  const __m128i table = _mm_loadu_si128((const __m128i*)kvalues_iq4nl);
  const __m128i n = _mm_loadu_si128((const __m128i*)qs);
  const __m256i index = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(n, 4), n), _mm256_set1_epi8(0x0F));
  return _mm256_shuffle_epi8(_mm256_set_m128i(table, table), index);
}

static void unpack_iq4_nl_simd(const uint8_t* p, KRow& r, int64_t e0) {
  _mm256_storeu_si256((__m256i*)(r.codes + e0), iq4_values(p + 2));
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

static void rows(const Job& job, int64_t r0, int64_t r1) {
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

// Activations quantized per block of 32 (quantize_activations): the scalar loop's results, eight lanes at a time
// (the maximum of |x| is exact in any order, x * inv is the same product, and the rounding the same: to nearest,
// ties to even, as nearbyint in the default mode). A NaN is passed over in the maximum, as std::max passes it.
static void quantize_blocks(const float* x, int64_t b0, int64_t b1, int8_t* q, uint8_t* u, float* d, float* s,
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

// Q4_0/Q4_1 rows interleaved eight by eight (X8: see ggml_kernels.cpp), against NT tokens (1 to 4) a pass over
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

// Q4_K/Q5_K/Q6_K rows interleaved eight by eight (X8, see ggml_kernels.cpp), against NT tokens a pass over a
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
          // Two chains (one token at a time: 1.13x on a 5632 x 2048 weight).
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

#ifdef GGML_VNNI
// IQ4_NL and IQ4_XS rows interleaved eight by eight (X8), against NT tokens a pass: per block of 32, four loads of
// nibbles (codes i and 16 + i of each row's lane) looked up in the table by a byte shuffle, once for the NT tokens.
// VNNI build (AVX2's: iq4x8_group): the table is offset by 128 (unsigned 1..241: dpbusd's sums of four stay far
// from int32's limit) and 128 times the token's integer sum of the block is taken off (the sum starts from Act's
// off128): the same exact sum with no sign instruction per token. Then per block and token one multiply-add for
// eight rows, by d * dx (IQ4_XS: by (d * sc) * dx, the block's signed scale per lane in d once for the pass's
// tokens): the arithmetic x8_rows of the scalar path does row by row.
template <bool XS, int NT>
static void x8_group_iq4(const uint8_t* group, int64_t nblocks, const int8_t* const* xq, const float* const* xd,
                         const int32_t* const* xoff128, float* const* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m128i table128 = _mm_loadu_si128((const __m128i*)kvalues_iq4nl);
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
#else
// IQ4_NL and IQ4_XS rows interleaved eight by eight (X8) on AVX2. A block unpacked: w[k] the signed values of codes
// 4k' + i (k = k' < 4) or 16 + 4k' + i (k = 4 + k') of each row's lane (a byte shuffle through the table), m[k]
// their magnitudes, d the rows' scales (IQ4_XS: d * sc, exact).
struct Iq4Block {
  __m256i w[8], m[8];
  __m256 d;
};

template <bool XS>
static inline void iq4x8_unpack(const uint8_t* group, int64_t b, Iq4Block& u) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m128i table128 = _mm_loadu_si128((const __m128i*)kvalues_iq4nl);
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
template <bool XS, int NT, bool READY>
static void iq4x8_group(const uint8_t* group, int64_t nblocks, const Iq4Block* ready, const int8_t* const* xq,
                        const float* const* xd, float* const* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    Iq4Block local;
    if (!READY) iq4x8_unpack<XS>(group, b, local);
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
    else if constexpr (BASE == IQ4_NL || BASE == IQ4_XS)
      x8_group_iq4<BASE == IQ4_XS, NT>(group, nb, x.xq, x.xd, x.xoff128, x.out);
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
// X8 | Q3_K (see X8 in ggml_kernels.cpp).

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

#ifndef GGML_VNNI
// Q4_K, Q5_K and Q6_K on AVX2. Q6_K's blocks are buffered from five tokens; Q4_K's and Q5_K's, cheaper to unpack
// again, from 17: buffered at 5 and 8 tokens their product measured 0.84-0.95x the passes unpacking for themselves,
// at 16 1.00x, at 64 1.14x (Q4_K) and 1.26x (Q5_K).
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

template <bool XS>
struct Iq4X8 {
  const uint8_t* group;
  using Block = Iq4Block;
  // Its block is four times the packed one and its unpacking cheap: buffered at 8-13 tokens it measured 0.84-0.97x
  // the passes unpacking for themselves, at 28 and 64 1.03-1.16x.
  static constexpr int64_t unbuffered = 24;
  void unpack(int64_t b, Block& u) const { iq4x8_unpack<XS>(group, b, u); }
  template <int NT, bool READY>
  void run(const Block* ready, int64_t nb, const Tokens<NT>& x) const {
    iq4x8_group<XS, NT, READY>(group, nb, ready, x.xq, x.xd, x.out);
  }
};
#endif

// One group against every token: the kernels that read their blocks unpacked (Q3_K; on AVX2 the other k-quants
// and IQ4) through unpacked_tokens, the others four, two, then one token a pass.
template <int64_t BASE>
static void x8_tokens(const uint8_t* group, int64_t nb, const Act& a, int64_t k, float* y, int64_t stride) {
  if constexpr (BASE == Q3_K) {
    unpacked_tokens(Q3kX8{group}, nb, a, k, y, stride);
#ifndef GGML_VNNI
  } else if constexpr (BASE == Q4_K || BASE == Q5_K || BASE == Q6_K) {
    unpacked_tokens(Kx8<BASE>{group}, nb, a, k, y, stride);
  } else if constexpr (BASE == IQ4_NL || BASE == IQ4_XS) {
    unpacked_tokens(Iq4X8<BASE == IQ4_XS>{group}, nb, a, k, y, stride);
#endif
  } else {
    int64_t t = x8_pass<BASE, 4>(group, nb, a, k, y, stride, 0, a.n);
    t = x8_pass<BASE, 2>(group, nb, a, k, y, stride, t, a.n);
    x8_pass<BASE, 1>(group, nb, a, k, y, stride, t, a.n);
  }
}

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
template <bool XS>
static inline void iq4x16_unpack(const uint8_t* group, int64_t pitch, int64_t b, K16Block& u) {
  const __m512i table = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)kvalues_iq4nl)),
                                         _mm512_set1_epi8(char(0x80)));
  const uint8_t* p = XS ? group + (b / 8) * 1104 : group + b * 144;
  x16_codes_iq4(XS ? p + 80 + 128 * (b % 8) : p + 16, pitch, table, u.w);
  u.m = _mm512_setzero_ps();
  u.d = pair_halves(p, pitch);
  if (XS) u.d = _mm512_mul_ps(u.d, _mm512_cvtepi32_ps(pair_lanes_s8(p + 16 + 8 * (b % 8), pitch)));
}

// IQ4_NL/IQ4_XS: x8_group_iq4's VNNI arithmetic for two groups. READY: the blocks unpacked once for all passes.
template <bool XS, int NT, bool READY>
static void x16_group_iq4(const uint8_t* group, int64_t pitch, int64_t nblocks, const K16Block* ready,
                          const int8_t* const* xq, const float* const* xd, const int32_t* const* xoff128,
                          float* const* out) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    K16Block local;
    if (!READY) iq4x16_unpack<XS>(group, pitch, b, local);
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

// X16's kernels whose passes can read the pair's blocks unpacked (as unpacked_tokens describes): the unpacking
// once pays from three passes of four (at two, 8 tokens, writing and reading the buffer measured 0.96x unpacking
// twice), IQ4_NL's (the cheapest to unpack, a block five times its packed size) from 25 tokens (buffered at 12 and
// 16 it measured 0.90-0.94x); Q3_K's from two passes.
template <int64_t BASE>
struct K16 {
  const uint8_t* group;
  int64_t pitch;
  static constexpr bool IQ4 = BASE == IQ4_NL || BASE == IQ4_XS;
  using Block = K16Block;
  static constexpr int64_t unbuffered = BASE == IQ4_NL ? 24 : 8;
  void unpack(int64_t b, Block& u) const {
    if constexpr (IQ4)
      iq4x16_unpack<BASE == IQ4_XS>(group, pitch, b, u);
    else
      kx16_unpack<BASE>(group + (b / 8) * kx16_bytes<BASE>(), pitch, b % 8, u);
  }
  template <int NT, bool READY>
  void run(const Block* ready, int64_t nb, const Tokens<NT>& x) const {
    if constexpr (IQ4)
      x16_group_iq4<BASE == IQ4_XS, NT, READY>(group, pitch, nb, ready, x.xq, x.xd, x.xoff128, x.out);
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
  } else if constexpr (BASE == Q4_K || BASE == Q5_K || BASE == Q6_K || BASE == IQ4_NL || BASE == IQ4_XS) {
    unpacked_tokens(K16<BASE>{group, pitch}, nb, a, k, y, stride, t0);
  } else {
    int64_t t = x16_pass<BASE, 4>(group, pitch, nb, a, k, y, stride, t0);
    t = x16_pass<BASE, 2>(group, pitch, nb, a, k, y, stride, t);
    x16_pass<BASE, 1>(group, pitch, nb, a, k, y, stride, t);
  }
}

#endif
