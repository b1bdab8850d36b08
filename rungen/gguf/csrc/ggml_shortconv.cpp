// A short convolution layer's decode step (LFM2's, transformers' Lfm2ShortConv) between its two products: one call
// for what transformers' PyTorch form takes in a depthwise conv1d over the window and some eight more operations.
#include "ggml_ops.h"

namespace rungen_ggml {

// window [rows, channels, held] float32, contiguous, updated in place (the last `held` positions' B * x); bcx
// [rows, 3 * channels] in_proj's output (B, C and x, each channels wide); taps [channels, kernel] (kernel <= held +
// 1). The window shifts to end with B * x of the new position; returns C times each channel's taps summed over the
// last `kernel` positions, in order (transformers' causal_conv1d_update within float32 rounding): [rows, channels],
// what out_proj takes.
at::Tensor short_conv_step(const at::Tensor& window, const at::Tensor& bcx_in, const at::Tensor& taps_in) {
  TORCH_CHECK(window.scalar_type() == at::kFloat && window.is_contiguous() && window.dim() == 3,
              "rungen_ggml: short_conv_step's window must be contiguous float32 [rows, channels, held]");
  const int64_t rows = window.size(0), channels = window.size(1), held = window.size(2);
  const at::Tensor bcx = bcx_in.to(at::kFloat).contiguous(), taps = taps_in.to(at::kFloat).contiguous();
  TORCH_CHECK(bcx.numel() == rows * 3 * channels && taps.dim() == 2 && taps.size(0) == channels &&
                  taps.size(1) >= 1 && taps.size(1) <= held + 1,
              "rungen_ggml: short_conv_step's inputs do not match its window");
  const int64_t kernel = taps.size(1);
  at::Tensor out = at::empty({rows, channels}, window.options());
  float* wp = window.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float *xp = bcx.data_ptr<float>(), *tp = taps.data_ptr<float>();
  at::parallel_for(0, rows * channels, 256, [&](int64_t p0, int64_t p1) {
    std::vector<float> line(held + 1);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r = p / channels, c = p % channels;
      const float* row = xp + r * 3 * channels;
      float* w = wp + p * held;
      std::copy(w, w + held, line.begin());
      line[held] = row[c] * row[2 * channels + c];  // B * x
      std::copy(line.begin() + 1, line.end(), w);
      const float* at = line.data() + held + 1 - kernel;
      float sum = 0.f;
      for (int64_t j = 0; j < kernel; ++j) sum += at[j] * tp[c * kernel + j];
      op[p] = row[channels + c] * sum;  // C times the convolution
    }
  });
  return out;
}

}  // namespace rungen_ggml
