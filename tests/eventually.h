// eventually(): the one way a test waits for something another thread or
// process does. It polls a predicate until it holds or a deadline passes and
// says what it awaited when it gives up, so
//
//   ASSERT_TRUE(eventually("the switch to commit", 10s, [&] { return ...; }));
//
// prints "timed out after 10000 ms waiting for the switch to commit".
// Code that returns a Status checks the result and words its own Timeout.
//
// Time that a test can own (token buckets, busy periods) is not awaited at
// all: inject a ManualClock (base/clock.h) and advance it.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string_view>
#include <thread>

namespace psld {

// `done` is checked once more after the deadline, so a condition that came
// true during the last poll interval still counts.
inline ::testing::AssertionResult eventually(
    std::string_view what, std::chrono::milliseconds timeout, const std::function<bool()>& done,
    std::chrono::microseconds poll = std::chrono::milliseconds(1)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) {
      return ::testing::AssertionFailure()
             << "timed out after " << timeout.count() << " ms waiting for " << what;
    }
    std::this_thread::sleep_for(poll);
  }
  return ::testing::AssertionSuccess();
}

}  // namespace psld
