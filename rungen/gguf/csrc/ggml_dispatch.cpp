// The code path in use: the best the CPU's flags allow, or a lesser one set_isa forces (tests, benchmarks).
#include "ggml_ops.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace rungen_ggml {
namespace {

const char* isa_names[] = {"scalar", "avx2", "avx512vnni", "amx"};

// AMX-TILE and AMX-INT8 (CPUID leaf 7, EDX bits 24 and 25), and Linux's leave to use their state (tile data is
// off until a process asks for it).
bool amx_usable() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25))) return false;
#ifdef __linux__
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return false;
#endif
}

int detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return amx_usable() ? AMX : VNNI;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
  return SCALAR;
}

const int best_isa = detect_isa();

}  // namespace

int current_isa = best_isa;

std::string isa() { return isa_names[current_isa]; }

std::string set_isa(const std::string& name) {
  int want = -1;
  for (int i = 0; i < 4; ++i)
    if (name == isa_names[i]) want = i;
  if (name == "best") want = best_isa;
  TORCH_CHECK(want >= 0, "rungen_ggml: unknown instruction set ", name);
  TORCH_CHECK(want <= best_isa, "rungen_ggml: this CPU cannot run ", name);
  current_isa = want;
  return isa_names[current_isa];
}

}  // namespace rungen_ggml
