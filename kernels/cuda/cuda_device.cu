// The CUDA runtime around the kernels: is there a device, is a pointer
// device memory, and the few memory and stream calls callers without CUDA
// headers need.

#include <cuda_runtime.h>

#include <cstdio>
#include <mutex>
#include <optional>
#include <string>

#include "kernels/cuda/cuda_error.h"
#include "kernels/cuda/cuda_kernels.h"

namespace psld::kernels::cuda {
namespace {

std::string driver_hint(cudaError_t e) {
  switch (e) {
    case cudaErrorInsufficientDriver:
      return "; the NVIDIA driver (libcuda.so.1) is missing or older than this CUDA runtime";
    case cudaErrorNoDevice:
      return "; no GPU is visible to this process (check the driver and CUDA_VISIBLE_DEVICES)";
    default:
      return "";
  }
}

Status probe_devices() {
  int count = 0;
  // Without a driver this fails cleanly (cudaErrorInsufficientDriver), it
  // does not abort: the runtime loads libcuda.so.1 lazily, here.
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    Status s = cuda_failure("cudaGetDeviceCount", e);
    return Unavailable(s.message() + driver_hint(e));
  }
  if (count <= 0) return Unavailable("the CUDA driver reports no devices");
  return {};
}

}  // namespace

bool built() {
  return true;
}

Status device_status() {
  // Once per process: a GPU does not come or go under a running trainer, and
  // the kernels ask on every launch. std::call_once rather than a static
  // local: its pthread_once is visible to ThreadSanitizer, whereas the guard
  // of a static local is an inline load in this nvcc-compiled (and so not
  // instrumented) file, and a thread reading the result would look racy.
  static std::once_flag once;
  static Status probed;
  std::call_once(once, [] { (void)(probed = probe_devices()); });
  return probed;
}

namespace {

// Makes one CUDA runtime call once a device is usable. An error names the
// call, with the bytes it moves or allocates where it has some.
template <typename Call>
Status runtime_call(const char* what, std::optional<size_t> bytes, Call&& call) {
  Status s = device_status();
  if (!s.ok()) return s;
  const cudaError_t e = call();
  if (e == cudaSuccess) return {};
  std::string name = what;
  if (bytes) {
    name += '(';
    name += std::to_string(*bytes);
    name += " bytes)";
  }
  return cuda_failure(name, e);
}

}  // namespace

bool is_device_pointer(const void* p) {
  if (p == nullptr || !device_status().ok()) return false;
  cudaPointerAttributes attributes{};
  // Since CUDA 11 a plain host pointer is not an error but
  // cudaMemoryTypeUnregistered.
  const cudaError_t e = cudaPointerGetAttributes(&attributes, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

Status device_alloc(size_t bytes, void** out) {
  *out = nullptr;
  Status s = runtime_call("cudaMalloc", bytes, [&] { return cudaMalloc(out, bytes); });
  if (!s.ok()) *out = nullptr;
  return s;
}

Status device_free(void* p) {
  if (p == nullptr) return {};
  return runtime_call("cudaFree", std::nullopt, [&] { return cudaFree(p); });
}

Status copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return {};
  return runtime_call("cudaMemcpy", bytes,
                      [&] { return cudaMemcpy(dst, src, bytes, cudaMemcpyDefault); });
}

Status stream_create(void** out) {
  *out = nullptr;
  cudaStream_t stream = nullptr;
  Status s = runtime_call("cudaStreamCreateWithFlags", std::nullopt, [&] {
    return cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  });
  if (s.ok()) *out = stream;
  return s;
}

Status stream_destroy(void* stream) {
  if (stream == nullptr) return {};
  return runtime_call("cudaStreamDestroy", std::nullopt,
                      [&] { return cudaStreamDestroy(static_cast<cudaStream_t>(stream)); });
}

Status stream_synchronize(void* stream) {
  return runtime_call("cudaStreamSynchronize", std::nullopt,
                      [&] { return cudaStreamSynchronize(static_cast<cudaStream_t>(stream)); });
}

Status copy_async(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return {};
  return runtime_call("cudaMemcpyAsync", bytes, [&] {
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream));
  });
}

Status zero(void* p, size_t bytes) {
  if (bytes == 0) return {};
  return runtime_call("cudaMemset", bytes, [&] { return cudaMemset(p, 0, bytes); });
}

Status host_alloc(size_t bytes, void** out) {
  *out = nullptr;
  Status s = runtime_call("cudaHostAlloc", bytes,
                          [&] { return cudaHostAlloc(out, bytes, cudaHostAllocPortable); });
  if (!s.ok()) *out = nullptr;
  return s;
}

Status host_free(void* p) {
  if (p == nullptr) return {};
  return runtime_call("cudaFreeHost", std::nullopt, [&] { return cudaFreeHost(p); });
}

Status host_register(void* p, size_t bytes) {
  if (bytes == 0) return {};
  return runtime_call("cudaHostRegister", bytes,
                      [&] { return cudaHostRegister(p, bytes, cudaHostRegisterDefault); });
}

Status host_unregister(void* p) {
  if (p == nullptr) return {};
  return runtime_call("cudaHostUnregister", std::nullopt, [&] { return cudaHostUnregister(p); });
}

Status describe_device(std::string* out) {
  out->clear();
  Status s = device_status();
  if (!s.ok()) return s;
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    return cuda_failure("cudaGetDevice", e);
  }
  cudaDeviceProp prop{};
  if (const cudaError_t e = cudaGetDeviceProperties(&prop, device); e != cudaSuccess) {
    return cuda_failure("cudaGetDeviceProperties", e);
  }
  char memory[32];
  std::snprintf(memory, sizeof(memory), "%.1f GiB",
                static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  *out = "cuda device " + std::to_string(device) + ": " + prop.name + ", " + memory + ", sm_" +
         std::to_string(prop.major) + std::to_string(prop.minor);
  return {};
}

}  // namespace psld::kernels::cuda
