// Epoch switches (docs/design.md §7; docs/migration.md), the coordinator's side:
// a proposed delta prepared, voted on and committed at a switch round, the
// transfer of the moved state, the low watermark that frees old runs, and
// the abort when a server is lost mid-switch.
#include <fmt/format.h>

#include <algorithm>
#include <random>

#include "base/log.h"
#include "lib/coordinator/service.h"
#include "lib/placement/epoch_log.h"

namespace psld {

using transport::Clock;
using transport::ConnectionPtr;

Status CoordinatorService::propose(const PlacementDelta& delta) {
  Status st = start_switch(delta);
  flush();
  return st;
}

Placement CoordinatorService::current_placement() const {
  MutexLock lock(mu_);
  return *placement_;
}

Status CoordinatorService::start_switch(const PlacementDelta& delta) {
  MutexLock lock(mu_);
  return start_switch_locked(delta);
}

// mu_ held. The one way an epoch switch starts (propose() and the balancer).
Status CoordinatorService::start_switch_locked(const PlacementDelta& delta) {
  if (!job_started_ || job_over_) return FailedPrecondition("the job is not running");
  if (options_.replication_factor > 1 && options_.sync != SyncMode::kBsp) {
    return FailedPrecondition(
        "replicated ranges move in BSP mode only; this job is async or bounded-staleness "
        "(docs/replication.md)");
  }
  if (switch_) return FailedPrecondition("an epoch switch is in flight");
  if (Status st = replication_allows_switch(); !st.ok()) return st;
  if (transfer_) {
    return FailedPrecondition(
        fmt::format("the transfer of epoch {} is not final yet", placement_->epoch()));
  }
  if (delta.from_epoch != placement_->epoch()) {
    return FailedPrecondition(fmt::format("the delta starts from epoch {}, the job is at {}",
                                          delta.from_epoch, placement_->epoch()));
  }
  auto next = placement_->apply(delta);
  if (!next.ok()) return next.status().with_context("the proposed epoch");
  // Two rounds ahead of the furthest round seen: the prepare, the votes and
  // the commit take milliseconds, and a switch too early for a server is
  // voted down and prepared again with the margin doubled. (It was 4: at
  // 170 ms rounds, two more rounds at a straggler's pace before every step.
  // The state of moved keys ships only after the round before the switch,
  // whatever the margin.)
  Switch sw{delta, delta.serialize(), std::move(next).value(), 0, kSwitchMarginRounds, {}};
  if (sw.delta_bytes.size() > protocol::kMaxDeltaBytes) {
    return InvalidArgument(fmt::format("a delta of {} bytes does not fit one message ({})",
                                       sw.delta_bytes.size(), protocol::kMaxDeltaBytes));
  }
  switch_ = std::move(sw);
  send_prepare();
  return Status::Ok();
}

// mu_ held.
void CoordinatorService::send_prepare() {
  Switch& sw = *switch_;
  // Ahead of every round seen, and after the previous switch (an epoch must
  // serve at least one round for the next one to take its keys from it).
  sw.switch_round = std::max(max_round_ + sw.margin, last_switch_round_ + 1);
  sw.yes.clear();
  post_all(servers_, protocol::EpochChange{protocol::EpochStep::kPrepare, sw.next.epoch(),
                                           sw.switch_round, sw.delta_bytes, 0});
}

void CoordinatorService::handle_vote(const Member& m, const protocol::EpochVote& vote) {
  if (m.role != Role::kServer || !switch_) return;
  Switch& sw = *switch_;
  if (vote.epoch != sw.next.epoch() || vote.switch_round != sw.switch_round) return;  // stale
  max_round_ = std::max(max_round_, vote.max_round);
  if (!vote.yes) {
    // A server already saw a round past the switch: switch later.
    sw.margin = std::min<uint64_t>(sw.margin * 2, 1 << 20);
    PSLD_LOG_DEBUG("coordinator: server {} saw round {} >= {}; epoch {} retried later", m.rank,
                   vote.max_round, sw.switch_round, sw.next.epoch());
    send_prepare();
    return;
  }
  sw.yes.insert(m.rank);
  maybe_commit();
}

// mu_ held.
void CoordinatorService::maybe_commit() {
  if (!switch_) return;
  for (const auto& [rank, id] : servers_) {
    if (!switch_->yes.count(rank)) return;
  }
  commit_switch();
}

// mu_ held. Everyone agreed: commit, servers first.
void CoordinatorService::commit_switch() {
  Switch& sw = *switch_;
  const protocol::EpochChange commit{protocol::EpochStep::kCommit, sw.next.epoch(), sw.switch_round,
                                     sw.delta_bytes, 0};
  post_all(servers_, commit);
  post_all(workers_, commit);
  PSLD_LOG_INFO("coordinator: epoch {} from round {} ({} ranges move)", sw.next.epoch(),
                sw.switch_round, sw.delta.assignments.size());
  Placement before = std::move(*placement_);
  placement_ = std::move(sw.next);
  const uint64_t moved = moved_bytes(before, *placement_);
  migrated_bytes_ += moved;
  if (trace_ && trace_->wants(sw.switch_round)) {
    trace_->instant("epoch commit", "epoch", transport::Clock::now(),
                    fmt::format(R"("epoch":{},"switch_round":{},"moved_bytes":{})",
                                placement_->epoch(), sw.switch_round, moved));
  }
  last_switch_round_ = sw.switch_round;
  if (options_.replication_factor > 1) {
    // Open until every worker finished the switch round (close_replicated_
    // switch). A member whose backup changed (a server joined or left the
    // ring) copies its keys to the new one and says so (ReplicaSynced).
    replicated_switch_round_ = sw.switch_round;
    for (const ServerInfo& s : placement_->servers()) {
      if (backup_of(before, s.id) != backup_of(*placement_, s.id)) {
        unsynced_.insert_or_assign(s.id,
                                   fmt::format("epoch {} changed its backup", placement_->epoch()));
      }
    }
  }
  switch_.reset();
  ++switches_;
  begin_transfer(std::move(before));
  // Servers lost while this switch was voted on held nothing then: what it
  // gave them goes back now.
  for (uint32_t rank : std::exchange(pending_losses_, {}))
    publish_abort(rank);
  cv_.notify_all();
}

// mu_ held. A transfer is tracked (and blocks the next switch until final)
// only when a server that never owned anything gains keys in it: only such a
// server can die without losing state, and only its transfer can be
// aborted. Other switches end as they always did, in the background.
void CoordinatorService::begin_transfer(Placement before) {
  bool abortable = false;
  for (uint32_t s : placement_->owners())
    abortable = abortable || !ever_owned_.count(s);
  if (!abortable) {
    ever_owned_.merge(placement_->owners());
    return;
  }
  Transfer t{last_switch_round_, std::move(before), {}, {}};
  for_each_overlap(t.before, *placement_, [&](uint64_t, uint64_t, ServerId was, ServerId now) {
    if (was != now) t.waiting.insert(was);
  });
  transfer_.emplace(std::move(t));
  finish_transfer_if_done();
}

// mu_ held.
void CoordinatorService::finish_transfer_if_done() {
  if (!transfer_ || !transfer_->waiting.empty()) return;
  // From now on the new owners hold state like any other owner.
  ever_owned_.merge(placement_->owners());
  const protocol::EpochFinal final{placement_->epoch(), transfer_->switch_round};
  post_all(servers_, final);
  PSLD_LOG_DEBUG("coordinator: the transfer of epoch {} at round {} is final", final.epoch,
                 final.switch_round);
  transfer_.reset();
  cv_.notify_all();
}

void CoordinatorService::handle_transfer_done(const Member& m, const protocol::TransferDone& done) {
  if (m.role != Role::kServer || !transfer_) return;
  // By switch round, not epoch: an abort changes the epoch of the same
  // transfer, and what a server shipped for the first still counts.
  if (done.switch_round != transfer_->switch_round) return;
  if (done.late_keys > 0) {
    PSLD_LOG_WARN(
        "coordinator: server {} reports the transfer at round {} done with {} keys that have not "
        "reached the switch; they move when they do",
        m.rank, done.switch_round, done.late_keys);
  }
  transfer_->reported.insert(m.rank);
  transfer_->waiting.erase(m.rank);
  finish_transfer_if_done();
}

// mu_ held. Per tensor, the lowest round any worker may still send a request
// for: a run of ownership of its keys that ended at or below it and shipped
// is needed by nobody. Capped below a switch being voted on and a transfer
// that can still be aborted: either may yet give a key back to the run it
// ends (docs/migration.md, "Freeing old runs").
std::optional<std::vector<uint64_t>> CoordinatorService::lowest_rounds() const {
  // Tensor ids are 1..tensors_.size(), assigned in registration order.
  const auto tensors = static_cast<uint32_t>(tensors_.size());
  std::vector<uint64_t> low(tensors, UINT64_MAX);
  for (uint32_t w = 0; w < options_.num_workers; ++w) {
    if (finished_workers_.count(w)) continue;  // it sends nothing any more
    auto it = progress_.find(w);
    if (it == progress_.end()) return std::nullopt;  // it promised nothing yet
    for (TensorId t = 1; t <= tensors; ++t)
      low[t - 1] = std::min(low[t - 1], protocol::round_of(it->second.low, it->second.tensors, t));
  }
  return low;
}

void CoordinatorService::publish_watermark() {
  const auto tensors = static_cast<uint32_t>(tensors_.size());
  if (!job_started_ || job_over_ || tensors == 0) return;
  std::optional<std::vector<uint64_t>> lowest = lowest_rounds();
  if (!lowest) return;
  std::vector<uint64_t>& low = *lowest;
  uint64_t cap = UINT64_MAX;
  if (switch_) cap = std::min(cap, switch_->switch_round - 1);
  if (transfer_) cap = std::min(cap, transfer_->switch_round - 1);
  for (uint64_t& r : low) {
    r = std::min(r, cap);
    if (r == UINT64_MAX) return;  // every worker is done
  }
  protocol::LowWatermark mark{tensors, protocol::pack_rounds(low)};
  if (watermark_ && watermark_->tensors == mark.tensors &&
      watermark_->low.size() == mark.low.size() &&
      std::equal(mark.low.begin(), mark.low.end(), watermark_->low.begin(),
                 [](const auto& a, const auto& b) {
                   return a.first_tensor == b.first_tensor && a.round == b.round;
                 })) {
    return;
  }
  watermark_ = std::move(mark);
  post_all(servers_, *watermark_);
}

// mu_ held. A server that never owned an arc outside an open transfer holds
// no state: nothing it gained was applied, answered or accepted before
// EpochFinal (protocol.h), so it can go without losing anything. Any other
// server may hold parameters nobody else has (also one that owns nothing
// now: it may still be shipping what it owned).
void CoordinatorService::server_lost(const Member& m, const std::string& what) {
  if (!job_started_) return fail_job(what);
  if (options_.replication_factor > 1 && placement_->find_server(m.rank) != nullptr) {
    return fail_over(m, what);
  }
  if (ever_owned_.count(m.rank)) {
    const size_t arcs = placement_->arcs_of(m.rank).size();
    return fail_job(fmt::format(
        "{}; it held parameters ({}) that exist nowhere else, so the job cannot go on", what,
        arcs > 0 ? fmt::format("{} ranges of epoch {}", arcs, placement_->epoch())
                 : std::string("ranges it owned before, maybe not all shipped")));
  }
  lost_servers_.insert(m.rank);
  seal_lost_server(m.rank);
  PSLD_LOG_WARN(
      "coordinator: {}; it held nothing but keys in transfer, so the job goes on without it", what);
  if (switch_) {
    // No vote is awaited from it; once the others agreed, the switch
    // commits and what it gave this server goes back.
    switch_->yes.erase(m.rank);
    pending_losses_.insert(m.rank);
    maybe_commit();
    return;
  }
  publish_abort(m.rank);
  cv_.notify_all();
}

// mu_ held.
void CoordinatorService::publish_abort(uint32_t rank) {
  const Placement& now = *placement_;
  if (now.find_server(rank) == nullptr) return;  // an idle standby: nothing to take back
  const Placement& before = transfer_ ? transfer_->before : now;
  PlacementDelta delta;
  delta.from_epoch = now.epoch();
  delta.to_epoch = now.epoch() + 1;
  delta.membership.push_back(MembershipChange::remove(rank));
  for_each_overlap(before, now, [&](uint64_t lo, uint64_t hi, ServerId was, ServerId owner) {
    if (owner != rank) return;
    auto& as = delta.assignments;
    if (!as.empty() && as.back().owner == was && as.back().hi + 1 == lo) {
      as.back().hi = hi;  // one range where neighbours go back to the same server
    } else {
      as.push_back({lo, hi, was});
    }
  });
  auto next = now.apply(delta);
  std::vector<uint8_t> bytes = delta.serialize();
  if (!next.ok() || bytes.size() > protocol::kMaxDeltaBytes) {
    return fail_job(fmt::format(
        "server {} was lost during a transfer, and giving its ranges back failed: {}", rank,
        next.ok() ? fmt::format("the delta has {} bytes, more than one message holds", bytes.size())
                  : next.status().to_string()));
  }
  const uint64_t round = transfer_ ? transfer_->switch_round : last_switch_round_;
  const protocol::EpochChange abort{protocol::EpochStep::kAbort, next->epoch(), round, bytes, rank};
  post_all(servers_, abort);
  post_all(workers_, abort);
  PSLD_LOG_INFO(
      "coordinator: epoch {} from round {}: server {} removed, {} ranges back to their "
      "owners",
      next->epoch(), round, rank, delta.assignments.size());
  placement_ = std::move(next).value();
  ++aborts_;
  if (transfer_) {
    // The rest of the transfer goes on; old owners that lost only to the
    // lost server have nothing left to ship.
    // The lambda runs inside for_each_overlap, where the analysis does not
    // see mu_ held: it gets the sets it needs by reference.
    std::set<uint32_t>& waiting = transfer_->waiting;
    const std::set<uint32_t>& reported = transfer_->reported;
    waiting.clear();
    for_each_overlap(transfer_->before, *placement_,
                     [&](uint64_t, uint64_t, ServerId was, ServerId owner) {
                       if (was != owner && !reported.count(was)) waiting.insert(was);
                     });
    finish_transfer_if_done();
  }
}

}  // namespace psld
