// Where code that measures or waits on time reads it: a TimeSource. By
// default it is the steady clock; a test hands in a ManualClock instead, whose
// time moves only when the test advances it, so that what depends on time
// (token buckets, busy periods) is checked exactly and without sleeping.
//
// A TimeSource is a handle, not an interface: now() is one inline, predictable
// branch before steady_clock::now(), so the data path that read the steady
// clock once per operation still does, with no virtual call added.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace psld {

// Time for tests: starts at kStart and advances only in advance() or set().
// Any thread may read it while one advances it.
class ManualClock {
 public:
  using time_point = std::chrono::steady_clock::time_point;
  using duration = std::chrono::steady_clock::duration;

  // Far from the steady clock's zero, as a real clock is: state that starts
  // at time_point{} (a token bucket's "free since") then looks long idle.
  static constexpr time_point kStart = time_point(std::chrono::hours(1));

  time_point now() const { return time_point(duration(ticks_.load(std::memory_order_acquire))); }
  void advance(duration d) { ticks_.fetch_add(d.count(), std::memory_order_acq_rel); }
  void set(time_point t) { ticks_.store(t.time_since_epoch().count(), std::memory_order_release); }

 private:
  std::atomic<duration::rep> ticks_{kStart.time_since_epoch().count()};
};

class TimeSource {
 public:
  using time_point = std::chrono::steady_clock::time_point;
  using duration = std::chrono::steady_clock::duration;

  TimeSource() = default;  // the steady clock
  // `clock` must outlive every user of this source.
  explicit TimeSource(const ManualClock* clock) : manual_(clock) {}

  time_point now() const {
    return manual_ == nullptr ? std::chrono::steady_clock::now() : manual_->now();
  }

  // How long a thread should block, in real time, for `d` to pass on this
  // source: `d` on the steady clock; zero on a manual clock, whose time does
  // not pass while a thread blocks (the test advances it, then drives the
  // code again).
  duration real_delay(duration d) const { return manual_ == nullptr ? d : duration::zero(); }

 private:
  const ManualClock* manual_ = nullptr;
};

}  // namespace psld
