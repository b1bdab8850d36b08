// Matrix products with GGUF's quantized blocks, as llama.cpp computes them on a CPU: the activations are
// quantized to int8 per block of 32 (one float scale each), each block's dot product is taken in integers,
// and the blocks are summed in float. Output rows are spread over torch's intra-op threads.
//
//   torch.ops.rungen_ggml.mm(x, blocks, qtype, in_features)      auto: integer kernel, or for many tokens
//                                                               de-quantized float tiles and torch's matmul
//   torch.ops.rungen_ggml.mm_parts(x, [blocks], [qtype], in_features)  mm of several weights side by side
//   torch.ops.rungen_ggml.mm_grouped(x, [blocks], [qtype], [rows], in_features)  each group of x's rows times
//                                                               its own weight (a mixture's experts)
//   torch.ops.rungen_ggml.mm_int(x, blocks, qtype, in_features)  integer kernel, any number of tokens
//   torch.ops.rungen_ggml.dequantize(blocks, qtype, in_features) float32 weight
//   torch.ops.rungen_ggml.rms_norm(x, weight, eps)               a decoder layer's small steps, one operator
//   torch.ops.rungen_ggml.rope_split(qkv, cos, sin, heads, kv_heads[, q_norm, k_norm, norm_eps])  each instead
//                                                               of several (see below)
//   torch.ops.rungen_ggml.dot_rows(x, w)                        x @ w.T in float32, a row's bits the same in any
//                                                               batch (a mixture's router)
//   torch.ops.rungen_ggml.mixture(x, router, top_k, norm_topk, [expert stacks], [qtype], [shared], [qtype],
//                                 shared_gate)              a mixture of experts' MLP (ggml_mixture.cpp)
//   torch.ops.rungen_ggml.chosen_experts(x, ids, weights, [expert stacks], [qtype], activation)
//                                                             its experts alone, routed by the caller
//   torch.ops.rungen_ggml.silu_mul(gate_up), gelu_tanh_mul(gate_up)
//   torch.ops.rungen_ggml.attend(q, k, v, mask, scale, softcap, window, sinks)  attention, the same bits
//                                                               with or without padding
//   torch.ops.rungen_ggml.attention_in(...), attention_out_mlp(...)  a decoder layer in two calls (see below)
//   torch.ops.rungen_ggml.decoder_stack(...)                     every decoder layer in one call (see below)
//   torch.ops.rungen_ggml.delta_step(...), short_conv_step(...)  a Gated DeltaNet's, a short convolution's and
//   torch.ops.rungen_ggml.mamba_step(...)                        a Mamba-2 layer's decode step between their
//                                                               products
//   torch.ops.rungen_ggml.delta_scan(...), mamba_scan(...)      a Gated DeltaNet's and a Mamba-2 layer's prompt
//                                                               between their products
//   torch.ops.rungen_ggml.isa() / set_isa(name)                  the code path in use ("avx512vnni", "avx2",
//                                                               "scalar"); set_isa forces one (tests)
//
// x is float32 [n, in_features]; blocks uint8 [out_features, row bytes] (rows may be strided), as the file
// stores them; qtype is GGML's type number. The instruction set is chosen at run time from the CPU's flags
// (ggml_dispatch.cpp): the sources are compiled without -march, and each SIMD variant only for its own functions.
//
// This file registers the operators; the rest by concern: ggml_formats.h (block formats, X8), ggml_kernels.h and
// ggml_ops.h (what the units share), ggml_products.cpp (the products' torch side), ggml_scalar.cpp, ggml_avx2.cpp
// and ggml_vnni.cpp (the products per instruction set, from ggml_simd.h, ggml_x8.h, ggml_x8_avx2.h, ggml_x16.h,
// ggml_amx.h and ggml_spans.h), ggml_layers.cpp and ggml_attend.cpp (norms, rope, gates, attention),
// ggml_decoder.cpp (the decoder layers), ggml_mixture.cpp (a mixture of experts' MLP), ggml_delta.cpp (a Gated
// DeltaNet layer's decode step), ggml_shortconv.cpp (a short convolution layer's), ggml_interleave.cpp (the X8
// layout at load).

#include "ggml_ops.h"

#include <torch/library.h>

using namespace rungen_ggml;

TORCH_LIBRARY(rungen_ggml, m) {
  m.def("mm(Tensor x, Tensor blocks, int qtype, int in_features) -> Tensor", &mm);
  m.def("mm_parts(Tensor x, Tensor[] blocks, int[] qtypes, int in_features) -> Tensor", &mm_parts);
  m.def("mm_grouped(Tensor x, Tensor[] blocks, int[] qtypes, int[] counts, int in_features) -> Tensor",
        &mm_grouped);
  m.def("mm_int(Tensor x, Tensor blocks, int qtype, int in_features) -> Tensor", &mm_int);
  m.def("mm_tiled(Tensor x, Tensor blocks, int qtype, int in_features) -> Tensor", &mm_tiled);
  m.def("dequantize(Tensor blocks, int qtype, int in_features) -> Tensor", &dequantize);
  m.def("interleave(Tensor blocks, int qtype, Tensor? out=None) -> Tensor", &interleave);
  m.def("mxfp4_held(Tensor blocks) -> Tensor", &mxfp4_held);
  m.def("embed(Tensor blocks, int qtype, int in_features, Tensor ids) -> Tensor", &embed);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("rope_split(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor? q_norm=None, "
        "Tensor? k_norm=None, float norm_eps=0.) -> Tensor[]", &rope_split);
  m.def("dot_rows(Tensor x, Tensor w) -> Tensor", &dot_rows);
  m.def("mixture(Tensor x, Tensor router, int top_k, bool norm_topk, Tensor[] experts, int[] expert_qtypes, "
        "Tensor[] shared, int[] shared_qtypes, Tensor? shared_gate, Tensor? router_bias=None, "
        "Tensor? gate_up_bias=None, Tensor? down_bias=None, float swiglu_alpha=0., float swiglu_limit=0.) -> Tensor",
        &mixture);
  m.def("chosen_experts(Tensor x, Tensor ids, Tensor weights, Tensor[] experts, int[] expert_qtypes, "
        "int activation) -> Tensor", &chosen_experts);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("delta_step(Tensor(a!) window, Tensor mixed, Tensor conv, Tensor(b!) state, Tensor a, Tensor b, Tensor z, "
        "Tensor decay, Tensor dt_bias, Tensor norm, int key_heads, float eps, Tensor? scatter=None) -> Tensor",
        &delta_step);
  m.def("delta_scan(Tensor mixed, int positions, Tensor conv, Tensor(a!) state, Tensor a, Tensor b, Tensor z, "
        "Tensor decay, Tensor dt_bias, Tensor norm, int key_heads, float eps, Tensor? scatter=None) -> Tensor",
        &delta_scan);
  m.def("short_conv_step(Tensor(a!) window, Tensor bcx, Tensor taps) -> Tensor", &short_conv_step);
  m.def("mamba_step(Tensor(a!) window, Tensor xbc, Tensor conv, Tensor? conv_bias, Tensor(b!) state, Tensor dt, "
        "Tensor dt_bias, Tensor a, Tensor d, Tensor z, Tensor? norm, int groups, float eps) -> Tensor", &mamba_step);
  m.def("mamba_scan(Tensor xbc, int positions, Tensor conv, Tensor? conv_bias, Tensor(a!) state, Tensor dt, "
        "Tensor dt_bias, Tensor a, Tensor d, Tensor z, Tensor? norm, int groups, float eps, float dt_min=0., "
        "Tensor? mask=None) -> Tensor", &mamba_scan);
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor", &gelu_tanh_mul);
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float softcap=0., int window=0, "
        "Tensor? sinks=None) -> Tensor", &attend);
  m.def("attention_in(Tensor hidden, Tensor norm_weight, float eps, Tensor[] qkv_blocks, int[] qkv_qtypes, "
        "Tensor? qkv_bias, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor? q_norm=None, Tensor? k_norm=None, "
        "float norm_eps=0.) -> Tensor[]", &attention_in);
  m.def("attention_out_mlp(Tensor hidden, Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, "
        "Tensor o_blocks, int o_qtype, Tensor norm_weight, float eps, Tensor[] gate_up_blocks, int[] gate_up_qtypes, "
        "Tensor down_blocks, int down_qtype) -> Tensor", &attention_out_mlp);
  m.def("decoder_stack(Tensor hidden, Tensor cos, Tensor sin, Tensor? mask, Tensor[] input_norms, Tensor[] qkv, "
        "Tensor?[] qkv_bias, Tensor?[] q_norms, Tensor?[] k_norms, Tensor[] o, Tensor[] post_norms, Tensor[] gate_up, "
        "Tensor[] down, int[] qtypes, float eps, "
        "int heads, int kv_heads, float scale, Tensor[] k_buffers, Tensor[] v_buffers, int length, "
        "Tensor?[] attention_out_norms, Tensor?[] mlp_out_norms, int[] windows, Tensor? local_cos, Tensor? local_sin, "
        "float softcap, bool gelu, Tensor?[] routers, Tensor[] experts, int[] expert_qtypes, Tensor?[] shared_gates, "
        "int top_k, bool norm_topk, int[] rotary=[], int[] dropped=[], float residual_scale=1.) -> "
        "(Tensor, Tensor[], Tensor[])",
        &decoder_stack);
  m.def("isa() -> str", &isa);
  m.def("set_isa(str name) -> str", &set_isa);
  m.def("set_tile_threshold(int n) -> int", &set_tile_threshold);
}
