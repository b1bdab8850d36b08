// The attention and the MLP gates of the decoder layers (see attend in ggml_layers.cpp): ggml_attend.cpp's loops,
// compiled three times by ggml_builds.h, in namespace avx512 for AVX-512 (RUNGEN_WIDE: two queries' scores and
// sixteen value sums a register), avx2 for AVX2 and scalar for the baseline, and chosen by the code path in use.
// All do the same operations in the same order, lane by lane, no multiply-add fused (the file is compiled with
// -ffp-contract=off), so they give the same bits; fused multiply-adds gained nothing and moved the last bits
// (docs/kernels.md, "Measured choices").

// Eight floats as one value (GCC's vector extension): a ymm register in the AVX2 build, two xmm in the
// baseline; each lane's arithmetic is the scalar code's.
typedef float f8 __attribute__((vector_size(32)));

static inline float dot64(const float* a, const float* b, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // fixed lanes: vectorized, and the same order always
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  float tail = 0.f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

static inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

static inline void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof(v)); }

// A cache's keys and values in float16 (c10::Half) are widened to float32 before the arithmetic: exactly, so every
// operation after it is the float32 cache's and the builds agree (F16C's instruction, or c10's bits in the
// baseline).
static inline float widen(c10::Half x) { return c10::detail::fp16_ieee_to_fp32_value(x.x); }

// `rows` rows of `dim` float16 values (`stride` apart) into dst [rows, dim].
static inline void widen_rows(const c10::Half* src, int64_t stride, int64_t rows, int64_t dim, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const c10::Half* x = src + r * stride;
    float* y = dst + r * dim;
    int64_t i = 0;
#ifdef RUNGEN_F16C
    for (; i + 8 <= dim; i += 8)
      _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
#endif
    for (; i < dim; ++i) y[i] = widen(x[i]);
  }
}

// The first `count` (at most 8) values, the rest zeros: whole vectors where count is 8, as a vector read back
// after a narrower copy into it stalls (store forwarding fails); a row's last part copied.
static inline void load_part8(const float* p, int64_t count, f8& v) {
  if (count == 8) {
    v = load8(p);
    return;
  }
  v = f8{};
  std::memcpy(&v, p, count * sizeof(float));
}

static inline void store_part8(float* p, int64_t count, f8 v) {
  if (count == 8)
    store8(p, v);
  else
    std::memcpy(p, &v, count * sizeof(float));
}

// dot64 of q with eight keys (k, k + stride, ...) for n a multiple of 8, each key's sum in dot64's order: the
// same eight results, as one vector. The eight keys' lane sums are reduced together, pairwise additions across
// the keys (as _mm256_hadd_ps pairs them), where a key at a time takes a dozen shuffles and additions for its
// sum alone.
typedef int32_t i8v __attribute__((vector_size(32)));

static inline f8 pair_sums(f8 a, f8 b) {  // [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]
  return __builtin_shuffle(a, b, i8v{0, 2, 8, 10, 4, 6, 12, 14}) +
         __builtin_shuffle(a, b, i8v{1, 3, 9, 11, 5, 7, 13, 15});
}

// dot64x8's sums of eight keys' lanes (acc[k] lane l: key k's products of dimensions l mod 8), reduced to one
// vector of the eight keys' dot products.
static inline f8 key_sums(const f8* acc) {
  // Lane l of key k: c_k[l]. After two rounds, lane k of `low` (k < 4) holds (c_k[0]+c_k[1]) + (c_k[2]+c_k[3])
  // and lane k of `high` (c_k[4]+c_k[5]) + (c_k[6]+c_k[7]); keys 4..7 in lanes 4..7 likewise.
  const f8 q0123 = pair_sums(pair_sums(acc[0], acc[1]), pair_sums(acc[2], acc[3]));
  const f8 q4567 = pair_sums(pair_sums(acc[4], acc[5]), pair_sums(acc[6], acc[7]));
  const f8 low = __builtin_shuffle(q0123, q4567, i8v{0, 1, 2, 3, 8, 9, 10, 11});
  const f8 high = __builtin_shuffle(q0123, q4567, i8v{4, 5, 6, 7, 12, 13, 14, 15});
  return low + high + f8{};  // + 0, as dot64's tail: -0 becomes +0 alike
}

static inline f8 dot64x8(const float* a, const float* b, int64_t stride, int64_t n) {
  f8 acc[8] = {};
  for (int64_t i = 0; i < n; i += 8) {
    const f8 x = load8(a + i);
    for (int key = 0; key < 8; ++key) acc[key] += x * load8(b + key * stride + i);
  }
  return key_sums(acc);
}

// y[t, j] = x[t] . w[j] for the rows [t0, t1) of x [*, n] and the e rows of w [e, n], each sum in dot64's order: a
// row's results are its own bits in a batch of any size (a mixture's router, where a last-bit difference between a
// token alone and in a batch picks other experts of a near tie).
void dot_rows(const float* x, const float* w, int64_t t0, int64_t t1, int64_t e, int64_t n, float* y) {
  for (int64_t t = t0; t < t1; ++t) {
    const float* xr = x + t * n;
    float* yr = y + t * e;
    int64_t j = 0;
    if (n % 8 == 0)
      for (; j + 8 <= e; j += 8) store8(yr + j, dot64x8(xr, w + j * n, n, n));
    for (; j < e; ++j) yr[j] = dot64(xr, w + j * n, n);
  }
}

#ifdef RUNGEN_WIDE
// dot64x8 of two queries a and a2 against the same eight keys, in one 512-bit register: a's lanes in its low half,
// a2's in its high half, each key's eight floats loaded once for both. Each half's arithmetic is dot64x8's, so
// each query gets its bits alone.
static inline void dot64x8_two(const float* a, const float* a2, const float* b, int64_t stride, int64_t n, f8& out,
                               f8& out2) {
  __m512 acc[8];
  for (int key = 0; key < 8; ++key) acc[key] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    // AVX-512 F's 64-bit forms of the 256-bit insert, broadcast and extract: the same bits moved, no DQ needed.
    const __m512d low_half = _mm512_castpd256_pd512(_mm256_loadu_pd((const double*)(a + i)));
    const __m512 x = _mm512_castpd_ps(_mm512_insertf64x4(low_half, _mm256_loadu_pd((const double*)(a2 + i)), 1));
    for (int key = 0; key < 8; ++key) {
      const __m256d key8 = _mm256_loadu_pd((const double*)(b + key * stride + i));
      const __m512 k8 = _mm512_castpd_ps(_mm512_broadcast_f64x4(key8));
      acc[key] = _mm512_add_ps(acc[key], _mm512_mul_ps(x, k8));
    }
  }
  f8 low[8], high[8];
  for (int key = 0; key < 8; ++key) {
    low[key] = (f8)_mm512_castps512_ps256(acc[key]);
    high[key] = (f8)_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[key]), 1));
  }
  out = key_sums(low);
  out2 = key_sums(high);
}
#endif

// exp(x) for x <= 0 of eight values at once (Cephes' expf: range reduction by ln 2, a degree-6 polynomial;
// relative error about 1e-7), without branches or library calls: a prompt's attention takes an exp per query
// and key, and the library's scalar exp was a third of a long prompt's pass.

static inline f8 exp_nonpositive8(f8 x) {
  const f8 lo = f8{} - 87.3f;
  x = x < lo ? lo : x;
  const f8 y = x * 1.44269504088896341f;
  const i8v n = __builtin_convertvector(y - 0.5f, i8v);
  const f8 fn = __builtin_convertvector(n, f8);
  x = x - fn * 0.693359375f - fn * -2.12194440e-4f;
  f8 p = f8{} + 1.9875691500e-4f;
  p = p * x + 1.3981999507e-3f;
  p = p * x + 8.3334519073e-3f;
  p = p * x + 4.1665795894e-2f;
  p = p * x + 1.6666665459e-1f;
  p = p * x + 5.0000001201e-1f;
  const f8 r = p * (x * x) + x + 1.f;
  const i8v bits = (n + 127) << 23;
  f8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return r * scale;
}

// tanh of eight values (Cephes' tanhf: below 0.625 an odd polynomial, above it (1 - e) / (1 + e) of
// e = exp(-2|x|), which then loses nothing to cancellation; relative error about 1e-7), without branches or
// library calls.
static inline f8 tanh8(f8 x) {
  const f8 a = x < 0.f ? -x : x, z = a * a;
  f8 p = f8{} - 5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const f8 small = p * z * a + a;
  const f8 e = exp_nonpositive8(f8{} - (a + a));
  const f8 large = (1.f - e) / (1.f + e);
  const f8 t = a < 0.625f ? small : large;
  return x < 0.f ? -t : t;
}

// tanh(s / cap) * cap of eight scores. The scalar scores go through it too, one lane used: every key's score
// the same bits, on either build.
static inline f8 softcap8(f8 s, float cap) { return tanh8(s / cap) * cap; }

// gate(g, u) eight values at a time over rows [r0, r1) of a fused gate/up product [rows, 2 * f] (gate first) into
// y [rows, f]: whole vectors loaded and stored, a row's last part copied.
template <class Gate>
static inline void gate_rows(const float* gp, int64_t r0, int64_t r1, int64_t f, float* yp, Gate gate) {
  for (int64_t r = r0; r < r1; ++r) {
    const float *g_row = gp + r * 2 * f, *u_row = g_row + f;
    float* y_row = yp + r * f;
    for (int64_t i = 0; i < f; i += 8) {
      const int64_t count = std::min<int64_t>(8, f - i);
      f8 g, u;
      load_part8(g_row + i, count, g);
      load_part8(u_row + i, count, u);
      store_part8(y_row + i, count, gate(g, u));
    }
  }
}

// gelu(gate) * up with GELU's tanh approximation (gemma's gelu_pytorch_tanh): 0.5 g (1 + tanh(sqrt(2 / pi) (g +
// 0.044715 g^3))), as torch computes it, through tanh8: the library's scalar tanh took a decode step's layer about
// as long as its attention.
void gelu_rows(const float* gp, int64_t r0, int64_t r1, int64_t f, float* yp) {
  gate_rows(gp, r0, r1, f, yp, [](f8 g, f8 u) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;  // sqrt(2 / pi)
    return 0.5f * g * (1.f + tanh8(k0 * (g + k1 * g * g * g))) * u;
  });
}

// exp(x) for x <= 0, exactly zero below -87.3, where exp_nonpositive8 clamps to e^-87.3 (1.2e-38, the least normal
// float) and float32's own exp is subnormal or zero.
static inline f8 exp_or_zero8(f8 x) { return x < -87.3f ? f8{} : exp_nonpositive8(x); }

// silu(gate) * up (SiLU: g / (1 + exp(-g)), as torch computes it) through exp_or_zero8 of -|g|: e = exp(-|g|),
// and silu(g) = g / (1 + e) for g >= 0, g e / (1 + e) below (neither side overflows; a gate below -87.3 gives
// zero, as torch's does, not g times the clamped e). The library's scalar exp took a tenth of a prompt's pass of
// the default model.
void silu_rows(const float* gp, int64_t r0, int64_t r1, int64_t f, float* yp) {
  gate_rows(gp, r0, r1, f, yp, [](f8 g, f8 u) {
    const f8 e = exp_or_zero8(g < 0.f ? g : -g);
    return (g < 0.f ? g * e : g) / (1.f + e) * u;
  });
}

// The weights exp(s - top) of eight scores s, the query's largest score top: exactly zero for a masked key (s
// -inf) and for one more than 87.3 below the top (exp_or_zero8): it adds nothing to the sum (at least 1, the top
// key's own weight), and the values then skip it. Weights at the edge of float's range made the value products
// subnormal, each a microcode assist: a head that gives one key (an attention sink) scores far above the rest
// ran 30 times as slow.
static inline f8 weight8(f8 x, float top) { return exp_or_zero8(x - top); }

// While it lives, float arithmetic on this thread takes subnormal inputs and results as zero (MXCSR's DAZ and FTZ
// bits), as it then does in both builds alike: a weight near e^-87 times a small value is subnormal, and each such
// product or sum costs a microcode assist (scores spread evenly down to 100 below the top ran twice as slow).
struct FlushSubnormals {
  const unsigned int saved = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushSubnormals() { _mm_setcsr(saved); }
};

// The values' sums: sixteen floats a vector in the AVX-512 build (RUNGEN_WIDE), eight in the others. Each
// dimension's sum is its own lane's, so the width changes no bit, only how many instructions a key takes.
#ifdef RUNGEN_WIDE
typedef float fv __attribute__((vector_size(64)));
#else
typedef f8 fv;
#endif
constexpr int FV = sizeof(fv) / sizeof(float);

// One query's weighted values of keys [jw, j1) added to o, NV vectors V (o's and each value row's first dimensions):
// the sums stay in registers across the keys (o read and written once, not once a key), each dimension's sum key
// after key in the same order as one dimension at a time. Zero weights (masked or underflowed keys) are skipped,
// so padding leaves no trace.
template <class V, int NV>
static inline void add_values(const float* w, float inv, const float* v, int64_t v_key, int64_t jw, int64_t j1,
                              float* o) {
  V acc[NV];
  std::memcpy(acc, o, sizeof(acc));
  for (int64_t j = jw; j < j1; ++j) {
    if (w[j] == 0.f) continue;
    const float a = w[j] * inv;
    const float* vj = v + j * v_key;
    for (int d = 0; d < NV; ++d) {
      V x;
      std::memcpy(&x, vj + d * (sizeof(V) / sizeof(float)), sizeof(x));
      acc[d] += a * x;
    }
  }
  std::memcpy(o, acc, sizeof(acc));
}

// add_values over a head of dim (a multiple of 8) dimensions: 64 at a time (the sums fill eight AVX2 registers),
// then 32, 16 and 8.
static inline void add_head_values(const float* w, float inv, const float* v, int64_t v_key, int64_t jw, int64_t j1,
                                   int64_t dim, float* o) {
  int64_t d = 0;
  for (; d + 64 <= dim; d += 64) add_values<fv, 64 / FV>(w, inv, v + d, v_key, jw, j1, o + d);
  if (d + 32 <= dim) {
    add_values<fv, 32 / FV>(w, inv, v + d, v_key, jw, j1, o + d);
    d += 32;
  }
  if (d + 16 <= dim) {
    add_values<fv, 16 / FV>(w, inv, v + d, v_key, jw, j1, o + d);
    d += 16;
  }
  if (d < dim) add_values<f8, 1>(w, inv, v + d, v_key, jw, j1, o + d);
}

// float16 keys and values widened to float32 for the arithmetic: KEY_CHUNK keys and VALUE_BLOCK values at a time
// (every query of a block reads them there, in L1), or a kv head's whole keys and values where its queries fill
// several blocks (a prompt's) and they take at most WHOLE_HEAD floats (1 MiB each: 4,096 positions of heads of 64,
// 2,048 of 128; past it a prompt's attention takes 1.07x a float32 cache's time, chunk by chunk). Kept by each
// thread between calls (a call's allocation cost more than its widening), so a thread keeps at most 2 MiB.
constexpr int64_t KEY_CHUNK = 64, WHOLE_HEAD = int64_t{1} << 18;
struct Widened {
  std::vector<float> key_floats, value_floats;
  float *keys = nullptr, *values = nullptr;  // 64-byte aligned in them, as a tensor's data (no load splits a line)
  int64_t head = -1;  // the kv head (batch * kv + head) whose keys and values they hold whole, or none

  void hold(int64_t floats) {
    for (auto [vector, start] : {std::pair{&key_floats, &keys}, std::pair{&value_floats, &values}}) {
      if (vector->size() < size_t(floats + 16)) vector->resize(floats + 16);
      *start = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(vector->data()) + 63) & ~uintptr_t{63});
    }
  }
};

// The queries [pb, pe) of one sequence and kv head (a block of ATTEND_BLOCK at most) over its keys kh and values vh
// (that kv head's, indexed by position, k_key_held and v_key_held apart) of type KT: float, or c10::Half (widened a
// chunk of keys and a block of values at a time into `widened`).
template <class KT>
static void attend_block(const AttendJob& job, int64_t pb, int64_t pe, const KT* kh, const KT* vh,
                         int64_t k_key_held, int64_t v_key_held, float* wp, Widened& widened) {
  constexpr bool half = std::is_same<KT, c10::Half>::value;
  const float* qp = job.q;
  const bool* mb = job.mask_bool;
  const float* mf = job.mask_add;
  float* op = job.out;
  const int64_t heads = job.heads, t = job.t, dim = job.dim, kv = job.kv, T = job.T, group = heads / kv;
  const float scale = job.scale, cap = job.softcap, lowest = -std::numeric_limits<float>::infinity();
  // Weights indexed by position: none before the group of 8 of the first key held (`dropped`; the exponentials'
  // loads start at a query's first group).
  const int64_t base = job.dropped / 8 * 8;
  const int64_t batch = pb / (group * t) / kv, nq = pe - pb;
  int64_t firsts[ATTEND_BLOCK], lasts[ATTEND_BLOCK], rows[ATTEND_BLOCK], most = 0, least = T;
  float tops[ATTEND_BLOCK], invs[ATTEND_BLOCK];
  f8 tops8[ATTEND_BLOCK];
  float* outs[ATTEND_BLOCK];
  for (int64_t n = 0; n < nq; ++n) {
    const int64_t p = pb + n, h = (p / t) % heads, i = p % t;
    lasts[n] = job.masked ? T : T - t + i + 1;  // causal without a mask
    // A sliding window (transformers' sliding_window_overlay: key position > query position - window), the
    // query at cache position T - t + i: the keys before it are masked, as a windowed mask masks them.
    firsts[n] = job.window > 0 ? std::max<int64_t>(0, T - t + i - job.window + 1) : 0;
    rows[n] = (batch * t + i) * T;
    tops[n] = lowest;
    tops8[n] = f8{} + lowest;  // the running maximum lane by lane: a maximum is the same in any order
    outs[n] = op + ((batch * t + i) * heads + h) * dim;
    std::fill(outs[n], outs[n] + dim, 0.f);
    most = std::max(most, lasts[n]);
    least = std::min(least, firsts[n]);
  }
  const auto weights = [&](int64_t n) { return wp + n * (T - base) - base; };
  // Scores, KEY_CHUNK keys at a time (float16 ones widened once for every query of the block): eight keys at once
  // for every query that sees all eight and has no boolean mask (from the block's earliest window on: the same
  // groups of 8 as from key 0, as the values' groups below), one at a time for the rest.
  const bool grouped = !mb && dim % 8 == 0;
  for (int64_t c0 = least / 8 * 8; c0 < most; c0 += KEY_CHUNK) {
    const int64_t c1 = std::min(c0 + KEY_CHUNK, most);
    const float* keys = reinterpret_cast<const float*>(kh);  // indexed by position, k_key apart
    int64_t k_key = k_key_held;
    if constexpr (half) {
      const int64_t from = std::max(c0, least);  // (rows before `least` may not be held)
      widen_rows(kh + from * k_key_held, k_key_held, c1 - from, dim, widened.keys + (from - c0) * dim);
      keys = widened.keys - c0 * dim;
      k_key = dim;
    }
    for (int64_t j = std::max(c0, (least + 7) / 8 * 8); grouped && j + 8 <= c1; j += 8) {
      auto keep = [&](int64_t n, f8 dots) {
        f8 scores = dots * scale;
        if (cap > 0.f) scores = softcap8(scores, cap);
        if (mf) scores += load8(mf + rows[n] + j);
        store8(weights(n) + j, scores);
        tops8[n] = tops8[n] < scores ? scores : tops8[n];
      };
      for (int64_t n = 0; n < nq; ++n) {
        if (j + 8 > lasts[n] || j < firsts[n]) continue;
#ifdef RUNGEN_WIDE
        if (n + 1 < nq && j + 8 <= lasts[n + 1] && j >= firsts[n + 1]) {  // the next query too: both at once
          f8 dots, dots2;
          dot64x8_two(qp + (pb + n) * dim, qp + (pb + n + 1) * dim, keys + j * k_key, k_key, dim, dots, dots2);
          keep(n, dots);
          keep(++n, dots2);
          continue;
        }
#endif
        keep(n, dot64x8(qp + (pb + n) * dim, keys + j * k_key, k_key, dim));
      }
    }
    // The keys the groups above did not score: a query's window's first ones and last ones, or all of them.
    for (int64_t n = 0; n < nq; ++n) {
      const float* qh = qp + (pb + n) * dim;
      float* w = weights(n);
      const int64_t g0 = grouped ? (firsts[n] + 7) / 8 * 8 : lasts[n], g1 = grouped ? lasts[n] / 8 * 8 : lasts[n];
      for (int64_t j = std::max(firsts[n], c0); j < std::min(lasts[n], c1); ++j) {
        if (j >= g0 && j < g1) {
          j = std::min(g1, c1) - 1;
          continue;
        }
        if (mb && !mb[rows[n] + j]) {
          w[j] = lowest;
          continue;
        }
        float score = dot64(qh, keys + j * k_key, dim) * scale;
        if (cap > 0.f) score = softcap8(f8{} + score, cap)[0];
        if (mf) score += mf[rows[n] + j];
        w[j] = score;
        tops[n] = std::max(tops[n], score);
      }
    }
  }
  for (int64_t n = 0; n < nq; ++n) {
    float* w = weights(n);
    for (int l = 0; l < 8; ++l) tops[n] = std::max(tops[n], tops8[n][l]);
    const float sink = job.sinks ? job.sinks[((pb + n) / t) % heads] : lowest;
    const int64_t first = firsts[n];
    for (int64_t j = first / 8 * 8; j < first; ++j) w[j] = lowest;  // outside the window: masked
    if (tops[n] == lowest) continue;  // sees no key: zeros
    tops[n] = std::max(tops[n], sink);  // (the sink's logit: in the softmax's sum, last, and on no value)
    // Exponentials eight at once, their sum key after key; whole groups loaded and stored as vectors (a
    // vector read back after a narrower copy into it stalls), the last group padded with masked lanes.
    // The keys before the window's group weigh nothing: they are left out of the sum (adding a zero to
    // it changes no bit) and of the values.
    float total = 0.f;
    int64_t e8 = first / 8 * 8;
    for (; e8 + 8 <= lasts[n]; e8 += 8) {
      const f8 kept = weight8(load8(w + e8), tops[n]);
      store8(w + e8, kept);
      for (int l = 0; l < 8; ++l) total += kept[l];
    }
    if (e8 < lasts[n]) {
      const int64_t count = lasts[n] - e8;
      f8 x = f8{} + lowest;
      std::memcpy(&x, w + e8, count * sizeof(float));
      const f8 kept = weight8(x, tops[n]);
      std::memcpy(w + e8, &kept, count * sizeof(float));
      for (int64_t l = 0; l < count; ++l) total += kept[l];
    }
    if (sink != lowest) total += std::exp(sink - tops[n]);
    invs[n] = 1.f / total;
  }
  // Values: each query's sum key after key, skipping the zero weights (masked or underflowed), so padding
  // leaves no trace.
  for (int64_t j0 = least / VALUE_BLOCK * VALUE_BLOCK; j0 < most; j0 += VALUE_BLOCK) {
    const float* values;
    int64_t v_key = v_key_held;
    if constexpr (half) {  // (rows before `least` may not be held: from the block's first window on)
      const int64_t first = std::max(j0, least), rows = std::min(j0 + VALUE_BLOCK, most) - first;
      widen_rows(vh + first * v_key_held, v_key_held, rows, dim, widened.values + (first - j0) * dim);
      values = widened.values - j0 * dim;
      v_key = dim;
    } else {
      values = vh;
    }
    for (int64_t n = 0; n < nq; ++n) {
      if (tops[n] == lowest || j0 >= lasts[n]) continue;
      const float* w = weights(n);
      const float inv = invs[n];
      float* o = outs[n];
      const int64_t j1 = std::min(j0 + VALUE_BLOCK, lasts[n]), jw = std::max(j0, firsts[n]);
      if (jw >= j1) continue;
      if (dim % 8 == 0) {
        add_head_values(w, inv, values, v_key, jw, j1, dim, o);
        continue;
      }
      for (int64_t j = jw; j < j1; ++j) {
        if (w[j] == 0.f) continue;
        const float a = w[j] * inv;
        const float* vj = values + j * v_key;
        for (int64_t d = 0; d < dim; ++d) o[d] += a * vj[d];
      }
    }
  }
}

// Each query of [p0, p1) (q enumerated in [b, heads, t] order), in blocks of ATTEND_BLOCK (ggml_kernels.h) that
// share a kv head, over keys and values of type KT (float, or c10::Half).
template <class KT>
static void attend_keys(const AttendJob& job, int64_t p0, int64_t p1, float* wp) {
  constexpr bool half = std::is_same<KT, c10::Half>::value;
  const FlushSubnormals flush;
  const KT *kp = static_cast<const KT*>(job.k), *vp = static_cast<const KT*>(job.v);
  const int64_t t = job.t, dim = job.dim, kv = job.kv, T = job.T, group = job.heads / kv, dropped = job.dropped;
  static thread_local Widened widened;
  widened.head = -1;
  if constexpr (half) widened.hold(std::max(KEY_CHUNK, VALUE_BLOCK) * dim);
  for (int64_t pb = p0; pb < p1;) {
    // p = ((batch * heads + h) * t + i) and h = kv head * group + g: p / (group * t) names the keys read.
    const int64_t shared = pb / (group * t), pe = std::min({p1, pb + ATTEND_BLOCK, (shared + 1) * group * t});
    const int64_t batch = shared / kv, kvh = shared % kv;
    // Keys and values indexed by position: keys before `dropped` are not held (no query reads them).
    const KT* kh = kp + batch * job.k_batch + kvh * job.k_head - dropped * job.k_key;
    const KT* vh = vp + batch * job.v_batch + kvh * job.v_head - dropped * job.v_key;
    if constexpr (half) {
      // A prompt's queries fill several blocks: the head's keys and values widened once, from the first any of its
      // queries reads (the first query's window) on, where they take at most WHOLE_HEAD floats each.
      const int64_t from = std::max(dropped, job.window > 0 ? T - t - job.window + 1 : int64_t{0});
      if (group * t > ATTEND_BLOCK && (T - from) * dim <= WHOLE_HEAD) {
        if (widened.head != shared) {
          widened.hold((T - from) * dim);
          widen_rows(kh + from * job.k_key, job.k_key, T - from, dim, widened.keys);
          widen_rows(vh + from * job.v_key, job.v_key, T - from, dim, widened.values);
          widened.head = shared;
        }
        attend_block<float>(job, pb, pe, widened.keys - from * dim, widened.values - from * dim, dim,
                            dim, wp, widened);
        pb = pe;
        continue;
      }
    }
    attend_block<KT>(job, pb, pe, kh, vh, job.k_key, job.v_key, wp, widened);
    pb = pe;
  }
}

void attend_queries(const AttendJob& job, int64_t p0, int64_t p1, float* wp) {
  if (job.half)
    attend_keys<c10::Half>(job, p0, p1, wp);
  else
    attend_keys<float>(job, p0, p1, wp);
}
