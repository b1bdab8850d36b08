// A decoder layer's steps around its matmuls: RMSNorm, the rotary embedding (with q/k's per-head norms), the MLP
// gates and attention; the loops of the last two in ggml_attend.h (ggml_attend.cpp).
#include "ggml_ops.h"

namespace rungen_ggml {

// The small steps of a llama decoder layer around its matmuls. At one token a step each is a few hundred
// floats, and as torch operators each costs several calls of 3-5 microseconds (dispatch, allocation);
// these take one call each. Plain loops: the work is far below what vector code would save.

// RMSNorm as transformers' LlamaRMSNorm: x / sqrt(mean(x^2) + eps) * weight, over the last dimension.
namespace {

template <class T>
T* row_at(const Rows4& rows, int64_t batch, int64_t head, int64_t token) {
  return static_cast<T*>(rows.p) + batch * rows.batch + head * rows.head + token * rows.token;
}

// A head's `dim` values into `rows`: as they are, or rounded to float16 (c10::Half: to nearest even, as torch's
// conversion of a tensor rounds them).
inline void write_row(const Rows4& rows, int64_t batch, int64_t head, int64_t token, const float* x, int64_t dim) {
  if (!rows.half) {
    std::memcpy(row_at<float>(rows, batch, head, token), x, dim * sizeof(float));
    return;
  }
  c10::Half* out = row_at<c10::Half>(rows, batch, head, token);
  for (int64_t i = 0; i < dim; ++i) out[i] = c10::Half(x[i]);
}

inline void rms_row(const float* v, const float* wp, double eps, int64_t d, float* y) {
  float sum = 0.f;
  for (int64_t i = 0; i < d; ++i) sum += v[i] * v[i];
  const float inv = 1.f / std::sqrt(sum / float(d) + float(eps));
  for (int64_t i = 0; i < d; ++i) y[i] = wp[i] * (v[i] * inv);
}

}  // namespace

void rms_norm_rows(const float* xp, const float* wp, double eps, int64_t rows, int64_t d, float* yp) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_row(xp + r * d, wp, eps, d, yp + r * d);
  });
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), weight = weight_in.to(at::kFloat).contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(weight.numel() == d, "rungen_ggml: rms_norm weight must have ", d, " values");
  at::Tensor y = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), eps, rows, d, y.data_ptr<float>());
  return y;
}

// The fused q/k/v product [b, t, (heads + 2 kv_heads) * head_dim] split into q [b, heads, t, head_dim],
// k and v [b, kv_heads, t, head_dim], q and k rotated as transformers' apply_rotary_pos_emb rotates them
// (rotate_half: the first half of the rotated part pairs with the second). cos/sin [.., rot]: a head's first rot
// values are rotated, the rest pass as they are (partial rotary, phi3's partial_rotary_factor); rot = head_dim
// for llama. Where a family normalizes each head of q and k before the rotation (qwen3's q_norm/k_norm: an
// RMSNorm over head_dim), HeadNorms carries their weights; none for llama, whose arithmetic is then unchanged.
void rope_rows(const float* src, const float* cp, const float* sp, bool shared, int64_t b, int64_t t, int64_t heads,
               int64_t kv_heads, int64_t dim, int64_t rot, float* qp, const Rows4& k, const Rows4& v,
               const HeadNorms& norms) {
  const int64_t all = heads + 2 * kv_heads, half = rot / 2;
  at::parallel_for(0, b * t, std::max<int64_t>(1, 4096 / (all * dim)), [&](int64_t p0, int64_t p1) {
    std::vector<float> normed(norms.q || norms.k ? dim : 0), rotated(k.half ? dim : 0);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t batch = p / t, token = p % t;
      const float* row = src + p * all * dim;
      const float* c = cp + (shared ? token : p) * rot;
      const float* s = sp + (shared ? token : p) * rot;
      for (int64_t h = 0; h < all; ++h) {
        const float* x = row + h * dim;
        float* out;
        const float* norm;
        if (h < heads) {
          out = qp + ((batch * heads + h) * t + token) * dim;
          norm = norms.q;
        } else if (h < heads + kv_heads) {
          out = k.half ? rotated.data() : row_at<float>(k, batch, h - heads, token);
          norm = norms.k;
        } else {
          write_row(v, batch, h - heads - kv_heads, token, x, dim);
          continue;
        }
        if (norm) {
          rms_row(x, norm, norms.eps, dim, normed.data());
          x = normed.data();
        }
        for (int64_t i = 0; i < half; ++i) {
          out[i] = x[i] * c[i] - x[i + half] * s[i];
          out[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
        }
        if (rot < dim) std::memcpy(out + rot, x + rot, (dim - rot) * sizeof(float));
        if (h >= heads && k.half) write_row(k, batch, h - heads, token, out, dim);
      }
    }
  });
}

Rows4 rows_of(const at::Tensor& x, int64_t from) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf),
              "rungen_ggml: keys and values are float32 or float16 [b, heads, positions, dim], dim contiguous");
  const bool half = x.scalar_type() == at::kHalf;
  char* base = static_cast<char*>(x.data_ptr()) + from * x.stride(2) * x.element_size();
  return Rows4{base, x.stride(0), x.stride(1), x.stride(2), half};
}

// cos/sin per sequence [b, t, rot], or one [1, t, rot] for all (positions without padding): whether shared.
bool rope_shared(const at::Tensor& cos, const at::Tensor& sin, int64_t b, int64_t t, int64_t rot) {
  const bool shared = cos.numel() == t * rot;
  TORCH_CHECK((shared || cos.numel() == b * t * rot) && sin.numel() == cos.numel(), "rungen_ggml: cos/sin must be "
              "[b or 1, t, ", rot, "]");
  return shared;
}

// The rotated width of cos (its last dimension): even, at most head_dim.
int64_t rotary_width(const at::Tensor& cos, int64_t dim) {
  const int64_t rot = cos.dim() ? cos.size(-1) : 0;
  TORCH_CHECK(rot > 0 && rot % 2 == 0 && rot <= dim, "rungen_ggml: cos/sin's last dimension must be even and at "
              "most head_dim (", dim, "), not ", rot);
  return rot;
}

// A per-head norm's weights as float32 [head_dim], held by `held` while they are read.
const float* head_norm(const c10::optional<at::Tensor>& weight, int64_t dim, at::Tensor& held) {
  if (!weight.has_value()) return nullptr;
  held = weight->to(at::kFloat).contiguous();
  TORCH_CHECK(held.numel() == dim, "rungen_ggml: a per-head norm must have head_dim (", dim, ") weights");
  return held.data_ptr<float>();
}

std::vector<at::Tensor> rope_split(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                   int64_t heads, int64_t kv_heads, const c10::optional<at::Tensor>& q_norm,
                                   const c10::optional<at::Tensor>& k_norm, double norm_eps) {
  const at::Tensor qkv = qkv_in.to(at::kFloat).contiguous();
  const at::Tensor cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  TORCH_CHECK(qkv.dim() == 3, "rungen_ggml: qkv must be [batch, tokens, features]");
  const int64_t b = qkv.size(0), t = qkv.size(1), all = heads + 2 * kv_heads;
  TORCH_CHECK(qkv.size(2) % all == 0, "rungen_ggml: qkv features are not (heads + 2 kv_heads) * head_dim");
  const int64_t dim = qkv.size(2) / all, rot = rotary_width(cos, dim);
  const bool shared = rope_shared(cos, sin, b, t, rot);
  at::Tensor held_q, held_k;
  const HeadNorms norms{head_norm(q_norm, dim, held_q), head_norm(k_norm, dim, held_k), norm_eps};
  at::Tensor q = at::empty({b, heads, t, dim}, qkv.options());
  at::Tensor k = at::empty({b, kv_heads, t, dim}, qkv.options());
  at::Tensor v = at::empty({b, kv_heads, t, dim}, qkv.options());
  rope_rows(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), shared, b, t, heads, kv_heads, dim,
            rot, q.data_ptr<float>(), rows_of(k), rows_of(v), norms);
  return {q, k, v};
}


namespace {

using AttendFn = void (*)(const AttendJob&, int64_t, int64_t, float*);
AttendFn attend_fn() {
  return BY_ISA(attend_queries);
}

}  // namespace

GateFn gelu_fn() { return current_isa >= AVX2 ? avx2::gelu_rows : scalar::gelu_rows; }
GateFn silu_fn() { return current_isa >= AVX2 ? avx2::silu_rows : scalar::silu_rows; }

// A gate (silu_fn's or gelu_fn's) over the fused gate/up product [rows, 2 * f] (gate first) into [rows, f], the rows
// spread over the threads, a task about `work` values (the GELU's tanh costs more a value than the SiLU's exp).
void gate_mul_rows(GateFn fn, int64_t work, const float* gp, int64_t rows, int64_t f, float* yp) {
  at::parallel_for(0, rows, std::max<int64_t>(1, work / std::max<int64_t>(f, 1)),
                   [&](int64_t r0, int64_t r1) { fn(gp, r0, r1, f, yp); });
}

namespace {

at::Tensor gate_mul(const at::Tensor& gu_in, GateFn fn, int64_t work) {
  const at::Tensor gu = gu_in.to(at::kFloat).contiguous();
  const int64_t f = gu.size(-1) / 2, rows = gu.numel() / std::max<int64_t>(2 * f, 1);
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = f;
  at::Tensor y = at::empty(shape, gu.options());
  gate_mul_rows(fn, work, gu.data_ptr<float>(), rows, f, y.data_ptr<float>());
  return y;
}

}  // namespace

// x [t, n] times w [e, n] transposed: [t, e], each row's sums in one fixed order (dot_rows), so a row gets the same
// bits alone and in a batch, which torch's matrix products (a vector product for one row) do not promise.
at::Tensor dot_rows(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
              "rungen_ggml: dot_rows takes x [t, n] and w [e, n]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), w = w_in.to(at::kFloat).contiguous();
  const int64_t t = x.size(0), e = w.size(0), n = x.size(1);
  at::Tensor y = at::empty({t, e}, x.options());
  dot_rows_into(x.data_ptr<float>(), w.data_ptr<float>(), t, e, n, y.data_ptr<float>());
  return y;
}

void dot_rows_into(const float* xp, const float* wp, int64_t t, int64_t e, int64_t n, float* yp) {
  const auto fn = BY_ISA(dot_rows);
  at::parallel_for(0, t, std::max<int64_t>(1, 65536 / std::max<int64_t>(e * n, 1)),
                   [&](int64_t t0, int64_t t1) { fn(xp, wp, t0, t1, e, n, yp); });
}

at::Tensor silu_mul(const at::Tensor& gu) { return gate_mul(gu, silu_fn(), SILU_WORK); }

at::Tensor gelu_tanh_mul(const at::Tensor& gu) { return gate_mul(gu, gelu_fn(), GELU_WORK); }
// Attention of t query tokens a sequence over T keys (the cached ones and their own): q [b, heads, t, dim],
// k and v [b, kv_heads, T, dim] (grouped heads: query head h reads kv head h / (heads / kv_heads)). mask None:
// causal, query i sees keys 0 .. T - t + i; else bool [b, 1, t, T] (true: attend) or additive float of that
// shape (0 attends, a large negative value does not). Out [b, t, heads * dim], as transformers' attention
// returns it reshaped. softcap > 0 (gemma2's attn_logit_softcapping) bounds each score to tanh(s / cap) * cap
// before the mask is added, as transformers' gemma2 eager attention does; 0: none. window > 0 (a sliding-window
// layer's): query i, at cache position T - t + i, also skips the keys at or before that position - window, on top
// of the mask (transformers' sliding_window_overlay; the cache keeps every position); 0: none. sinks [heads]
// (gpt-oss's): a logit each query head's softmax takes beside its keys' scores (after the scale and the mask), whose
// weight goes to no value, as transformers' gpt-oss attention concatenates it and drops its column.
//
// Each query's keys are visited in order and the masked ones skipped, so a sequence's result does not depend on
// the padding beside it: a prompt alone and the same prompt left-padded in a batch give the same bits (torch's
// attention kernels block the keys differently once padding shifts them, which moves the last bits). A query
// that sees no key gives zeros, where softmax would give NaN.

AttendMask attend_mask(const c10::optional<at::Tensor>& mask_in, int64_t b, int64_t t, int64_t T) {
  AttendMask m;
  if (!mask_in.has_value()) return m;
  const bool additive = mask_in->is_floating_point();
  m.held = additive ? mask_in->to(at::kFloat).contiguous() : mask_in->to(at::kBool).contiguous();
  TORCH_CHECK(m.held.numel() == b * t * T, "rungen_ggml: attend's mask must be [b, 1, ", t, ", ", T, "]");
  if (additive)
    m.adds = m.held.data_ptr<float>();
  else
    m.bools = m.held.data_ptr<bool>();
  return m;
}

// attend of q [b, heads, t, dim] (float32, contiguous) over k, v [b, kv, T - dropped, dim] (both float32 or both
// float16, last dimension contiguous: read in place; the keys from position `dropped` on, AttendJob's), into out
// [b, t, heads * dim].
void attend_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttendMask& mask, double scale,
                 double softcap, int64_t window, float* op, const float* sinks, int64_t dropped) {
  const int64_t b = q.size(0), heads = q.size(1), t = q.size(2), dim = q.size(3), kv = k.size(1);
  const int64_t T = k.size(2) + dropped;
  TORCH_CHECK(k.size(0) == b && k.size(3) == dim && kv > 0 && heads % kv == 0 && T >= t,
              "rungen_ggml: attend's shapes differ");
  // Every query's window starts at or after the first key held (the first query's is the earliest).
  TORCH_CHECK(dropped == 0 || (window > 0 && dropped <= T - t - window + 1),
              "rungen_ggml: attend's dropped keys must lie outside every query's window");
  const bool half = k.scalar_type() == at::kHalf;
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && (half || k.scalar_type() == at::kFloat) && k.stride(3) == 1 &&
              v.stride(3) == 1, "rungen_ggml: attend's keys and values are both float32 or both float16, each "
              "head's values contiguous");
  const float* qp = q.data_ptr<float>();
  const void *kp = k.data_ptr(), *vp = v.data_ptr();
  const bool masked = mask.bools != nullptr || mask.adds != nullptr;
  at::parallel_for(0, b * heads * t, std::max<int64_t>(1, 32768 / std::max<int64_t>(T * dim, 1)),
                   [&](int64_t p0, int64_t p1) {
    std::vector<float> w(ATTEND_BLOCK * (T - dropped / 8 * 8));
    attend_fn()(AttendJob{qp, kp, vp, mask.bools, mask.adds, op, heads, t, dim, kv, T, k.stride(0), k.stride(1),
                             k.stride(2), v.stride(0), v.stride(1), v.stride(2), float(scale), float(softcap),
                             window, masked, sinks, dropped, half}, p0, p1,
                   w.data());
  });
}

at::Tensor attend(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                  const c10::optional<at::Tensor>& mask_in, double scale, double softcap, int64_t window,
                  const c10::optional<at::Tensor>& sinks_in) {
  // k and v may be views of a cache with room to grow (strided over keys, heads and batch, float32 or float16):
  // read in place.
  const bool held = k_in.scalar_type() == v_in.scalar_type() &&
                    (k_in.scalar_type() == at::kFloat || k_in.scalar_type() == at::kHalf);
  const auto in_place = [held](const at::Tensor& x) {
    return held && x.dim() == 4 && x.stride(3) == 1 ? x : x.to(at::kFloat).contiguous();
  };
  const at::Tensor q = q_in.to(at::kFloat).contiguous(), k = in_place(k_in), v = in_place(v_in);
  TORCH_CHECK(softcap >= 0.0, "rungen_ggml: attend's softcap must be positive, or 0 for none");
  TORCH_CHECK(window >= 0, "rungen_ggml: attend's window must be positive, or 0 for none");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(),
              "rungen_ggml: attend takes q [b, h, t, d] and k, v [b, kv, T, d]");
  at::Tensor sinks;
  if (sinks_in.has_value()) {
    sinks = sinks_in->to(at::kFloat).contiguous();
    TORCH_CHECK(sinks.numel() == q.size(1), "rungen_ggml: attend's sinks are a logit a query head");
  }
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1) * q.size(3)}, q.options());
  attend_into(q, k, v, attend_mask(mask_in, q.size(0), q.size(2), k.size(2)), scale, softcap, window,
              out.data_ptr<float>(), sinks.defined() ? sinks.data_ptr<float>() : nullptr);
  return out;
}

}  // namespace rungen_ggml
