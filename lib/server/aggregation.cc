// Aggregation (DESIGN.md §4): pushes reduced into a key's accumulator, rounds
// applied (sum or optimizer) under the sync mode, and pulls served from the
// result.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <thread>
#include <unordered_map>

#include "base/log.h"
#include "lib/server/key_state.h"

namespace psld {

using protocol::DType;
using transport::ConnectionPtr;

namespace kn = psld::kernels;

void ServerService::serve_ready_pulls(Shard& shard, KeyState& k) {
  std::vector<PullWork> still;
  for (auto& p : k.waiting) {
    if (pull_ready(k, p.req)) {
      serve_pull(shard, k, p);
    } else {
      still.push_back(p);
    }
  }
  k.waiting.swap(still);
}

void ServerService::release_parked(Shard& shard, KeyState& k) {
  if (options_.sync != SyncMode::kBsp) return;
  auto next = k.parked.find(k.version + 1);
  if (next == k.parked.end()) return;
  std::vector<PushWork> ready = std::move(next->second);
  k.parked.erase(next);
  for (auto& p : ready)
    process_push(shard, p);
}

// With a device the chunk is first copied to the shard's staging buffer in
// GPU memory (pushes land in host memory), then reduced there.
Status ServerService::reduce_push(Shard& shard, KeyState& k, const PushWork& w) {
  PSLD_RETURN_IF_ERROR(k.failed);
  ServerDevice* dev = device_.get();
  const size_t lane = shard.index;
  const void* src = w.data;
  if (dev != nullptr) {
    if (shard.stage_bytes < k.bytes) {
      PSLD_RETURN_IF_ERROR(dev->synchronize(lane));  // nothing reads the old one any more
      shard.stage.reset();
      shard.stage_bytes = 0;
      PSLD_ASSIGN_OR_RETURN(shard.stage, make_array<uint8_t>(dev, k.bytes));
      shard.stage_bytes = k.bytes;
    }
    PSLD_RETURN_IF_ERROR(dev->copy(shard.stage.get(), w.data, k.bytes, lane));
    src = shard.stage.get();
  }
  const bool first = k.pushes == 0;
  float* acc = k.acc.get();
  const size_t n = k.n;
  Status st;
  switch (k.dtype) {
    case DType::kF32: {
      const auto* x = static_cast<const float*>(src);
      st = first ? copy_on(dev, lane, acc, x, k.bytes)
                 : run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
                     return kn::reduce_f32(where, acc, x, n, stream);
                   });
      break;
    }
    case DType::kF16: {
      const auto* x = static_cast<const uint16_t*>(src);
      st = run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
        return first ? kn::f16_to_f32(where, acc, x, n, stream)
                     : kn::reduce_f16(where, acc, x, n, stream);
      });
      break;
    }
    case DType::kBF16: {
      const auto* x = static_cast<const uint16_t*>(src);
      st = run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
        return first ? kn::bf16_to_f32(where, acc, x, n, stream)
                     : kn::reduce_bf16(where, acc, x, n, stream);
      });
      break;
    }
  }
  if (st.ok()) st = finish_on(dev, lane);
  PSLD_RETURN_IF_ERROR(st.with_context("reducing a push"));
  ++k.pushes;
  pace_compute(k.bytes);
  return Status::Ok();
}

Status ServerService::publish(const Shard& shard, KeyState& k) {
  ServerDevice* dev = device_.get();
  const size_t lane = shard.index;
  const float* param = k.param.get();
  uint16_t* out16 = k.out16.get();
  const size_t n = k.n;
  if (k.dtype == DType::kF16) {
    PSLD_RETURN_IF_ERROR(run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
      return kn::f32_to_f16(where, out16, param, n, stream);
    }));
  }
  if (k.dtype == DType::kBF16) {
    PSLD_RETURN_IF_ERROR(run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
      return kn::f32_to_bf16(where, out16, param, n, stream);
    }));
  }
  if (dev == nullptr) return Status::Ok();
  const void* out = k.dtype == DType::kF32 ? static_cast<const void*>(param) : out16;
  PSLD_RETURN_IF_ERROR(dev->copy(k.out_host.get(), out, k.bytes, lane));
  return dev->synchronize(lane);
}

void ServerService::fail_key(Shard& shard, KeyState& k, const Status& why) {
  if (k.failed.ok()) {
    k.failed = why.with_context(fmt::format("server {}, key {:#x} ({})", rank(), k.key,
                                            device_ ? device_->describe() : "host memory"));
    PSLD_LOG_ERROR("{}; every request for this key fails from now on", k.failed.to_string());
  }
  for (const PullWork& p : k.waiting)
    send_error(p.conn, p.req.tag, k.failed);
  k.waiting.clear();
  auto refuse = [&](const PushWork& w) {
    free_slot(shard, w.conn, w.meta.slot);
    send_error(w.conn, w.meta.tag, k.failed);
  };
  for (const auto& [round, pushes] : k.parked) {
    for (const PushWork& w : pushes)
      refuse(w);
  }
  k.parked.clear();
  for (const PushWork& w : k.deferred)
    refuse(w);
  k.deferred.clear();
  k.apply_pending = false;
}

void ServerService::process_push(Shard& shard, PushWork& w) {
  const protocol::PushMeta& meta = w.meta;
  const uint64_t round = (meta.flags & protocol::kPushInit) ? 0 : meta.round;
  if (owner_for(meta.key, round) != rank()) {
    if (wait_for_epoch(meta.epoch, meta.key, w)) return;  // keeps its slot meanwhile
    free_slot(shard, w.conn, meta.slot);
    send_moved(w.conn, meta.tag, meta.key);
    return;
  }
  KeyState& k = key_state(shard, meta.key, meta.dtype, meta.bytes, round);
  if (k.dtype != meta.dtype || k.bytes != meta.bytes) {
    free_slot(shard, w.conn, meta.slot);
    send_error(w.conn, meta.tag,
               InvalidArgument(fmt::format("key {:#x} holds {} bytes of {}, the push has {} of {}",
                                           meta.key, k.bytes, protocol::dtype_name(k.dtype),
                                           meta.bytes, protocol::dtype_name(meta.dtype))));
    return;
  }
  if (!k.failed.ok()) {
    free_slot(shard, w.conn, meta.slot);
    send_error(w.conn, meta.tag, k.failed);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.pushes;
  }
  const bool then_pull = (meta.flags & protocol::kPushThenPull) != 0;
  if (k.awaiting_final) {
    // Held, not taken: if this server dies before the transfer is final,
    // the worker still has the push to send to the old owner again.
    if (options_.sync == SyncMode::kBsp) {
      k.parked[meta.round].push_back(w);
    } else {
      k.deferred.push_back(w);
    }
    return;
  }
  // A plain push completes at the worker once taken here (reduced or kept).
  if (!then_pull && !w.taken) {
    shard.accepted[w.conn].push_back(meta.tag);
    w.taken = true;
  }
  if (k.awaiting_state) {
    // Gained by migration: everything waits for the state (and a push_pull's
    // pull is queued when its push is processed again).
    if (options_.sync == SyncMode::kBsp) {
      k.parked[meta.round].push_back(w);
    } else {
      k.deferred.push_back(w);
    }
    return;
  }
  PullWork follow{w.conn, protocol::PullRequest{meta.pull_tag, meta.dtype, meta.bytes, meta.key,
                                                meta.round, meta.epoch}};

  if (meta.flags & protocol::kPushInit) {
    // The initial value, round 0: written into the parameter as is.
    k.pushes = 0;
    Status st = reduce_push(shard, k, w);
    if (st.ok()) {
      st = copy_on(device_.get(), shard.index, k.param.get(), k.acc.get(), k.n * sizeof(float));
    }
    if (st.ok()) st = publish(shard, k);
    k.pushes = 0;
    free_slot(shard, w.conn, meta.slot);
    if (!st.ok()) {
      fail_key(shard, k, st.with_context("the initial value"));
      send_error(w.conn, meta.tag, k.failed);
      return;
    }
    if (then_pull) {
      follow.req.round = 0;
      serve_pull(shard, k, follow);
    }
    return;
  }

  if (options_.sync == SyncMode::kBsp) {
    if (meta.round <= k.version) {
      free_slot(shard, w.conn, meta.slot);
      send_error(w.conn, meta.tag,
                 FailedPrecondition(fmt::format("round {} of key {:#x} was already applied",
                                                meta.round, meta.key)));
      return;
    }
    if (meta.round > k.version + 1 || k.apply_pending) {
      // A later round (or this one while its predecessor waits to apply):
      // keep the slot until the key gets there.
      k.parked[meta.round].push_back(w);
      return;
    }
    if (k.pushed[w.worker]) {
      free_slot(shard, w.conn, meta.slot);
      send_error(w.conn, meta.tag,
                 FailedPrecondition(fmt::format("worker {} pushed round {} of key {:#x} twice",
                                                w.worker, meta.round, meta.key)));
      return;
    }
    const auto start = transport::Clock::now();
    Status st = reduce_push(shard, k, w);
    load_->record(k.arc, LoadMetric::kBusyNs, ns_since(start));
    free_slot(shard, w.conn, meta.slot);
    if (!st.ok()) {
      fail_key(shard, k, st);
      send_error(w.conn, meta.tag, k.failed);
      return;
    }
    k.pushed[w.worker] = true;
    if (then_pull) k.waiting.push_back(follow);
    if (k.pushes == k.pushed.size()) try_apply(shard, k);
    return;
  }

  // Async and bounded staleness: every push is applied on arrival, once no
  // pull write is reading the parameter.
  if (k.inflight > 0) {
    k.deferred.push_back(w);
    return;
  }
  k.pushes = 0;
  const auto start = transport::Clock::now();
  Status st = reduce_push(shard, k, w);
  load_->record(k.arc, LoadMetric::kBusyNs, ns_since(start));
  free_slot(shard, w.conn, meta.slot);
  if (!st.ok()) {
    fail_key(shard, k, st);
    send_error(w.conn, meta.tag, k.failed);
    return;
  }
  k.last_round[w.worker] = std::max(k.last_round[w.worker], meta.round);
  ++k.applied[w.worker];
  if (then_pull) k.waiting.push_back(follow);
  apply_round(shard, k);
}

void ServerService::try_apply(Shard& shard, KeyState& k) {
  if (k.inflight > 0) {
    k.apply_pending = true;  // pull writes of the last round still read param
    return;
  }
  apply_round(shard, k);
}

// Turns the accumulator into the new parameter value, then serves what waited.
void ServerService::apply_round(Shard& shard, KeyState& k) {
  const auto start = transport::Clock::now();
  const bool sum_mode = options_.mode == ServerMode::kSum;
  const bool bsp = options_.sync == SyncMode::kBsp;
  ServerDevice* dev = device_.get();
  const size_t lane = shard.index;
  float* param = k.param.get();
  const float* acc = k.acc.get();
  const size_t n = k.n;
  Status st = k.failed;
  if (!st.ok()) {
    // Nothing to apply: fail_key answered what waited.
  } else if (sum_mode) {
    if (bsp) {
      // The round's sum. No pull write reads param now (apply waits for
      // them), and the next round's first push overwrites acc whole.
      if (k.acc_region) {
        std::swap(k.param, k.acc);
        std::swap(k.out_region, k.acc_region);
      } else {
        st = copy_on(dev, lane, param, acc, n * sizeof(float));
      }
    } else {
      st = run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
        return kn::reduce_f32(where, param, acc, n, stream);  // the running total
      });
    }
  } else {
    const OptimizerOptions& o = options_.optimizer;
    switch (o.kind) {
      case OptimizerKind::kSgd: {
        const kn::SgdParams p{o.lr, o.weight_decay};
        st = run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
          return kn::sgd_f32(where, param, acc, n, p, stream);
        });
        break;
      }
      case OptimizerKind::kMomentum: {
        st = ensure_array(dev, k.m, n);
        if (!st.ok()) break;
        float* m = k.m.get();
        const kn::MomentumParams p{o.lr,           o.momentum, o.dampening,
                                   o.weight_decay, o.nesterov, k.version == 0};
        st = run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
          return kn::momentum_f32(where, param, m, acc, n, p, stream);
        });
        break;
      }
      case OptimizerKind::kAdam:
      case OptimizerKind::kAdamW: {
        st = ensure_array(dev, k.m, n);
        if (st.ok()) st = ensure_array(dev, k.v, n);
        if (!st.ok()) break;
        float* m = k.m.get();
        float* v = k.v.get();
        const kn::AdamParams p{o.lr,         o.beta1,        o.beta2,
                               o.eps,        o.weight_decay, o.kind == OptimizerKind::kAdamW,
                               k.version + 1};
        st = run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
          return kn::adam_f32(where, param, m, v, acc, n, p, stream);
        });
        break;
      }
    }
  }
  if (st.ok()) st = publish(shard, k);
  if (!st.ok()) {
    fail_key(shard, k, st.with_context(fmt::format("applying round {}", k.version + 1)));
    return;
  }
  ++k.version;
  k.pushes = 0;
  std::fill(k.pushed.begin(), k.pushed.end(), false);
  load_->record(k.arc, LoadMetric::kBusyNs, ns_since(start));
  load_->record(k.arc, LoadMetric::kRound, 1);
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.rounds_applied;
  }
  // Serve the pulls this round satisfies.
  serve_ready_pulls(shard, k);
  maybe_ship(shard, k);
  // BSP: pushes parked for the next round can be reduced now.
  if (bsp) release_parked(shard, k);
}

bool ServerService::pull_ready(const KeyState& k, const protocol::PullRequest& req) const {
  switch (options_.sync) {
    case SyncMode::kBsp:
      return k.version >= req.round;
    case SyncMode::kAsync:
      return true;
    case SyncMode::kStaleness: {
      // Every worker's pushes up to round - staleness must be in.
      const uint64_t slowest = *std::min_element(k.last_round.begin(), k.last_round.end());
      return slowest + options_.staleness >= req.round;
    }
  }
  return true;
}

void ServerService::process_pull(Shard& shard, PullWork& w) {
  if (owner_for(w.req.key, w.req.round) != rank()) {
    if (wait_for_epoch(w.req.epoch, w.req.key, w)) return;
    send_moved(w.conn, w.req.tag, w.req.key);
    return;
  }
  KeyState& k = key_state(shard, w.req.key, w.req.dtype, w.req.bytes, w.req.round);
  if (k.dtype != w.req.dtype || k.bytes != w.req.bytes) {
    send_error(w.conn, w.req.tag,
               InvalidArgument(fmt::format("key {:#x} holds {} bytes of {}, the pull asks {} of {}",
                                           w.req.key, k.bytes, protocol::dtype_name(k.dtype),
                                           w.req.bytes, protocol::dtype_name(w.req.dtype))));
    return;
  }
  if (!k.failed.ok()) {
    send_error(w.conn, w.req.tag, k.failed);
    return;
  }
  if (!k.awaiting_state && !k.awaiting_final && pull_ready(k, w.req)) {
    serve_pull(shard, k, w);
  } else {
    k.waiting.push_back(w);
  }
}

void ServerService::serve_pull(Shard& shard, KeyState& k, const PullWork& w) {
  (void)shard;
  std::shared_ptr<transport::RemoteRegion> remote;
  uint64_t base = 0;  // of the tensor in `remote`
  ConnectionPtr conn;
  {
    std::lock_guard<std::mutex> lock(conns_mu_);
    auto it = conns_.find(w.conn);
    if (it == conns_.end()) return;  // the worker is gone
    conn = it->second->conn;
    auto t = it->second->tensors.find(key_tensor(w.req.key));
    if (t != it->second->tensors.end()) {
      remote = t->second.remote;
      base = t->second.offset;
    }
  }
  if (!remote) {
    send_error(w.conn, w.req.tag,
               FailedPrecondition(fmt::format("no TensorKey for tensor {} from this worker",
                                              key_tensor(w.req.key))));
    return;
  }
  if (!k.out_region) {
    send_error(w.conn, w.req.tag, Internal("the key's memory could not be registered"));
    return;
  }
  const uint64_t offset =
      base + static_cast<uint64_t>(key_chunk(w.req.key)) * session_.welcome().chunk_bytes;
  ++k.inflight;
  const Key key = w.req.key;
  const uint64_t run = k.owned_from;
  load_->begin_service();  // until the write completed
  Status s = conn->write({k.out_region.get(), 0, remote.get(), offset, k.bytes, w.req.tag},
                         [this, key, run](Status) {
                           load_->end_service();
                           dispatch(key, PullDone{key, run});
                         });
  if (!s.ok()) {
    --k.inflight;
    load_->end_service();
    send_error(w.conn, w.req.tag, s.with_context("pull write"));
    return;
  }
  load_->record(k.arc, LoadMetric::kBytesOut, static_cast<double>(k.bytes));
  std::lock_guard<std::mutex> lock(stats_mu_);
  ++stats_.pulls;
  stats_.bytes_out += k.bytes;
}

}  // namespace psld
