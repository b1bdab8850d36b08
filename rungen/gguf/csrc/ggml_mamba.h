// A Mamba-2 layer's decode step and a prompt's scan (see mamba_step and mamba_scan in ggml_mamba.cpp): compiled
// three times by ggml_builds.h, in namespace avx512 for AVX-512, avx2 for AVX2 and scalar for the baseline, and
// chosen by the code path in use (current_isa). The loops over a head's state are lane by lane (each
// state value's update as transformers' selective_state_update orders it, no multiply-add fused), the sums over the
// state in lanes added in one fixed order (ggml_lanes.h), the norm's scalar: the same bits in every build.

#include "ggml_lanes.h"

// The convolution of the new position for rows r0..r1 (the window shifted, the position last), its bias, silu.
static void mamba_convolve(const MambaJob& job, int64_t r0, int64_t r1) {
  const int64_t channels = job.channels, kernel = job.kernel;
  std::vector<float> sums(2 * channels, 1.f);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = 0; c < channels; ++c) {
      float* w = job.window + (r * channels + c) * kernel;
      for (int64_t j = 0; j + 1 < kernel; ++j) w[j] = w[j + 1];
      w[kernel - 1] = job.xbc[r * channels + c];
      float sum = 0.f;
      for (int64_t j = 0; j < kernel; ++j) sum += w[j] * job.conv[c * kernel + j];
      sums[c] = job.conv_bias ? sum + job.conv_bias[c] : sum;
    }
    silu_rows(sums.data(), 0, 1, channels, job.y + r * channels);
  }
}

// A prompt's convolution for rows r0..r1 (of sequences * positions): each position's sum over the kernel's last
// inputs (x's positions before the first are zeros), its bias, silu, times the row's mask where there is one (a
// padded position's x, B and C zeros, as transformers masks them).
static void mamba_scan_convolve(const MambaJob& job, int64_t r0, int64_t r1) {
  const int64_t channels = job.channels, positions = job.positions, inputs = job.inputs;
  std::vector<float> sums(2 * channels, 1.f);
  for (int64_t r = r0; r < r1; ++r) {
    convolve_position(job.xbc + r / positions * inputs * channels, inputs - positions + r % positions, job.kernel,
                      job.taps, channels, sums.data());
    if (job.conv_bias)
      for (int64_t c = 0; c < channels; ++c) sums[c] += job.conv_bias[c];
    float* y = job.y + r * channels;
    silu_rows(sums.data(), 0, 1, channels, y);
    if (job.mask)
      for (int64_t c = 0; c < channels; ++c) y[c] *= job.mask[r];
  }
}

// Heads p0..p1 of the sequences' (sequences * heads), each through its positions in order: the head's state decayed
// by exp(dt * A) and moved by dt * B * x, read by C, plus D times x; the head's output in `out` before the gated
// norm. dt at least dt_min (a prompt's time step limit, as transformers' chunked form clamps it).
static void mamba_heads(const MambaJob& job, int64_t p0, int64_t p1) {
  const int64_t heads = job.heads, dh = job.head_size, n = job.state_size, channels = job.channels;
  const int64_t inner = heads * dh, per_group = heads / job.groups;
  std::vector<float> db(n);
  for (int64_t pair = p0; pair < p1; ++pair)
  for (int64_t t = 0; t < job.positions; ++t) {
    const int64_t h = pair % heads, r = pair / heads * job.positions + t, g = h / per_group, p = r * heads + h;
    const float* x = job.y + r * channels + h * dh;
    const float* b = job.y + r * channels + inner + g * n;
    const float* c = job.y + r * channels + inner + job.groups * n + g * n;
    const float dt = std::max(softplus(job.dt[p] + job.dt_bias[h]), job.dt_min);
    const float decay = std::exp(dt * job.a[h]);
    float* __restrict__ step = db.data();
    for (int64_t k = 0; k < n; ++k) step[k] = dt * b[k];
    float* s = job.state + pair * dh * n;
    float* o = job.out + r * inner + h * dh;
    const int64_t whole = n - n % 16;
    for (int64_t i = 0; i < dh; ++i) {
      float* __restrict__ row = s + i * n;
      const float xi = x[i];
      // Sixteen of the state's values at a time, their products with C summed in lanes, then the lanes in one fixed
      // order (total), then the values past the last sixteen in order.
      Lanes sums{};
      for (int64_t k = 0; k < whole; k += 16) {
        const Lanes next = lanes(row + k) * decay + lanes(step + k) * xi;
        store(row + k, next);
        sums += next * lanes(c + k);
      }
      float sum = total(sums);
      for (int64_t k = whole; k < n; ++k) {
        row[k] = row[k] * decay + step[k] * xi;
        sum += row[k] * c[k];
      }
      o[i] = sum + xi * job.d[h];
    }
  }
}

// Rows r0..r1's gated norm: the output times silu of the gate, normalized over each group (its RMS), times the weight
// (no weight: the gated output alone).
static void mamba_norm(const MambaJob& job, int64_t r0, int64_t r1) {
  const int64_t inner = job.heads * job.head_size, group = inner / job.groups;
  std::vector<float> gated(2 * inner);
  for (int64_t r = r0; r < r1; ++r) {
    float* o = job.out + r * inner;
    std::copy(job.z + r * inner, job.z + (r + 1) * inner, gated.begin());  // [gate | output]: silu(gate) * output
    std::copy(o, o + inner, gated.begin() + inner);
    silu_rows(gated.data(), 0, 1, inner, o);
    if (job.norm == nullptr) continue;
    for (int64_t g0 = 0; g0 < inner; g0 += group) {
      float sum = 0.f;
      for (int64_t j = g0; j < g0 + group; ++j) sum += o[j] * o[j];
      const float inv = 1.f / std::sqrt(sum / float(group) + job.eps);
      for (int64_t j = g0; j < g0 + group; ++j) o[j] = job.norm[j] * (o[j] * inv);
    }
  }
}

void mamba_step_rows(const MambaJob& job) {
  at::parallel_for(0, job.rows, 1, [&](int64_t r0, int64_t r1) { mamba_convolve(job, r0, r1); });
  at::parallel_for(0, job.rows * job.heads, 1, [&](int64_t p0, int64_t p1) { mamba_heads(job, p0, p1); });
  at::parallel_for(0, job.rows, 1, [&](int64_t r0, int64_t r1) { mamba_norm(job, r0, r1); });
}

// A prompt: every position's convolution, then each sequence's heads through its positions (a head's state stays in
// its core's cache for all of them), then every position's gated norm.
void mamba_scan_rows(const MambaJob& job) {
  const int64_t sequences = job.rows / job.positions;
  at::parallel_for(0, job.rows, 1, [&](int64_t r0, int64_t r1) { mamba_scan_convolve(job, r0, r1); });
  at::parallel_for(0, sequences * job.heads, 1, [&](int64_t p0, int64_t p1) { mamba_heads(job, p0, p1); });
  at::parallel_for(0, job.rows, 1, [&](int64_t r0, int64_t r1) { mamba_norm(job, r0, r1); });
}
