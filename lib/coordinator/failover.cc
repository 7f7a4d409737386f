// Failover (docs/replication.md), the coordinator's side: a replicated
// server is lost, and the epoch that gives its ranges to its backup goes
// out, servers first; or the job fails when a range would have no copy left.
#include <fmt/format.h>

#include <algorithm>

#include "base/log.h"
#include "lib/coordinator/service.h"

namespace psld {

namespace {

// "[0x0, 0x3fff] and [0x8000, 0xbfff]", at most `limit` ranges named.
std::string describe_ranges(const std::vector<Arc>& arcs, size_t limit = 4) {
  std::string out;
  for (size_t i = 0; i < arcs.size() && i < limit; ++i) {
    if (i > 0) out += i + 1 == arcs.size() ? " and " : ", ";
    out += fmt::format("[{:#x}, {:#x}]", arcs[i].lo, arcs[i].hi);
  }
  if (arcs.size() > limit) out += fmt::format(" and {} more", arcs.size() - limit);
  return out;
}

}  // namespace

// mu_ held. The backup of `m` in the current placement holds a copy of
// every key m applied anything to, unless a failover changed m's backup
// and m has not reported ReplicaSynced since.
void CoordinatorService::fail_over(const Member& m, const std::string& what) {
  const uint32_t lost = m.rank;
  const Placement& now = *placement_;
  if (switch_) {
    // Only prepared: nothing moved, and no worker knows of it. The servers
    // drop it (cancel, before the failover epoch on the same connections),
    // and the failover takes its epoch number; the balancer plans again
    // from the placement that results.
    PSLD_LOG_WARN(
        "coordinator: server {} was lost while the switch to epoch {} at round {} was being "
        "voted on: the switch is cancelled",
        lost, switch_->next.epoch(), switch_->switch_round);
    post_all(
        servers_,
        protocol::EpochChange{
            protocol::EpochStep::kCancel, switch_->next.epoch(), switch_->switch_round, {}, lost});
    switch_.reset();
  }
  if (replicated_switch_round_ != 0) {
    return fail_job(fmt::format(
        "{}; it was lost before every worker had finished round {}, at which epoch {} moved "
        "ranges: until then the newest state of a moved range may exist at one server only, and a "
        "replicated job does not survive a loss during a switch yet (docs/replication.md), so the "
        "job cannot go on",
        what, replicated_switch_round_, now.epoch()));
  }
  const std::vector<Arc> arcs = now.arcs_of(lost);
  const std::optional<ServerId> backup = backup_of(now, lost);
  // A member that owns nothing (a standby that joined in a lost server's
  // place and took nothing over yet) holds copies only: losing it loses
  // nothing, whatever state its own backup is in.
  std::string why;
  const std::string ranges = fmt::format(
      "{} of epoch {} ({})", arcs.size() == 1 ? "range" : fmt::format("{} ranges", arcs.size()),
      now.epoch(), describe_ranges(arcs));
  if (arcs.empty()) {
    // Nothing to lose; a backup is still needed for the hand-over step.
    if (!backup) why = "no other server is left";
  } else if (!backup || lost_servers_.count(*backup) || servers_.count(*backup) == 0) {
    why = fmt::format("{}: its {} exist nowhere else",
                      backup ? fmt::format("its backup, server {}, is lost too", *backup)
                             : std::string("no other server is left to hold a copy"),
                      ranges);
  } else if (auto it = unsynced_.find(lost); it != unsynced_.end()) {
    why = fmt::format(
        "its keys had not all been copied to its backup, server {}, since {}: some of its {} "
        "exist nowhere else",
        *backup, it->second, ranges);
  }
  if (!why.empty()) return fail_job(fmt::format("{}; {}, so the job cannot go on", what, why));
  // An idle standby server (joined, never a member, not lost) takes the
  // lost server's place in the ring, empty: the job keeps its number of
  // servers, and the member before it backs up to it from now on.
  std::optional<ServerSpec> replacement;
  for (const auto& [rank, conn] : servers_) {
    if (rank != lost && now.find_server(rank) == nullptr && !lost_servers_.count(rank)) {
      replacement = ServerSpec{rank, 1.0};
      break;
    }
  }
  // One hand-over step, whatever the number of arcs: the delta always fits
  // one message (a delta listing a server's arcs did not once it had taken
  // over a few others').
  auto handed = now.hand_over(lost, *backup, replacement);
  if (!handed.ok()) {
    return fail_job(fmt::format("{}; giving its ranges to server {} failed: {}", what, *backup,
                                handed.status().to_string()));
  }
  Placement next = std::move(handed->next);
  const std::vector<uint8_t> bytes = handed->delta.serialize();
  lost_servers_.insert(lost);
  seal_lost_server(lost);
  // Every server whose backup changes (a replacement's too: it had none),
  // and the backup itself (the keys it takes over have no copy yet), is
  // unprotected until it says it synced; so are those of an earlier
  // failover that have not said so yet (every server resyncs at every
  // failover epoch and reports for the newest).
  const std::string cause = fmt::format("server {} was lost", lost);
  unsynced_.erase(lost);
  unsynced_.insert_or_assign(*backup, cause);
  for (const ServerInfo& s : next.servers()) {
    if (backup_of(now, s.id) != backup_of(next, s.id)) unsynced_.insert_or_assign(s.id, cause);
  }
  // It takes the place of the newest epoch for every round that one serves:
  // the same switch round. Every worker has finished that round (a loss
  // before fails the job, above), so no request names an earlier one.
  const protocol::EpochChange change{protocol::EpochStep::kFailover, next.epoch(),
                                     last_switch_round_, bytes, lost};
  post_all(servers_, change);
  post_all(workers_, change);
  PSLD_LOG_WARN(
      "coordinator: {}; epoch {}: its {} ranges fail over to server {}{}", what, next.epoch(),
      arcs.size(), *backup,
      replacement
          ? fmt::format(", and standby server {} joins the placement in its place", replacement->id)
          : std::string());
  placement_ = std::move(next);
  ++failovers_;
  cv_.notify_all();
}

// mu_ held.
Status CoordinatorService::replication_allows_switch() const {
  if (options_.replication_factor <= 1) return Status::Ok();
  if (replicated_switch_round_ != 0) {
    return FailedPrecondition(fmt::format(
        "replication: not every worker has finished round {}, where the last switch moved ranges",
        replicated_switch_round_));
  }
  if (!unsynced_.empty()) {
    return FailedPrecondition(
        fmt::format("replication: server {}'s keys do not all have a copy at its backup yet (since "
                    "{})",
                    unsynced_.begin()->first, unsynced_.begin()->second));
  }
  return Status::Ok();
}

// mu_ held. Every live worker promised no request at or below the switch
// round (WorkerProgress): each pull of that round of a moved key was
// answered, which its new owner does only once its backup holds the round.
void CoordinatorService::close_replicated_switch() {
  // Read here: the analysis does not see mu_ held inside the lambda.
  const uint64_t switch_round = replicated_switch_round_;
  if (switch_round == 0) return;
  const std::optional<std::vector<uint64_t>> low = lowest_rounds();
  if (!low || std::any_of(low->begin(), low->end(),
                          [switch_round](uint64_t r) { return r <= switch_round; })) {
    return;
  }
  PSLD_LOG_DEBUG(
      "coordinator: every worker finished round {}: epoch {}'s moved ranges have their "
      "copies",
      replicated_switch_round_, placement_->epoch());
  replicated_switch_round_ = 0;
}

void CoordinatorService::handle_synced(const Member& m, const protocol::ReplicaSynced& synced) {
  if (m.role != Role::kServer || synced.epoch != placement_->epoch()) return;  // stale
  if (!unsynced_.erase(m.rank)) return;
  PSLD_LOG_INFO("coordinator: server {}'s keys all have a copy at their backup again", m.rank);
  if (unsynced_.empty()) {
    PSLD_LOG_INFO("coordinator: every range has its copies again (epoch {})", synced.epoch);
  }
}

}  // namespace psld
