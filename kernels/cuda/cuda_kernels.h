// CUDA kernels for the server's data path: the operations of
// kernels/cpu/cpu_kernels.h on arrays in GPU memory, with the same results.
//
// No CUDA header is needed to use this one: a stream is an opaque void* (a
// cudaStream_t; nullptr is the legacy default stream), so code that is built
// the same way with and without CUDA can call it. In a build without nvcc the
// same functions exist and return Unavailable, "built without CUDA"
// (cuda_stub.cc); kernels/dispatch.h is the usual way in.
//
// Contract, beyond cpu_kernels.h's (any n, 0 included; natural alignment;
// only [0, n) touched; an input may be the very same array as an output):
//  - Every array must be reachable by the current device of the calling
//    thread (cudaMalloc'd on it, managed, or mapped), and the stream must
//    belong to that device.
//  - Launches are asynchronous: an ok status means the kernel was queued on
//    the stream. A fault while it runs shows up in a later call on the
//    stream (stream_synchronize, or any other CUDA call that syncs).
//  - With n == 0 nothing is launched and no pointer is looked at. A null or
//    misaligned pointer with n > 0 is InvalidArgument, checked before launch.
//  - Results are bit-identical to the CPU kernels: every operation is one
//    correctly-rounded fp32 add, mul, div or sqrt (__fadd_rn, __fmul_rn,
//    __fdiv_rn, __fsqrt_rn, which are never fused into an FMA), in the CPU
//    kernels' order, with the per-call constants computed on the host by the
//    very functions the CPU kernels use; subnormals are kept (no
//    flush-to-zero). The conversions are the CPU kernels' integer code.
//    The one difference: a NaN produced by arithmetic is the GPU's canonical
//    NaN (0x7fffffff), whatever the payload of the NaN that went in;
//    conversions keep payloads exactly as the CPU does.
//  - Arrays are read with 16-byte loads where every array of the call has
//    the same alignment modulo 16 bytes after a short scalar head, and with
//    plain element loads otherwise; results do not depend on which.
#ifndef PSLD_KERNELS_CUDA_CUDA_KERNELS_H_
#define PSLD_KERNELS_CUDA_CUDA_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cpu/cpu_kernels.h"
#include "psld/status.h"

namespace psld::kernels::cuda {

// True if this build has the CUDA kernels (nvcc was found at configure time).
bool built();

// Ok if the kernels can run here: the build has them, the NVIDIA driver
// loads, and it reports at least one device. Otherwise Unavailable, with the
// reason (built without CUDA, no driver, no device); a failed CUDA call is
// Internal, naming the call. Probed once per process (the first call loads
// the driver); never aborts, with or without a driver.
Status device_status();

// True for memory the GPU owns (cudaMalloc, cudaMallocManaged, pointers into
// such allocations); false for pageable or pinned host memory, for nullptr,
// and when there is no device (nothing can be device memory then).
bool is_device_pointer(const void* p);

// The kernels. Each is the operation of the same name in cpu_kernels.h.
Status reduce_f32(float* acc, const float* x, size_t n, void* stream);
Status reduce_f16(float* acc, const uint16_t* x, size_t n, void* stream);
Status reduce_bf16(float* acc, const uint16_t* x, size_t n, void* stream);
Status scale_f32(float* x, float a, size_t n, void* stream);
Status sgd_f32(float* w, const float* g, size_t n, const SgdParams& p, void* stream);
Status momentum_f32(float* w, float* buf, const float* g, size_t n, const MomentumParams& p,
                    void* stream);
Status adam_f32(float* w, float* m, float* v, const float* g, size_t n, const AdamParams& p,
                void* stream);
Status f32_to_f16(uint16_t* out, const float* in, size_t n, void* stream);
Status f16_to_f32(float* out, const uint16_t* in, size_t n, void* stream);
Status f32_to_bf16(uint16_t* out, const float* in, size_t n, void* stream);
Status bf16_to_f32(float* out, const uint16_t* in, size_t n, void* stream);

// Thin wrappers over the runtime, so that tests, benchmarks and callers
// without CUDA headers can place data on the device.
Status device_alloc(size_t bytes, void** out);  // cudaMalloc; *out = nullptr on error
Status device_free(void* p);                    // cudaFree; nullptr is fine
// cudaMemcpy with the direction taken from the pointers; synchronous.
Status copy(void* dst, const void* src, size_t bytes);
Status stream_create(void** out);  // a non-blocking stream; *out = nullptr on error
Status stream_destroy(void* stream);
// Waits for the stream's work; reports an error raised by a kernel on it.
Status stream_synchronize(void* stream);
// cudaMemcpyAsync on `stream`, the direction taken from the pointers. From
// pageable host memory the runtime stages the bytes and may return only
// once they are read; from pinned or device memory it returns at once.
Status copy_async(void* dst, const void* src, size_t bytes, void* stream);
// cudaMemset to zero; synchronous.
Status zero(void* p, size_t bytes);
// Page-locked host memory (cudaHostAlloc, portable), and cudaFreeHost.
Status host_alloc(size_t bytes, void** out);  // *out = nullptr on error
Status host_free(void* p);                    // nullptr is fine
// Page-locks host memory allocated elsewhere (cudaHostRegister), and undoes it.
Status host_register(void* p, size_t bytes);
Status host_unregister(void* p);
// The calling thread's current device in words, for start-up lines:
// "cuda device 0: NVIDIA H200, 139.8 GiB, sm_90".
Status describe_device(std::string* out);

}  // namespace psld::kernels::cuda

#endif  // PSLD_KERNELS_CUDA_CUDA_KERNELS_H_
