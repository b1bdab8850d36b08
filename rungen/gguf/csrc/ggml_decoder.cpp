// A decoder layer in two calls, and every decoder layer in one (decoder_stack), from the layers' steps and products.
#include "ggml_ops.h"

#include <algorithm>

namespace rungen_ggml {

// A llama decoder layer in two calls, around the cache update that stays transformers': at one token a step
// each of its dozen operators costs more in dispatch and Python than in arithmetic. The same functions as the
// separate operators, in the same order: the bits are theirs.
//
// The fused products (q/k/v, gate/up) come as parts side by side (mm_parts): the whole weight as one part
// where the projections share a block type, else each run of one type its own part.
//
// attention_in: q, k, v of rms_norm(hidden) (the fused q/k/v product, its bias if any, q and k normalized
// per head where the family does, rotated).
std::vector<at::Tensor> attention_in(const at::Tensor& hidden, const at::Tensor& norm_weight, double eps,
                                     at::TensorList qkv_blocks, at::IntArrayRef qkv_qtypes,
                                     const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& cos,
                                     const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                                     const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                                     double norm_eps) {
  TORCH_CHECK(hidden.dim() == 3, "rungen_ggml: hidden must be [batch, tokens, features]");
  const int64_t b = hidden.size(0), t = hidden.size(1), features = hidden.size(2);
  const at::Tensor x = rms_norm(hidden, norm_weight, eps);
  at::Tensor qkv = mm_parts(x.view({b * t, features}), qkv_blocks, qkv_qtypes, features);
  if (qkv_bias.has_value()) qkv.add_(*qkv_bias);
  return rope_split(qkv.view({b, t, qkv.size(1)}), cos, sin, heads, kv_heads, q_norm, k_norm, norm_eps);
}

// attention_out_mlp: the rest of the layer, k and v the whole cache: h = hidden + o(attend(q, k, v)), then
// h + down(silu(gate) * up) of rms_norm(h).
at::Tensor attention_out_mlp(const at::Tensor& hidden, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const c10::optional<at::Tensor>& mask, double scale, const at::Tensor& o_blocks,
                             int64_t o_qtype, const at::Tensor& norm_weight, double eps,
                             at::TensorList gate_up_blocks, at::IntArrayRef gate_up_qtypes,
                             const at::Tensor& down_blocks,
                             int64_t down_qtype) {
  TORCH_CHECK(hidden.dim() == 3, "rungen_ggml: hidden must be [batch, tokens, features]");
  const int64_t b = hidden.size(0), t = hidden.size(1), features = hidden.size(2);
  const at::Tensor attended = attend(q, k, v, mask, scale, 0.0, 0, c10::nullopt);
  at::Tensor h = mm(attended.view({b * t, attended.size(2)}), o_blocks, o_qtype, attended.size(2));
  h.add_(hidden.to(at::kFloat).reshape({b * t, features}));  // hidden + o: a float sum is the same either way
  const at::Tensor x = rms_norm(h, norm_weight, eps);
  const at::Tensor gate_up = mm_parts(x, gate_up_blocks, gate_up_qtypes, features);
  const at::Tensor act = silu_mul(gate_up);
  at::Tensor out = mm(act, down_blocks, down_qtype, act.size(1));
  out.add_(h);
  return out.view({b, t, features});
}

// Every decoder layer of a model in one call (the same functions as attention_in and attention_out_mlp, in the
// same order: the same bits), the cache's keys and values written in place: k_buffers[i] and v_buffers[i] are
// layer i's [b, kv_heads, capacity, head_dim] (float32, or float16: each value rounded as torch rounds it, and
// read back as it is held) with `length` positions filled and room for this call's tokens.
// qkv: QKV_PARTS parts a layer, gate_up: GATE_UP_PARTS (mm_parts; a layer with fewer passes empty ones: zero
// rows cost nothing); qtypes: seven a layer (the q/k/v parts', o, the gate/up parts', down). q_norms/k_norms:
// each layer's per-head norms of q and k (None for llama; their epsilon is the layers' `eps`). Returns the hidden
// states and each layer's filled keys and values (views of the buffers).
//
// What gemma's layers add, each list empty where no layer has it: attention_out_norms/mlp_out_norms, each layer's
// norm of the attention's and of the MLP's output before its residual sum (None: none); windows, each layer's
// sliding window (0: it attends to every key; the kernel masks what lies outside it, whatever `mask` masks
// besides); local_cos/local_sin, the rotation of the windowed layers where it differs (gemma3's local rope
// base); softcap, the attention logits' soft cap (gemma2; 0: none); gelu, a GELU-tanh gate instead of SiLU;
// rotary, whether each layer rotates q and k (SmolLM3's every fourth does not; empty: every layer does); dropped,
// the positions before `length` a sliding layer's buffers no longer hold (they start at the next, outside every
// query's window; empty: none). residual_scale: what each layer's attention and MLP outputs are multiplied by
// before their residual sums (Granite's residual_multiplier; 1: as they are).
// Gemma's norms multiply by 1 + weight: the caller passes that sum as the weight.
//
// A mixture of experts' layers (Qwen3-MoE, Qwen2-MoE), each list empty where no layer has one: routers, each
// layer's router weight (None: a dense layer); experts, EXPERT_PARTS a layer, its experts' gate/up parts and down
// as stacks [experts, rows, bytes] (a dense layer passes empty ones), their types in expert_qtypes; shared_gates,
// Qwen2-MoE's shared expert's gate (None: no shared expert), whose gate, up and down are that layer's gate/up
// parts and down; top_k and norm_topk, every mixture's routing (rungen_ggml::Mixture).
//
// At one token a step the layers' arithmetic is a few milliseconds, and a torch operator inside them (an
// allocation, a view, a copy) costs a microsecond or more: the call allocates its working buffers once, the
// rotation writes keys and values straight into the cache, and the residual sums are plain loops (hidden + o and
// then + down: a float sum is the same in either order, so the bits are the separate operators').
constexpr size_t QKV_PARTS = 3, GATE_UP_PARTS = 2, LAYER_TYPES = QKV_PARTS + 1 + GATE_UP_PARTS + 1;
constexpr size_t EXPERT_PARTS = GATE_UP_PARTS + 1;

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
    bool norm_topk, at::IntArrayRef rotary, at::IntArrayRef dropped, double residual_scale) {
  const size_t layers = o.size();
  const auto per_layer = [&](size_t count) { return count == 0 || count == layers; };
  TORCH_CHECK(per_layer(attention_out_norms.size()) && per_layer(mlp_out_norms.size()) && per_layer(windows.size())
              && per_layer(routers.size()) && per_layer(shared_gates.size()) && per_layer(rotary.size())
              && per_layer(dropped.size()),
              "rungen_ggml: decoder_stack's per-layer lists hold one entry a layer, or none");
  TORCH_CHECK(experts.size() == EXPERT_PARTS * routers.size() && expert_qtypes.size() == experts.size(),
              "rungen_ggml: decoder_stack takes ", EXPERT_PARTS, " expert stacks and types a layer where it takes "
              "routers");
  TORCH_CHECK(local_cos_in.has_value() == local_sin_in.has_value() && softcap >= 0.0,
              "rungen_ggml: decoder_stack takes local cos and sin together, and a softcap >= 0");
  TORCH_CHECK(input_norms.size() == layers && qkv_bias.size() == layers && q_norms.size() == layers &&
              k_norms.size() == layers && qkv.size() == QKV_PARTS * layers &&
              post_norms.size() == layers && gate_up.size() == GATE_UP_PARTS * layers && down.size() == layers &&
              k_buffers.size() == layers && v_buffers.size() == layers && qtypes.size() == LAYER_TYPES * layers,
              "rungen_ggml: decoder_stack takes the same number of each layer's tensors");
  TORCH_CHECK(hidden.dim() == 3, "rungen_ggml: hidden must be [batch, tokens, features]");
  const int64_t b = hidden.size(0), t = hidden.size(1), features = hidden.size(2), n = b * t;
  at::Tensor h = hidden.to(at::kFloat).contiguous().clone();  // the residual stream, [n, features]
  if (layers == 0) return {h, {}, {}};
  // Layer i's parts and their types.
  const auto qkv_of = [&](size_t i) { return qkv.slice(QKV_PARTS * i, QKV_PARTS); };
  const auto qkv_types = [&](size_t i) { return qtypes.slice(LAYER_TYPES * i, QKV_PARTS); };
  const auto gate_up_of = [&](size_t i) { return gate_up.slice(GATE_UP_PARTS * i, GATE_UP_PARTS); };
  const auto gate_up_types = [&](size_t i) { return qtypes.slice(LAYER_TYPES * i + QKV_PARTS + 1, GATE_UP_PARTS); };
  const int64_t o_type = QKV_PARTS, down_type = LAYER_TYPES - 1;  // within a layer's types
  const int64_t qkv_width = parts_rows(qkv_of(0), qkv_types(0)), all = heads + 2 * kv_heads, dim = qkv_width / all;
  TORCH_CHECK(qkv_width % all == 0, "rungen_ggml: qkv features are not (heads + 2 kv_heads) * head_dim");
  const at::Tensor cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  const int64_t rot = rotary_width(cos, dim);
  const bool shared = rope_shared(cos, sin, b, t, rot);
  const at::Tensor local_cos = local_cos_in.has_value() ? local_cos_in->to(at::kFloat).contiguous() : cos;
  const at::Tensor local_sin = local_sin_in.has_value() ? local_sin_in->to(at::kFloat).contiguous() : sin;
  TORCH_CHECK(local_cos.sizes() == cos.sizes() && local_sin.sizes() == sin.sizes(),
              "rungen_ggml: decoder_stack's local cos/sin differ in shape from cos/sin");
  // A layer without rotary turns q and k by cos 1 and sin 0: x * 1 - y * 0, x as it is.
  const bool all_rotate = std::all_of(rotary.begin(), rotary.end(), [](int64_t r) { return r != 0; });
  const at::Tensor unit_cos = all_rotate ? cos : at::ones_like(cos), zero_sin = all_rotate ? sin : at::zeros_like(sin);
  const AttendMask attend_mask_once = attend_mask(mask, b, t, length + t);
  int64_t ffn = 0;
  for (size_t i = 0; i < layers; ++i) ffn = std::max(ffn, parts_rows(gate_up_of(i), gate_up_types(i)) / 2);
  const auto options = h.options();
  at::Tensor x = at::empty({n, features}, options), part = at::empty({n, features}, options);
  at::Tensor qkv_out = at::empty({n, qkv_width}, options), q = at::empty({b, heads, t, dim}, options);
  at::Tensor attended = at::empty({n, heads * dim}, options);
  at::Tensor gu = at::empty({n, 2 * ffn}, options), act = at::empty({n, ffn}, options);
  float *hp = h.data_ptr<float>(), *xp = x.data_ptr<float>(), *pp = part.data_ptr<float>();
  // Layer i's norm of a product's output (in place) where `norms` holds one.
  const auto out_norm = [&](const c10::List<c10::optional<at::Tensor>>& norms, size_t i, float* yp) {
    if (norms.empty() || !norms.get(i).has_value()) return;
    const at::Tensor weight = norms.get(i)->to(at::kFloat).contiguous();
    TORCH_CHECK(weight.numel() == features, "rungen_ggml: an output norm must have ", features, " weights");
    rms_norm_rows(yp, weight.data_ptr<float>(), eps, n, features, yp);
  };
  // h += y, or h += y * residual_scale: the product rounded to float first, as transformers' `residual + y * m`.
  const float residual = static_cast<float>(residual_scale);
  const auto add_residual = [&](const float* yp) {
    if (residual_scale == 1.0) {
      for (int64_t j = 0; j < n * features; ++j) hp[j] += yp[j];
    } else {
      for (int64_t j = 0; j < n * features; ++j) hp[j] += yp[j] * residual;
    }
  };
  std::vector<at::Tensor> keys, values;
  keys.reserve(layers);
  values.reserve(layers);
  for (size_t i = 0; i < layers; ++i) {
    const at::Tensor &kb = k_buffers[i], &vb = v_buffers[i];
    const int64_t gone = dropped.empty() ? 0 : dropped[i], held = length - gone;  // positions before `gone`: let go
    TORCH_CHECK(gone >= 0 && held >= 0, "rungen_ggml: decoder_stack's dropped positions must lie within the length");
    TORCH_CHECK(kb.size(2) >= held + t && vb.size(2) >= held + t && kb.size(3) == dim && vb.size(3) == dim &&
                kb.stride(3) == 1 && vb.stride(3) == 1 && vb.scalar_type() == kb.scalar_type() &&
                (kb.scalar_type() == at::kFloat || kb.scalar_type() == at::kHalf),
                "rungen_ggml: decoder_stack's cache buffers must be both float32 or both float16 [b, kv_heads, "
                "room for ", held + t, ", ", dim, "]");
    TORCH_CHECK(parts_rows(qkv_of(i), qkv_types(i)) == qkv_width,
                "rungen_ggml: decoder_stack's layers differ in q/k/v");
    const int64_t width = parts_rows(gate_up_of(i), gate_up_types(i)) / 2;
    const int64_t* types = qtypes.data() + LAYER_TYPES * i;
    // attention_in: norm, the q/k/v product (and bias), rotation; keys and values into the cache.
    rms_norm_rows(hp, input_norms[i].to(at::kFloat).contiguous().data_ptr<float>(), eps, n, features, xp);
    mm_parts_into(x, qkv_of(i), qkv_types(i), features, qkv_out.data_ptr<float>());
    if (qkv_bias.get(i).has_value()) qkv_out.add_(*qkv_bias.get(i));
    at::Tensor held_q, held_k;
    const HeadNorms norms{head_norm(q_norms.get(i), dim, held_q), head_norm(k_norms.get(i), dim, held_k), eps};
    const int64_t window = windows.empty() ? 0 : windows[i];
    TORCH_CHECK(window >= 0, "rungen_ggml: decoder_stack's windows must be positive, or 0 for none");
    const bool rotates = rotary.empty() || rotary[i] != 0;
    const at::Tensor& c = !rotates ? unit_cos : window ? local_cos : cos;
    const at::Tensor& s = !rotates ? zero_sin : window ? local_sin : sin;
    rope_rows(qkv_out.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), shared, b, t, heads, kv_heads,
              dim, rot, q.data_ptr<float>(),
              rows_of(kb, held), rows_of(vb, held), norms);
    keys.push_back(kb.narrow(2, 0, held + t));
    values.push_back(vb.narrow(2, 0, held + t));
    // attention_out_mlp: attention, the output product, the residual; norm, gate/up, SiLU, down, the residual.
    attend_into(q, keys.back(), values.back(), attend_mask_once, scale, softcap, window, attended.data_ptr<float>(),
                nullptr, gone);
    mm_into(attended, o[i], types[o_type], heads * dim, pp);
    out_norm(attention_out_norms, i, pp);
    add_residual(pp);
    rms_norm_rows(hp, post_norms[i].to(at::kFloat).contiguous().data_ptr<float>(), eps, n, features, xp);
    if (!routers.empty() && routers.get(i).has_value()) {
      const bool shared = !shared_gates.empty() && shared_gates.get(i).has_value();
      const std::vector<at::Tensor> shared_blocks =
          shared ? std::vector<at::Tensor>{gate_up_of(i)[0], gate_up_of(i)[1], down[i]} : std::vector<at::Tensor>{};
      const std::vector<int64_t> shared_types =
          shared ? std::vector<int64_t>{gate_up_types(i)[0], gate_up_types(i)[1], types[down_type]}
                 : std::vector<int64_t>{};
      Mixture(*routers.get(i), top_k, norm_topk, experts.slice(EXPERT_PARTS * i, EXPERT_PARTS),
              expert_qtypes.slice(EXPERT_PARTS * i, EXPERT_PARTS), shared_blocks, shared_types,
              shared ? shared_gates.get(i) : c10::nullopt)
          .forward_into(xp, n, pp);
    } else {
      // A layer narrower than the widest (models whose MLP width varies) uses the start of the buffers.
      const at::Tensor act_i = width == ffn ? act : act.view({-1}).narrow(0, 0, n * width).view({n, width});
      mm_parts_into(x, gate_up_of(i), gate_up_types(i), features, gu.data_ptr<float>());
      gate_mul_rows(gelu ? gelu_fn() : silu_fn(), gelu ? GELU_WORK : SILU_WORK, gu.data_ptr<float>(), n, width,
                    act_i.data_ptr<float>());
      mm_into(act_i, down[i], types[down_type], width, pp);
    }
    out_norm(mlp_out_norms, i, pp);
    add_residual(pp);
  }
  return {h.view({b, t, features}), keys, values};
}

}  // namespace rungen_ggml
