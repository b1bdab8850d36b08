// A Gated DeltaNet layer's decode step (Qwen3.5's linear attention, transformers' Qwen3_5GatedDeltaNet) after its
// products: one call for what transformers' PyTorch forms take in some 25 (the short convolution's depthwise conv1d,
// the delta rule's broadcast products over each head's state, the gated norm). Each value head's state is read
// twice and written once, in place.
#include "ggml_ops.h"

namespace rungen_ggml {

namespace {

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // (torch's threshold)

at::Tensor floats(const at::Tensor& x) { return x.to(at::kFloat).contiguous(); }

}  // namespace

// window [rows, channels, kernel] (the last positions' convolution inputs) and state [rows, heads, key size, value
// size] float32, contiguous, both updated in place; mixed [rows, channels] the new position's q/k/v product; conv
// [channels, kernel]; a, b [rows, heads] the decay's and the step's products; z [rows, heads * value size] the
// output gate's; decay [heads] = -exp(A_log); dt_bias [heads]; norm [value size]. Each value head reads key head
// head / (heads / key_heads) (grouped, as transformers' repeat_interleave). Returns the gated norm's output
// [rows, heads * value size], what out_proj takes.
at::Tensor delta_step(const at::Tensor& window, const at::Tensor& mixed_in, const at::Tensor& conv_in,
                      const at::Tensor& state, const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& z_in,
                      const at::Tensor& decay_in, const at::Tensor& dt_bias_in, const at::Tensor& norm_in,
                      int64_t key_heads, double eps) {
  TORCH_CHECK(window.scalar_type() == at::kFloat && window.is_contiguous() && window.dim() == 3,
              "rungen_ggml: delta_step's window must be contiguous float32 [rows, channels, kernel]");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4,
              "rungen_ggml: delta_step's state must be contiguous float32 [rows, heads, key size, value size]");
  const int64_t rows = window.size(0), channels = window.size(1), kernel = window.size(2);
  const int64_t heads = state.size(1), dk = state.size(2), dv = state.size(3);
  TORCH_CHECK(state.size(0) == rows && key_heads > 0 && heads % key_heads == 0 &&
                  channels == 2 * key_heads * dk + heads * dv,
              "rungen_ggml: delta_step's window holds ", channels, " channels, not q, k and v of its state's shape");
  const at::Tensor mixed = floats(mixed_in), conv = floats(conv_in), a = floats(a_in), b = floats(b_in),
                   z = floats(z_in), decay = floats(decay_in), dt_bias = floats(dt_bias_in), norm = floats(norm_in);
  TORCH_CHECK(mixed.numel() == rows * channels && conv.numel() == channels * kernel && a.numel() == rows * heads &&
                  b.numel() == rows * heads && z.numel() == rows * heads * dv && decay.numel() == heads &&
                  dt_bias.numel() == heads && norm.numel() == dv,
              "rungen_ggml: delta_step's inputs do not match its window and state");
  float* wp = window.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  const float *mp = mixed.data_ptr<float>(), *cp = conv.data_ptr<float>(), *ap = a.data_ptr<float>(),
              *bp = b.data_ptr<float>(), *zp = z.data_ptr<float>(), *gp = decay.data_ptr<float>(),
              *tp = dt_bias.data_ptr<float>(), *np = norm.data_ptr<float>();

  // The convolution of the new position (the window shifted, the position last), silu; then q and k of each key
  // head normalized (l2, eps 1e-6, as transformers' l2norm), q times 1 / sqrt(key size). The SiLUs are silu_fn's
  // (the instruction set's exp: the library's scalar one took the call half its time), over [sums | ones].
  at::Tensor y = at::empty({rows, channels}, window.options());
  float* yp = y.data_ptr<float>();
  const int64_t qk = key_heads * dk;
  const GateFn silu_times = silu_fn();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> sums(2 * channels, 1.f);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < channels; ++c) {
        float* w = wp + (r * channels + c) * kernel;
        for (int64_t j = 0; j + 1 < kernel; ++j) w[j] = w[j + 1];
        w[kernel - 1] = mp[r * channels + c];
        float sum = 0.f;
        for (int64_t j = 0; j < kernel; ++j) sum += w[j] * cp[c * kernel + j];
        sums[c] = sum;
      }
      silu_times(sums.data(), 0, 1, channels, yp + r * channels);
      for (int64_t h = 0; h < 2 * key_heads; ++h) {
        float* x = yp + r * channels + h * dk;
        float sum = 0.f;
        for (int64_t i = 0; i < dk; ++i) sum += x[i] * x[i];
        const float inv = 1.f / std::sqrt(sum + 1e-6f), scale = h < key_heads ? 1.f / std::sqrt(float(dk)) : 1.f;
        for (int64_t i = 0; i < dk; ++i) x[i] = x[i] * inv * scale;
      }
    }
  });

  // Each value head: its state decayed by g, read by k (kv), moved toward v by beta (delta), read by q; then the
  // output normalized over the head (the norm's weight) times silu of the gate.
  at::Tensor out = at::empty({rows, heads * dv}, window.options());
  float* op = out.data_ptr<float>();
  const int64_t per_key = heads / key_heads;
  at::parallel_for(0, rows * heads, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> kv(dv), delta(dv), gated(2 * dv);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r = p / heads, h = p % heads, kh = h / per_key;
      const float* q = yp + r * channels + kh * dk;
      const float* k = yp + r * channels + qk + kh * dk;
      const float* v = yp + r * channels + 2 * qk + h * dv;
      float* s = sp + p * dk * dv;
      float* o = op + p * dv;
      const float g = std::exp(gp[h] * softplus(ap[p] + tp[h])), beta = sigmoid(bp[p]);
      float* __restrict__ read = kv.data();
      float* __restrict__ step = delta.data();
      std::fill(read, read + dv, 0.f);
      for (int64_t i = 0; i < dk; ++i) {
        const float ki = k[i];
        const float* __restrict__ row = s + i * dv;
        for (int64_t j = 0; j < dv; ++j) read[j] += ki * row[j];
      }
      for (int64_t j = 0; j < dv; ++j) step[j] = (v[j] - g * read[j]) * beta;
      float* __restrict__ sum_out = o;
      std::fill(sum_out, sum_out + dv, 0.f);
      for (int64_t i = 0; i < dk; ++i) {
        const float ki = k[i], qi = q[i];
        float* __restrict__ row = s + i * dv;
        for (int64_t j = 0; j < dv; ++j) {
          const float next = g * row[j] + ki * step[j];
          row[j] = next;
          sum_out[j] += qi * next;
        }
      }
      float sum = 0.f;
      for (int64_t j = 0; j < dv; ++j) sum += o[j] * o[j];
      const float inv = 1.f / std::sqrt(sum / float(dv) + float(eps));
      std::copy(zp + p * dv, zp + (p + 1) * dv, gated.begin());  // [gate | normed]: silu(gate) * normed
      for (int64_t j = 0; j < dv; ++j) gated[dv + j] = np[j] * (o[j] * inv);
      silu_times(gated.data(), 0, 1, dv, o);
    }
  });
  return out;
}

}  // namespace rungen_ggml
