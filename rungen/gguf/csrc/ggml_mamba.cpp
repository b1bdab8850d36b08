// A Mamba-2 layer's decode step (Granite 4.0 H's, transformers' GraniteMoeHybridMambaLayer) between its products:
// one call for what transformers' PyTorch forms take in some 40 (the convolution of one position a depthwise conv1d,
// the state's update and read broadcast products and a batched product over it, the gated norm). Each head's state
// is updated and read in place; the loops (ggml_mamba.h) in the build of the code path in use.
#include "ggml_ops.h"

namespace rungen_ggml {

namespace {

// What ggml_mamba.h's loops read and write: mamba_step's and mamba_scan's tensors (below) as float32 pointers, and
// their shapes. A row is a sequence's position (decode: one position, rows the sequences).
struct MambaJob {
  float *window, *state;
  const float *xbc, *conv, *conv_bias, *dt, *dt_bias, *a, *d, *z, *norm;
  float *y, *out;  // the convolved x, B and C [rows, channels]; the output [rows, heads * head size]
  int64_t rows, channels, kernel, heads, head_size, state_size, groups;
  float eps;
  int64_t positions = 1, inputs = 1;  // a sequence's positions (rows / sequences), and its convolution's inputs
  const float* taps = nullptr;        // a prompt's: the convolution's weights by tap [kernel, channels]
  float dt_min = 0.f;                 // the time step's least value (a prompt's, as transformers clamps it)
  const float* mask = nullptr;        // [rows]: a prompt's padded positions 0, or none
};

}  // namespace

// ggml_mamba.h's loops for AVX-512, AVX2 and the baseline.
#define RUNGEN_LOOPS "ggml_mamba.h"
#include "ggml_builds.h"

// window [rows, channels, kernel] (the last positions' convolution inputs) and state [rows, heads, head size, state
// size] float32, contiguous, both updated in place; xbc [rows, channels] the new position's x, B and C (channels =
// heads * head size + 2 * groups * state size); conv [channels, kernel] and its bias [channels] or none; dt [rows,
// heads] the step's product, dt_bias, a (= -exp(A_log)) and d [heads]; z [rows, heads * head size] the gate; norm
// [heads * head size] the gated norm's weight over `groups` groups, or none (the output times silu of the gate alone:
// Falcon-H1's mixer without its norm). Head h reads group h / (heads / groups). Returns the gated norm's output
// [rows, heads * head size], what out_proj takes.
at::Tensor mamba_step(const at::Tensor& window, const at::Tensor& xbc_in, const at::Tensor& conv_in,
                      const c10::optional<at::Tensor>& conv_bias_in, const at::Tensor& state, const at::Tensor& dt_in,
                      const at::Tensor& dt_bias_in, const at::Tensor& a_in, const at::Tensor& d_in,
                      const at::Tensor& z_in, const c10::optional<at::Tensor>& norm_in, int64_t groups, double eps) {
  TORCH_CHECK(window.scalar_type() == at::kFloat && window.is_contiguous() && window.dim() == 3,
              "rungen_ggml: mamba_step's window must be contiguous float32 [rows, channels, kernel]");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4,
              "rungen_ggml: mamba_step's state must be contiguous float32 [rows, heads, head size, state size]");
  const int64_t rows = window.size(0), channels = window.size(1), kernel = window.size(2);
  const int64_t heads = state.size(1), dh = state.size(2), n = state.size(3);
  TORCH_CHECK(state.size(0) == rows && groups > 0 && heads % groups == 0 && channels == heads * dh + 2 * groups * n,
              "rungen_ggml: mamba_step's window holds ", channels, " channels, not x, B and C of its state's shape");
  const at::Tensor xbc = floats(xbc_in), conv = floats(conv_in), dt = floats(dt_in), dt_bias = floats(dt_bias_in),
                   a = floats(a_in), d = floats(d_in), z = floats(z_in),
                   norm = norm_in.has_value() ? floats(*norm_in) : at::Tensor();
  at::Tensor conv_bias;
  if (conv_bias_in.has_value()) conv_bias = floats(*conv_bias_in);
  TORCH_CHECK(xbc.numel() == rows * channels && conv.numel() == channels * kernel && dt.numel() == rows * heads &&
                  dt_bias.numel() == heads && a.numel() == heads && d.numel() == heads &&
                  z.numel() == rows * heads * dh && (!norm.defined() || norm.numel() == heads * dh) &&
                  (!conv_bias.defined() || conv_bias.numel() == channels),
              "rungen_ggml: mamba_step's inputs do not match its window and state");
  at::Tensor y = at::empty({rows, channels}, window.options());
  at::Tensor out = at::empty({rows, heads * dh}, window.options());
  const MambaJob job{window.data_ptr<float>(), state.data_ptr<float>(), xbc.data_ptr<float>(),
                     conv.data_ptr<float>(), conv_bias.defined() ? conv_bias.data_ptr<float>() : nullptr,
                     dt.data_ptr<float>(), dt_bias.data_ptr<float>(), a.data_ptr<float>(), d.data_ptr<float>(),
                     z.data_ptr<float>(), norm.defined() ? norm.data_ptr<float>() : nullptr, y.data_ptr<float>(),
                     out.data_ptr<float>(), rows, channels, kernel, heads, dh, n, groups, float(eps)};
  BY_ISA(mamba_step_rows)(job);
  return out;
}

// A prompt's positions through the layer between its products, each sequence's heads a position at a time as
// mamba_step takes them (the same arithmetic a position, dt at least dt_min): xbc [sequences, inputs, channels] the
// x, B and C products, the last `positions` of each sequence the prompt's and those before them the convolution's
// earlier inputs (the cache's window, or none); state [sequences, heads, head size, state size] float32 contiguous,
// updated in place; dt [sequences, positions, heads]; z [sequences, positions, heads * head size]; mask [sequences,
// positions] (a padded position 0: its convolved x, B and C zeroed) or none; the rest as mamba_step's. Returns the
// gated norm's output [sequences, positions, heads * head size].
at::Tensor mamba_scan(const at::Tensor& xbc_in, int64_t positions, const at::Tensor& conv_in,
                      const c10::optional<at::Tensor>& conv_bias_in, const at::Tensor& state, const at::Tensor& dt_in,
                      const at::Tensor& dt_bias_in, const at::Tensor& a_in, const at::Tensor& d_in,
                      const at::Tensor& z_in, const c10::optional<at::Tensor>& norm_in, int64_t groups, double eps,
                      double dt_min,
                      const c10::optional<at::Tensor>& mask_in) {
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4,
              "rungen_ggml: mamba_scan's state must be contiguous float32 [sequences, heads, head size, state size]");
  TORCH_CHECK(xbc_in.dim() == 3 && xbc_in.size(0) == state.size(0) && positions > 0 && xbc_in.size(1) >= positions,
              "rungen_ggml: mamba_scan's xbc must be [sequences, inputs >= positions, channels]");
  const int64_t sequences = state.size(0), inputs = xbc_in.size(1), channels = xbc_in.size(2);
  const int64_t heads = state.size(1), dh = state.size(2), n = state.size(3), rows = sequences * positions;
  TORCH_CHECK(groups > 0 && heads % groups == 0 && channels == heads * dh + 2 * groups * n,
              "rungen_ggml: mamba_scan's xbc holds ", channels, " channels, not x, B and C of its state's shape");
  const at::Tensor xbc = floats(xbc_in), conv = floats(conv_in), dt = floats(dt_in), dt_bias = floats(dt_bias_in),
                   a = floats(a_in), d = floats(d_in), z = floats(z_in),
                   norm = norm_in.has_value() ? floats(*norm_in) : at::Tensor();
  at::Tensor conv_bias, mask;
  if (conv_bias_in.has_value()) conv_bias = floats(*conv_bias_in);
  if (mask_in.has_value()) mask = floats(*mask_in);
  TORCH_CHECK(conv.numel() % channels == 0 && dt.numel() == rows * heads && dt_bias.numel() == heads &&
                  a.numel() == heads && d.numel() == heads && z.numel() == rows * heads * dh &&
                  (!norm.defined() || norm.numel() == heads * dh) &&
                  (!conv_bias.defined() || conv_bias.numel() == channels) &&
                  (!mask.defined() || mask.numel() == rows),
              "rungen_ggml: mamba_scan's inputs do not match its xbc and state");
  at::Tensor y = at::empty({rows, channels}, state.options());
  at::Tensor out = at::empty({sequences, positions, heads * dh}, state.options());
  MambaJob job{nullptr, state.data_ptr<float>(), xbc.data_ptr<float>(), conv.data_ptr<float>(),
               conv_bias.defined() ? conv_bias.data_ptr<float>() : nullptr, dt.data_ptr<float>(),
               dt_bias.data_ptr<float>(), a.data_ptr<float>(), d.data_ptr<float>(), z.data_ptr<float>(),
               norm.defined() ? norm.data_ptr<float>() : nullptr, y.data_ptr<float>(), out.data_ptr<float>(), rows,
               channels, conv.numel() / channels, heads, dh, n, groups, float(eps)};
  const at::Tensor taps = conv.view({channels, -1}).t().contiguous();  // (a tap's weights side by side)
  job.positions = positions;
  job.inputs = inputs;
  job.taps = taps.data_ptr<float>();
  job.dt_min = float(dt_min);
  job.mask = mask.defined() ? mask.data_ptr<float>() : nullptr;
  BY_ISA(mamba_scan_rows)(job);
  return out;
}

}  // namespace rungen_ggml
