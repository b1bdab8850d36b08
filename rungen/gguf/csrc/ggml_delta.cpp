// A Gated DeltaNet layer's decode step (Qwen3.5's linear attention, transformers' Qwen3_5GatedDeltaNet) after its
// products: one call for what transformers' PyTorch forms take in some 25 (the short convolution's depthwise conv1d,
// the delta rule's broadcast products over each head's state, the gated norm). Each value head's state is read
// twice and written once, in place; the loops (ggml_delta.h) in the build of the code path in use.
#include "ggml_ops.h"

namespace rungen_ggml {

namespace {

// What ggml_delta.h's loops read and write: delta_step's and delta_scan's tensors (below) as float32 pointers, and
// their shapes. A row is a sequence's position (decode: one position, rows the sequences).
struct DeltaJob {
  float *window, *state;
  const float *mixed, *conv, *a, *b, *z, *decay, *dt_bias, *norm;
  float *y, *out;  // the convolved q/k/v [rows, channels]; the output [rows, heads * value size]
  const int64_t* scatter;  // where each output column goes in its row (a permutation), or null: in place
  int64_t rows, channels, kernel, heads, key_heads, dk, dv;
  float eps;
  int64_t positions = 1, inputs = 1;  // a sequence's positions (rows / sequences), and its convolution's inputs
  const float* taps = nullptr;        // a prompt's: the convolution's weights by tap [kernel, channels]
};

// `scatter_in` as int64, checked to be a permutation of a row's `columns` output columns; undefined where none.
at::Tensor checked_scatter(const c10::optional<at::Tensor>& scatter_in, int64_t columns) {
  if (!scatter_in.has_value()) return at::Tensor();
  const at::Tensor scatter = scatter_in->to(at::kLong).contiguous();
  TORCH_CHECK(scatter.numel() == columns, "rungen_ggml: a delta rule's scatter must have heads * value size entries");
  const int64_t* sc = scatter.data_ptr<int64_t>();
  std::vector<bool> seen(columns, false);
  for (int64_t c = 0; c < columns; ++c) {
    TORCH_CHECK(sc[c] >= 0 && sc[c] < columns && !seen[sc[c]], "rungen_ggml: a delta rule's scatter is not a "
                "permutation of the output's columns");
    seen[sc[c]] = true;
  }
  return scatter;
}

}  // namespace

// ggml_delta.h's loops for AVX-512, AVX2 and the baseline.
#define RUNGEN_LOOPS "ggml_delta.h"
#include "ggml_builds.h"

// window [rows, channels, kernel] (the last positions' convolution inputs) and state [rows, heads, key size, value
// size] float32, contiguous, both updated in place; mixed [rows, channels] the new position's q/k/v product; conv
// [channels, kernel]; a, b [rows, heads] the decay's and the step's products; z [rows, heads * value size] the
// output gate's; decay [heads] = -exp(A_log); dt_bias [heads]; norm [value size]. Each value head reads key head
// head / (heads / key_heads) (grouped, as transformers' repeat_interleave). Returns the gated norm's output
// [rows, heads * value size], what out_proj takes; `scatter` given, each row's column c at scatter[c] (out_proj's
// input in the order its columns keep in the file, which would otherwise gather it).
at::Tensor delta_step(const at::Tensor& window, const at::Tensor& mixed_in, const at::Tensor& conv_in,
                      const at::Tensor& state, const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& z_in,
                      const at::Tensor& decay_in, const at::Tensor& dt_bias_in, const at::Tensor& norm_in,
                      int64_t key_heads, double eps, const c10::optional<at::Tensor>& scatter_in) {
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
  const at::Tensor scatter = checked_scatter(scatter_in, heads * dv);
  at::Tensor y = at::empty({rows, channels}, window.options());
  at::Tensor out = at::empty({rows, heads * dv}, window.options());
  const DeltaJob job{window.data_ptr<float>(), state.data_ptr<float>(), mixed.data_ptr<float>(),
                     conv.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), z.data_ptr<float>(),
                     decay.data_ptr<float>(), dt_bias.data_ptr<float>(), norm.data_ptr<float>(), y.data_ptr<float>(),
                     out.data_ptr<float>(),
                     scatter.defined() ? scatter.data_ptr<int64_t>() : nullptr, rows, channels, kernel, heads,
                     key_heads, dk, dv, float(eps)};
  BY_ISA(delta_step_rows)(job);
  return out;
}

// A prompt's positions through the layer after its products, each sequence's heads a position at a time as
// delta_step takes them (the same arithmetic a position, so a prompt leaves the state decoding it token by token
// would): mixed [sequences, inputs, channels] the q/k/v products, the last `positions` of each sequence the prompt's
// and those before them the convolution's earlier inputs (the cache's window, or none); state [sequences, heads, key
// size, value size] float32 contiguous, updated in place; a, b [sequences, positions, heads]; z [sequences,
// positions, heads * value size]; the rest as delta_step's. Returns [sequences, positions, heads * value size].
at::Tensor delta_scan(const at::Tensor& mixed_in, int64_t positions, const at::Tensor& conv_in,
                      const at::Tensor& state, const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& z_in,
                      const at::Tensor& decay_in, const at::Tensor& dt_bias_in, const at::Tensor& norm_in,
                      int64_t key_heads, double eps, const c10::optional<at::Tensor>& scatter_in) {
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4,
              "rungen_ggml: delta_scan's state must be contiguous float32 [sequences, heads, key size, value size]");
  TORCH_CHECK(mixed_in.dim() == 3 && mixed_in.size(0) == state.size(0) && positions > 0 &&
                  mixed_in.size(1) >= positions,
              "rungen_ggml: delta_scan's mixed must be [sequences, inputs >= positions, channels]");
  const int64_t sequences = state.size(0), inputs = mixed_in.size(1), channels = mixed_in.size(2);
  const int64_t heads = state.size(1), dk = state.size(2), dv = state.size(3), rows = sequences * positions;
  TORCH_CHECK(key_heads > 0 && heads % key_heads == 0 && channels == 2 * key_heads * dk + heads * dv,
              "rungen_ggml: delta_scan's mixed holds ", channels, " channels, not q, k and v of its state's shape");
  const at::Tensor mixed = floats(mixed_in), conv = floats(conv_in), a = floats(a_in), b = floats(b_in),
                   z = floats(z_in), decay = floats(decay_in), dt_bias = floats(dt_bias_in), norm = floats(norm_in);
  TORCH_CHECK(conv.numel() % channels == 0 && a.numel() == rows * heads && b.numel() == rows * heads &&
                  z.numel() == rows * heads * dv && decay.numel() == heads && dt_bias.numel() == heads &&
                  norm.numel() == dv,
              "rungen_ggml: delta_scan's inputs do not match its mixed and state");
  const at::Tensor scatter = checked_scatter(scatter_in, heads * dv);
  at::Tensor y = at::empty({rows, channels}, state.options());
  at::Tensor out = at::empty({sequences, positions, heads * dv}, state.options());
  DeltaJob job{nullptr, state.data_ptr<float>(), mixed.data_ptr<float>(), conv.data_ptr<float>(),
               a.data_ptr<float>(), b.data_ptr<float>(), z.data_ptr<float>(), decay.data_ptr<float>(),
               dt_bias.data_ptr<float>(), norm.data_ptr<float>(), y.data_ptr<float>(), out.data_ptr<float>(),
               scatter.defined() ? scatter.data_ptr<int64_t>() : nullptr, rows, channels, conv.numel() / channels,
               heads, key_heads, dk, dv, float(eps)};
  const at::Tensor taps = conv.view({channels, -1}).t().contiguous();  // (a tap's weights side by side)
  job.positions = positions;
  job.inputs = inputs;
  job.taps = taps.data_ptr<float>();
  BY_ISA(delta_scan_rows)(job);
  return out;
}

}  // namespace rungen_ggml
