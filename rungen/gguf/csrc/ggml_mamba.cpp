// A Mamba-2 layer's decode step (Granite 4.0 H's, transformers' GraniteMoeHybridMambaLayer) between its products:
// one call for what transformers' PyTorch forms take in some 40 (the convolution of one position a depthwise conv1d,
// the state's update and read broadcast products and a batched product over it, the gated norm). Each head's state
// is updated and read in place; the loops (ggml_mamba.h) in the build of the code path in use.
#include "ggml_ops.h"

namespace rungen_ggml {

namespace {

// What ggml_mamba.h's loops read and write: mamba_step's tensors (below) as float32 pointers, and their shapes.
struct MambaJob {
  float *window, *state;
  const float *xbc, *conv, *conv_bias, *dt, *dt_bias, *a, *d, *z, *norm;
  float *y, *out;  // the convolved x, B and C [rows, channels]; the output [rows, heads * head size]
  int64_t rows, channels, kernel, heads, head_size, state_size, groups;
  float eps;
};

}  // namespace

// ggml_mamba.h's loops for AVX-512, AVX2 and the baseline (see ggml_attend.cpp).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f")
namespace avx512 {
#include "ggml_mamba.h"
}  // namespace avx512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "ggml_mamba.h"
}  // namespace avx2
#pragma GCC pop_options
namespace scalar {
#include "ggml_mamba.h"
}  // namespace scalar

// window [rows, channels, kernel] (the last positions' convolution inputs) and state [rows, heads, head size, state
// size] float32, contiguous, both updated in place; xbc [rows, channels] the new position's x, B and C (channels =
// heads * head size + 2 * groups * state size); conv [channels, kernel] and its bias [channels] or none; dt [rows,
// heads] the step's product, dt_bias, a (= -exp(A_log)) and d [heads]; z [rows, heads * head size] the gate; norm
// [heads * head size] the gated norm's weight over `groups` groups. Head h reads group h / (heads / groups).
// Returns the gated norm's output [rows, heads * head size], what out_proj takes.
at::Tensor mamba_step(const at::Tensor& window, const at::Tensor& xbc_in, const at::Tensor& conv_in,
                      const c10::optional<at::Tensor>& conv_bias_in, const at::Tensor& state, const at::Tensor& dt_in,
                      const at::Tensor& dt_bias_in, const at::Tensor& a_in, const at::Tensor& d_in,
                      const at::Tensor& z_in, const at::Tensor& norm_in, int64_t groups, double eps) {
  TORCH_CHECK(window.scalar_type() == at::kFloat && window.is_contiguous() && window.dim() == 3,
              "rungen_ggml: mamba_step's window must be contiguous float32 [rows, channels, kernel]");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4,
              "rungen_ggml: mamba_step's state must be contiguous float32 [rows, heads, head size, state size]");
  const int64_t rows = window.size(0), channels = window.size(1), kernel = window.size(2);
  const int64_t heads = state.size(1), dh = state.size(2), n = state.size(3);
  TORCH_CHECK(state.size(0) == rows && groups > 0 && heads % groups == 0 && channels == heads * dh + 2 * groups * n,
              "rungen_ggml: mamba_step's window holds ", channels, " channels, not x, B and C of its state's shape");
  const at::Tensor xbc = floats(xbc_in), conv = floats(conv_in), dt = floats(dt_in), dt_bias = floats(dt_bias_in),
                   a = floats(a_in), d = floats(d_in), z = floats(z_in), norm = floats(norm_in);
  at::Tensor conv_bias;
  if (conv_bias_in.has_value()) conv_bias = floats(*conv_bias_in);
  TORCH_CHECK(xbc.numel() == rows * channels && conv.numel() == channels * kernel && dt.numel() == rows * heads &&
                  dt_bias.numel() == heads && a.numel() == heads && d.numel() == heads &&
                  z.numel() == rows * heads * dh && norm.numel() == heads * dh &&
                  (!conv_bias.defined() || conv_bias.numel() == channels),
              "rungen_ggml: mamba_step's inputs do not match its window and state");
  at::Tensor y = at::empty({rows, channels}, window.options());
  at::Tensor out = at::empty({rows, heads * dh}, window.options());
  const MambaJob job{window.data_ptr<float>(), state.data_ptr<float>(), xbc.data_ptr<float>(),
                     conv.data_ptr<float>(), conv_bias.defined() ? conv_bias.data_ptr<float>() : nullptr,
                     dt.data_ptr<float>(), dt_bias.data_ptr<float>(), a.data_ptr<float>(), d.data_ptr<float>(),
                     z.data_ptr<float>(), norm.data_ptr<float>(), y.data_ptr<float>(), out.data_ptr<float>(), rows,
                     channels, kernel, heads, dh, n, groups, float(eps)};
  if (current_isa >= VNNI) {
    avx512::mamba_step_rows(job);
  } else if (current_isa >= AVX2) {
    avx2::mamba_step_rows(job);
  } else {
    scalar::mamba_step_rows(job);
  }
  return out;
}

}  // namespace rungen_ggml
