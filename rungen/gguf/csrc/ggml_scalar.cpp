// The portable path: the same integer arithmetic as the SIMD kernels, plain loops (the reference the others are
// tested against, and what a CPU without AVX2 runs).
#include "ggml_kernels.h"

namespace rungen_ggml {
namespace scalar {
namespace {

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

}  // namespace

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
}  // namespace rungen_ggml
