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

Status without_cuda(const char* name) {
  return Unavailable(std::string(name) + ": " + kWithoutCuda);
}

}  // namespace

bool built() {
  return false;
}

Status device_status() {
  return Unavailable(kWithoutCuda);
}

bool is_device_pointer(const void*) {
  return false;
}

Status reduce_f32(float*, const float*, size_t n, void*) {
  return n == 0 ? Status() : without_cuda("cuda reduce_f32");
}
Status reduce_f16(float*, const uint16_t*, size_t n, void*) {
  return n == 0 ? Status() : without_cuda("cuda reduce_f16");
}
Status reduce_bf16(float*, const uint16_t*, size_t n, void*) {
  return n == 0 ? Status() : without_cuda("cuda reduce_bf16");
}
Status scale_f32(float*, float, size_t n, void*) {
  return n == 0 ? Status() : without_cuda("cuda scale_f32");
}
Status sgd_f32(float*, const float*, size_t n, const SgdParams&, void*) {
  return n == 0 ? Status() : without_cuda("cuda sgd_f32");
}
Status momentum_f32(float*, float*, const float*, size_t n, const MomentumParams&, void*) {
  return n == 0 ? Status() : without_cuda("cuda momentum_f32");
}
Status adam_f32(float*, float*, float*, const float*, size_t n, const AdamParams&, void*) {
  return n == 0 ? Status() : without_cuda("cuda adam_f32");
}
Status f32_to_f16(uint16_t*, const float*, size_t n, void*) {
  return n == 0 ? Status() : without_cuda("cuda f32_to_f16");
}
Status f16_to_f32(float*, const uint16_t*, size_t n, void*) {
  return n == 0 ? Status() : without_cuda("cuda f16_to_f32");
}
Status f32_to_bf16(uint16_t*, const float*, size_t n, void*) {
  return n == 0 ? Status() : without_cuda("cuda f32_to_bf16");
}
Status bf16_to_f32(float*, const uint16_t*, size_t n, void*) {
  return n == 0 ? Status() : without_cuda("cuda bf16_to_f32");
}

Status device_alloc(size_t, void** out) {
  *out = nullptr;
  return without_cuda("cuda device_alloc");
}
Status device_free(void* p) {
  return p == nullptr ? Status() : without_cuda("cuda device_free");
}
Status copy(void*, const void*, size_t bytes) {
  return bytes == 0 ? Status() : without_cuda("cuda copy");
}
Status stream_create(void** out) {
  *out = nullptr;
  return without_cuda("cuda stream_create");
}
Status stream_destroy(void* stream) {
  return stream == nullptr ? Status() : without_cuda("cuda stream_destroy");
}
Status stream_synchronize(void*) {
  return without_cuda("cuda stream_synchronize");
}

Status copy_async(void*, const void*, size_t bytes, void*) {
  return bytes == 0 ? Status() : without_cuda("cuda copy_async");
}
Status zero(void*, size_t bytes) {
  return bytes == 0 ? Status() : without_cuda("cuda zero");
}
Status host_alloc(size_t, void** out) {
  *out = nullptr;
  return without_cuda("cuda host_alloc");
}
Status host_free(void* p) {
  return p == nullptr ? Status() : without_cuda("cuda host_free");
}
Status host_register(void*, size_t bytes) {
  return bytes == 0 ? Status() : without_cuda("cuda host_register");
}
Status host_unregister(void* p) {
  return p == nullptr ? Status() : without_cuda("cuda host_unregister");
}
Status describe_device(std::string* out) {
  out->clear();
  return device_status();
}

}  // namespace psld::kernels::cuda
