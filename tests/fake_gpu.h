// A GPU for tests on machines without one.
//
// FakeDevice is the "device memory": an mmap'd arena that is inaccessible
// (PROT_NONE) except while a fake copy or kernel runs, so psld touching it
// any other way (a memcpy, a transport reading from it, a CPU kernel called
// on it) crashes the test.
//
// FakeServerDevice is a server's device (lib/server/server_device.h) on that arena:
// copies and kernels are only queued, and run when the lane is synchronized,
// as on a CUDA stream, so a server that uses a result before waiting for it
// reads stale bytes and exact results fail. Its kernels are the CPU ones
// (kernels/dispatch.h with MemoryKind::kHost), which the CUDA kernels match
// bit for bit (tests/cuda_kernels_test.cc checks that on a GPU).
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "lib/server/server_device.h"

namespace psld {

class FakeDevice {
 public:
  explicit FakeDevice(size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    base_ = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
  }
  ~FakeDevice() {
    if (base_ != nullptr) munmap(base_, bytes_);
  }
  FakeDevice(const FakeDevice&) = delete;
  FakeDevice& operator=(const FakeDevice&) = delete;

  bool ok() const { return base_ != nullptr; }
  bool contains(const void* p) const {
    const auto* b = static_cast<const uint8_t*>(p);
    return b >= base_ && b < base_ + bytes_;
  }
  // "cudaMalloc": 256-byte aligned, zeroed (the arena's pages are fresh and
  // never handed out twice), never reused.
  void* alloc(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    used_ = (used_ + 255) & ~size_t{255};
    if (used_ + bytes > bytes_) return nullptr;
    void* p = base_ + used_;
    used_ += bytes;
    return p;
  }
  // Runs fn with the arena accessible: the only way in or out. One at a time.
  template <typename F>
  auto with_access(F&& fn) {
    std::lock_guard<std::mutex> lock(mu_);
    mprotect(base_, bytes_, PROT_READ | PROT_WRITE);
    struct Reprotect {
      FakeDevice* d;
      ~Reprotect() { mprotect(d->base_, d->bytes_, PROT_NONE); }
    } reprotect{this};
    return fn();
  }
  // "cudaMemcpy".
  void copy(void* dst, const void* src, size_t n) {
    with_access([&] { std::memcpy(dst, src, n); });
  }
  template <typename T>
  void upload(T* device, const std::vector<T>& host) {
    copy(device, host.data(), host.size() * sizeof(T));
  }
  template <typename T>
  std::vector<T> download(const T* device, size_t n) {
    std::vector<T> out(n);
    copy(out.data(), device, n * sizeof(T));
    return out;
  }

 private:
  uint8_t* base_ = nullptr;
  size_t bytes_;
  std::mutex mu_;
  size_t used_ = 0;
};

// What the fake server devices of a job did, and how they should misbehave.
struct ServerDeviceLog {
  std::atomic<int64_t> live{0};                 // device allocations not yet freed
  std::atomic<int64_t> live_host{0};            // pinned host allocations not yet freed
  std::atomic<uint64_t> pins{0};                // host ranges pinned
  std::atomic<int64_t> live_pins{0};            // of them, not yet unpinned
  std::atomic<uint64_t> copies_from_pinned{0};  // copies whose source was in a pinned range
  std::atomic<uint64_t> launches{0};
  std::atomic<uint64_t> copies{0};
  std::atomic<uint64_t> syncs{0};
  std::atomic<uint64_t> bad_frees{0};  // free of a pointer outside the arena
  // The kernel launch with this number (from 1, over the whole job) faults
  // when it runs, as a kernel with a bad address would; 0: none does.
  std::atomic<uint64_t> fault_launch{0};
};

class FakeServerDevice final : public ServerDevice {
 public:
  FakeServerDevice(FakeDevice& arena, size_t lanes, std::shared_ptr<ServerDeviceLog> log)
      : arena_(arena), log_(std::move(log)), lanes_(lanes) {}

  std::string describe() const override { return "fake GPU (tests/fake_gpu.h)"; }
  size_t lanes() const override { return lanes_.size(); }

  Result<void*> allocate(size_t bytes) override {
    void* p = arena_.alloc(bytes);
    if (p == nullptr) return ResourceExhausted("the fake GPU's arena is full");
    log_->live.fetch_add(1);
    return p;
  }
  void free(void* p) override {
    if (p == nullptr) return;
    if (!arena_.contains(p)) log_->bad_frees.fetch_add(1);
    log_->live.fetch_sub(1);
  }
  Result<void*> allocate_host(size_t bytes) override {
    void* p = std::malloc(std::max<size_t>(bytes, 1));
    if (p == nullptr) return ResourceExhausted("fake pinned allocation");
    log_->live_host.fetch_add(1);
    return p;
  }
  void free_host(void* p) override {
    if (p == nullptr) return;
    std::free(p);
    log_->live_host.fetch_sub(1);
  }
  Status pin(void* p, size_t bytes) override {
    if (p == nullptr || bytes == 0) return InvalidArgument("fake GPU: nothing to pin");
    std::lock_guard<std::mutex> lock(mu_);
    pinned_[static_cast<const uint8_t*>(p)] = bytes;
    log_->pins.fetch_add(1);
    log_->live_pins.fetch_add(1);
    return Status::Ok();
  }
  void unpin(void* p) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (pinned_.erase(static_cast<const uint8_t*>(p)) == 1) log_->live_pins.fetch_sub(1);
  }

  Status copy(void* dst, const void* src, size_t bytes, size_t lane) override {
    if (lane >= lanes_.size()) return InvalidArgument("fake GPU: no such lane");
    log_->copies.fetch_add(1);
    if (is_pinned(src)) log_->copies_from_pinned.fetch_add(1);
    return queue(lane, [dst, src, bytes]() -> Status {
      std::memcpy(dst, src, bytes);
      return Status::Ok();
    });
  }
  Status launch(size_t lane, const Launch& fn) override {
    if (lane >= lanes_.size()) return InvalidArgument("fake GPU: no such lane");
    const bool fault = log_->launches.fetch_add(1) + 1 == log_->fault_launch.load();
    return queue(lane, [fn, fault]() -> Status {
      if (fault) return Internal("fake kernel fault (as cudaErrorIllegalAddress)");
      return fn(MemoryKind::kHost, nullptr);
    });
  }
  Status synchronize(size_t lane) override {
    if (lane >= lanes_.size()) return InvalidArgument("fake GPU: no such lane");
    log_->syncs.fetch_add(1);
    std::deque<std::function<Status()>> work;
    {
      std::lock_guard<std::mutex> lock(mu_);
      work.swap(lanes_[lane]);
    }
    return arena_.with_access([&]() -> Status {
      for (auto& op : work) {
        Status s = op();
        if (!s.ok()) return s;  // as a faulted stream: what follows does not run
      }
      return Status::Ok();
    });
  }

 private:
  bool is_pinned(const void* p) {
    const auto* b = static_cast<const uint8_t*>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pinned_.upper_bound(b);
    if (it == pinned_.begin()) return false;
    --it;
    return b < it->first + it->second;
  }
  Status queue(size_t lane, std::function<Status()> op) {
    std::lock_guard<std::mutex> lock(mu_);
    lanes_[lane].push_back(std::move(op));
    return Status::Ok();
  }

  FakeDevice& arena_;
  std::shared_ptr<ServerDeviceLog> log_;
  std::mutex mu_;
  std::vector<std::deque<std::function<Status()>>> lanes_;
  std::map<const uint8_t*, size_t> pinned_;  // start -> bytes
};

}  // namespace psld
