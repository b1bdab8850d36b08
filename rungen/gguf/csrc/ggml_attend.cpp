#include "ggml_kernels.h"

namespace rungen_ggml {

// The attention's and the gates' loops (ggml_attend.h), compiled for AVX-512 (two queries' scores and sixteen value
// sums a 512-bit register), for AVX2 and for the baseline (RUNGEN_F16C: a float16 cache widened by F16C's
// instruction, in the baseline by c10's bits); the code path in use picks one (scalar: the baseline), so set_isa
// reaches them as it reaches the products.
#define RUNGEN_LOOPS "ggml_attend.h"
#include "ggml_builds.h"

}  // namespace rungen_ggml
