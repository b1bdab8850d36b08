// A mixture of experts' MLP in one call (Qwen3-MoE's block: a router and its experts; Qwen2-MoE's: a shared expert
// beside them, weighted by the sigmoid of its own gate): what transformers' block computes over
// rungen/gguf/experts.py's ExpertRouter and GGMLExperts, within float32 rounding (the softmax, SiLU and sigmoid are
// this file's and the products the kernels'), where those modules cost some forty torch operators, a sort and a
// read of each expert's count to the host a layer. Each step goes row by row or in a fixed order, so a token gets
// the same bits alone and in a batch. gpt-oss's block adds its router's and experts' biases and gates by its
// clamped SwiGLU; its softmax over the top k logits is the top k of the softmax divided by their sum.
#include "ggml_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

namespace rungen_ggml {
namespace {

// Expert e's rows of a stack [experts, tensor rows, bytes].
Weight expert_weight(const at::Tensor& stack, int64_t e, int64_t qtype) {
  return Weight{stack.data_ptr<uint8_t>() + e * stack.stride(0), stack.stride(1), stack.size(1), qtype};
}

// Output rows of a stack's expert (eight a tensor row in the X8 layout).
int64_t stack_rows(const at::Tensor& stack, int64_t qtype) { return stack.size(1) * (qtype & X8 ? 8 : 1); }

void check_stack(const at::Tensor& stack, int64_t qtype, int64_t experts, int64_t in_features) {
  TORCH_CHECK(stack.dim() == 3 && stack.size(0) == experts,
              "rungen_ggml: an expert part's blocks must be a stack [", experts, " experts, rows, bytes]");
  check_inputs(stack.select(0, 0), qtype, in_features);
}

}  // namespace

namespace {

// A bias of `shape` as float32, contiguous; none where none is given.
c10::optional<at::Tensor> float_bias(const c10::optional<at::Tensor>& bias, at::IntArrayRef shape, const char* what) {
  if (!bias.has_value()) return bias;
  TORCH_CHECK(bias->sizes() == shape, "rungen_ggml: a mixture's ", what, " bias must be ", shape);
  return bias->to(at::kFloat).contiguous();
}

}  // namespace

Mixture::Mixture(const at::Tensor& router_in, int64_t top_k_in, bool norm_topk_in, at::TensorList experts,
                 at::IntArrayRef expert_types, at::TensorList shared_in, at::IntArrayRef shared_types_in,
                 const c10::optional<at::Tensor>& shared_gate_in, const c10::optional<at::Tensor>& router_bias_in,
                 const c10::optional<at::Tensor>& gate_up_bias_in, const c10::optional<at::Tensor>& down_bias_in,
                 double swiglu_alpha_in, double swiglu_limit_in, int64_t features_in, int64_t activation_in)
    : router(router_in.defined() ? router_in.to(at::kFloat).contiguous() : router_in), top_k(top_k_in),
      norm_topk(norm_topk_in), shared(shared_in.begin(), shared_in.end()),
      shared_types(shared_types_in.begin(), shared_types_in.end()), shared_gate(shared_gate_in),
      swiglu_alpha(float(swiglu_alpha_in)), swiglu_limit(float(swiglu_limit_in)), activation(activation_in) {
  TORCH_CHECK(activation >= SILU_GATED && activation <= RELU2, "rungen_ggml: an experts' activation is 0 (SiLU "
              "gated), 1 (GELU-tanh gated) or 2 (ReLU squared, no gate), not ", activation);
  TORCH_CHECK(experts.size() >= 2 && experts.size() == expert_types.size(),
              "rungen_ggml: a mixture takes its experts' gate/up parts and then down, a type each");
  count = router.defined() ? router.size(0) : experts[0].size(0);
  features = router.defined() ? router.size(1) : features_in;
  TORCH_CHECK((!router.defined() || router.dim() == 2) && top_k > 0 && top_k <= count,
              "rungen_ggml: a mixture's router is [experts, features], and 0 < top_k <= experts");
  for (size_t i = 0; i + 1 < experts.size(); ++i) {
    check_stack(experts[i], expert_types[i], count, features);
    gate_up.push_back(experts[i]);
    gate_up_types.push_back(expert_types[i]);
  }
  down = experts.back();
  down_type = expert_types.back();
  int64_t width = 0;
  for (size_t i = 0; i < gate_up.size(); ++i) width += stack_rows(gate_up[i], gate_up_types[i]);
  TORCH_CHECK(width > 0 && (activation == RELU2 || width % 2 == 0),
              "rungen_ggml: a mixture's gate/up rows are gate's and as many of up's");
  check_stack(down, down_type, count, inner_features());
  TORCH_CHECK(stack_rows(down, down_type) == features, "rungen_ggml: the experts' down rows must be ", features);
  TORCH_CHECK(shared.empty() || (shared.size() == 3 && shared_types.size() == 3 && shared_gate.has_value()),
              "rungen_ggml: a shared expert is its gate, up and down blocks, a type each, and its gate's weight");
  if (shared_gate.has_value()) {
    shared_gate = shared_gate->to(at::kFloat).contiguous();
    TORCH_CHECK(shared_gate->numel() == features, "rungen_ggml: a shared expert's gate has ", features, " weights");
  }
  router_bias = float_bias(router_bias_in, {count}, "router's");
  gate_up_bias = float_bias(gate_up_bias_in, {count, width}, "gate/up");
  down_bias = float_bias(down_bias_in, {count, features}, "down");
}

namespace {

// Each token's top_k experts and their weights (ids, weights [n, top_k]): the softmax of its router logits (in
// float, from the largest), the k largest (the lower expert first on a tie), divided by their sum where norm_topk
// asks (Qwen3-MoE's configs; Qwen2-MoE's keep the softmax's). A token's choice is its own, the same in any batch.
void route(const float* logits, int64_t n, int64_t experts, int64_t k, bool norm_topk, int64_t* ids,
           float* weights) {
  std::vector<float> p(experts);
  std::vector<int64_t> order(experts);
  for (int64_t t = 0; t < n; ++t) {
    const float* l = logits + t * experts;
    const float most = *std::max_element(l, l + experts);
    float sum = 0.f;
    for (int64_t e = 0; e < experts; ++e) sum += p[e] = std::exp(l[e] - most);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float chosen = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      ids[t * k + j] = order[j];
      chosen += weights[t * k + j] = p[order[j]] / sum;
    }
    if (norm_topk)
      for (int64_t j = 0; j < k; ++j) weights[t * k + j] /= chosen;
  }
}

// A call's working buffers, kept from call to call (a decode step's layers would otherwise allocate each time).
struct Scratch {
  std::vector<float> weights, rows, gate_up, act, done;
  std::vector<int64_t> tokens, experts;
};

// A bias [n] added to each of `count` rows of y [count, n].
void add_bias_rows(const float* bias, int64_t n, int64_t count, float* y) {
  for (int64_t r = 0; r < count; ++r)
    for (int64_t j = 0; j < n; ++j) y[r * n + j] += bias[j];
}

// relu(x)^2 of `n` values (Nemotron 3's experts: of up alone, no gate).
void relu2_rows(const float* xp, int64_t n, float* yp) {
  at::parallel_for(0, n, SILU_WORK, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float r = std::max(xp[i], 0.f);
      yp[i] = r * r;
    }
  });
}

// gpt-oss's gating of rows [gate | up] (gp [rows, 2f]) into yp [rows, f]: the gate clamped above at `limit`, up to
// +-limit, (up + 1) * gate * sigmoid(alpha * gate) (GptOssExperts._apply_gate on gate and up apart).
void clamped_swiglu_rows(const float* gp, int64_t rows, int64_t f, float alpha, float limit, float* yp) {
  at::parallel_for(0, rows, std::max<int64_t>(1, SILU_WORK / std::max<int64_t>(f, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < f; ++j) {
        const float g = std::min(gp[r * 2 * f + j], limit);
        const float u = std::max(std::min(gp[r * 2 * f + f + j], limit), -limit);
        yp[r * f + j] = (u + 1.f) * (g / (1.f + std::exp(-alpha * g)));
      }
  });
}

}  // namespace

void Mixture::forward_into(const float* x, int64_t n, float* out) const {
  if (n == 0) return;
  static thread_local std::vector<float> logits, weights;
  static thread_local std::vector<int64_t> ids;
  logits.resize(n * count);
  ids.resize(n * top_k);
  weights.resize(n * top_k);
  dot_rows_into(x, router.data_ptr<float>(), n, count, features, logits.data());
  if (router_bias.has_value()) add_bias_rows(router_bias->data_ptr<float>(), count, n, logits.data());
  route(logits.data(), n, count, top_k, norm_topk, ids.data(), weights.data());
  chosen_experts_into(x, n, ids.data(), weights.data(), out);
}

void Mixture::chosen_experts_into(const float* x, int64_t n, const int64_t* ids, const float* weights,
                                  float* out) const {
  std::fill(out, out + n * features, 0.f);
  if (n == 0) return;
  static thread_local Scratch s;
  const int64_t pairs = n * top_k;
  s.weights.resize(pairs);  // each pair's weight in the pairs' sorted order
  // The (token, slot) pairs grouped by expert in token order (a counting sort), each pair's row of x copied.
  std::vector<int64_t> counts(count, 0), next(count, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < count, "rungen_ggml: a chosen expert past the ", count, " experts");
    ++counts[ids[p]];
  }
  for (int64_t e = 1; e < count; ++e) next[e] = next[e - 1] + counts[e - 1];
  s.tokens.resize(pairs);
  s.experts.resize(pairs);
  s.rows.resize(pairs * features);
  float* sorted = s.weights.data();
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t at = next[ids[p]]++;
    s.tokens[at] = p / top_k;
    s.experts[at] = ids[p];
    sorted[at] = weights[p];
    std::memcpy(s.rows.data() + at * features, x + s.tokens[at] * features, features * sizeof(float));
  }
  // Each chosen expert's gate/up over its tokens, gate(gate) * up, its down (one loop over the threads a product).
  std::vector<int64_t> used;
  std::vector<std::vector<Weight>> gate_up_weights, down_weights;
  for (int64_t e = 0; e < count; ++e) {
    if (counts[e] == 0) continue;
    used.push_back(counts[e]);
    std::vector<Weight> parts;
    for (size_t i = 0; i < gate_up.size(); ++i) parts.push_back(expert_weight(gate_up[i], e, gate_up_types[i]));
    gate_up_weights.push_back(std::move(parts));
    down_weights.push_back({expert_weight(down, e, down_type)});
  }
  const int64_t inner = inner_features();
  const int64_t rows = activation == RELU2 ? inner : 2 * inner;  // an expert's gate/up rows
  s.gate_up.resize(pairs * rows);
  s.act.resize(pairs * inner);
  s.done.resize(pairs * features);
  grouped_into(s.rows.data(), features, used, gate_up_weights, rows, s.gate_up.data());
  if (gate_up_bias.has_value())
    for (int64_t p = 0; p < pairs; ++p)
      add_bias_rows(gate_up_bias->data_ptr<float>() + s.experts[p] * rows, rows, 1, s.gate_up.data() + p * rows);
  if (swiglu_limit > 0.f)
    clamped_swiglu_rows(s.gate_up.data(), pairs, inner, swiglu_alpha, swiglu_limit, s.act.data());
  else if (activation == RELU2)
    relu2_rows(s.gate_up.data(), pairs * inner, s.act.data());
  else
    gate_mul_rows(activation == GELU_GATED ? gelu_fn() : silu_fn(), activation == GELU_GATED ? GELU_WORK : SILU_WORK,
                  s.gate_up.data(), pairs, inner, s.act.data());
  grouped_into(s.act.data(), inner, used, down_weights, features, s.done.data());
  if (down_bias.has_value())
    for (int64_t p = 0; p < pairs; ++p)
      add_bias_rows(down_bias->data_ptr<float>() + s.experts[p] * features, features, 1,
                    s.done.data() + p * features);
  // Each token's experts weighted and added in order (by expert): the same sum alone and in a batch.
  for (int64_t p = 0; p < pairs; ++p) {
    float* o = out + s.tokens[p] * features;
    const float* d = s.done.data() + p * features;
    const float w = sorted[p];
    for (int64_t j = 0; j < features; ++j) o[j] += w * d[j];
  }
  if (shared.empty()) return;
  // Qwen2-MoE's shared expert, weighted by the sigmoid of its gate.
  const at::Tensor xt = at::from_blob(const_cast<float*>(x), {n, features}, router.options());
  const int64_t wide = out_rows(shared[0], shared_types[0]);
  at::Tensor gu = at::empty({n, 2 * wide}, router.options()), act = at::empty({n, wide}, router.options());
  at::Tensor expert = at::empty({n, features}, router.options()), gates = at::empty({n}, router.options());
  mm_parts_into(xt, at::TensorList(shared.data(), 2), at::IntArrayRef(shared_types.data(), 2), features,
                gu.data_ptr<float>());
  gate_mul_rows(silu_fn(), SILU_WORK, gu.data_ptr<float>(), n, wide, act.data_ptr<float>());
  mm_into(act, shared[2], shared_types[2], wide, expert.data_ptr<float>());
  dot_rows_into(x, shared_gate->data_ptr<float>(), n, 1, features, gates.data_ptr<float>());
  const float *ep = expert.data_ptr<float>(), *gp = gates.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    const float g = 1.f / (1.f + std::exp(-gp[t]));
    for (int64_t j = 0; j < features; ++j) out[t * features + j] += g * ep[t * features + j];
  }
}

int64_t Mixture::inner_features() const {
  int64_t width = 0;
  for (size_t i = 0; i < gate_up.size(); ++i) width += stack_rows(gate_up[i], gate_up_types[i]);
  return activation == RELU2 ? width : width / 2;
}

at::Tensor mixture(const at::Tensor& x_in, const at::Tensor& router, int64_t top_k, bool norm_topk,
                   at::TensorList experts, at::IntArrayRef expert_types, at::TensorList shared,
                   at::IntArrayRef shared_types, const c10::optional<at::Tensor>& shared_gate,
                   const c10::optional<at::Tensor>& router_bias, const c10::optional<at::Tensor>& gate_up_bias,
                   const c10::optional<at::Tensor>& down_bias, double swiglu_alpha, double swiglu_limit) {
  const Mixture m(router, top_k, norm_topk, experts, expert_types, shared, shared_types, shared_gate, router_bias,
                  gate_up_bias, down_bias, swiglu_alpha, swiglu_limit);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == m.features, "rungen_ggml: x must be [n, ", m.features,
              "]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(x);
  m.forward_into(x.data_ptr<float>(), x.size(0), out.data_ptr<float>());
  return out;
}

// x [n, features] through the experts a caller chose (ids [n, k] int64, weights [n, k]): the call's experts
// without its routing (Gemma 4's router normalizes and scales its own input, and scales each expert's weight;
// Nemotron 3's chooses within groups and scales the weights), by `activation` (Activation).
at::Tensor chosen_experts(const at::Tensor& x_in, const at::Tensor& ids_in, const at::Tensor& weights_in,
                          at::TensorList experts, at::IntArrayRef expert_types, int64_t activation) {
  TORCH_CHECK(x_in.dim() == 2 && ids_in.dim() == 2 && ids_in.size(0) == x_in.size(0) &&
                  weights_in.sizes() == ids_in.sizes(),
              "rungen_ggml: chosen_experts takes x [n, features], ids and weights [n, k]");
  const Mixture m(at::Tensor(), ids_in.size(1), false, experts, expert_types, {}, {}, c10::nullopt, {}, {}, {}, 0.,
                  0., x_in.size(1), activation);
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), ids = ids_in.to(at::kLong).contiguous();
  const at::Tensor weights = weights_in.to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(x);
  m.chosen_experts_into(x.data_ptr<float>(), x.size(0), ids.data_ptr<int64_t>(), weights.data_ptr<float>(),
                        out.data_ptr<float>());
  return out;
}

}  // namespace rungen_ggml
