// The error value of the kernels that can fail: the CUDA kernels and the
// memory-kind dispatch in front of them (the CPU kernels cannot fail).
//
// kernels/ is leaf code and does not see lib/'s psld::Status; the code that
// calls these maps a KernelStatus onto it (kBuiltWithoutCuda and kNoDevice
// are Unimplemented / Unavailable there, kInvalidArgument is InvalidArgument,
// kCudaError is Internal or Unavailable depending on the call).
#ifndef PSLD_KERNELS_KERNEL_STATUS_H_
#define PSLD_KERNELS_KERNEL_STATUS_H_

#include <cstdint>
#include <string>
#include <string_view>

namespace psld::kernels {

enum class KernelError : uint8_t {
  kOk = 0,
  kInvalidArgument,   // a null or misaligned pointer; retrying will not help
  kBuiltWithoutCuda,  // a CUDA call in a build that has no CUDA kernels
  kNoDevice,          // CUDA is built in, but no driver or no device is usable here
  kCudaError,         // a CUDA runtime call or kernel launch failed; the message names it
};

constexpr std::string_view kernel_error_name(KernelError error) {
  switch (error) {
    case KernelError::kOk:
      return "OK";
    case KernelError::kInvalidArgument:
      return "InvalidArgument";
    case KernelError::kBuiltWithoutCuda:
      return "BuiltWithoutCuda";
    case KernelError::kNoDevice:
      return "NoDevice";
    case KernelError::kCudaError:
      return "CudaError";
  }
  return "Unknown";
}

// Success costs nothing (an empty std::string does not allocate), so the
// CUDA launchers can return one on the hot path.
struct [[nodiscard]] KernelStatus {
  KernelError error = KernelError::kOk;
  std::string message;  // what happened and, where it can, what to do; empty when ok

  bool ok() const { return error == KernelError::kOk; }
  // "NoDevice: ...", or "OK".
  std::string to_string() const {
    if (ok()) return "OK";
    return std::string(kernel_error_name(error)) + ": " + message;
  }
};

}  // namespace psld::kernels

#endif  // PSLD_KERNELS_KERNEL_STATUS_H_
