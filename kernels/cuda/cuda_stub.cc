// The CUDA entry points of a build without nvcc: every call that would need
// the GPU says so, so the code above kernels/ is the same in both builds.

#include <string>

#include "kernels/cuda/cuda_kernels.h"

namespace psld::kernels::cuda {
namespace {

constexpr const char* kWithoutCuda =
    "psld was built without CUDA (configured with -Dcuda=disabled, or nvcc and libcudart "
    "were not found); to use the GPU, install the CUDA toolkit under /usr/local/cuda and "
    "reconfigure with -Dcuda=enabled";

KernelStatus without_cuda(const char* name) {
  return {KernelError::kBuiltWithoutCuda, std::string(name) + ": " + kWithoutCuda};
}

}  // namespace

bool built() {
  return false;
}

KernelStatus device_status() {
  return {KernelError::kBuiltWithoutCuda, kWithoutCuda};
}

bool is_device_pointer(const void*) {
  return false;
}

KernelStatus reduce_f32(float*, const float*, size_t n, void*) {
  return n == 0 ? KernelStatus{} : without_cuda("cuda reduce_f32");
}
KernelStatus reduce_f16(float*, const uint16_t*, size_t n, void*) {
  return n == 0 ? KernelStatus{} : without_cuda("cuda reduce_f16");
}
KernelStatus reduce_bf16(float*, const uint16_t*, size_t n, void*) {
  return n == 0 ? KernelStatus{} : without_cuda("cuda reduce_bf16");
}
KernelStatus scale_f32(float*, float, size_t n, void*) {
  return n == 0 ? KernelStatus{} : without_cuda("cuda scale_f32");
}
KernelStatus sgd_f32(float*, const float*, size_t n, const SgdParams&, void*) {
  return n == 0 ? KernelStatus{} : without_cuda("cuda sgd_f32");
}
KernelStatus momentum_f32(float*, float*, const float*, size_t n, const MomentumParams&, void*) {
  return n == 0 ? KernelStatus{} : without_cuda("cuda momentum_f32");
}
KernelStatus adam_f32(float*, float*, float*, const float*, size_t n, const AdamParams&, void*) {
  return n == 0 ? KernelStatus{} : without_cuda("cuda adam_f32");
}
KernelStatus f32_to_f16(uint16_t*, const float*, size_t n, void*) {
  return n == 0 ? KernelStatus{} : without_cuda("cuda f32_to_f16");
}
KernelStatus f16_to_f32(float*, const uint16_t*, size_t n, void*) {
  return n == 0 ? KernelStatus{} : without_cuda("cuda f16_to_f32");
}
KernelStatus f32_to_bf16(uint16_t*, const float*, size_t n, void*) {
  return n == 0 ? KernelStatus{} : without_cuda("cuda f32_to_bf16");
}
KernelStatus bf16_to_f32(float*, const uint16_t*, size_t n, void*) {
  return n == 0 ? KernelStatus{} : without_cuda("cuda bf16_to_f32");
}

KernelStatus device_alloc(size_t, void** out) {
  *out = nullptr;
  return without_cuda("cuda device_alloc");
}
KernelStatus device_free(void* p) {
  return p == nullptr ? KernelStatus{} : without_cuda("cuda device_free");
}
KernelStatus copy(void*, const void*, size_t bytes) {
  return bytes == 0 ? KernelStatus{} : without_cuda("cuda copy");
}
KernelStatus stream_create(void** out) {
  *out = nullptr;
  return without_cuda("cuda stream_create");
}
KernelStatus stream_destroy(void* stream) {
  return stream == nullptr ? KernelStatus{} : without_cuda("cuda stream_destroy");
}
KernelStatus stream_synchronize(void*) {
  return without_cuda("cuda stream_synchronize");
}

KernelStatus copy_async(void*, const void*, size_t bytes, void*) {
  return bytes == 0 ? KernelStatus{} : without_cuda("cuda copy_async");
}
KernelStatus zero(void*, size_t bytes) {
  return bytes == 0 ? KernelStatus{} : without_cuda("cuda zero");
}
KernelStatus host_alloc(size_t, void** out) {
  *out = nullptr;
  return without_cuda("cuda host_alloc");
}
KernelStatus host_free(void* p) {
  return p == nullptr ? KernelStatus{} : without_cuda("cuda host_free");
}
KernelStatus host_register(void*, size_t bytes) {
  return bytes == 0 ? KernelStatus{} : without_cuda("cuda host_register");
}
KernelStatus host_unregister(void* p) {
  return p == nullptr ? KernelStatus{} : without_cuda("cuda host_unregister");
}
KernelStatus describe_device(std::string* out) {
  out->clear();
  return device_status();
}

}  // namespace psld::kernels::cuda
