// A server's key state (one run of ownership of a key), its shards and its
// worker connections, shared by the server's files (service, intake, shards,
// aggregation, migration). Internal to lib/server/.
#pragma once

#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <unordered_map>

#include "lib/server/service.h"

namespace psld {

namespace kn = psld::kernels;
// A shipped key's state: {u64 version, u64 reserved}, then parameter, first
// and second moment, fp32.
inline constexpr uint64_t kStateHeader = 16;

inline double ns_since(transport::Clock::time_point t) {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(transport::Clock::now() - t).count());
}

// A key's array: host memory (new[]), or the server's device memory when it
// has a device (server.device = cuda).
template <typename T>
struct ArrayFree {
  ServerDevice* device = nullptr;
  void operator()(T* p) const {
    if (device != nullptr) {
      device->free(p);
    } else {
      delete[] p;
    }
  }
};
template <typename T>
using Array = std::unique_ptr<T[], ArrayFree<T>>;

// n zeroed elements.
template <typename T>
Result<Array<T>> make_array(ServerDevice* device, size_t n) {
  if (device == nullptr) return Array<T>(new T[n](), ArrayFree<T>{});
  PSLD_ASSIGN_OR_RETURN(void* p, device->allocate(std::max<size_t>(n, 1) * sizeof(T)));
  return Array<T>(static_cast<T*>(p), ArrayFree<T>{device});
}

inline Status ensure_array(ServerDevice* device, Array<float>& a, size_t n) {
  if (a) return Status::Ok();
  PSLD_ASSIGN_OR_RETURN(a, make_array<float>(device, n));
  return Status::Ok();
}

// Pinned host memory of the device (a key's output, which pulls are written from).
struct HostFree {
  ServerDevice* device = nullptr;
  void operator()(uint8_t* p) const { device->free_host(p); }
};
using HostBuffer = std::unique_ptr<uint8_t, HostFree>;

// Host memory the device page-locked (ServerDevice::pin).
struct Unpin {
  ServerDevice* device = nullptr;
  void operator()(uint8_t* p) const { device->unpin(p); }
};
using PinnedRange = std::unique_ptr<uint8_t, Unpin>;

// The key-state operations, on the host (at once) or queued on the device's
// lane; finish_on() waits for the lane.
inline Status copy_on(ServerDevice* device, size_t lane, void* dst, const void* src, size_t bytes) {
  if (device != nullptr) return device->copy(dst, src, bytes, lane);
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

// fn(where, stream) calls one kernel of kernels/dispatch.h; on the host it
// runs at once, with no std::function in between.
template <typename Fn>
Status run_on(ServerDevice* device, size_t lane, const Fn& fn) {
  if (device != nullptr) return device->launch(lane, ServerDevice::Launch(fn));
  return status_from_kernel(fn(kn::MemoryKind::kHost, nullptr));
}

inline Status finish_on(ServerDevice* device, size_t lane) {
  return device != nullptr ? device->synchronize(lane) : Status::Ok();
}

struct ServerService::KeyState {
  Key key = 0;
  uint64_t arc = 0;  // first hash of the key's arc: the subject of its load samples
  protocol::DType dtype = protocol::DType::kF32;
  uint64_t bytes = 0;  // of the chunk in the workers' dtype
  size_t n = 0;        // elements
  // Allocated once, in host memory or on the server's device: the source of
  // pull writes (param or out16 on the host; out_host with a device) is
  // registered with the transport, so it must never move.
  Array<float> param;
  Array<float> acc;
  Array<float> m, v;      // optimizer state, allocated on first use
  Array<uint16_t> out16;  // fp16/bf16 keys: param converted
  HostBuffer out_host;    // with a device: the output, copied from the device
  std::shared_ptr<transport::MemoryRegion> out_region;
  // BSP sum mode, fp32: acc is registered too, and a round is applied by
  // swapping param and acc (and their regions) instead of copying.
  std::shared_ptr<transport::MemoryRegion> acc_region;
  uint64_t version = 0;  // rounds (BSP) or pushes (async) applied
  uint32_t pushes = 0;   // BSP: pushes reduced into acc for round version + 1
  std::vector<bool> pushed;
  std::map<uint64_t, std::vector<PushWork>> parked;  // BSP: pushes for later rounds
  std::deque<PushWork> deferred;                     // async: waiting for pull writes
  std::vector<PullWork> waiting;
  uint32_t inflight = 0;  // pull writes reading param right now
  bool apply_pending = false;
  std::vector<uint64_t> last_round;  // per worker, for bounded staleness
  std::vector<uint64_t> applied;     // per worker: async pushes applied in this run
  // Migration. A key this server gained waits for its state: pushes park,
  // pulls wait, until the previous owner's write lands in `incoming`.
  bool awaiting_state = false;
  uint64_t state_round = 0;  // the switch round it was gained at
  // The switch round this server's run of ownership began (0: from the first
  // epoch). A key that leaves and comes back gets a new KeyState for the new
  // run; the old one still finishes its rounds and ships them.
  uint64_t owned_from = 0;
  std::shared_ptr<transport::MemoryRegion> incoming;
  std::vector<StateWork> successors;  // state requests waiting for their round
  // Gained at a switch while this server owned nothing before: rounds >= the
  // switch are held (not applied, no pull answered, no plain push accepted)
  // until the transfer is final, so an abort can still give the key back.
  bool awaiting_final = false;
  // As an old owner, the switch round this run last offered its state at,
  // started shipping it at, and shipped it at (the write completed): the
  // run ended there. An abort that gives the key back clears shipped_round
  // (the run goes on), so that the run is not freed.
  uint64_t offered_round = 0;
  uint64_t shipping_round = 0;
  uint64_t shipped_round = 0;
  // A device operation on the key failed (a CUDA error): every request for
  // it is answered with this.
  Status failed;
};

struct ServerService::Shard {
  size_t index = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Work> queue;
  bool stop = false;
  // Per key, its runs of ownership here, oldest first.
  std::unordered_map<Key, std::vector<std::unique_ptr<KeyState>>> keys;
  std::map<uint64_t, std::vector<uint32_t>> credits;   // connection -> freed slots
  std::map<uint64_t, std::vector<uint32_t>> accepted;  // connection -> plain push tags taken
  // With a device: where pushes are copied to before they are reduced.
  Array<uint8_t> stage;
  uint64_t stage_bytes = 0;
  // The keys (runs) this shard still has to ship for the transfer at
  // out_round (0: none scanned yet).
  uint64_t out_round = 0;
  std::set<std::pair<Key, uint64_t>> outgoing;
  // The last LowWatermark: no request of a tensor's rounds below the
  // round it gives that tensor will come.
  protocol::LowWatermark low;
  std::thread thread;
};

struct ServerService::WorkerConn {
  transport::ConnectionPtr conn;
  bool hello = false;
  uint32_t rank = 0;
  std::shared_ptr<transport::MemoryRegion> slots;
  // With a device: the slots page-locked for its copies; unpinned before
  // the slots go (declared after them).
  PinnedRange pinned;
  uint32_t num_slots = 0;
  uint64_t slot_bytes = 0;
  std::vector<uint8_t> slot_busy;
  std::map<uint32_t, protocol::PushMeta> metas;  // tag -> metadata waiting for its write
  std::map<uint32_t, uint64_t> early;  // tag -> length of a write waiting for its metadata
  // Where each tensor's pulls land (the worker's memory and the tensor's
  // offset in it), and where this process maps that memory, if it does
  // (then push_pulls are read in place: protocol::kPushMapped).
  struct TensorTarget {
    std::shared_ptr<transport::RemoteRegion> remote;
    uint64_t offset = 0;
    const uint8_t* view = nullptr;
  };
  std::map<TensorId, TensorTarget> tensors;
};
}  // namespace psld
