// The products on AVX-512 VNNI: the same SIMD kernels with vpdpbusd for the 8-bit dot products (256-bit
// registers), the X16 kernels for prompts (512-bit), and on the `amx` path the tiles (ggml_amx.h).
#include "ggml_kernels.h"

namespace rungen_ggml {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
#define GGML_VNNI
#include "ggml_simd.h"
#include "ggml_x8.h"
#include "ggml_x16.h"
#include "ggml_amx.h"
#include "ggml_spans.h"
#undef GGML_VNNI
}  // namespace vnni
#pragma GCC pop_options

}  // namespace rungen_ggml
