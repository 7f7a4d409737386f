// The shard threads: each owns the keys that hash to it, takes the work
// queued for them, and creates a key's state (a run of ownership) on first use.
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

void ServerService::shard_loop(Shard& shard) {
  std::deque<Work> batch;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(shard.mu);
      shard.cv.wait(lock, [&] { return shard.stop || !shard.queue.empty(); });
      if (shard.stop) return;
      batch.swap(shard.queue);
    }
    for (auto& work : batch)
      process(shard, work);
    batch.clear();
    flush_credits(shard);
  }
}

void ServerService::process(Shard& shard, Work& work) {
  if (auto* push = std::get_if<PushWork>(&work)) {
    if (push->requeued) {
      process_push(shard, *push);  // its arrival was counted the first time
      return;
    }
    const uint64_t arc = arc_of(push->meta.key);
    load_->record(arc, LoadMetric::kBytesIn, static_cast<double>(push->meta.bytes));
    load_->record(arc, LoadMetric::kQueueNs, ns_since(push->arrived));
    process_push(shard, *push);
    load_->end_service();  // reduced, parked for a later round, or refused
  } else if (auto* pull = std::get_if<PullWork>(&work)) {
    if (!pull->requeued) {
      load_->record(arc_of(pull->req.key), LoadMetric::kQueueNs, ns_since(pull->arrived));
    }
    process_pull(shard, *pull);
  } else if (auto* sw = std::get_if<StateWork>(&work)) {
    const protocol::StateRequest& req = sw->req;
    if (owner_for(req.key, req.switch_round - 1) != rank()) {
      PSLD_LOG_ERROR(
          "server {}: asked for the state of key {:#x} as of round {}, which it does "
          "not own",
          rank(), req.key, req.switch_round - 1);
      return;
    }
    if (owner_for(req.key, req.switch_round) == rank()) {
      // The key stays here after all: an abort gave it back before the
      // request of the (lost) successor arrived.
      PSLD_LOG_DEBUG("server {}: a state request for key {:#x} at round {} is void", rank(),
                     req.key, req.switch_round);
      return;
    }
    KeyState& k = key_state(shard, req.key, req.dtype, req.bytes, req.switch_round - 1);
    k.successors.push_back(*sw);
    maybe_ship(shard, k);
  } else if (auto* arrived = std::get_if<StateArrived>(&work)) {
    KeyState* k = find_run(shard, arrived->key, arrived->run);
    if (k != nullptr && k->awaiting_state) install_state(shard, *k);
  } else if (auto* scan = std::get_if<TransferScan>(&work)) {
    scan_outgoing(shard, scan->switch_round);
  } else if (auto* done = std::get_if<ShipDone>(&work)) {
    if (!done->ok) return;  // logged where it failed; the key stays to ship
    {
      MutexLock lock(stats_mu_);
      ++stats_.states_out;
    }
    KeyState* k = find_run(shard, done->key, done->run);
    // The run ended at that switch, unless an abort gave the key back
    // while the write was on its way (scan_outgoing already looked then).
    if (k != nullptr && owner_for(done->key, done->switch_round) != rank()) {
      k->shipped_round = done->switch_round;
    }
    if (shard.out_round == done->switch_round && shard.outgoing.erase({done->key, done->run})) {
      note_outgoing(shard);
    }
    free_runs(shard, done->key);
  } else if (auto* offered = std::get_if<Offered>(&work)) {
    const protocol::StateOffer& o = offered->offer;
    // Only a key this server gains at that very switch: anything else is a
    // stale offer (the transfer was aborted, or the key moved on since).
    if (owner_for(o.key, o.switch_round) != rank()) return;
    const auto g = gained(o.key, o.switch_round);
    if (!g || g->first != o.switch_round) return;
    // Every worker has pushed every round below the watermark, so a run
    // that began below it was created here: missing, it was freed, and the
    // offer is stale (created again, it would ask for a state nobody ships).
    if (o.switch_round < protocol::round_of(shard.low.low, shard.low.tensors, key_tensor(o.key)) &&
        find_run(shard, o.key, o.switch_round) == nullptr) {
      return;
    }
    (void)key_state(shard, o.key, o.dtype, o.bytes, o.switch_round);  // asks for the state
  } else if (auto* release = std::get_if<Release>(&work)) {
    release_final(shard, release->switch_round);
  } else if (auto* dial = std::get_if<Dial>(&work)) {
    for (ServerId id : dial->servers)
      (void)peer(id);
  } else if (auto* mark = std::get_if<Trim>(&work)) {
    trim(shard, mark->mark);
  } else {
    const PullDone& pd = std::get<PullDone>(work);
    KeyState* found = find_run(shard, pd.key, pd.run);
    if (found == nullptr) return;
    KeyState& k = *found;
    if (k.inflight > 0) --k.inflight;
    if (k.inflight == 0) {
      if (k.apply_pending) {
        k.apply_pending = false;
        apply_round(shard, k);
      }
      while (k.inflight == 0 && !k.deferred.empty() && !k.awaiting_state && !k.awaiting_final) {
        PushWork next = std::move(k.deferred.front());
        k.deferred.pop_front();
        process_push(shard, next);
      }
      maybe_ship(shard, k);
      free_runs(shard, pd.key);  // k may be gone from here on
    }
  }
}

ServerService::KeyState& ServerService::key_state(Shard& shard, Key key, DType dtype,
                                                  uint64_t bytes, uint64_t round) {
  const auto g = gained(key, round);
  const uint64_t run = g ? g->first : 0;
  auto& runs = shard.keys[key];
  for (auto& r : runs) {
    if (r->owned_from == run) return *r;
  }
  auto it = std::upper_bound(runs.begin(), runs.end(), run,
                             [](uint64_t v, const auto& r) { return v < r->owned_from; });
  it = runs.insert(it, std::make_unique<KeyState>());
  {
    MutexLock lock(stats_mu_);
    ++stats_.runs;
  }
  KeyState& k = **it;
  k.owned_from = run;
  k.key = key;
  k.arc = arc_of(key);
  k.agg = Aggregator(AggregatorOptions{options_.sync, options_.staleness, options_.mode,
                                       options_.optimizer, session_.welcome().num_workers},
                     dtype, bytes);
  Status made = k.agg.allocate(shard.lane);
  if (!made.ok()) {
    fail_key(shard, k, made.with_context(fmt::format("allocating {} bytes", bytes)));
  } else {
    auto region = transport().register_memory(k.agg.output(), bytes, transport::MemoryKind::kHost);
    if (region.ok()) {
      k.out_region = *region;
    } else {
      PSLD_LOG_ERROR("server {}: cannot register key {:#x}: {}", rank(), key,
                     region.status().to_string());
    }
  }
  if (k.out_region && k.agg.can_swap(shard.lane)) {
    auto acc =
        transport().register_memory(k.agg.accumulator(), bytes, transport::MemoryKind::kHost);
    if (acc.ok()) {
      k.acc_region = *acc;
      k.agg.swap_on_apply();
    }  // else: apply copies, as for other keys
  }
  if (g) {
    k.awaiting_final = hold_until_final(k.owned_from);
    request_state(k, g->first, g->second);
  }
  // A run that holds round out_round - 1 of a key leaving at out_round,
  // created after this shard looked for such keys: it ships too.
  const uint64_t leaving_at = shard.out_round;
  if (leaving_at > 0 && round < leaving_at && owner_for(key, leaving_at - 1) == rank() &&
      owner_for(key, leaving_at) != rank()) {
    const auto held = gained(key, leaving_at - 1);
    if ((held ? held->first : 0) == k.owned_from) {
      shard.outgoing.insert({key, k.owned_from});
      note_outgoing(shard);
    }
  }
  return k;
}

ServerService::KeyState* ServerService::find_run(Shard& shard, Key key, uint64_t run) {
  auto it = shard.keys.find(key);
  if (it == shard.keys.end()) return nullptr;
  for (auto& r : it->second) {
    if (r->owned_from == run) return r.get();
  }
  return nullptr;
}

}  // namespace psld
