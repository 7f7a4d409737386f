// The CUDA copy engine (gpu/cuda_copy_engine.h) that stages device tensors:
// host -> device -> host through its pinned memory, on two lanes. Skips with
// "no CUDA device" where there is none (here: no GPU); tools/gpu-check runs it
// on a GPU machine, where a skip is a failure. Without the CUDA toolkit the
// engine must answer Unavailable, never crash.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "gpu/cuda_copy_engine.h"
#include "kernels/cuda/cuda_kernels.h"

namespace psld {
namespace {

Status wait_idle(CopyEngine& engine, size_t lane) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    Result<bool> idle = engine.lane_idle(lane);
    if (!idle.ok()) return idle.status();
    if (*idle) return Status::Ok();
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return Timeout("the copy did not finish in 30 s");
}

TEST(CudaCopyEngine, DeviceRangeRoundTripsThroughPinnedMemory) {
  Result<std::unique_ptr<CopyEngine>> engine = create_cuda_copy_engine(2);
  if (!engine.ok()) {
    EXPECT_EQ(engine.status().code(), StatusCode::kUnavailable) << engine.status().to_string();
    GTEST_SKIP() << engine.status().message();  // "no CUDA device: ..." / "built without CUDA"
  }
  const Status device_ok = kernels::cuda::device_status();
  if (!device_ok.ok()) GTEST_SKIP() << "no CUDA device: " << device_ok.message();
  ASSERT_EQ((*engine)->lanes(), 2u);
  constexpr size_t kBytes = (size_t{20} << 20) + 333;
  Result<void*> out = (*engine)->allocate_host(kBytes);
  Result<void*> back = (*engine)->allocate_host(kBytes);
  ASSERT_TRUE(out.ok() && back.ok());
  auto* src = static_cast<uint8_t*>(*out);
  for (size_t i = 0; i < kBytes; ++i)
    src[i] = static_cast<uint8_t>(i * 131 + 7);
  std::memset(*back, 0, kBytes);
  void* dev = nullptr;
  ASSERT_TRUE(kernels::cuda::device_alloc(kBytes, &dev).ok());
  ASSERT_TRUE((*engine)->copy_async(dev, src, kBytes, 0).ok());
  ASSERT_TRUE(wait_idle(**engine, 0).ok());
  ASSERT_TRUE((*engine)->copy_async(*back, dev, kBytes, 1).ok());
  ASSERT_TRUE(wait_idle(**engine, 1).ok());
  EXPECT_EQ(std::memcmp(src, *back, kBytes), 0) << "host -> device -> host changed the bytes";
  EXPECT_TRUE(kernels::cuda::device_free(dev).ok());
  (*engine)->free_host(*out);
  (*engine)->free_host(*back);
}

}  // namespace
}  // namespace psld
