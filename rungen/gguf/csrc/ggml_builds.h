// An op's loops, written once in the header RUNGEN_LOOPS names, compiled three times, each build in its namespace:
// avx512 for AVX-512 (RUNGEN_WIDE and RUNGEN_F16C defined), avx2 for AVX2 (RUNGEN_F16C) and scalar for the
// baseline. The op's source defines RUNGEN_LOOPS and includes this inside namespace rungen_ggml, once (so no include
// guard), then calls the build of the code path in use by BY_ISA (ggml_kernels.h): set_isa reaches every loop.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f")
namespace avx512 {
#define RUNGEN_WIDE
#define RUNGEN_F16C
#include RUNGEN_LOOPS
#undef RUNGEN_WIDE
#undef RUNGEN_F16C
}  // namespace avx512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define RUNGEN_F16C
#include RUNGEN_LOOPS
#undef RUNGEN_F16C
}  // namespace avx2
#pragma GCC pop_options
namespace scalar {
#include RUNGEN_LOOPS
}  // namespace scalar
#undef RUNGEN_LOOPS
