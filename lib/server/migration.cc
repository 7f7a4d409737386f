// Migration, the server side (docs/migration.md): epoch changes, asking for a
// gained key's state and installing it, shipping a lost key's state, the
// transfer report, and freeing the runs of ownership nothing needs.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <thread>
#include <unordered_map>

#include "base/log.h"
#include "base/secret.h"
#include "lib/server/key_state.h"

namespace psld {

using transport::ConnectionPtr;

ConnectionPtr ServerService::peer(ServerId id) {
  MutexLock lock(peers_mu_);
  auto it = peers_.find(id);
  if (it != peers_.end() && it->second->is_open()) return it->second;
  for (const auto& entry : session_.servers()) {
    if (entry.rank != id) continue;
    auto conn = connect_text(transport(), std::string(entry.address.begin(), entry.address.end()));
    if (!conn.ok()) {
      PSLD_LOG_ERROR("server {}: cannot reach server {}: {}", rank(), id,
                     conn.status().to_string());
      return nullptr;
    }
    // The handshake runs on its own (handle_dialing); what send_peer()
    // sends meanwhile waits for its grant, so no dial blocks a shard.
    protocol::PeerHello hello;
    {
      MutexLock dialing(dialing_mu_);
      Dialing& d = dialing_
                       .try_emplace((*conn)->id(),
                                    Dialing{protocol::PeerDial(Role::kServer, rank()), id, {}})
                       .first->second;
      hello = d.dial.hello;
    }
    Status st = send(*conn, hello);
    if (!st.ok()) {
      PSLD_LOG_ERROR("server {}: cannot reach server {}: {}", rank(), id, st.to_string());
      MutexLock dialing(dialing_mu_);
      dialing_.erase((*conn)->id());
      return nullptr;
    }
    peers_[id] = *conn;
    return *conn;
  }
  return nullptr;
}

Status ServerService::send_peer(const ConnectionPtr& conn, const protocol::Message& message) {
  {
    MutexLock lock(dialing_mu_);
    auto it = dialing_.find(conn->id());
    if (it != dialing_.end()) {
      it->second.queued.push_back(message);
      return Status::Ok();
    }
  }
  return send(conn, message);
}

bool ServerService::handle_dialing(const ConnectionPtr& conn, protocol::Message& message) {
  std::optional<protocol::PeerProof> answer;
  std::vector<protocol::Message> release;
  Status refused;
  ServerId peer_rank = 0;
  {
    MutexLock lock(dialing_mu_);
    auto it = dialing_.find(conn->id());
    if (it == dialing_.end()) return false;
    Dialing& d = it->second;
    peer_rank = d.peer;
    if (auto* c = std::get_if<protocol::Challenge>(&message)) {
      answer = d.dial.answer(options_.secret, *c);
    } else if (auto* g = std::get_if<protocol::Grant>(&message)) {
      if (d.dial.proves(options_.secret, *g)) {
        release = std::move(d.queued);
      } else {
        refused = FailedPrecondition(
            fmt::format("it did not prove it knows the job secret ({})", kSameSecretEverywhere));
      }
      dialing_.erase(it);
    } else if (auto* e = std::get_if<protocol::Error>(&message)) {
      refused = FailedPrecondition(e->message);
      dialing_.erase(it);
    } else {
      return false;
    }
  }
  if (answer) (void)send(conn, *answer);
  for (const auto& m : release)
    (void)send(conn, m);
  if (!refused.ok()) drop_dial(conn, peer_rank, refused);
  return true;
}

void ServerService::drop_dial(const ConnectionPtr& conn, ServerId peer, const Status& why) {
  PSLD_LOG_ERROR("server {}: server {} refused our connection: {}", rank(), peer, why.to_string());
  {
    MutexLock lock(peers_mu_);
    auto it = peers_.find(peer);
    if (it != peers_.end() && it->second->id() == conn->id()) peers_.erase(it);
  }
  conn->close();
}

void ServerService::request_state(KeyState& k, uint64_t switch_round, ServerId from) {
  k.awaiting_state = true;
  k.state_round = switch_round;
  {
    // Counted when decided: the dial and its handshake may take a while.
    MutexLock lock(stats_mu_);
    ++stats_.states_requested;
  }
  auto region = transport().allocate_memory(kStateHeader + 3 * k.agg.size() * sizeof(float),
                                            MemoryKind::kHost);
  ConnectionPtr conn = peer(from);
  if (!region.ok() || !conn) {
    PSLD_LOG_ERROR("server {}: cannot ask server {} for key {:#x}: {}", rank(), from, k.key,
                   region.ok() ? "no connection" : region.status().to_string());
    return;
  }
  k.incoming = *region;
  protocol::StateRequest req{
      0,
      k.key,
      switch_round,
      k.agg.dtype(),
      k.agg.bytes(),
      std::vector<uint8_t>(k.incoming->remote_key().begin(), k.incoming->remote_key().end())};
  {
    MutexLock lock(peers_mu_);
    req.tag = next_state_tag_++;
    if (req.tag == 0) req.tag = next_state_tag_++;
    incoming_[{conn->id(), req.tag}] = {k.key, k.owned_from};
  }
  PSLD_LOG_DEBUG("server {}: key {:#x} moves here at round {}; asking server {} for it", rank(),
                 k.key, switch_round, from);
  Status st = send_peer(conn, req);
  if (!st.ok()) {
    PSLD_LOG_ERROR("server {}: asking server {} for key {:#x}: {}", rank(), from, k.key,
                   st.to_string());
  }
}

void ServerService::install_state(Shard& shard, KeyState& k) {
  uint64_t version = 0;
  std::memcpy(&version, k.incoming->data(), sizeof(version));
  const float* in = reinterpret_cast<const float*>(k.incoming->data() + kStateHeader);
  // BSP: the version is the round, state_round - 1. Async: the updates
  // applied. Every worker pushed up to the switch.
  Status st = k.failed;
  if (st.ok()) st = k.agg.restore(shard.lane, in, version, k.state_round - 1);
  k.awaiting_state = false;
  k.incoming.reset();
  if (!st.ok()) {
    fail_key(shard, k, st.with_context("installing the state that migrated here"));
    return;
  }
  {
    MutexLock lock(stats_mu_);
    ++stats_.states_in;
  }
  PSLD_LOG_DEBUG("server {}: key {:#x} arrived as of round {}", rank(), k.key, k.agg.version());
  if (k.awaiting_final) return;  // served once the transfer is final
  resume(shard, k);
}

void ServerService::resume(Shard& shard, KeyState& k) {
  serve_ready_pulls(shard, k);
  release_parked(shard, k);
  while (k.inflight == 0 && !k.deferred.empty()) {
    PushWork next = std::move(k.deferred.front());
    k.deferred.pop_front();
    process_push(shard, next);
  }
  maybe_ship(shard, k);
}

bool ServerService::ready_to_ship(const KeyState& k, uint64_t switch_round) const {
  if (k.awaiting_state || k.awaiting_final || !k.failed.ok()) return false;
  return k.agg.applied_before(switch_round, k.owned_from);
}

void ServerService::maybe_ship(Shard& shard, KeyState& k) {
  if (!k.successors.empty()) {
    std::vector<StateWork> still;
    for (auto& w : k.successors) {
      if (ready_to_ship(k, w.req.switch_round)) {
        ship_state(shard, k, w);
      } else {
        still.push_back(std::move(w));
      }
    }
    k.successors.swap(still);
  }
  maybe_offer(shard, k);
}

// Parameter, then the two moments (zeros when the optimizer keeps none),
// fp32, into the successor's region with one write.
void ServerService::ship_state(Shard& shard, KeyState& k, const StateWork& w) {
  const uint64_t bytes = kStateHeader + 3 * k.agg.size() * sizeof(float);
  auto staging = transport().allocate_memory(bytes, MemoryKind::kHost);
  ConnectionPtr conn = worker_connection(w.conn);
  if (!staging.ok() || !conn) {
    PSLD_LOG_ERROR("server {}: cannot ship key {:#x}: {}", rank(), k.key,
                   staging.ok() ? "the successor is gone" : staging.status().to_string());
    return;
  }
  std::memset((*staging)->data(), 0, kStateHeader);
  const uint64_t version = k.agg.version();
  std::memcpy((*staging)->data(), &version, sizeof(version));
  float* out = reinterpret_cast<float*>((*staging)->data() + kStateHeader);
  Status copied = k.agg.save(shard.lane, out);
  if (!copied.ok()) {
    fail_key(shard, k, copied.with_context("copying the state to ship"));
    return;
  }
  PSLD_LOG_DEBUG("server {}: shipping key {:#x} as of round {}", rank(), k.key, k.agg.version());
  // Both regions must outlive the write (an emulated link queues it).
  auto region = *staging;
  auto target = w.region;
  k.shipping_round = w.req.switch_round;
  const Key key = k.key;
  const uint64_t run = k.owned_from, round = w.req.switch_round;
  std::shared_ptr<TraceRecorder> trace = trace_ && trace_->wants(round) ? trace_ : nullptr;
  const auto started = transport::Clock::now();
  Status st = conn->write(
      {region.get(), 0, target.get(), 0, bytes, w.req.tag},
      [this, region, target, key, run, round, trace, started, bytes](const Status& s) {
        if (trace) {
          trace->async_begin(
              "ship", "migration", key, started,
              fmt::format(R"("key":"{:#x}","switch_round":{},"bytes":{})", key, round, bytes));
          trace->async_end("ship", "migration", key, transport::Clock::now());
        }
        if (!s.ok()) {
          PSLD_LOG_ERROR("shipping the state of key {:#x} failed: {}", key, s.to_string());
        }
        // Completed: the transfer may be done (docs/migration.md).
        dispatch(key, ShipDone{key, run, round, s.ok()});
      });
  if (!st.ok()) {
    PSLD_LOG_ERROR("server {}: shipping key {:#x}: {}", rank(), k.key, st.to_string());
  }
}

void ServerService::on_epoch_change(const protocol::EpochChange& change) {
  using protocol::EpochStep;
  if (change.step == EpochStep::kCancel) return cancel_prepared(change);
  protocol::EpochVote vote{change.epoch, change.switch_round, false, 0};
  bool scan = false;
  bool backup_changed = false;  // replicated: this switch gave this server another backup
  std::vector<TakeOver> take;   // a failover: the lost server's keys held here
  Dial dial;                    // the servers this switch brings keys from
  std::vector<std::tuple<uint64_t, Key, Work>> wake;
  {
    MutexLock lock(epoch_mu_);
    const ServerId me = rank();
    if (change.step == EpochStep::kPrepare) {
      auto next = epochs_->follow(change.epoch, change.delta);
      if (!next.ok()) {
        PSLD_LOG_ERROR("server {}: a prepare refused: {}", me, next.status().to_string());
        return;
      }
      // A round at or past the switch already seen here means the switch is
      // too early: vote no and change nothing (a push this server took must
      // never be refused later). Otherwise, from here on rounds >=
      // switch_round of the keys this server loses are refused. Pushes arrive
      // on this same thread, so none slips in between.
      vote.max_round = max_round_seen_.load();
      vote.yes = vote.max_round < change.switch_round;
      if (vote.yes) {
        // Gaining keys, never having owned any: all this server will hold
        // is the transfer, which an abort can undo until it is final (the
        // coordinator decides by the same rule).
        if (!owned_ever_ && !(*next)->arcs_of(me).empty()) {
          gate_round_ = change.switch_round;
          gate_final_ = false;
        }
        prepared_ = Prepared{change.epoch, change.switch_round, *next};
        ownership_gen_.fetch_add(1, std::memory_order_release);  // shards' owner caches
        for_each_overlap(
            epochs_->latest(), **next, [&](uint64_t, uint64_t, ServerId was, ServerId now) {
              if (now == me && was != me &&
                  std::find(dial.servers.begin(), dial.servers.end(), was) == dial.servers.end())
                dial.servers.push_back(was);
            });
      }
    } else {
      std::shared_ptr<const Placement> next;
      if (change.step == EpochStep::kCommit) {
        if (!prepared_ || prepared_->epoch != change.epoch) {
          PSLD_LOG_ERROR("server {}: commit of epoch {} that was not prepared", me, change.epoch);
          return;
        }
        next = prepared_->placement;
      } else {
        // An abort (or failover) is committed without a prepare: it only
        // takes keys away from the lost server (protocol.h).
        auto n = epochs_->follow(change.epoch, change.delta);
        if (!n.ok()) {
          PSLD_LOG_ERROR("server {}: an abort refused: {}", me, n.status().to_string());
          return;
        }
        next = *n;
      }
      prepared_.reset();
      if (change.step == EpochStep::kFailover) failed_over_.insert(change.lost_server);
      backup_changed = change.step == EpochStep::kCommit && replicated() &&
                       backup_of(epochs_->latest(), me) != backup_of(*next, me);
      bool losing = false;
      for_each_overlap(epochs_->latest(), *next, [&](uint64_t, uint64_t, ServerId a, ServerId b) {
        losing = losing || (a == me && b != me);
      });
      epochs_->push(next, change.switch_round);
      committed_epoch_.store(change.epoch, std::memory_order_release);
      if (change.step == EpochStep::kFailover) take = take_copies_of(change.lost_server, *next);
      latest_placements_.fetch_add(1, std::memory_order_release);  // shards' arc caches
      ownership_gen_.fetch_add(1, std::memory_order_release);      // and owner caches
      if (trace_ && trace_->wants(change.switch_round)) {
        trace_->instant(change.step == EpochStep::kCommit ? "epoch commit" : "epoch hand-over",
                        "epoch", transport::Clock::now(),
                        fmt::format(R"("epoch":{},"switch_round":{},"losing":{})", change.epoch,
                                    change.switch_round, losing));
      }
      const bool held = !gate_final_ && gate_round_ == change.switch_round;
      if (!held && !next->arcs_of(me).empty()) owned_ever_ = true;
      if (change.step == EpochStep::kCommit) {
        transfer_ = Transfer{change.epoch,
                             change.switch_round,
                             losing,
                             /*reported=*/!losing,
                             std::vector<int64_t>(shards_.size(), -1),
                             {}};
        scan = losing;
      } else if (transfer_.switch_round == change.switch_round) {
        // The same transfer without the lost server: what this server still
        // has to ship is looked for again (keys given back no longer count).
        transfer_.epoch = change.epoch;
        std::fill(transfer_.pending.begin(), transfer_.pending.end(), -1);
        scan = transfer_.losing;
      }
      PSLD_LOG_INFO(
          "server {}: epoch {} from round {}{}", me, change.epoch, change.switch_round,
          change.step == EpochStep::kAbort
              ? fmt::format(" (server {} lost: its transfer aborted)", change.lost_server)
          : change.step == EpochStep::kFailover
              ? fmt::format(" (server {} lost: its ranges go to their backups)", change.lost_server)
              : "");
      // Requests that waited for this epoch are looked at again.
      const uint64_t newest = change.epoch;
      std::vector<std::tuple<uint64_t, Key, Work>> still;
      for (auto& f : waiting_for_epoch_) {
        (std::get<0>(f) <= newest ? wake : still).push_back(std::move(f));
      }
      waiting_for_epoch_.swap(still);
    }
  }
  if (change.step == EpochStep::kPrepare) {
    (void)session_.send_to_coordinator(vote);
    // Connected ahead (on a shard thread: a dial blocks), so that the first
    // state request of the switch does not wait for a connection.
    if (!dial.servers.empty()) dispatch(0, std::move(dial));
    return;
  }
  if (change.step == EpochStep::kAbort || change.step == EpochStep::kFailover) {
    forget_peer(change.lost_server);
  }
  // Before the requests that waited for this epoch: the lost server's keys
  // are installed from their copies first.
  if (change.step == EpochStep::kFailover) on_failover(change, std::move(take));
  if (backup_changed) on_backup_changed(change.epoch);
  if (scan) dispatch_all(TransferScan{change.switch_round});
  for (auto& [epoch, key, work] : wake)
    dispatch(key, std::move(work));
}

// The prepare of change.epoch is withdrawn: rounds >= its switch round of the
// keys this server would have lost are served here again (a request refused
// meanwhile comes back once the worker has the epoch that follows), and a
// gate it set for keys it would have gained opens.
void ServerService::cancel_prepared(const protocol::EpochChange& change) {
  MutexLock lock(epoch_mu_);
  if (!prepared_ || prepared_->epoch != change.epoch) return;  // not prepared here, or newer
  if (!gate_final_ && gate_round_ == prepared_->switch_round) {
    gate_round_ = 0;
    gate_final_ = true;
  }
  PSLD_LOG_INFO("server {}: the switch to epoch {} at round {} is cancelled (server {} lost)",
                rank(), change.epoch, prepared_->switch_round, change.lost_server);
  prepared_.reset();
  ownership_gen_.fetch_add(1, std::memory_order_release);  // shards' owner caches
}

void ServerService::on_final(const protocol::EpochFinal& final) {
  {
    MutexLock lock(epoch_mu_);
    if (gate_final_ || gate_round_ != final.switch_round) return;
    gate_final_ = true;
    owned_ever_ = true;
  }
  PSLD_LOG_INFO("server {}: the transfer at round {} is final; serving the keys it brought", rank(),
                final.switch_round);
  dispatch_all(Release{final.switch_round});
}

bool ServerService::hold_until_final(uint64_t run) const {
  MutexLock lock(epoch_mu_);
  return run != 0 && run == gate_round_ && !gate_final_;
}

bool ServerService::wait_for_epoch(uint64_t epoch, Key key, Work work) {
  MutexLock lock(epoch_mu_);
  if (epoch <= epochs_->latest().epoch() || waiting_for_epoch_.size() >= kMaxWaitingForEpoch)
    return false;
  std::visit(
      [](auto& w) {
        if constexpr (requires { w.requeued; }) w.requeued = true;
      },
      work);
  waiting_for_epoch_.emplace_back(epoch, key, std::move(work));
  return true;
}

void ServerService::forget_peer(ServerId id) {
  ConnectionPtr conn;
  {
    MutexLock lock(peers_mu_);
    auto it = peers_.find(id);
    if (it == peers_.end()) return;
    conn = it->second;
    peers_.erase(it);
    for (auto in = incoming_.begin(); in != incoming_.end();) {
      in = in->first.first == conn->id() ? incoming_.erase(in) : std::next(in);
    }
  }
  conn->close();  // for good: the coordinator removed it from the job
}

void ServerService::on_tick() {
  sweep_door();
  std::optional<protocol::TransferDone> report;
  {
    MutexLock lock(epoch_mu_);
    Transfer& t = transfer_;
    if (t.switch_round == 0 || !t.losing || t.reported) return;
    const auto now = transport::Clock::now();
    if (t.reached == transport::Clock::time_point{} && max_round_seen_.load() + 1 >= t.switch_round)
      t.reached = now;
    // Twice the heartbeat timeout: longer than the coordinator takes to
    // find a successor that hung, whose transfer must still be abortable.
    if (t.reached == transport::Clock::time_point{} ||
        now - t.reached < 2 * options_.heartbeat_timeout) {
      return;
    }
    int64_t late = 0;
    for (int64_t p : t.pending) {
      if (p < 0) return;  // a shard has not looked yet
      late += p;
    }
    // The switch arrived here two heartbeat timeouts ago and some keys are
    // still not at it (a tensor pushed less often than others, or not at
    // all any more): waiting for them could hold the gained keys, and the
    // workers waiting on them, forever. They ship when they get there.
    t.reported = true;
    report = protocol::TransferDone{t.epoch, t.switch_round, static_cast<uint64_t>(late)};
  }
  PSLD_LOG_INFO(
      "server {}: {} keys leaving at round {} have not reached it {} ms after the switch; "
      "reporting the transfer done without them",
      rank(), report->late_keys, report->switch_round, 2 * options_.heartbeat_timeout.count());
  (void)session_.send_to_coordinator(*report);
}

void ServerService::note_outgoing(const Shard& shard) {
  std::optional<protocol::TransferDone> report;
  {
    MutexLock lock(epoch_mu_);
    Transfer& t = transfer_;
    if (t.reported || shard.out_round != t.switch_round) return;
    t.pending[shard.index] = static_cast<int64_t>(shard.outgoing.size());
    for (int64_t p : t.pending) {
      if (p != 0) return;
    }
    t.reported = true;
    report = protocol::TransferDone{t.epoch, t.switch_round, 0};
  }
  PSLD_LOG_DEBUG("server {}: every key leaving at round {} shipped", rank(), report->switch_round);
  (void)session_.send_to_coordinator(*report);
}

// The keys of this shard that leave at switch_round and were not shipped
// yet: each must ship before the transfer is done.
void ServerService::scan_outgoing(Shard& shard, uint64_t switch_round) {
  const ServerId me = rank();
  shard.out_round = switch_round;
  shard.outgoing.clear();
  std::vector<KeyState*> leaving;
  for (auto& [key, runs] : shard.keys) {
    if (owner_for(key, switch_round) == me) {
      // Stays here, or came back with an abort: requests for it at this
      // switch came from a successor that is gone, and a run that shipped
      // its state to it goes on instead of ending there.
      for (auto& r : runs) {
        std::erase_if(r->successors,
                      [&](const StateWork& w) { return w.req.switch_round == switch_round; });
        if (r->shipped_round == switch_round) r->shipped_round = 0;
      }
      continue;
    }
    if (owner_for(key, switch_round - 1) != me) continue;
    const auto held = gained(key, switch_round - 1);
    KeyState* k = find_run(shard, key, held ? held->first : 0);
    if (k == nullptr || k->shipped_round == switch_round) continue;
    shard.outgoing.insert({key, k->owned_from});
    leaving.push_back(k);
  }
  note_outgoing(shard);
  for (KeyState* k : leaving)
    maybe_offer(shard, *k);
}

void ServerService::maybe_offer(Shard& shard, KeyState& k) {
  const uint64_t t = shard.out_round;
  if (t == 0 || k.offered_round == t || k.shipping_round == t) return;
  if (!shard.outgoing.count({k.key, k.owned_from})) return;
  for (const auto& w : k.successors) {
    if (w.req.switch_round == t) return;  // asked for already
  }
  if (!ready_to_ship(k, t)) return;
  k.offered_round = t;
  const ServerId to = owner_for(k.key, t);
  ConnectionPtr conn = peer(to);
  if (!conn) return;  // logged by peer()
  PSLD_LOG_DEBUG("server {}: offering key {:#x} to server {} at round {}", rank(), k.key, to, t);
  (void)send_peer(conn, protocol::StateOffer{k.key, t, k.agg.dtype(), k.agg.bytes()});
}

void ServerService::release_final(Shard& shard, uint64_t switch_round) {
  for (auto& [key, runs] : shard.keys) {
    for (auto& r : runs) {
      KeyState& k = *r;
      if (!k.awaiting_final || k.owned_from != switch_round) continue;
      k.awaiting_final = false;
      if (!k.awaiting_state) resume(shard, k);  // else once the state lands
    }
  }
}

// A run that ended at switch round T (the key left here at T) is needed
// while its state has not reached the successor, while an abort could still
// give the key back to it, and while a worker may still send a request for
// a round < T (docs/migration.md, "Freeing old runs"). The last watermark
// says neither of the last two can happen once it gives the key's tensor a
// round >= T (and that holds for good); shipped_round says the first is
// over. Nothing may be queued on the run either.
bool ServerService::done_with(const Shard& shard, const KeyState& k) const {
  const uint64_t low = protocol::round_of(shard.low.low, shard.low.tensors, key_tensor(k.key));
  return k.shipped_round != 0 && k.shipped_round <= low && k.inflight == 0 && k.waiting.empty() &&
         k.deferred.empty() && k.parked.empty() && k.successors.empty() && !k.awaiting_state &&
         !k.awaiting_final && !shard.outgoing.count({k.key, k.owned_from});
}

void ServerService::trim(Shard& shard, const protocol::LowWatermark& mark) {
  shard.low = mark;
  uint64_t freed = 0;
  for (auto it = shard.keys.begin(); it != shard.keys.end();) {
    freed += std::erase_if(it->second, [&](const auto& r) { return done_with(shard, *r); });
    it = it->second.empty() ? shard.keys.erase(it) : std::next(it);
  }
  note_freed(freed);
}

// A run may become free after the watermark passed its end: its write
// completed, its last pull write finished.
void ServerService::free_runs(Shard& shard, Key key) {
  auto it = shard.keys.find(key);
  if (it == shard.keys.end()) return;
  const uint64_t freed =
      std::erase_if(it->second, [&](const auto& r) { return done_with(shard, *r); });
  if (it->second.empty()) shard.keys.erase(it);
  note_freed(freed);
}

void ServerService::note_freed(uint64_t freed) {
  if (freed == 0) return;
  PSLD_LOG_DEBUG("server {}: freed {} runs of ownership", rank(), freed);
  MutexLock lock(stats_mu_);
  stats_.runs -= freed;
  stats_.runs_freed += freed;
}

}  // namespace psld
