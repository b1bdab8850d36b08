// The torch side's functions that one translation unit calls in another, and the operators ggml_kernels.cpp
// registers: the products (ggml_products.cpp), the layers' steps (ggml_layers.cpp), a mixture of experts
// (ggml_mixture.cpp), the decoder (ggml_decoder.cpp), interleaving (ggml_interleave.cpp) and the code path
// (ggml_dispatch.cpp).
#pragma once

#include "ggml_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <string>
#include <tuple>
#include <vector>

namespace rungen_ggml {

// A tensor as float32 and contiguous, what the steps' loops read by pointer.
inline at::Tensor floats(const at::Tensor& x) { return x.to(at::kFloat).contiguous(); }

// torch's softplus (its threshold: above 20, x itself), for the recurrent steps' time steps.
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// ggml_dispatch.cpp
std::string isa();
std::string set_isa(const std::string& name);

// ggml_products.cpp
// A weight's blocks as a product reads them: `rows` tensor rows (eight output rows each where qtype has X8), `pitch`
// bytes apart.
struct Weight {
  const uint8_t* blocks;
  int64_t pitch, rows, qtype;
};

int64_t out_rows(const at::Tensor& blocks, int64_t qtype);
void check_inputs(const at::Tensor& blocks, int64_t qtype, int64_t in_features);
Weight weight_of(const at::Tensor& blocks, int64_t qtype);
void grouped_into(const float* x, int64_t in_features, const std::vector<int64_t>& counts,
                  const std::vector<std::vector<Weight>>& weights, int64_t width, float* y);
at::Tensor mm(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t in_features);
at::Tensor mm_parts(const at::Tensor& x_in, at::TensorList blocks, at::IntArrayRef qtypes, int64_t in_features);
at::Tensor mm_grouped(const at::Tensor& x_in, at::TensorList blocks, at::IntArrayRef qtypes, at::IntArrayRef counts,
                      int64_t in_features);
at::Tensor mm_int(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t in_features);
at::Tensor mm_tiled(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t in_features);
at::Tensor dequantize(const at::Tensor& blocks, int64_t qtype, int64_t in_features);
at::Tensor embed(const at::Tensor& blocks, int64_t qtype, int64_t in_features, const at::Tensor& ids_in);
int64_t set_tile_threshold(int64_t n);
void mm_parts_into(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef qtypes, int64_t in_features,
                   float* y);
void mm_into(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t in_features, float* y);
int64_t parts_rows(at::TensorList blocks, at::IntArrayRef qtypes);

// ggml_interleave.cpp
at::Tensor interleave(const at::Tensor& blocks, int64_t qtype, const c10::optional<at::Tensor>& out_in);
at::Tensor mxfp4_held(const at::Tensor& blocks);

// ggml_layers.cpp
// Where rope_rows writes keys or values: [b, kv_heads, positions, head_dim] with these strides (elements), from
// its position 0 (a cache's buffer from the first free position, or a tensor of its own); float32, or float16
// where `half` (each value rounded to nearest even, as torch's conversion rounds it).
struct Rows4 {
  void* p;
  int64_t batch, head, token;
  bool half = false;
};

// Rows4 over a float32 or float16 tensor's data from position `from` of its third dimension.
Rows4 rows_of(const at::Tensor& x, int64_t from = 0);

struct HeadNorms {
  const float* q = nullptr;  // [head_dim] weights, or none
  const float* k = nullptr;
  double eps = 0.;
};

void rms_norm_rows(const float* xp, const float* wp, double eps, int64_t rows, int64_t d, float* yp);
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps);
void rope_rows(const float* src, const float* cp, const float* sp, bool shared, int64_t b, int64_t t, int64_t heads,
               int64_t kv_heads, int64_t dim, int64_t rot, float* qp, const Rows4& k, const Rows4& v,
               const HeadNorms& norms = HeadNorms{});
bool rope_shared(const at::Tensor& cos, const at::Tensor& sin, int64_t b, int64_t t, int64_t rot);
int64_t rotary_width(const at::Tensor& cos, int64_t dim);
const float* head_norm(const c10::optional<at::Tensor>& weight, int64_t dim, at::Tensor& held);
std::vector<at::Tensor> rope_split(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                   int64_t heads, int64_t kv_heads, const c10::optional<at::Tensor>& q_norm,
                                   const c10::optional<at::Tensor>& k_norm, double norm_eps);

using GateFn = void (*)(const float*, int64_t, int64_t, int64_t, float*);
constexpr int64_t SILU_WORK = 16384, GELU_WORK = 65536;
GateFn gelu_fn();
GateFn silu_fn();
void gate_mul_rows(GateFn fn, int64_t work, const float* gp, int64_t rows, int64_t f, float* yp);
at::Tensor dot_rows(const at::Tensor& x_in, const at::Tensor& w_in);
void dot_rows_into(const float* xp, const float* wp, int64_t t, int64_t e, int64_t n, float* yp);
at::Tensor silu_mul(const at::Tensor& gu);
at::Tensor short_conv_step(const at::Tensor& window, const at::Tensor& bcx, const at::Tensor& taps);
at::Tensor delta_step(const at::Tensor& window, const at::Tensor& mixed, const at::Tensor& conv, const at::Tensor& state,
                      const at::Tensor& a, const at::Tensor& b, const at::Tensor& z, const at::Tensor& decay,
                      const at::Tensor& dt_bias, const at::Tensor& norm, int64_t key_heads, double eps,
                      const c10::optional<at::Tensor>& scatter);
at::Tensor mamba_scan(const at::Tensor& xbc, int64_t positions, const at::Tensor& conv,
                      const c10::optional<at::Tensor>& conv_bias, const at::Tensor& state, const at::Tensor& dt,
                      const at::Tensor& dt_bias, const at::Tensor& a, const at::Tensor& d, const at::Tensor& z,
                      const c10::optional<at::Tensor>& norm, int64_t groups, double eps, double dt_min,
                      const c10::optional<at::Tensor>& mask);
at::Tensor delta_scan(const at::Tensor& mixed, int64_t positions, const at::Tensor& conv, const at::Tensor& state,
                      const at::Tensor& a, const at::Tensor& b, const at::Tensor& z, const at::Tensor& decay,
                      const at::Tensor& dt_bias, const at::Tensor& norm, int64_t key_heads, double eps,
                      const c10::optional<at::Tensor>& scatter);
at::Tensor gelu_tanh_mul(const at::Tensor& gu);
at::Tensor mamba_step(const at::Tensor& window, const at::Tensor& xbc, const at::Tensor& conv,
                      const c10::optional<at::Tensor>& conv_bias, const at::Tensor& state, const at::Tensor& dt,
                      const at::Tensor& dt_bias, const at::Tensor& a, const at::Tensor& d, const at::Tensor& z,
                      const c10::optional<at::Tensor>& norm, int64_t groups, double eps);

// attend's mask as the kernel reads it: bool or additive float [b, 1, t, T], or none (causal).
struct AttendMask {
  at::Tensor held;
  const bool* bools = nullptr;
  const float* adds = nullptr;
};

AttendMask attend_mask(const c10::optional<at::Tensor>& mask_in, int64_t b, int64_t t, int64_t T);
void attend_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttendMask& mask, double scale,
                 double softcap, int64_t window, float* op, const float* sinks = nullptr, int64_t dropped = 0);
at::Tensor attend(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                  const c10::optional<at::Tensor>& mask_in, double scale, double softcap, int64_t window,
                  const c10::optional<at::Tensor>& sinks);

// ggml_mixture.cpp
// A mixture of experts' MLP: the router's float weight [experts, features], the experts' parts as stacks
// [experts, tensor rows, bytes] (gate/up's parts side by side, then down), and Qwen2-MoE's shared expert (its gate,
// up and down blocks, 2-D; none where `shared` is empty) with its gate's weight [1, features]. gpt-oss's adds
// biases (the router's [experts], the experts' gate/up [experts, 2 inner] and down [experts, features]) and gates
// by its clamped SwiGLU (swiglu_limit > 0).
// An expert's activation: SiLU(gate) * up, GELU-tanh(gate) * up (Gemma 4's), or relu(up)^2 of up alone (Nemotron
// 3's experts have no gate).
enum Activation : int64_t { SILU_GATED = 0, GELU_GATED = 1, RELU2 = 2 };
struct Mixture {
  at::Tensor router;
  int64_t top_k;
  bool norm_topk;
  std::vector<at::Tensor> gate_up;
  std::vector<int64_t> gate_up_types;
  at::Tensor down;
  int64_t down_type;
  std::vector<at::Tensor> shared;
  std::vector<int64_t> shared_types;
  c10::optional<at::Tensor> shared_gate;
  c10::optional<at::Tensor> router_bias, gate_up_bias, down_bias;
  float swiglu_alpha = 0.f, swiglu_limit = 0.f;
  int64_t activation = SILU_GATED;  // the experts' activation (Activation)
  int64_t count, features;  // experts, and their input and output features

  // router: [experts, features] (undefined where the caller routes: chosen_experts_into; `features` then says).
  Mixture(const at::Tensor& router, int64_t top_k, bool norm_topk, at::TensorList experts,
          at::IntArrayRef expert_types, at::TensorList shared, at::IntArrayRef shared_types,
          const c10::optional<at::Tensor>& shared_gate, const c10::optional<at::Tensor>& router_bias = {},
          const c10::optional<at::Tensor>& gate_up_bias = {}, const c10::optional<at::Tensor>& down_bias = {},
          double swiglu_alpha = 0., double swiglu_limit = 0., int64_t features = -1,
          int64_t activation = SILU_GATED);
  // x [n, features] (float32, contiguous) through the mixture into out [n, features].
  void forward_into(const float* x, int64_t n, float* out) const;
  // x's rows through the experts the caller chose (ids, weights [n, top_k]) into out [n, features].
  void chosen_experts_into(const float* x, int64_t n, const int64_t* ids, const float* weights, float* out) const;
  int64_t inner_features() const;  // an expert's up rows (and as many gate rows where it has a gate)
};

at::Tensor mixture(const at::Tensor& x, const at::Tensor& router, int64_t top_k, bool norm_topk,
                   at::TensorList experts, at::IntArrayRef expert_types, at::TensorList shared,
                   at::IntArrayRef shared_types, const c10::optional<at::Tensor>& shared_gate,
                   const c10::optional<at::Tensor>& router_bias, const c10::optional<at::Tensor>& gate_up_bias,
                   const c10::optional<at::Tensor>& down_bias, double swiglu_alpha, double swiglu_limit);
at::Tensor chosen_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                          at::TensorList experts, at::IntArrayRef expert_types, int64_t activation);

// ggml_decoder.cpp
std::vector<at::Tensor> attention_in(const at::Tensor& hidden, const at::Tensor& norm_weight, double eps,
                                     at::TensorList qkv_blocks, at::IntArrayRef qkv_qtypes,
                                     const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& cos,
                                     const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                                     const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                                     double norm_eps);
at::Tensor attention_out_mlp(const at::Tensor& hidden, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const c10::optional<at::Tensor>& mask, double scale, const at::Tensor& o_blocks,
                             int64_t o_qtype, const at::Tensor& norm_weight, double eps,
                             at::TensorList gate_up_blocks, at::IntArrayRef gate_up_qtypes,
                             const at::Tensor& down_blocks, int64_t down_qtype);
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> decoder_stack(
    const at::Tensor& hidden, const at::Tensor& cos_in, const at::Tensor& sin_in,
    const c10::optional<at::Tensor>& mask, at::TensorList input_norms, at::TensorList qkv,
    const c10::List<c10::optional<at::Tensor>>& qkv_bias, const c10::List<c10::optional<at::Tensor>>& q_norms,
    const c10::List<c10::optional<at::Tensor>>& k_norms, at::TensorList o, at::TensorList post_norms,
    at::TensorList gate_up, at::TensorList down, at::IntArrayRef qtypes, double eps, int64_t heads, int64_t kv_heads,
    double scale, at::TensorList k_buffers, at::TensorList v_buffers, int64_t length,
    const c10::List<c10::optional<at::Tensor>>& attention_out_norms,
    const c10::List<c10::optional<at::Tensor>>& mlp_out_norms, at::IntArrayRef windows,
    const c10::optional<at::Tensor>& local_cos_in, const c10::optional<at::Tensor>& local_sin_in, double softcap,
    bool gelu, const c10::List<c10::optional<at::Tensor>>& routers, at::TensorList experts,
    at::IntArrayRef expert_qtypes, const c10::List<c10::optional<at::Tensor>>& shared_gates, int64_t top_k,
    bool norm_topk, at::IntArrayRef rotary, at::IntArrayRef dropped, double residual_scale);

}  // namespace rungen_ggml
