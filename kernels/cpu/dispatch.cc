// Run-time choice of the kernel table. Built for baseline x86-64 (or whatever
// the target is): nothing here runs a wide instruction before the CPU check.

#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/internal.h"

#if defined(PSLD_KERNELS_X86)
#include <cpuid.h>
#endif

namespace psld::kernels {

#if defined(PSLD_KERNELS_X86)
namespace {

// Read from CPUID directly: clang's __builtin_cpu_supports does not know
// "f16c". F16C uses the YMM state, so the OS side is covered by the AVX2 /
// AVX-512 checks it is combined with.
bool has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

}  // namespace
#endif

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return true;
#if defined(PSLD_KERNELS_X86)
    // __builtin_cpu_supports (libgcc and compiler-rt alike) reports AVX and
    // AVX-512 features only when XGETBV shows that the OS saves the YMM/ZMM
    // and mask registers, so a kernel or hypervisor that disables them is
    // respected.
    case Isa::kAvx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && has_f16c();
    case Isa::kAvx512:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && has_f16c();
#else
    case Isa::kAvx2:
    case Isa::kAvx512:
      return false;
#endif
  }
  return false;
}

Isa best_isa() {
  if (isa_supported(Isa::kAvx512)) return Isa::kAvx512;
  if (isa_supported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

bool parse_isa(std::string_view name, Isa* isa) {
  for (Isa candidate : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (name == isa_name(candidate)) {
      *isa = candidate;
      return true;
    }
  }
  return false;
}

Isa select_isa(std::string_view request) {
  Isa ceiling = Isa::kAvx512;
  if (!parse_isa(request, &ceiling)) return best_isa();
  // Step down from the request to the first ISA the CPU runs; kScalar always is.
  for (Isa isa = ceiling; isa != Isa::kScalar; isa = static_cast<Isa>(static_cast<int>(isa) - 1)) {
    if (isa_supported(isa)) return isa;
  }
  return Isa::kScalar;
}

const KernelTable* kernels_for(Isa isa) {
  if (!isa_supported(isa)) return nullptr;
  switch (isa) {
    case Isa::kScalar:
      return &internal::kScalarTable;
#if defined(PSLD_KERNELS_X86)
    case Isa::kAvx2:
      return &internal::kAvx2Table;
    case Isa::kAvx512:
      return &internal::kAvx512Table;
#else
    case Isa::kAvx2:
    case Isa::kAvx512:
      return nullptr;
#endif
  }
  return nullptr;
}

const KernelTable& kernels() {
  // Chosen once: the kernels sit on the hot path and a process must not
  // switch tables (and results' rounding) halfway through training.
  static const KernelTable* const table = [] {
    const char* env = std::getenv("PSLD_KERNEL_ISA");
    const std::string_view request = env != nullptr ? env : "";
    Isa parsed;
    if (!request.empty() && !parse_isa(request, &parsed)) {
      std::fprintf(stderr,
                   "psld: ignoring PSLD_KERNEL_ISA=%s (accepted: scalar, avx2, avx512); "
                   "using %s\n",
                   env, isa_name(best_isa()).data());
    }
    return kernels_for(select_isa(request));
  }();
  return *table;
}

}  // namespace psld::kernels
