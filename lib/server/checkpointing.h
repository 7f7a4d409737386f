// A server's side of consistent checkpoints (docs/checkpoint.md). Shard
// threads hand the writer each key's state as they apply a checkpoint round
// (a multiple of checkpoint.every_rounds); its thread appends the states to
// that round's file (lib/checkpoint/checkpoint.h). The coordinator's
// CheckpointSeal, sent once every worker went past the round, commits the
// file (fsync, rename) and is answered with a CheckpointSealed.
//
// Why a seal finds every state of its round already queued: a shard queues a
// key's state before it answers any pull of that round, and the coordinator
// seals a round only after every worker's pulls of it completed.
//
// Bounded: at most max_queued_bytes of states wait for the disk (a shard
// that would queue more waits: the checkpoint slows the job rather than
// grow without limit), and at most max_open_rounds files wait for their
// seal (the oldest is given up, and its seal answered with why).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/mutex.h"
#include "lib/checkpoint/checkpoint.h"
#include "lib/protocol/protocol.h"

namespace psld {

class CheckpointWriter {
 public:
  struct Options {
    std::string dir;
    uint32_t server = 0;
    uint64_t max_queued_bytes = uint64_t{256} << 20;
    size_t max_open_rounds = 4;
  };
  // Runs on the writer's thread with the answer to each seal.
  using SealedFn = std::function<void(const protocol::CheckpointSealed&)>;

  static Result<std::unique_ptr<CheckpointWriter>> start(Options options, SealedFn sealed);
  // Stops the thread; files not sealed are removed (never a torn file left
  // under its final name).
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // One key's state after `round`: `arrays` arrays of elements floats
  // (checkpoint::KeyRecord). Waits while the queue is full.
  void add(uint64_t round, checkpoint::KeyRecord record);
  // A key's state of `round` could not be taken (a device error): the
  // round's seal is answered with `why`.
  void fail(uint64_t round, std::string why);
  // The coordinator's seal of `round`; files of older rounds not sealed are
  // given up (the coordinator moved past them).
  void seal(uint64_t round);

 private:
  CheckpointWriter(Options options, SealedFn sealed);

  enum class Kind : uint8_t { kRecord, kFail, kSeal };
  struct Item {
    Kind kind = Kind::kRecord;
    uint64_t round = 0;
    checkpoint::KeyRecord record;
    std::string why;
  };
  // A round's file, on the writer's thread only.
  struct Open {
    std::optional<checkpoint::FileWriter> file;
    std::string error;  // non-empty: the seal answers this
  };

  void loop();
  void write(Item& item);
  void answer_seal(uint64_t round);
  // Gives up a round's file: removed, and its directory if that is empty.
  void drop(uint64_t round);

  const Options options_;
  const SealedFn sealed_;
  Mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_ GUARDED_BY(mu_);
  uint64_t queued_bytes_ GUARDED_BY(mu_) = 0;
  bool stop_ GUARDED_BY(mu_) = false;
  // The writer's thread only.
  std::map<uint64_t, Open> open_;
  std::map<uint64_t, std::string> given_up_;  // round -> why, until its seal
  uint64_t sealed_through_ = 0;               // the newest round sealed
  std::thread thread_;
};

}  // namespace psld
