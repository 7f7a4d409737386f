// The memory-kind switch in front of the CPU and CUDA kernels. No #ifdef:
// in a build without nvcc, kernels/cuda/cuda_stub.cc provides the cuda::
// functions and they say so.

#include "kernels/dispatch.h"

#include <string>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_kernels.h"

namespace psld::kernels {
namespace {

// Runs host() or cuda() by kind. The device check comes first so that a
// machine without a GPU gets one clear error, not a launch failure.
template <class Host, class Cuda>
Status run(const char* name, MemoryKind where, Host host, Cuda cuda) {
  switch (where) {
    case MemoryKind::kHost:
      host();
      return {};
    case MemoryKind::kCuda: {
      Status s = cuda::device_status();
      if (!s.ok()) {
        const char* what = cuda::built() ? "no CUDA device: " : "";
        return Status(s.code(), std::string(name) + " on CUDA memory: " + what + s.message());
      }
      return cuda();
    }
  }
  return InvalidArgument(std::string(name) + ": unknown memory kind " +
                         std::to_string(static_cast<int>(where)));
}

}  // namespace

bool cuda_built() {
  return cuda::built();
}

Status cuda_device_status() {
  return cuda::device_status();
}

bool cuda_device_present() {
  return cuda::device_status().ok();
}

MemoryKind memory_kind_of(const void* p) {
  return cuda::is_device_pointer(p) ? MemoryKind::kCuda : MemoryKind::kHost;
}

Status reduce_f32(MemoryKind where, float* acc, const float* x, size_t n, void* stream) {
  return run(
      "reduce_f32", where, [&] { kernels::reduce_f32(acc, x, n); },
      [&] { return cuda::reduce_f32(acc, x, n, stream); });
}

Status reduce_f16(MemoryKind where, float* acc, const uint16_t* x, size_t n, void* stream) {
  return run(
      "reduce_f16", where, [&] { kernels::reduce_f16(acc, x, n); },
      [&] { return cuda::reduce_f16(acc, x, n, stream); });
}

Status reduce_bf16(MemoryKind where, float* acc, const uint16_t* x, size_t n, void* stream) {
  return run(
      "reduce_bf16", where, [&] { kernels::reduce_bf16(acc, x, n); },
      [&] { return cuda::reduce_bf16(acc, x, n, stream); });
}

Status scale_f32(MemoryKind where, float* x, float a, size_t n, void* stream) {
  return run(
      "scale_f32", where, [&] { kernels::scale_f32(x, a, n); },
      [&] { return cuda::scale_f32(x, a, n, stream); });
}

Status sgd_f32(MemoryKind where, float* w, const float* g, size_t n, const SgdParams& p,
               void* stream) {
  return run(
      "sgd_f32", where, [&] { kernels::sgd_f32(w, g, n, p); },
      [&] { return cuda::sgd_f32(w, g, n, p, stream); });
}

Status momentum_f32(MemoryKind where, float* w, float* buf, const float* g, size_t n,
                    const MomentumParams& p, void* stream) {
  return run(
      "momentum_f32", where, [&] { kernels::momentum_f32(w, buf, g, n, p); },
      [&] { return cuda::momentum_f32(w, buf, g, n, p, stream); });
}

Status adam_f32(MemoryKind where, float* w, float* m, float* v, const float* g, size_t n,
                const AdamParams& p, void* stream) {
  return run(
      "adam_f32", where, [&] { kernels::adam_f32(w, m, v, g, n, p); },
      [&] { return cuda::adam_f32(w, m, v, g, n, p, stream); });
}

Status f32_to_f16(MemoryKind where, uint16_t* out, const float* in, size_t n, void* stream) {
  return run(
      "f32_to_f16", where, [&] { kernels::f32_to_f16(out, in, n); },
      [&] { return cuda::f32_to_f16(out, in, n, stream); });
}

Status f16_to_f32(MemoryKind where, float* out, const uint16_t* in, size_t n, void* stream) {
  return run(
      "f16_to_f32", where, [&] { kernels::f16_to_f32(out, in, n); },
      [&] { return cuda::f16_to_f32(out, in, n, stream); });
}

Status f32_to_bf16(MemoryKind where, uint16_t* out, const float* in, size_t n, void* stream) {
  return run(
      "f32_to_bf16", where, [&] { kernels::f32_to_bf16(out, in, n); },
      [&] { return cuda::f32_to_bf16(out, in, n, stream); });
}

Status bf16_to_f32(MemoryKind where, float* out, const uint16_t* in, size_t n, void* stream) {
  return run(
      "bf16_to_f32", where, [&] { kernels::bf16_to_f32(out, in, n); },
      [&] { return cuda::bf16_to_f32(out, in, n, stream); });
}

}  // namespace psld::kernels
