#include "lib/server/checkpointing.h"

#include <fmt/format.h>

#include <unistd.h>

#include "base/log.h"
#include "base/thread.h"
#include "lib/server/key_state.h"

namespace psld {

Result<std::unique_ptr<CheckpointWriter>> CheckpointWriter::start(Options options,
                                                                  SealedFn sealed) {
  std::unique_ptr<CheckpointWriter> w(new CheckpointWriter(std::move(options), std::move(sealed)));
  PSLD_RETURN_IF_ERROR(
      start_thread(w->thread_, "checkpoint writer", [raw = w.get()] { raw->loop(); }));
  return w;
}

CheckpointWriter::CheckpointWriter(Options options, SealedFn sealed)
    : options_(std::move(options)), sealed_(std::move(sealed)) {}

CheckpointWriter::~CheckpointWriter() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  while (!open_.empty())
    drop(open_.begin()->first);
}

void CheckpointWriter::drop(uint64_t round) {
  open_.erase(round);  // a writer never committed removes its .tmp file
  // And the round's directory, when nothing else is in it (another server's
  // file, a manifest): an empty one would read as a torn checkpoint.
  ::rmdir(checkpoint::round_dir(options_.dir, round).c_str());
}

void CheckpointWriter::add(uint64_t round, checkpoint::KeyRecord record) {
  const uint64_t bytes = record.state.size() * sizeof(float);
  UniqueLock lock(mu_);
  // One state bigger than the bound still goes, alone.
  cv_.wait(lock.native(), [&]() REQUIRES(mu_) {
    return stop_ || queued_bytes_ == 0 || queued_bytes_ + bytes <= options_.max_queued_bytes;
  });
  if (stop_) return;
  queued_bytes_ += bytes;
  queue_.push_back(Item{Kind::kRecord, round, std::move(record), {}});
  cv_.notify_all();
}

void CheckpointWriter::fail(uint64_t round, std::string why) {
  MutexLock lock(mu_);
  queue_.push_back(Item{Kind::kFail, round, {}, std::move(why)});
  cv_.notify_all();
}

void CheckpointWriter::seal(uint64_t round) {
  MutexLock lock(mu_);
  queue_.push_back(Item{Kind::kSeal, round, {}, {}});
  cv_.notify_all();
}

void CheckpointWriter::loop() {
  while (true) {
    Item item;
    {
      UniqueLock lock(mu_);
      cv_.wait(lock.native(), [&]() REQUIRES(mu_) { return stop_ || !queue_.empty(); });
      if (stop_) return;
      item = std::move(queue_.front());
      queue_.pop_front();
      queued_bytes_ -= item.record.state.size() * sizeof(float);
    }
    cv_.notify_all();  // a shard may wait for room
    write(item);
  }
}

void CheckpointWriter::write(Item& item) {
  const uint64_t round = item.round;
  if (item.kind == Kind::kSeal) return answer_seal(round);
  if (round <= sealed_through_ || given_up_.count(round)) {
    // The coordinator moved past this round already; nothing waits for it.
    PSLD_LOG_DEBUG("server {}: a checkpoint state of round {}, which is sealed or given up",
                   options_.server, round);
    return;
  }
  auto it = open_.find(round);
  if (it == open_.end()) {
    if (open_.size() >= options_.max_open_rounds) {
      auto oldest = open_.begin();
      given_up_[oldest->first] = fmt::format(
          "server {} gave up its file of round {}: {} newer checkpoint rounds were written "
          "before the coordinator sealed it",
          options_.server, oldest->first, options_.max_open_rounds);
      drop(oldest->first);
    }
    it = open_.emplace(round, Open{}).first;
    auto file = checkpoint::FileWriter::create(options_.dir, round, options_.server);
    if (file.ok()) {
      it->second.file.emplace(std::move(file).value());
    } else {
      it->second.error = file.status().to_string();
    }
  }
  Open& open = it->second;
  if (!open.error.empty()) return;
  if (item.kind == Kind::kFail) {
    open.error = std::move(item.why);
    open.file.reset();
    return;
  }
  const checkpoint::KeyRecord& r = item.record;
  Status st = open.file->append(r.key, r.dtype, r.bytes, r.version, r.arrays, r.state);
  if (!st.ok()) {
    open.error = st.to_string();
    open.file.reset();
  }
}

void CheckpointWriter::answer_seal(uint64_t round) {
  protocol::CheckpointSealed answer;
  answer.round = round;
  if (auto g = given_up_.find(round); g != given_up_.end()) {
    answer.error = g->second;
  } else if (round <= sealed_through_) {
    answer.error = fmt::format("server {} sealed round {} already", options_.server, round);
  } else if (auto it = open_.find(round); it != open_.end()) {
    if (it->second.error.empty()) {
      auto entry = it->second.file->commit();
      if (entry.ok()) {
        answer.bytes = entry->bytes;
        answer.records = entry->records;
        answer.blake2b = entry->blake2b;
      } else {
        answer.error = entry.status().to_string();
      }
    } else {
      answer.error = it->second.error;
    }
  }  // else: this server applied no key at that round; an empty answer
  if (!answer.error.empty()) {
    if (answer.error.size() > protocol::kMaxReasonBytes)
      answer.error.resize(protocol::kMaxReasonBytes);
    PSLD_LOG_WARN("server {}: the checkpoint of round {} is not written: {}", options_.server,
                  round, answer.error);
  }
  sealed_through_ = std::max(sealed_through_, round);
  // Older rounds the coordinator will never seal, and this one.
  while (!open_.empty() && open_.begin()->first < round)
    drop(open_.begin()->first);
  open_.erase(round);
  while (!given_up_.empty() && given_up_.begin()->first <= round)
    given_up_.erase(given_up_.begin());
  sealed_(answer);
}

// The server's hooks (service.h).

CheckpointWriter* ServerService::checkpoint_writer() {
  MutexLock lock(ckpt_mu_);
  if (!writer_tried_ && options_.checkpoint.every_rounds > 0) {
    writer_tried_ = true;
    auto w = CheckpointWriter::start(
        {.dir = options_.checkpoint.dir, .server = rank()},
        [this](const protocol::CheckpointSealed& sealed) {
          if (Status st = session_.send_to_coordinator(sealed); !st.ok()) {
            PSLD_LOG_WARN("server {}: cannot report the checkpoint of round {}: {}", rank(),
                          sealed.round, st.to_string());
          }
        });
    if (w.ok()) {
      writer_ = std::move(w).value();
    } else {
      PSLD_LOG_ERROR("server {}: no checkpoints: {}", rank(), w.status().to_string());
    }
  }
  return writer_.get();
}

void ServerService::save_checkpoint(Shard& shard, KeyState& k) {
  CheckpointWriter* writer = checkpoint_writer();
  if (writer == nullptr || !k.failed.ok()) return;
  const uint64_t round = k.agg.version();
  checkpoint::KeyRecord r;
  r.key = k.key;
  r.dtype = k.agg.dtype();
  r.bytes = k.agg.bytes();
  r.version = round;
  // The sum service keeps no optimizer state: the parameter alone.
  r.arrays = options_.mode == ServerMode::kSum ? 1 : 3;
  r.elements = k.agg.size();
  r.state.resize(r.arrays * r.elements);
  if (Status st = k.agg.save(shard.lane, r.state.data(), r.arrays); !st.ok()) {
    writer->fail(
        round, fmt::format("server {}: the state of key {:#x}: {}", rank(), k.key, st.to_string()));
    return;
  }
  writer->add(round, std::move(r));
}

Result<const checkpoint::Reader*> ServerService::resume_reader() {
  MutexLock lock(ckpt_mu_);
  if (!resume_) {
    const uint64_t round = session_.welcome().resume_round;
    const std::string dir = checkpoint::round_dir(options_.checkpoint.dir, round);
    auto open = [&]() -> Result<std::unique_ptr<checkpoint::Reader>> {
      // The coordinator chose this checkpoint and checked every file's hash.
      PSLD_ASSIGN_OR_RETURN(checkpoint::Found found,
                            checkpoint::open_round(options_.checkpoint.dir, round));
      PSLD_ASSIGN_OR_RETURN(checkpoint::Reader reader, checkpoint::Reader::open(found));
      PSLD_LOG_INFO("server {}: resuming from the checkpoint of round {} in {} ({} keys)", rank(),
                    round, dir, reader.keys());
      return std::make_unique<checkpoint::Reader>(std::move(reader));
    };
    resume_.emplace(open());
    if (!resume_->ok()) {
      PSLD_LOG_ERROR("server {}: cannot resume from {}: {}", rank(), dir,
                     resume_->status().to_string());
    }
  }
  if (!resume_->ok()) return resume_->status();
  return resume_->value().get();
}

Status ServerService::restore_checkpoint(Shard& shard, KeyState& k) {
  const uint64_t round = session_.welcome().resume_round;
  PSLD_ASSIGN_OR_RETURN(const checkpoint::Reader* reader, resume_reader());
  auto record = reader->read(k.key);
  if (!record.ok()) {
    return FailedPrecondition(
        fmt::format("key {:#x} (tensor {}, chunk {}) is not in the checkpoint of round {}: {}",
                    k.key, key_tensor(k.key), key_chunk(k.key), round, record.status().message()));
  }
  if (record->dtype != k.agg.dtype() || record->bytes != k.agg.bytes() ||
      record->elements != k.agg.size()) {
    return FailedPrecondition(fmt::format(
        "key {:#x} is {} bytes of {} in the checkpoint of round {}, but {} bytes of {} now", k.key,
        record->bytes, protocol::dtype_name(record->dtype), round, k.agg.bytes(),
        protocol::dtype_name(k.agg.dtype())));
  }
  // Parameter, then the moments (zeros when the checkpoint has none).
  std::vector<float> state(3 * k.agg.size(), 0.0F);
  std::copy(record->state.begin(), record->state.end(), state.begin());
  return k.agg.restore(shard.lane, state.data(), record->version, record->version);
}

}  // namespace psld
