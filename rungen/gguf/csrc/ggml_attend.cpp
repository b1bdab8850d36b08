#include "ggml_kernels.h"

namespace rungen_ggml {

// The attention's and the gates' loops (ggml_attend.h), compiled for AVX-512 (two queries' scores and sixteen value
// sums a 512-bit register), for AVX2 and for the baseline (ATTEND_F16C: a float16 cache widened by F16C's
// instruction, in the baseline by c10's bits); the code path in use picks one (scalar: the baseline), so set_isa
// reaches them as it reaches the products.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f")
namespace avx512 {
#define ATTEND_WIDE
#define ATTEND_F16C
#include "ggml_attend.h"
#undef ATTEND_WIDE
#undef ATTEND_F16C
}  // namespace avx512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define ATTEND_F16C
#include "ggml_attend.h"
#undef ATTEND_F16C
}  // namespace avx2
#pragma GCC pop_options
namespace scalar {
#include "ggml_attend.h"
}  // namespace scalar

}  // namespace rungen_ggml
