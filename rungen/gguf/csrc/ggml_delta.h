// A Gated DeltaNet layer's decode step and a prompt's scan (see delta_step and delta_scan in ggml_delta.cpp):
// compiled three times by ggml_builds.h, in namespace avx512 for AVX-512, avx2 for AVX2 and scalar for the
// baseline, and chosen by the code path in use (current_isa). The loops over a head's values are lane by lane (each
// value's sums over the key in order, no multiply-add fused; ggml_lanes.h) and the sums over a head are scalar in
// every build, so all three give the same bits.

#include "ggml_lanes.h"

// A row's q and k of each key head (y: its convolved q/k/v) normalized (l2, eps 1e-6, as transformers' l2norm), q
// times 1 / sqrt(key size).
static void normalize_qk(const DeltaJob& job, float* y) {
  const int64_t dk = job.dk, key_heads = job.key_heads;
  for (int64_t h = 0; h < 2 * key_heads; ++h) {
    float* x = y + h * dk;
    float sum = 0.f;
    for (int64_t i = 0; i < dk; ++i) sum += x[i] * x[i];
    const float inv = 1.f / std::sqrt(sum + 1e-6f), scale = h < key_heads ? 1.f / std::sqrt(float(dk)) : 1.f;
    for (int64_t i = 0; i < dk; ++i) x[i] = x[i] * inv * scale;
  }
}

// The convolution of the new position for rows r0..r1 (the window shifted, the position last), silu; then q and k
// normalized (normalize_qk). The SiLUs are silu_rows' (the build's exp), over [sums | ones].
static void delta_convolve(const DeltaJob& job, int64_t r0, int64_t r1) {
  const int64_t channels = job.channels, kernel = job.kernel;
  std::vector<float> sums(2 * channels, 1.f);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = 0; c < channels; ++c) {
      float* w = job.window + (r * channels + c) * kernel;
      for (int64_t j = 0; j + 1 < kernel; ++j) w[j] = w[j + 1];
      w[kernel - 1] = job.mixed[r * channels + c];
      float sum = 0.f;
      for (int64_t j = 0; j < kernel; ++j) sum += w[j] * job.conv[c * kernel + j];
      sums[c] = sum;
    }
    silu_rows(sums.data(), 0, 1, channels, job.y + r * channels);
    normalize_qk(job, job.y + r * channels);
  }
}

// The columns of a head's state a pass holds in registers: eight Lanes.
constexpr int LANES = 8;
constexpr int64_t COLUMNS = 16 * LANES;

// A prompt's convolution for rows r0..r1 (of sequences * positions): each position's sum over the kernel's last
// inputs (x's positions before the first are zeros), silu, q and k normalized as delta_convolve's.
static void scan_convolve(const DeltaJob& job, int64_t r0, int64_t r1) {
  const int64_t channels = job.channels, positions = job.positions, inputs = job.inputs;
  std::vector<float> sums(2 * channels, 1.f);
  for (int64_t r = r0; r < r1; ++r) {
    convolve_position(job.mixed + r / positions * inputs * channels, inputs - positions + r % positions, job.kernel,
                      job.taps, channels, sums.data());
    silu_rows(sums.data(), 0, 1, channels, job.y + r * channels);
    normalize_qk(job, job.y + r * channels);
  }
}

// Value heads p0..p1 of the sequences' (sequences * heads), each through its positions in order: the head's state
// decayed by g, read by k (kv), moved toward v by beta (delta), read by q; then the output normalized over the head
// (the norm's weight) times silu of the gate.
static void delta_heads(const DeltaJob& job, int64_t p0, int64_t p1) {
  const int64_t heads = job.heads, dk = job.dk, dv = job.dv, channels = job.channels, qk = job.key_heads * dk;
  const int64_t per_key = heads / job.key_heads;
  std::vector<float> gated(2 * dv), held(job.scatter ? dv : 0);
  for (int64_t pair = p0; pair < p1; ++pair)
  for (int64_t t = 0; t < job.positions; ++t) {
    const int64_t h = pair % heads, r = pair / heads * job.positions + t, kh = h / per_key, p = r * heads + h;
    const float* q = job.y + r * channels + kh * dk;
    const float* k = job.y + r * channels + qk + kh * dk;
    const float* v = job.y + r * channels + 2 * qk + h * dv;
    float* s = job.state + pair * dk * dv;
    float* o = job.scatter ? held.data() : job.out + p * dv;
    const float g = std::exp(job.decay[h] * softplus(job.a[p] + job.dt_bias[h]));
    const float beta = 1.f / (1.f + std::exp(-job.b[p]));
    // A block of columns at a time (128: a whole Qwen3.5 value head, 64 KB of state for a key of 128, read from the
    // L2 cache in its first pass), their sums over the key's rows held in registers, eight independent chains; each
    // column's sums in the rows' order, as row by row. The columns past the last whole block one at a time.
    const int64_t whole = dv - dv % COLUMNS;
    for (int64_t j0 = 0; j0 < whole; j0 += COLUMNS) {
      Lanes read[LANES] = {}, m[LANES], out[LANES] = {};
      for (int64_t i = 0; i < dk; ++i) {
        const float ki = k[i];
        const float* row = s + i * dv + j0;
#pragma GCC unroll 8
        for (int l = 0; l < LANES; ++l) read[l] += ki * lanes(row + 16 * l);
      }
#pragma GCC unroll 8
      for (int l = 0; l < LANES; ++l) m[l] = (lanes(v + j0 + 16 * l) - g * read[l]) * beta;
      for (int64_t i = 0; i < dk; ++i) {
        const float ki = k[i], qi = q[i];
        float* row = s + i * dv + j0;
#pragma GCC unroll 8
        for (int l = 0; l < LANES; ++l) {
          const Lanes next = g * lanes(row + 16 * l) + ki * m[l];
          store(row + 16 * l, next);
          out[l] += qi * next;
        }
      }
#pragma GCC unroll 8
      for (int l = 0; l < LANES; ++l) store(o + j0 + 16 * l, out[l]);
    }
    for (int64_t j = whole; j < dv; ++j) {
      float read = 0.f, sum = 0.f;
      for (int64_t i = 0; i < dk; ++i) read += k[i] * s[i * dv + j];
      const float step = (v[j] - g * read) * beta;
      for (int64_t i = 0; i < dk; ++i) {
        const float next = g * s[i * dv + j] + k[i] * step;
        s[i * dv + j] = next;
        sum += q[i] * next;
      }
      o[j] = sum;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < dv; ++j) sum += o[j] * o[j];
    const float inv = 1.f / std::sqrt(sum / float(dv) + job.eps);
    std::copy(job.z + p * dv, job.z + (p + 1) * dv, gated.begin());  // [gate | normed]: silu(gate) * normed
    for (int64_t j = 0; j < dv; ++j) gated[dv + j] = job.norm[j] * (o[j] * inv);
    silu_rows(gated.data(), 0, 1, dv, o);
    if (job.scatter) {
      const int64_t* to = job.scatter + h * dv;
      float* row = job.out + r * heads * dv;
      for (int64_t j = 0; j < dv; ++j) row[to[j]] = o[j];
    }
  }
}

void delta_step_rows(const DeltaJob& job) {
  at::parallel_for(0, job.rows, 1, [&](int64_t r0, int64_t r1) { delta_convolve(job, r0, r1); });
  at::parallel_for(0, job.rows * job.heads, 1, [&](int64_t p0, int64_t p1) { delta_heads(job, p0, p1); });
}

// A prompt: every position's convolution, then each sequence's heads through its positions (a head's state stays in
// its core's cache for all of them).
void delta_scan_rows(const DeltaJob& job) {
  const int64_t sequences = job.rows / job.positions;
  at::parallel_for(0, job.rows, 1, [&](int64_t r0, int64_t r1) { scan_convolve(job, r0, r1); });
  at::parallel_for(0, sequences * job.heads, 1, [&](int64_t p0, int64_t p1) { delta_heads(job, p0, p1); });
}
