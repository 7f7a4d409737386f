// The shard threads: each owns the keys that hash to it, takes the work
// queued for them, and creates a key's state (a run of ownership) on first use.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <thread>
#include <unordered_map>
#include <variant>

#include "base/log.h"
#include "lib/server/key_state.h"

namespace psld {

using transport::ConnectionPtr;

void ServerService::shard_loop(Shard& shard) {
  std::vector<Work> batch;  // swapped with shard.queue: neither allocates once grown
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
    load_->end_service(shard.services_ended);
    shard.services_ended = 0;
    // Counted before the answers leave: whoever has an answer sees its counts.
    fold_counts(shard);
    flush_answers(shard);
    flush_credits(shard);
  }
}

void ServerService::fold_counts(Shard& shard) {
  MutexLock lock(stats_mu_);
  stats_ += shard.counted;
  shard.counted = ServerStats{};
}

void ServerService::process(Shard& shard, Work& work) {
  std::visit([&](auto& w) { handle(shard, w); }, work);
}

void ServerService::handle(Shard& shard, PushWork& w) {
  if (w.requeued) {
    process_push(shard, w);  // its arrival was counted the first time
    return;
  }
  load_->record_push(shard_arc_of(shard, w.meta.key), w.meta.bytes, ns_since(w.arrived));
  process_push(shard, w);
  // Reduced, parked for a later round, or refused: its service ends with
  // the pass (shard_loop), which works on until then.
  ++shard.services_ended;
}

void ServerService::handle(Shard& shard, PullWork& w) {
  if (!w.requeued) {
    load_->record(shard_arc_of(shard, w.req.key), LoadMetric::kQueueNs, ns_since(w.arrived));
  }
  process_pull(shard, w);
}

void ServerService::handle(Shard& shard, const PullDone& w) {
  KeyState* found = find_run(shard, w.key, w.run);
  if (found == nullptr) return;
  KeyState& k = *found;
  if (k.inflight > 0) --k.inflight;
  if (k.inflight == 0) {
    if (k.apply_pending && k.durable) {
      k.apply_pending = false;
      apply_round(shard, k);
    }
    while (k.inflight == 0 && !k.deferred.empty() && !k.awaiting_state && !k.awaiting_final) {
      PushWork next = std::move(k.deferred.front());
      k.deferred.pop_front();
      process_push(shard, next);
    }
    maybe_ship(shard, k);
    free_runs(shard, w.key);  // k may be gone from here on
  }
}

void ServerService::handle(Shard& shard, const StateWork& w) {
  const protocol::StateRequest& req = w.req;
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
    PSLD_LOG_DEBUG("server {}: a state request for key {:#x} at round {} is void", rank(), req.key,
                   req.switch_round);
    return;
  }
  KeyState& k = key_state(shard, req.key, req.dtype, req.bytes, req.switch_round - 1);
  k.successors.push_back(w);
  maybe_ship(shard, k);
}

void ServerService::handle(Shard& shard, const StateArrived& w) {
  KeyState* k = find_run(shard, w.key, w.run);
  if (k != nullptr && k->awaiting_state) install_state(shard, *k);
}

void ServerService::handle(Shard& shard, const TransferScan& w) {
  scan_outgoing(shard, w.switch_round);
}

void ServerService::handle(Shard& shard, const ShipDone& w) {
  if (!w.ok) return;  // logged where it failed; the key stays to ship
  {
    MutexLock lock(stats_mu_);
    ++stats_.states_out;
  }
  KeyState* k = find_run(shard, w.key, w.run);
  // The run ended at that switch, unless an abort gave the key back
  // while the write was on its way (scan_outgoing already looked then).
  if (k != nullptr && owner_for(w.key, w.switch_round) != rank()) {
    k->shipped_round = w.switch_round;
  }
  if (shard.out_round == w.switch_round && shard.outgoing.erase({w.key, w.run})) {
    note_outgoing(shard);
  }
  free_runs(shard, w.key);
}

void ServerService::handle(Shard& shard, const Offered& w) {
  const protocol::StateOffer& o = w.offer;
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
}

void ServerService::handle(Shard& shard, const Release& w) {
  release_final(shard, w.switch_round);
}

void ServerService::handle(Shard&, const Dial& w) {
  for (ServerId id : w.servers)
    (void)peer(id);
}

void ServerService::handle(Shard& shard, const Trim& w) {
  trim(shard, w.mark);
}

ServerService::KeyState& ServerService::key_state(Shard& shard, Key key, DType dtype,
                                                  uint64_t bytes, uint64_t round, bool from_replica,
                                                  const Gained* known) {
  const Gained g = known != nullptr ? *known : gained(key, round);
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
    auto region = transport().register_memory(k.agg.output(), bytes, MemoryKind::kHost);
    if (region.ok()) {
      k.out_region = *region;
    } else {
      PSLD_LOG_ERROR("server {}: cannot register key {:#x}: {}", rank(), key,
                     region.status().to_string());
    }
  }
  if (k.out_region && k.agg.can_swap(shard.lane)) {
    auto acc = transport().register_memory(k.agg.accumulator(), bytes, MemoryKind::kHost);
    if (acc.ok()) {
      k.acc_region = *acc;
      k.agg.swap_on_apply();
    }  // else: apply copies, as for other keys
  }
  if (g) {
    k.awaiting_final = hold_until_final(k.owned_from);
    // From a lost server by a failover (after a switch: before one, the run
    // starts at round 0 and is no gain): the copy here brings the state.
    if (!failed_over(g->second)) request_state(k, g->first, g->second);
  } else if (made.ok() && session_.welcome().resume_round > 0 && !from_replica) {
    if (Status st = restore_checkpoint(shard, k); !st.ok()) fail_key(shard, k, st);
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
