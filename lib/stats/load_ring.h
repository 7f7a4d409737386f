// LoadRing: the fixed-capacity, lock-free ring of load samples (docs/design.md §5),
// and WindowStats, which turns a window of drained samples into a summary.
//
// Many producers (data-path threads recording bytes moved, queueing delay,
// reduce time) and one consumer (the thread that sends a summary to the
// coordinator every interval). Producers never block and never allocate: a
// push is one fetch_add and a handful of relaxed stores. When producers
// outrun the consumer the ring overwrites its oldest samples, and the
// consumer counts every sample it never saw, so
//   consumed + lost == pushed
// holds exactly once the producers have stopped and the ring is drained.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "psld/status.h"

namespace psld {

// One load sample. `source` says what it is about (an arc index, a server id)
// and `metric` which quantity (see the users' enums); the ring itself does not
// interpret either.
struct LoadSample {
  uint64_t time_ns = 0;
  uint32_t source = 0;
  uint32_t metric = 0;
  double value = 0;
};

template <typename T>
concept RingSample = std::is_trivially_copyable_v<T> && sizeof(T) % sizeof(uint64_t) == 0 &&
                     alignof(T) <= alignof(uint64_t);

template <RingSample T>
class LoadRing {
 public:
  static constexpr size_t kMinCapacity = 2;
  static constexpr size_t kMaxCapacity = size_t{1} << 24;

  // A ring of `capacity` samples (a power of two in [2, 2^24]).
  static Result<std::unique_ptr<LoadRing>> make(size_t capacity) {
    if (capacity < kMinCapacity || capacity > kMaxCapacity || !std::has_single_bit(capacity)) {
      return InvalidArgument("LoadRing capacity must be a power of two in [2, 16777216], got " +
                             std::to_string(capacity));
    }
    return std::unique_ptr<LoadRing>(new LoadRing(capacity));
  }

  LoadRing(const LoadRing&) = delete;
  LoadRing& operator=(const LoadRing&) = delete;

  size_t capacity() const { return mask_ + 1; }

  // Any thread, wait-free. Returns false when the sample was dropped because
  // its slot was still being written by a producer a whole lap behind (that
  // producer was descheduled for `capacity` pushes); the consumer counts the
  // sample as lost.
  bool push(const T& sample) {
    const uint64_t seq = head_.fetch_add(1, std::memory_order_relaxed);
    Slot& slot = slots_[seq & mask_];
    const uint64_t writing = 2 * seq + 1;
    uint64_t cur = slot.stamp.load(std::memory_order_relaxed);
    do {
      // Odd: another producer is mid-write. >= writing: a later lap already
      // owns the slot. Either way this sample can only be dropped.
      if ((cur & 1) != 0 || cur >= writing) {
        dropped_.fetch_add(1, std::memory_order_relaxed);
        return false;
      }
    } while (!slot.stamp.compare_exchange_weak(cur, writing, std::memory_order_relaxed));
    // Seqlock writer. Each data word is stored with release, so a reader that
    // sees any new word also sees the odd stamp and rejects the torn read.
    // (Release stores instead of a standalone fence: ThreadSanitizer does not
    // model fences, and on x86 both compile to plain moves.)
    const auto words = std::bit_cast<std::array<uint64_t, kWords>>(sample);
    for (size_t i = 0; i < kWords; ++i)
      slot.words[i].store(words[i], std::memory_order_release);
    slot.stamp.store(writing + 1, std::memory_order_release);
    return true;
  }

  // How drain() treats a sequence number whose sample is not published yet.
  enum class DrainMode {
    // Stop there: its producer may still be writing it (the sample arrives
    // next time), so samples are never reordered or lost by a slow producer.
    // A sample dropped by a lapped producer holds later ones back until the
    // ring wraps past it (at most `capacity` more pushes), which happens
    // soon, since drops only occur when producers lap the ring.
    kLive,
    // Count it as lost and go on. Only correct once no producer is pushing
    // (shutdown, or after joining the producers): then nothing unpublished
    // will ever be published.
    kFinal,
  };

  // One consumer at a time. Calls fn(const T&) for each published sample in
  // push order, at most `max` of them, and returns how many it delivered.
  template <typename Fn>
  size_t drain(Fn&& fn, size_t max = SIZE_MAX, DrainMode mode = DrainMode::kLive) {
    const uint64_t head = head_.load(std::memory_order_acquire);
    if (head - tail_ > capacity()) {
      const uint64_t gone = head - capacity() - tail_;
      lost_.fetch_add(gone, std::memory_order_relaxed);
      tail_ += gone;
    }
    size_t delivered = 0;
    while (tail_ < head && delivered < max) {
      Slot& slot = slots_[tail_ & mask_];
      const uint64_t published = 2 * tail_ + 2;
      const uint64_t s1 = slot.stamp.load(std::memory_order_acquire);
      if (s1 == published) {
        std::array<uint64_t, kWords> words;
        for (size_t i = 0; i < kWords; ++i)
          words[i] = slot.words[i].load(std::memory_order_acquire);
        if (slot.stamp.load(std::memory_order_relaxed) == s1) {
          const T sample = std::bit_cast<T>(words);
          ++tail_;
          ++delivered;
          fn(static_cast<const T&>(sample));
          continue;
        }
        lost_.fetch_add(1, std::memory_order_relaxed);  // a later lap overwrote it mid-read
        ++tail_;
        continue;
      }
      if (s1 > published) {  // a later lap already claimed the slot
        lost_.fetch_add(1, std::memory_order_relaxed);
        ++tail_;
        continue;
      }
      // Not yet published.
      if (mode == DrainMode::kFinal) {
        lost_.fetch_add(1, std::memory_order_relaxed);
        ++tail_;
        continue;
      }
      break;
    }
    consumed_.fetch_add(delivered, std::memory_order_relaxed);  // once, not per sample
    return delivered;
  }

  // Counters, readable from any thread.
  uint64_t pushed() const { return head_.load(std::memory_order_relaxed); }
  uint64_t consumed() const { return consumed_.load(std::memory_order_relaxed); }
  // Samples the consumer will never see: overwritten before they were drained,
  // or dropped by a producer.
  uint64_t lost() const { return lost_.load(std::memory_order_relaxed); }
  // Pushes that returned false (a subset of lost(), once drained).
  uint64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }

 private:
  static constexpr size_t kWords = sizeof(T) / sizeof(uint64_t);

  struct Slot {
    // 2*seq+1 while the producer of `seq` writes, 2*seq+2 once published.
    std::atomic<uint64_t> stamp{0};
    std::array<std::atomic<uint64_t>, kWords> words{};
  };

  explicit LoadRing(size_t capacity) : mask_(capacity - 1), slots_(new Slot[capacity]) {}

  const uint64_t mask_;
  std::unique_ptr<Slot[]> slots_;
  alignas(64) std::atomic<uint64_t> head_{0};
  alignas(64) std::atomic<uint64_t> dropped_{0};
  // Consumer side.
  alignas(64) uint64_t tail_ = 0;
  std::atomic<uint64_t> consumed_{0};
  std::atomic<uint64_t> lost_{0};
};

// The summary of one window of samples.
struct WindowSummary {
  uint64_t count = 0;
  double sum = 0;
  double mean = 0;  // 0 for an empty window
  double min = 0;
  double max = 0;
  double p50 = 0;  // nearest-rank percentiles over the window
  double p99 = 0;
  double ewma = 0;  // exponentially weighted mean across windows (see WindowStats)
  // True when p50/p99 were computed from a uniform sample of the window
  // because it held more values than WindowStats keeps (count, sum, mean,
  // min and max are always exact).
  bool sampled = false;
};

// Accumulates the values of one window and closes it into a WindowSummary.
// Memory is bounded by max_values whatever the window length: past it,
// percentiles come from a reservoir sample (deterministic, seeded).
class WindowStats {
 public:
  // alpha: EWMA weight of the newest window's mean, in (0, 1].
  static Result<WindowStats> make(double ewma_alpha = 0.2, size_t max_values = 4096);

  // Inline: every load sample of a queue or answer time comes here.
  void add(double value) {
    if (count_ == 0) {
      min_ = max_ = value;
    } else {
      min_ = std::min(min_, value);
      max_ = std::max(max_, value);
    }
    ++count_;
    sum_ += value;
    if (values_.size() < max_values_) {
      values_.push_back(value);
      return;
    }
    // Reservoir sampling (Algorithm R) keeps a uniform sample of the window in
    // bounded memory; xorshift64 keeps it deterministic across runs.
    rng_ ^= rng_ << 13;
    rng_ ^= rng_ >> 7;
    rng_ ^= rng_ << 17;
    const uint64_t j = rng_ % count_;
    if (j < max_values_) values_[j] = value;
  }
  // Summarises the window, folds its mean into the EWMA (an empty window
  // leaves the EWMA as it was) and starts a new window.
  WindowSummary close();

  double ewma() const { return ewma_; }
  bool has_ewma() const { return has_ewma_; }
  uint64_t windows() const { return windows_; }

 private:
  WindowStats(double alpha, size_t max_values);

  double alpha_;
  size_t max_values_;
  std::vector<double> values_;
  uint64_t count_ = 0;
  double sum_ = 0;
  double min_ = 0;
  double max_ = 0;
  double ewma_ = 0;
  bool has_ewma_ = false;
  uint64_t windows_ = 0;
  uint64_t rng_ = 0x9e3779b97f4a7c15ull;
};

}  // namespace psld
