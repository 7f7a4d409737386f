// CPU kernels for the server's data path: gradient reduction, optimizer
// updates and dtype conversion, for fp32 parameters and fp32/fp16/bf16 inputs.
//
// One table of function pointers per instruction set (plain C++, AVX2, AVX-512);
// kernels() picks the best one for this CPU once, at run time, so the rest of
// psld is built for baseline x86-64 and still runs the wide code.
//
// Contract shared by every kernel, in every ISA:
//  - n may be anything, 0 included; pointers need only the natural alignment of
//    their element type (4 bytes for float, 2 for uint16_t). With n == 0 no
//    pointer is dereferenced.
//  - Exactly the elements [0, n) of each array are read or written; nothing
//    beyond n is touched.
//  - Element i of every output depends only on element i of the inputs (and
//    on the scalar parameters), never on n, the position in the array or the
//    alignment.
//  - Aliasing: an input may be the very same array as an output of the same
//    element type (reduce_f32(a, a, n) doubles a). Any other overlap, such as
//    a shifted view of the same buffer, is undefined.
//  - Results are bit-identical across ISAs (0 ulp; only the payload of a NaN
//    produced from two NaN operands may differ). Every operation is a single
//    IEEE fp32 add, mul, div or sqrt, evaluated in the order written below,
//    never fused (no FMA contraction), so a job whose servers run on AVX2 and
//    AVX-512 machines computes the same parameters. It costs nothing
//    measurable from 1 MiB up, where the kernels are bandwidth-bound, and
//    about 5% for Adam on arrays that fit in L1 (Zen 4).
//  - Accuracy against exact arithmetic on the same fp32 inputs: reduce,
//    scale and the conversions are correctly rounded (one rounding). The
//    optimizers round once per operation; where nothing cancels (w, g and
//    buf/m of one sign, the update a few percent of |w| at most) they are
//    within: SGD 1 ulp, momentum 2 ulp (w and buf), Adam/AdamW 3 ulp (m, v)
//    and 2 ulp (w).
//    Where terms cancel, the error is a few ulp of the largest term instead,
//    as for any fp32 evaluation of the same formula.
//  - The floating-point environment is the default one (round to nearest, no
//    flush-to-zero / denormals-are-zero). Conversions do not depend on it;
//    the arithmetic kernels inherit it, identically in every ISA.
#ifndef PSLD_KERNELS_CPU_CPU_KERNELS_H_
#define PSLD_KERNELS_CPU_CPU_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace psld::kernels {

// Ordered: a higher value needs a superset of the lower one's instructions.
enum class Isa : uint8_t {
  kScalar,  // plain C++, any CPU
  kAvx2,    // AVX2 + F16C (Haswell, Zen 1 and later)
  kAvx512,  // AVX-512 F/BW/VL/DQ + F16C (Skylake-SP, Ice Lake, Zen 4 and later)
};

// True if this CPU and the OS (saved vector state, checked via XGETBV by
// __builtin_cpu_supports) can run the ISA. kScalar is always supported.
bool isa_supported(Isa isa);
// The highest supported ISA.
Isa best_isa();
// "scalar", "avx2", "avx512".
std::string_view isa_name(Isa isa);
// Inverse of isa_name. Returns false, leaving *isa alone, for anything else.
bool parse_isa(std::string_view name, Isa* isa);
// The ISA kernels() uses for a given value of PSLD_KERNEL_ISA: the highest
// supported ISA not above the requested one, so a request can lower the
// choice (to compare paths, or to work around a CPU erratum) but never raise
// it past what the CPU runs. An empty or unknown request gives best_isa().
Isa select_isa(std::string_view request);

struct SgdParams {
  float lr;
  float weight_decay = 0;
};

// PyTorch torch.optim.SGD with momentum.
struct MomentumParams {
  float lr;
  float momentum;
  float dampening = 0;
  float weight_decay = 0;
  bool nesterov = false;
  // PyTorch initialises the buffer with the first step's gradient, undamped.
  // Set this on the first step, with buf zero-filled by the caller, to get
  // exactly that (buf = g'); on later steps leave it false.
  bool first_step = false;
};

// PyTorch torch.optim.Adam (decoupled = false) and AdamW (decoupled = true).
struct AdamParams {
  float lr;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0;
  bool decoupled = false;
  uint64_t step = 1;  // 1-based count of updates including this one; 0 is treated as 1
};

// One ISA's kernels. The operations are documented on the free functions below.
struct KernelTable {
  Isa isa;
  void (*reduce_f32)(float* acc, const float* x, size_t n);
  void (*reduce_f16)(float* acc, const uint16_t* x, size_t n);
  void (*reduce_bf16)(float* acc, const uint16_t* x, size_t n);
  void (*scale_f32)(float* x, float a, size_t n);
  void (*sgd_f32)(float* w, const float* g, size_t n, const SgdParams& p);
  void (*momentum_f32)(float* w, float* buf, const float* g, size_t n, const MomentumParams& p);
  void (*adam_f32)(float* w, float* m, float* v, const float* g, size_t n, const AdamParams& p);
  void (*f32_to_f16)(uint16_t* out, const float* in, size_t n);
  void (*f16_to_f32)(float* out, const uint16_t* in, size_t n);
  void (*f32_to_bf16)(uint16_t* out, const float* in, size_t n);
  void (*bf16_to_f32)(float* out, const uint16_t* in, size_t n);
};

// The table of one ISA, for tests and benchmarks; nullptr if !isa_supported(isa).
const KernelTable* kernels_for(Isa isa);
// The table chosen on first use: select_isa(getenv("PSLD_KERNEL_ISA")). The
// variable is read once; an unknown value is reported on stderr and ignored.
const KernelTable& kernels();

// acc[i] += x[i]. Exact IEEE fp32 addition.
inline void reduce_f32(float* acc, const float* x, size_t n) {
  kernels().reduce_f32(acc, x, n);
}
// acc[i] += float(x[i]), x IEEE binary16 (the widening is exact).
inline void reduce_f16(float* acc, const uint16_t* x, size_t n) {
  kernels().reduce_f16(acc, x, n);
}
// acc[i] += float(x[i]), x bfloat16 (the widening is exact).
inline void reduce_bf16(float* acc, const uint16_t* x, size_t n) {
  kernels().reduce_bf16(acc, x, n);
}
// x[i] *= a.
inline void scale_f32(float* x, float a, size_t n) {
  kernels().scale_f32(x, a, n);
}

// Plain SGD: g' = g + wd*w (skipped when wd == 0, as PyTorch does);
// w = w + (-lr)*g'.
inline void sgd_f32(float* w, const float* g, size_t n, const SgdParams& p) {
  kernels().sgd_f32(w, g, n, p);
}

// SGD with momentum, PyTorch semantics:
//   g'  = g + wd*w                          (skipped when wd == 0)
//   buf = momentum*buf + (1-dampening)*g'   (first_step: buf = g')
//   d   = nesterov ? g' + momentum*buf : buf
//   w   = w + (-lr)*d
// momentum == 0 is plain SGD, as in PyTorch: buf is neither read nor written.
inline void momentum_f32(float* w, float* buf, const float* g, size_t n, const MomentumParams& p) {
  kernels().momentum_f32(w, buf, g, n, p);
}

// Adam / AdamW, PyTorch semantics with bias correction, t = step:
//   Adam:  g' = g + wd*w (skipped when wd == 0)     AdamW: w = w*(1 - lr*wd), g' = g
//   m = b1*m + (1-b1)*g'
//   v = b2*v + ((1-b2)*g')*g'
//   w = w + (-lr/(1-b1^t))*m / (sqrt(v)/sqrt(1-b2^t) + eps)
// The per-call constants (1-b1, 1-b2, the bias corrections, 1-lr*wd) are
// computed in double and rounded to fp32 once, the same way for every ISA.
// amsgrad and maximize are not supported.
inline void adam_f32(float* w, float* m, float* v, const float* g, size_t n, const AdamParams& p) {
  kernels().adam_f32(w, m, v, g, n, p);
}

// fp32 -> IEEE binary16, round to nearest even; fp16 subnormals are produced,
// values from 65520 up become inf, NaN stays NaN (quiet bit set, sign and the
// top 9 payload bits kept), as F16C's vcvtps2ph does.
inline void f32_to_f16(uint16_t* out, const float* in, size_t n) {
  kernels().f32_to_f16(out, in, n);
}
// IEEE binary16 -> fp32, exact; a signalling NaN comes back quiet, as with
// F16C's vcvtph2ps.
inline void f16_to_f32(float* out, const uint16_t* in, size_t n) {
  kernels().f16_to_f32(out, in, n);
}
// fp32 -> bfloat16, round to nearest even, subnormals kept (no flush to zero);
// large finite values may round to inf, NaN never does: it stays NaN with the
// quiet bit set and the sign and top payload bits kept.
inline void f32_to_bf16(uint16_t* out, const float* in, size_t n) {
  kernels().f32_to_bf16(out, in, n);
}
// bfloat16 -> fp32, exact (the bits shifted left by 16, NaN payloads untouched).
inline void bf16_to_f32(float* out, const uint16_t* in, size_t n) {
  kernels().bf16_to_f32(out, in, n);
}

// One-element conversions, bit-identical to the array kernels.
uint16_t f32_to_f16_scalar(float x);
float f16_to_f32_scalar(uint16_t h);
uint16_t f32_to_bf16_scalar(float x);
float bf16_to_f32_scalar(uint16_t h);

}  // namespace psld::kernels

#endif  // PSLD_KERNELS_CPU_CPU_KERNELS_H_
