// The products on AVX2: the SIMD kernels compiled for AVX2 (maddubs and madd for the 8-bit dot products).
#include "ggml_kernels.h"

namespace rungen_ggml {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "ggml_simd.h"
#include "ggml_x8.h"
#include "ggml_x8_avx2.h"
#include "ggml_spans.h"
}  // namespace avx2
#pragma GCC pop_options

}  // namespace rungen_ggml
