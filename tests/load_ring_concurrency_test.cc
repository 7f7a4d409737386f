// Many producers, one consumer, run under ThreadSanitizer in CI.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "lib/stats/load_ring.h"

namespace psld {
namespace {

constexpr uint32_t kProducers = 4;

// Each producer pushes value = its own running counter, so the consumer can
// check per-producer order and that no sample was torn (time_ns mirrors value).
void run(size_t capacity, uint64_t per_producer, bool consumer_sleeps,
         bool expect_no_loss = false) {
  auto ring = *LoadRing<LoadSample>::make(capacity);
  std::atomic<uint32_t> done{0};
  std::vector<std::thread> producers;
  for (uint32_t p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      for (uint64_t i = 0; i < per_producer; ++i) {
        LoadSample s;
        s.time_ns = i;
        s.source = p;
        s.metric = ~p;
        s.value = static_cast<double>(i);
        ring->push(s);
      }
      done.fetch_add(1);
    });
  }

  std::vector<int64_t> last(kProducers, -1);
  uint64_t delivered = 0, torn = 0, reordered = 0;
  auto check = [&](const LoadSample& s) {
    ++delivered;
    if (s.source >= kProducers || s.metric != ~s.source ||
        static_cast<double>(s.time_ns) != s.value) {
      ++torn;
      return;
    }
    if (static_cast<int64_t>(s.time_ns) <= last[s.source]) ++reordered;
    last[s.source] = static_cast<int64_t>(s.time_ns);
  };
  while (done.load() < kProducers) {
    ring->drain(check);
    if (consumer_sleeps) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  for (auto& t : producers)
    t.join();
  // Every producer has stopped: what is still unpublished (a push dropped by
  // a lapped producer) is lost for good.
  ring->drain(check, SIZE_MAX, LoadRing<LoadSample>::DrainMode::kFinal);

  EXPECT_EQ(torn, 0u);
  EXPECT_EQ(reordered, 0u);
  EXPECT_EQ(delivered, ring->consumed());
  EXPECT_EQ(ring->pushed(), kProducers * per_producer);
  EXPECT_EQ(ring->consumed() + ring->lost(), ring->pushed())
      << "consumed " << ring->consumed() << " lost " << ring->lost();
  EXPECT_LE(ring->dropped(), ring->lost());
  if (expect_no_loss) {
    EXPECT_EQ(ring->lost(), 0u);
  }
}

TEST(LoadRingConcurrency, LargeRingKeepsUpWithoutLoss) {
  // 4 x 20,000 pushes into a ring that holds them all: nothing may be lost.
  run(size_t{1} << 17, 20000, /*consumer_sleeps=*/false, /*expect_no_loss=*/true);
}

TEST(LoadRingConcurrency, SmallRingOverwritesAndCountsExactly) {
  run(64, 50000, /*consumer_sleeps=*/true);
}

TEST(LoadRingConcurrency, TinyRingUnderHeavyContention) {
  run(2, 20000, /*consumer_sleeps=*/false);
}

}  // namespace
}  // namespace psld
