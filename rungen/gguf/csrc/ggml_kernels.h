// What the kernels' translation units share: the quantized activations and a product's job, the code path in
// use, and each instruction set's entry points (whole products over rows, attention over queries), which the
// torch-facing code (ggml_products.cpp, ggml_layers.cpp) calls through function pointers.
#pragma once

#include "ggml_formats.h"

#include <immintrin.h>

#include <limits>
#include <type_traits>

namespace rungen_ggml {

// The activations of n tokens, quantized per block of 32: codes q [n, K], scale d [n, K/32] (q * d ~ x),
// s = d * sum(q) per 32 [n, K/32] (what a block's offset multiplies), s16 = d * sum(q) per 16 [n, K/16], and
// s4: s of each whole group of four tokens, the four side by side [n/4, K/32, 4] (one vector a block), and
// off128: -128 sum(q) per 32 [n, K/32] in integers (where the VNNI kernels whose codes are offset by 128, Q8_0's
// and IQ4's, start a block's sum: one broadcast load a token and block); for X8 | Q3_K's offsets, sum16: sum(q)
// per 16 [n, K/16] in integers, and high16: the same sums as (sum16 << 16) + 16384 (where the VNNI kernel starts a
// half block's sum); off16: -32 sum16 (where the VNNI kernels start a Q6_K half block's sum of its unsigned codes:
// one broadcast load a token and half block).
struct Act {
  int64_t n;
  const int8_t* q;
  const float* d;
  const float* s;
  const float* s16;
  const float* s4;
  const int32_t* off128;
  const int32_t* sum16;
  const int32_t* high16;
  const int32_t* off16;
  const uint8_t* u;  // q + 128 (1..255), on the AVX2 path only (else null): what its Q6_K kernel for prompts reads
};

struct Job {
  const Act* act;
  const uint8_t* blocks;
  int64_t pitch;  // bytes from one row to the next
  int64_t qtype, in_features, out_features;
  float* y;  // [n, out_features]
};

// The code path in use, from the CPU's flags (set_isa forces a lesser one): the `amx` path is the VNNI build with
// its prompts through the tiles (ggml_spans.h reads current_isa). Defined in ggml_dispatch.cpp.
enum Isa { SCALAR = 0, AVX2 = 1, VNNI = 2, AMX = 3 };
extern int current_isa;
// A loop's build for the code path in use (ggml_builds.h's three): AVX-512's from VNNI's path up, AVX2's, else the
// baseline's.
#define BY_ISA(loop) (current_isa >= VNNI ? avx512::loop : current_isa >= AVX2 ? avx2::loop : scalar::loop)

// Each instruction set's products: rows [r0, r1) of a row-major weight (rows), groups [g0, g1) of eight rows of
// an X8 weight (x8_rows), and blocks [b0, b1) of the activations quantized (quantize_blocks). The portable loops
// in ggml_scalar.cpp, the SIMD ones in ggml_avx2.cpp and ggml_vnni.cpp.
#define RUNGEN_ISA_PRODUCTS                                                                                      \
  void rows(const Job& job, int64_t r0, int64_t r1);                                                           \
  void x8_rows(const Job& job, int64_t g0, int64_t g1);                                                        \
  void quantize_blocks(const float* x, int64_t b0, int64_t b1, int8_t* q, uint8_t* u, float* d, float* s,      \
                       float* s16, int32_t* off128, int32_t* sum16, int32_t* high16, int32_t* off16);
namespace scalar { RUNGEN_ISA_PRODUCTS }
namespace avx2 { RUNGEN_ISA_PRODUCTS }
namespace vnni { RUNGEN_ISA_PRODUCTS }
#undef RUNGEN_ISA_PRODUCTS

// What ggml_attend.h's attend_queries reads: the tensors of attend above, their shapes and strides, its options.
struct AttendJob {
  const float* q;
  const void *k, *v;  // float32, or float16 where `half` (a cache's keys and values in half the bytes)
  const bool* mask_bool;
  const float* mask_add;
  float* out;
  int64_t heads, t, dim, kv, T;
  int64_t k_batch, k_head, k_key, v_batch, v_head, v_key;  // strides (elements) of k and v
  float scale, softcap;  // softcap 0: none
  int64_t window;        // > 0: query i sees only the keys within `window` positions of its own (0: all)
  bool masked;
  const float* sinks = nullptr;  // [heads]: a logit each query head's softmax takes beside its keys' (gpt-oss's)
  // Keys before it are not held (a sliding layer's, out of every query's window): k and v start at key `dropped`,
  // T counts it; the weights' buffer holds T - dropped / 8 * 8 a query.
  int64_t dropped = 0;
  bool half = false;
};

// Queries are taken in blocks of up to ATTEND_BLOCK that read the same keys and values (one sequence, one kv
// head: its grouped query heads, each over the tokens): a group of key or value rows, once loaded, serves the
// whole block from L1, where a query at a time streamed every row from L2 again (at a thousand keys that
// streaming, not the arithmetic, bounded a prompt's attention). Each query's arithmetic is unchanged by its
// block: its scores key by key (dot64x8 and dot64 give the same bits), its exponentials and their sum in order,
// its weighted values added key after key into one chain (kept in memory between groups of keys).
constexpr int64_t ATTEND_BLOCK = 16;
constexpr int64_t VALUE_BLOCK = 32;  // keys whose value rows stay in L1 while the block's queries add them

// The attention's and the MLP gates' loops (ggml_attend.h), compiled in ggml_attend.cpp for AVX-512, for AVX2 and
// for the baseline.
namespace avx512 {
void attend_queries(const AttendJob& job, int64_t p0, int64_t p1, float* wp);
void dot_rows(const float* x, const float* w, int64_t t0, int64_t t1, int64_t e, int64_t n, float* y);
void gelu_rows(const float* gp, int64_t r0, int64_t r1, int64_t f, float* yp);
void silu_rows(const float* gp, int64_t r0, int64_t r1, int64_t f, float* yp);
}  // namespace avx512
namespace avx2 {
void attend_queries(const AttendJob& job, int64_t p0, int64_t p1, float* wp);
void dot_rows(const float* x, const float* w, int64_t t0, int64_t t1, int64_t e, int64_t n, float* y);
void gelu_rows(const float* gp, int64_t r0, int64_t r1, int64_t f, float* yp);
void silu_rows(const float* gp, int64_t r0, int64_t r1, int64_t f, float* yp);
}  // namespace avx2
namespace scalar {
void attend_queries(const AttendJob& job, int64_t p0, int64_t p1, float* wp);
void dot_rows(const float* x, const float* w, int64_t t0, int64_t t1, int64_t e, int64_t n, float* y);
void gelu_rows(const float* gp, int64_t r0, int64_t r1, int64_t f, float* yp);
void silu_rows(const float* gp, int64_t r0, int64_t r1, int64_t f, float* yp);
}  // namespace scalar

}  // namespace rungen_ggml
