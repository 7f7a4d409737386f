// Private to kernels/cpu: the per-call constants every ISA shares, and the
// tables each ISA's file defines.
#ifndef PSLD_KERNELS_CPU_INTERNAL_H_
#define PSLD_KERNELS_CPU_INTERNAL_H_

#include "kernels/cpu/cpu_kernels.h"

namespace psld::kernels::internal {

// The scalar parameters of a call, rounded to fp32 once. They are computed by
// out-of-line functions in scalar.cc (built for baseline x86-64) and handed to
// every ISA, so a difference in how a compiler evaluates pow() or 1.0 - b1
// under different -m flags cannot make two ISAs disagree.
struct SgdConsts {
  float neg_lr;
  float wd;
  bool has_wd;
};
SgdConsts sgd_consts(const SgdParams& p);

struct MomentumConsts {
  float neg_lr;
  float wd;
  float decay;     // factor on the old buf: momentum, or 0 on the first step
  float g_scale;   // factor on g': 1 - dampening, or 1 on the first step
  float momentum;  // for the Nesterov look-ahead
  bool has_wd;
};
MomentumConsts momentum_consts(const MomentumParams& p);

struct AdamConsts {
  float wd;       // coupled (Adam) weight decay, used when coupled_wd
  float w_scale;  // 1 - lr*wd, used when decoupled_wd (AdamW)
  float b1, one_minus_b1;
  float b2, one_minus_b2;
  float neg_step;  // -lr / (1 - b1^t)
  float bc2_sqrt;  // sqrt(1 - b2^t)
  float eps;
  bool coupled_wd;
  bool decoupled_wd;
};
AdamConsts adam_consts(const AdamParams& p);

extern const KernelTable kScalarTable;
#if defined(PSLD_KERNELS_X86)
extern const KernelTable kAvx2Table;
extern const KernelTable kAvx512Table;
#endif

}  // namespace psld::kernels::internal

#endif  // PSLD_KERNELS_CPU_INTERNAL_H_
