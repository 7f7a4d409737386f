// The arithmetic of one key on a server (docs/design.md §4): its parameter,
// accumulator and optimizer state, the reduce of each push, the update of a
// round (sum or optimizer), and the rules of the sync mode (which push may be
// reduced now, which pull may be answered).
//
// Pure, like Placement and Balancer: no transport, no locks, no clock. The
// shard thread that owns the key calls it; the service around it pairs
// messages with writes, parks what must wait and answers the workers. Its
// memory lives where the shard's ComputeLane says: host memory and the CPU
// kernels, or one lane of the server's device (server.device = cuda; in the
// tests a fake GPU, tests/fake_gpu.h).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/dispatch.h"
#include "lib/protocol/protocol.h"
#include "lib/server/server_device.h"
#include "psld/config.h"
#include "psld/status.h"

namespace psld {

// A key's array: host memory (new[]), or the server's device memory when it
// has a device.
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

// Pinned host memory of the device (a key's output, which pulls are written from).
struct HostFree {
  ServerDevice* device = nullptr;
  void operator()(uint8_t* p) const { device->free_host(p); }
};
using HostBuffer = std::unique_ptr<uint8_t, HostFree>;

// Where a shard's keys live and its kernels run: host memory, where every
// operation runs at once, or one lane (a stream) of the server's device,
// where operations queue and finish() waits for them. Holds the shard's
// staging buffer, into which a device lane copies pushes (they land in host
// memory) before reducing them.
class ComputeLane {
 public:
  ComputeLane() = default;  // host memory, the CPU kernels
  ComputeLane(ServerDevice* device, size_t lane) : device_(device), lane_(lane) {}

  ServerDevice* device() const { return device_; }
  // n zeroed elements.
  template <typename T>
  Result<Array<T>> make_array(size_t n) const {
    if (device_ == nullptr) return Array<T>(new T[n](), ArrayFree<T>{});
    PSLD_ASSIGN_OR_RETURN(void* p, device_->allocate(std::max<size_t>(n, 1) * sizeof(T)));
    return Array<T>(static_cast<T*>(p), ArrayFree<T>{device_});
  }
  // Allocates `a` (zeroed) unless it is already.
  Status ensure(Array<float>& a, size_t n) const;
  Status copy(void* dst, const void* src, size_t bytes) const;
  // fn(where, stream) calls one kernel of kernels/dispatch.h; on the host it
  // runs at once, with no std::function in between.
  template <typename Fn>
  Status run(const Fn& fn) const {
    if (device_ != nullptr) return device_->launch(lane_, ServerDevice::Launch(fn));
    return fn(MemoryKind::kHost, nullptr);
  }
  // Waits for what was queued (nothing to wait for on the host).
  Status finish() const { return device_ != nullptr ? device_->synchronize(lane_) : Status::Ok(); }
  // `bytes` of host memory where the kernels can read them: the memory itself
  // on the host; on a device, a copy in the staging buffer, queued.
  Result<const void*> stage(const void* host, size_t bytes);

 private:
  ServerDevice* device_ = nullptr;
  size_t lane_ = 0;
  Array<uint8_t> stage_;
  size_t stage_bytes_ = 0;
};

// The server's optimizer (server.mode = optimizer; config optimizer.*).
struct OptimizerOptions {
  // The defaults are Config's (include/psld/config.h), in one place.
  OptimizerKind kind = OptimizerConfig{}.kind;
  float lr = static_cast<float>(OptimizerConfig{}.lr);
  float momentum = static_cast<float>(OptimizerConfig{}.momentum);
  float dampening = static_cast<float>(OptimizerConfig{}.dampening);
  bool nesterov = OptimizerConfig{}.nesterov;
  float beta1 = static_cast<float>(OptimizerConfig{}.beta1);
  float beta2 = static_cast<float>(OptimizerConfig{}.beta2);
  float eps = static_cast<float>(OptimizerConfig{}.eps);
  float weight_decay = static_cast<float>(OptimizerConfig{}.weight_decay);
};

struct AggregatorOptions {
  SyncMode sync = SyncMode::kBsp;
  uint32_t staleness = 0;
  ServerMode mode = ServerMode::kSum;
  OptimizerOptions optimizer;
  uint32_t num_workers = 1;
};

class Aggregator {
 public:
  // What a BSP push of a round may do now.
  enum class Admission {
    kNow,      // reduce it: it is of the round being summed, and new from its worker
    kLater,    // of a later round: keep it until the key gets there
    kApplied,  // its round was applied already
    kTwice,    // its worker pushed this round already
  };

  Aggregator() = default;  // holds no key until allocate()
  Aggregator(const AggregatorOptions& options, DType dtype, uint64_t bytes);

  // The zeroed parameter and accumulator (and output), in the lane's memory:
  // a key pulled before any push reads zeros. Their addresses never change
  // after this, but for the swap (swap_on_apply).
  Status allocate(const ComputeLane& lane);

  // BSP: whether `worker`'s push of `round` can be reduced now.
  Admission admit(uint32_t worker, uint64_t round) const;
  // Reduces `worker`'s push of `round` (host memory, the key's dtype) into
  // the accumulator and waits for it: the memory may be reused after. BSP:
  // admitted with kNow first; the round's first push is copied. Async and
  // staleness: every push is one update (apply() follows).
  // `lr` is the push's learning rate (0: options' optimizer.lr); the update
  // of a BSP round uses the one of the lowest worker that pushed it, so that
  // workers that disagree still get one deterministic answer.
  Status reduce(ComputeLane& lane, uint32_t worker, uint64_t round, const void* src, double lr = 0);
  // BSP: every worker's push of round version() + 1 is in.
  bool round_complete() const { return pushes_ == pushed_.size(); }
  // The initial value (round 0), written into the parameter as it is.
  Status set_initial(ComputeLane& lane, const void* src);
  // Turns the accumulator into the new parameter (BSP: the round's sum or
  // the optimizer step; async: added to the running total, or one step) and
  // brings the output up to date. On success version() grows by one.
  Status apply(ComputeLane& lane);

  // Whether a pull of `round` may be answered now.
  bool pull_ready(uint64_t round) const;

  // Async and staleness: whether `worker`'s push of `round` is in the
  // parameter already (a push sent again after a failover is taken once).
  // Exact for the 64 rounds after the newest round below which every one of
  // the worker's pushes is in; those further ahead move that window on,
  // counting the rounds it leaves behind as in (a worker's pushes in flight
  // are far fewer: its credits).
  bool applied(uint32_t worker, uint64_t round) const;
  // Replication copies in async and staleness modes carry those windows:
  // seen_bytes() bytes (0 in BSP, where the round says it all), written by
  // save_seen() and read back by restore_seen() with the copied state (both
  // touch nothing in BSP).
  size_t seen_bytes() const { return seen_bytes(options_.sync, seen_.size()); }
  // The same for a key of a job of `workers` workers in mode `sync` (a
  // backup sizes a copy's slots by it).
  static size_t seen_bytes(SyncMode sync, size_t workers) {
    return sync == SyncMode::kBsp ? 0 : workers * 2 * sizeof(uint64_t);
  }
  void save_seen(uint8_t* out) const;
  void restore_seen(const uint8_t* in);
  // Whether every round of this run (from `run_start`, its first round)
  // before `switch_round` is applied: its state can then be shipped.
  bool applied_before(uint64_t switch_round, uint64_t run_start) const;

  // Migration: the parameter and the two moments (zeros where the optimizer
  // keeps none), size() floats each, into host memory, waited for. With
  // `arrays` below 3 only the first `arrays` of them (replication copies
  // state_arrays(): in sum mode the parameter alone, not 2 arrays of zeros).
  Status save(ComputeLane& lane, float* out, size_t arrays = 3) const;
  // The state save() wrote, with the version it had; every worker pushed up
  // to `last_round`. Waits for the copies out of `in`.
  Status restore(ComputeLane& lane, const float* in, uint64_t version, uint64_t last_round);

  // The arrays of the state restore() reads: the parameter, and the
  // moments the optimizer keeps (1 to 3); save() writes all three.
  size_t state_arrays() const {
    const OptimizerKind kind = options_.optimizer.kind;
    const bool optimizer = options_.mode == ServerMode::kOptimizer;
    const bool with_m =
        optimizer && (kind != OptimizerKind::kSgd || options_.optimizer.momentum > 0);
    const bool with_v =
        optimizer && (kind == OptimizerKind::kAdam || kind == OptimizerKind::kAdamW);
    return 1 + (with_m ? 1 : 0) + (with_v ? 1 : 0);
  }

  DType dtype() const { return dtype_; }
  uint64_t bytes() const { return bytes_; }  // in the workers' dtype
  size_t size() const { return elements_; }  // elements
  // Rounds (BSP) or pushes (async) applied.
  uint64_t version() const { return version_; }
  // The host memory pulls are written from (the parameter, its fp16/bf16
  // conversion, or with a device its pinned copy).
  void* output() const;
  // BSP sum mode, fp32, host memory: the accumulator, for the service to
  // register as well; after swap_on_apply() a round is applied by swapping
  // parameter and accumulator (output() then changes) instead of copying.
  float* accumulator() const { return acc_.get(); }
  void swap_on_apply() { swap_ = true; }
  bool swaps() const { return swap_; }
  bool can_swap(const ComputeLane& lane) const {
    return dtype_ == DType::kFloat32 && options_.mode == ServerMode::kSum &&
           options_.sync == SyncMode::kBsp && lane.device() == nullptr;
  }

 private:
  // The first push of a round is copied (converted) into the accumulator,
  // the others added.
  Status accumulate(ComputeLane& lane, const void* src);
  // fp16/bf16 conversion of the parameter; with a device, the copy to host.
  Status publish(ComputeLane& lane);

  AggregatorOptions options_;
  DType dtype_ = DType::kFloat32;
  uint64_t bytes_ = 0;
  size_t elements_ = 0;
  Array<float> param_;
  Array<float> acc_;
  // Optimizer state, allocated on first use: the momentum buffer or Adam's m,
  // and Adam's v.
  Array<float> first_moment_, second_moment_;
  Array<uint16_t> out16_;  // fp16/bf16 keys: the parameter converted
  HostBuffer out_host_;    // with a device: the output, copied from the device
  bool swap_ = false;
  uint64_t version_ = 0;
  uint32_t pushes_ = 0;               // BSP: pushes reduced for round version_ + 1
  double round_lr_ = 0;               // the next update's learning rate; 0: options'
  uint32_t round_lr_worker_ = 0;      // BSP: the worker whose push set round_lr_
  std::vector<bool> pushed_;          // BSP: per worker, for round version_ + 1
  std::vector<uint64_t> last_round_;  // per worker: newest round pushed (staleness)
  std::vector<uint64_t> applied_;     // per worker: async pushes applied in this run
  // Async and staleness, per worker: every round <= low is in, and round
  // low + 1 + i is where bit i of `ahead` is set (applied()).
  struct Seen {
    uint64_t low = 0;
    uint64_t ahead = 0;
  };
  std::vector<Seen> seen_;
  void mark_seen(uint32_t worker, uint64_t round);
};

}  // namespace psld
