#include "transports/stager.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

namespace psld::transport {

Result<std::unique_ptr<Stager>> Stager::create(CopyEngine& engine, StagerOptions options) {
  if (options.chunk_bytes == 0 || options.buffers == 0) {
    return InvalidArgument("stager: chunk_bytes and buffers must be positive");
  }
  if (engine.lanes() < options.buffers) {
    return InvalidArgument(fmt::format("stager: {} buffers need {} copy lanes; the engine has {}",
                                       options.buffers, options.buffers, engine.lanes()));
  }
  if (options.chunk_bytes > SIZE_MAX / options.buffers) {
    return InvalidArgument("stager: chunk_bytes * buffers overflows");
  }
  const size_t total = options.chunk_bytes * options.buffers;
  PSLD_ASSIGN_OR_RETURN(void* host, engine.allocate_host(total));
  return std::unique_ptr<Stager>(new Stager(engine, options, static_cast<uint8_t*>(host), total));
}

Stager::Stager(CopyEngine& engine, StagerOptions options, uint8_t* host, size_t total_bytes)
    : engine_(engine),
      options_(options),
      host_(host),
      total_bytes_(total_bytes),
      slots_(options.buffers) {}

Stager::~Stager() {
  engine_.free_host(host_);
}

Status Stager::start_send(const void* device, size_t length, ChunkTransfer transfer) {
  // The device range is only read on this path.
  return start(true, static_cast<uint8_t*>(const_cast<void*>(device)), length, std::move(transfer));
}

Status Stager::start_receive(void* device, size_t length, ChunkTransfer transfer) {
  return start(false, static_cast<uint8_t*>(device), length, std::move(transfer));
}

Status Stager::start(bool send, uint8_t* device, size_t length, ChunkTransfer transfer) {
  if (active_) return FailedPrecondition("stager: the previous staging has not finished");
  if (device == nullptr && length > 0) return InvalidArgument("stager: null device pointer");
  if (!transfer) return InvalidArgument("stager: no transfer function");
  send_ = send;
  device_ = device;
  length_ = length;
  chunks_ = (length + options_.chunk_bytes - 1) / options_.chunk_bytes;
  transfer_ = std::move(transfer);
  for (Slot& s : slots_)
    s = Slot{};
  next_first_ = next_second_ = completed_ = 0;
  failure_ = Status::Ok();
  {
    std::lock_guard<std::mutex> lock(inbox_->mu);
    inbox_->done.clear();
  }
  active_ = true;
  return Status::Ok();
}

size_t Stager::chunk_length(size_t chunk) const {
  const uint64_t offset = static_cast<uint64_t>(chunk) * options_.chunk_bytes;
  return std::min<size_t>(options_.chunk_bytes, length_ - offset);
}

StagedChunk Stager::chunk_view(size_t chunk) const {
  StagedChunk c;
  c.index = chunk;
  c.offset = static_cast<uint64_t>(chunk) * options_.chunk_bytes;
  c.buffer = chunk % options_.buffers;
  c.buffer_offset = static_cast<uint64_t>(c.buffer) * options_.chunk_bytes;
  c.host = {host_ + c.buffer_offset, chunk_length(chunk)};
  return c;
}

void Stager::fail(Status s) {
  if (failure_.ok()) failure_ = std::move(s);
}

Status Stager::start_copy(size_t chunk) {
  const StagedChunk c = chunk_view(chunk);
  uint8_t* device = device_ + c.offset;
  Status s = send_ ? engine_.copy_async(c.host.data(), device, c.host.size(), c.buffer)
                   : engine_.copy_async(device, c.host.data(), c.host.size(), c.buffer);
  if (!s.ok()) {
    return s.with_context(fmt::format("stager: copy of chunk {} ({} bytes at offset {})", chunk,
                                      c.host.size(), c.offset));
  }
  slots_[c.buffer] = Slot{SlotState::kCopying, chunk};
  return Status::Ok();
}

Status Stager::start_transfer(size_t chunk) {
  const StagedChunk c = chunk_view(chunk);
  // Set first: `done` may run inside transfer_, and its report is read only
  // by the next pass of poll(), which expects the slot in this state.
  slots_[c.buffer] = Slot{SlotState::kTransferring, chunk};
  std::shared_ptr<Inbox> inbox = inbox_;
  const size_t buffer = c.buffer;
  Status s = transfer_(c, [inbox, buffer](Status st) {
    std::lock_guard<std::mutex> lock(inbox->mu);
    inbox->done.emplace_back(buffer, std::move(st));
  });
  if (!s.ok()) {
    slots_[c.buffer] = Slot{};
    return s.with_context(fmt::format("stager: transfer of chunk {}", chunk));
  }
  return Status::Ok();
}

bool Stager::in_flight() const {
  for (const Slot& s : slots_) {
    if (s.state == SlotState::kCopying || s.state == SlotState::kTransferring) return true;
  }
  return false;
}

Result<bool> Stager::poll() {
  if (!active_) return true;
  // Passes repeat while they change something, so a transfer that completes
  // inside its own call, or a copy that is already done, moves on at once.
  for (bool changed = true; changed;) {
    changed = false;
    std::vector<std::pair<size_t, Status>> done;
    {
      std::lock_guard<std::mutex> lock(inbox_->mu);
      done.swap(inbox_->done);
    }
    for (auto& [buffer, status] : done) {
      Slot& slot = slots_[buffer];
      if (slot.state != SlotState::kTransferring) continue;  // a second `done`: ignored
      changed = true;
      if (!status.ok()) {
        fail(status.with_context(fmt::format("stager: transfer of chunk {}", slot.chunk)));
        slot = Slot{};
      } else if (send_) {
        slot = Slot{};
        ++completed_;
      } else {
        slot.state = SlotState::kStaged;
      }
    }
    for (size_t b = 0; b < slots_.size(); ++b) {
      Slot& slot = slots_[b];
      if (slot.state != SlotState::kCopying) continue;
      Result<bool> idle = engine_.lane_idle(b);
      if (!idle.ok()) {
        fail(idle.status().with_context(fmt::format("stager: copy of chunk {}", slot.chunk)));
        slot = Slot{};
        changed = true;
      } else if (*idle) {
        changed = true;
        if (send_) {
          slot.state = SlotState::kStaged;
        } else {
          slot = Slot{};
          ++completed_;
        }
      }
    }
    if (!failure_.ok()) continue;  // only drain what is in flight
    // Second stage, in chunk order: sends leave in order, and receives are
    // copied out in the order they arrived.
    while (next_second_ < next_first_) {
      const Slot& slot = slots_[next_second_ % options_.buffers];
      if (slot.state != SlotState::kStaged || slot.chunk != next_second_) break;
      Status s = send_ ? start_transfer(next_second_) : start_copy(next_second_);
      if (!s.ok()) {
        slots_[next_second_ % options_.buffers] = Slot{};
        fail(std::move(s));
        break;
      }
      ++next_second_;
      changed = true;
    }
    // First stage: the next chunk enters once its buffer is free.
    while (failure_.ok() && next_first_ < chunks_) {
      if (slots_[next_first_ % options_.buffers].state != SlotState::kFree) break;
      Status s = send_ ? start_copy(next_first_) : start_transfer(next_first_);
      if (!s.ok()) {
        fail(std::move(s));
        break;
      }
      ++next_first_;
      changed = true;
    }
  }
  if (!failure_.ok()) {
    if (in_flight()) return false;
    active_ = false;
    transfer_ = nullptr;
    return failure_;
  }
  if (completed_ == chunks_) {
    active_ = false;
    transfer_ = nullptr;
    return true;
  }
  return false;
}

Status Stager::drain(const std::function<void()>& step) {
  for (;;) {
    PSLD_ASSIGN_OR_RETURN(bool finished, poll());
    if (finished) return Status::Ok();
    if (step) step();
  }
}

}  // namespace psld::transport
