// One call for the kernels whatever memory the arrays are in: host memory
// runs the CPU kernels (kernels/cpu/cpu_kernels.h), CUDA device memory the
// CUDA kernels (kernels/cuda/cuda_kernels.h), with the same results bit for
// bit (NaN payloads aside; see cuda_kernels.h).
//
// The caller says where the arrays are (it registered them, so it knows);
// memory_kind_of() asks the CUDA driver instead, for a caller that does not.
// Every call returns a psld::Status. In a build without CUDA the host side
// works as ever and the CUDA side returns Unavailable ("built without
// CUDA"); on a machine without a GPU, Unavailable ("no CUDA device").
// Either way nothing is launched, nothing aborts, and this header and its
// callers need no #ifdef.
#ifndef PSLD_KERNELS_DISPATCH_H_
#define PSLD_KERNELS_DISPATCH_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "base/memory_kind.h"
#include "kernels/cpu/cpu_kernels.h"
#include "psld/status.h"

namespace psld::kernels {

// Where the arrays of one call live (base/memory_kind.h); all of a call's
// arrays live in one kind. kHost runs the CPU kernels, synchronously; kCuda
// the CUDA kernels, queued on a stream.

// True if this build has the CUDA kernels.
bool cuda_built();
// Ok if the CUDA kernels can run here; otherwise why not (built without
// CUDA, no driver, no device). Probed once per process, never aborts.
Status cuda_device_status();
bool cuda_device_present();

// kCuda for device or managed memory (a pointer into such an allocation
// included), kHost for anything else, nullptr included, and for every
// pointer when no device is present. One driver call; not for a hot loop.
MemoryKind memory_kind_of(const void* p);

// The operations of cpu_kernels.h. With kHost the stream is ignored and the
// result is final on return; with kCuda the kernel is queued on `stream` (a
// cudaStream_t, nullptr for the default stream) and the status reports the
// launch; without a usable device that is an error even for n == 0, since
// the caller asked for the GPU. InvalidArgument for a kind outside the enum.
Status reduce_f32(MemoryKind where, float* acc, const float* x, size_t n, void* stream = nullptr);
Status reduce_f16(MemoryKind where, float* acc, const uint16_t* x, size_t n,
                  void* stream = nullptr);
Status reduce_bf16(MemoryKind where, float* acc, const uint16_t* x, size_t n,
                   void* stream = nullptr);
Status scale_f32(MemoryKind where, float* x, float a, size_t n, void* stream = nullptr);
Status sgd_f32(MemoryKind where, float* w, const float* g, size_t n, const SgdParams& p,
               void* stream = nullptr);
Status momentum_f32(MemoryKind where, float* w, float* buf, const float* g, size_t n,
                    const MomentumParams& p, void* stream = nullptr);
Status adam_f32(MemoryKind where, float* w, float* m, float* v, const float* g, size_t n,
                const AdamParams& p, void* stream = nullptr);
Status f32_to_f16(MemoryKind where, uint16_t* out, const float* in, size_t n,
                  void* stream = nullptr);
Status f16_to_f32(MemoryKind where, float* out, const uint16_t* in, size_t n,
                  void* stream = nullptr);
Status f32_to_bf16(MemoryKind where, uint16_t* out, const float* in, size_t n,
                   void* stream = nullptr);
Status bf16_to_f32(MemoryKind where, float* out, const uint16_t* in, size_t n,
                   void* stream = nullptr);

}  // namespace psld::kernels

#endif  // PSLD_KERNELS_DISPATCH_H_
