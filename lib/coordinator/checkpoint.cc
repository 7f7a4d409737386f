// The coordinator's side of consistent checkpoints (docs/checkpoint.md):
// choosing the checkpoint a resumed job starts from, sealing a checkpoint
// round once every worker went past it, and writing its manifest once every
// server committed its file.
#include <fmt/format.h>

#include <utility>

#include "base/log.h"
#include "lib/coordinator/service.h"

namespace psld {

Status CoordinatorService::load_resume() {
  const std::string& dir = options_.checkpoint.dir;
  auto found = checkpoint::find_latest(dir);
  if (!found.ok()) {
    return found.status().with_context(
        fmt::format("checkpoint.resume: nothing to resume from in {}", dir));
  }
  for (const std::string& why : found->skipped)
    PSLD_LOG_WARN("coordinator: passed over a checkpoint in {}: {}", dir, why);
  const checkpoint::Manifest& m = found->manifest;
  // Tensor ids are 1..n (publish_watermark relies on it), as a job assigns them.
  std::vector<bool> seen(m.tensors.size() + 1, false);
  for (const auto& t : m.tensors) {
    if (t.id == 0 || t.id > m.tensors.size() || seen[t.id]) {
      return DataLoss(fmt::format("{}: tensor ids are not 1..{} (tensor '{}' has id {})",
                                  found->dir, m.tensors.size(), t.name, t.id));
    }
    seen[t.id] = true;
  }
  MutexLock lock(mu_);
  for (const auto& t : m.tensors)
    tensors_[t.name] = TensorRecord{t.id, t.dtype, t.bytes, t.chunk_bytes, kFromCheckpoint};
  next_tensor_ = static_cast<TensorId>(m.tensors.size() + 1);
  resume_round_ = m.round;
  sealed_through_ = m.round;
  PSLD_LOG_INFO("coordinator: resuming from the checkpoint of round {} in {} ({} tensors, {} keys)",
                m.round, found->dir, m.tensors.size(), m.keys);
  return Status::Ok();
}

uint64_t CoordinatorService::expected_keys() const {
  uint64_t keys = 0;
  for (const auto& [name, t] : tensors_)
    keys += (t.bytes + t.chunk_bytes - 1) / t.chunk_bytes;
  return keys;
}

// mu_ held. Every round below the lowest one any worker may still ask for
// (WorkerProgress) was pulled by every worker, so every key applied it, and
// each server queued the key's state of a checkpoint round before it
// answered those pulls (lib/server/checkpointing.h).
void CoordinatorService::maybe_seal() {
  const uint32_t every = options_.checkpoint.every_rounds;
  if (every == 0 || options_.sync != SyncMode::kBsp || !job_started_ || job_over_ || sealing_ ||
      tensors_.empty()) {
    return;
  }
  const auto tensors = static_cast<uint32_t>(tensors_.size());
  uint64_t low = UINT64_MAX;
  for (uint32_t w = 0; w < options_.num_workers; ++w) {
    if (finished_workers_.count(w)) continue;
    auto it = progress_.find(w);
    // A worker that has not promised anything, or not registered every
    // tensor yet, may still send anything.
    if (it == progress_.end() || it->second.tensors < tensors) return;
    for (TensorId t = 1; t <= tensors; ++t)
      low = std::min(low, protocol::round_of(it->second.low, it->second.tensors, t));
  }
  if (low == UINT64_MAX || low == 0) return;
  const uint64_t round = (low - 1) / every * every;
  if (round == 0 || round <= sealed_through_) return;
  Sealing s;
  s.round = round;
  s.epoch = placement_->epoch();
  for (const auto& [rank, id] : servers_)
    s.waiting.insert(rank);
  sealing_ = std::move(s);
  PSLD_LOG_DEBUG("coordinator: sealing the checkpoint of round {}", round);
  post_all(servers_, protocol::CheckpointSeal{round});
}

void CoordinatorService::handle_sealed(const Member& m, const protocol::CheckpointSealed& sealed) {
  if (m.role != Role::kServer || !sealing_ || sealed.round != sealing_->round ||
      sealing_->waiting.erase(m.rank) == 0) {
    PSLD_LOG_WARN("coordinator: {} reported a checkpoint of round {} that is not being sealed",
                  describe(m), sealed.round);
    return;
  }
  if (!sealed.error.empty()) {
    if (sealing_->error.empty()) sealing_->error = fmt::format("{}: {}", describe(m), sealed.error);
  } else if (sealed.records > 0) {
    sealing_->files.push_back({m.rank, checkpoint::server_file_name(m.rank), sealed.bytes,
                               sealed.records, sealed.blake2b});
    sealing_->records += sealed.records;
  }
  finish_seal_if_done();
}

void CoordinatorService::seal_lost_server(uint32_t rank) {
  if (!sealing_ || sealing_->waiting.erase(rank) == 0) return;
  if (sealing_->error.empty()) {
    sealing_->error = fmt::format("server {} was lost before it wrote its file", rank);
  }
  finish_seal_if_done();
}

void CoordinatorService::finish_seal_if_done() {
  if (!sealing_ || !sealing_->waiting.empty()) return;
  Sealing done = std::move(*sealing_);
  sealing_.reset();
  sealed_through_ = std::max(sealed_through_, done.round);
  const uint64_t want = expected_keys();
  if (done.error.empty() && done.records != want) {
    done.error = fmt::format("the servers' files hold {} keys, the job's tensors have {}",
                             done.records, want);
  }
  if (!done.error.empty()) return skip_checkpoint(done.round, done.error);
  checkpoint::Manifest m;
  m.round = done.round;
  m.epoch = done.epoch;
  m.keys = done.records;
  for (const auto& [name, t] : tensors_)
    m.tensors.push_back({t.id, name, t.dtype, t.bytes, t.chunk_bytes});
  std::sort(m.tensors.begin(), m.tensors.end(),
            [](const auto& a, const auto& b) { return a.id < b.id; });
  m.files = std::move(done.files);
  std::sort(m.files.begin(), m.files.end(),
            [](const auto& a, const auto& b) { return a.server < b.server; });
  to_write_ = std::move(m);
  cv_.notify_all();
}

void CoordinatorService::skip_checkpoint(uint64_t round, const std::string& why) {
  ++checkpoints_skipped_;
  PSLD_LOG_WARN("coordinator: the checkpoint of round {} is skipped: {}", round, why);
}

void CoordinatorService::write_sealed_checkpoint() {
  std::optional<checkpoint::Manifest> m;
  {
    MutexLock lock(mu_);
    m = std::exchange(to_write_, std::nullopt);
  }
  if (!m) return;
  const std::string& dir = options_.checkpoint.dir;
  const Status written = checkpoint::write_manifest(dir, *m);
  if (written.ok()) {
    if (Status pruned = checkpoint::prune(dir, options_.checkpoint.keep); !pruned.ok()) {
      PSLD_LOG_WARN("coordinator: cannot remove old checkpoints: {}", pruned.to_string());
    }
  }
  MutexLock lock(mu_);
  if (!written.ok()) return skip_checkpoint(m->round, written.to_string());
  ++checkpoints_;
  last_checkpoint_round_ = m->round;
  uint64_t bytes = 0;
  for (const auto& f : m->files)
    bytes += f.bytes;
  PSLD_LOG_INFO("coordinator: checkpoint of round {} complete: {} keys, {} bytes in {}", m->round,
                m->keys, bytes, checkpoint::round_dir(dir, m->round));
}

uint64_t CoordinatorService::checkpoints() const {
  MutexLock lock(mu_);
  return checkpoints_;
}

uint64_t CoordinatorService::last_checkpoint_round() const {
  MutexLock lock(mu_);
  return last_checkpoint_round_;
}

uint64_t CoordinatorService::checkpoints_skipped() const {
  MutexLock lock(mu_);
  return checkpoints_skipped_;
}

}  // namespace psld
