// The Transport calls a backend passes on unchanged to what does the work:
// its core (ucx, verbs), or the transport it wraps (the emulated link). A
// backend derives from it, supplies name(), and overrides only what it does
// itself, so each one's shell is its differences.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "psld/status.h"
#include "transports/transport.h"

namespace psld::transport {

// `Target`: a pointer to the object that does the work, e.g.
// std::shared_ptr<UcxCore> or std::unique_ptr<Transport>.
template <typename Target>
class ForwardingTransport : public Transport {
 public:
  MemorySupport memory_support(MemoryKind kind) const override {
    return target_->memory_support(kind);
  }
  std::vector<uint8_t> address() const override { return target_->address(); }
  Result<ConnectionPtr> connect(std::span<const uint8_t> peer_address) override {
    return target_->connect(peer_address);
  }
  Result<std::shared_ptr<MemoryRegion>> register_memory(void* data, size_t length,
                                                        MemoryKind kind) override {
    return target_->register_memory(data, length, kind);
  }
  Result<std::shared_ptr<MemoryRegion>> allocate_memory(size_t length, MemoryKind kind) override {
    return target_->allocate_memory(length, kind);
  }
  Status invalidate(void* data, size_t length) override {
    return target_->invalidate(data, length);
  }
  size_t progress() override { return target_->progress(); }
  void wait(std::chrono::milliseconds timeout) override { target_->wait(timeout); }
  void wake() override { target_->wake(); }
  void shutdown() override { target_->shutdown(); }

 protected:
  // `backend`: as Transport::backend().
  ForwardingTransport(const void* backend, Target target)
      : Transport(backend), target_(std::move(target)) {}

  Target target_;
};

}  // namespace psld::transport
