// TagMap against std::map: the same operations give the same contents,
// whatever the tags' order, collisions, erasures inside probe runs and growth.
#include "base/tag_map.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace psld {
namespace {

void expect_same(TagMap<std::string>& got, const std::map<uint32_t, std::string>& want) {
  ASSERT_EQ(got.size(), want.size());
  std::vector<uint32_t> want_tags;
  for (const auto& [tag, value] : want) {
    want_tags.push_back(tag);
    const std::string* v = got.find(tag);
    ASSERT_NE(v, nullptr) << "tag " << tag;
    EXPECT_EQ(*v, value);
  }
  EXPECT_EQ(got.tags(), want_tags);
  size_t seen = 0;
  got.for_each([&](uint32_t tag, const std::string& value) {
    ++seen;
    auto it = want.find(tag);
    ASSERT_NE(it, want.end());
    EXPECT_EQ(value, it->second);
  });
  EXPECT_EQ(seen, want.size());
}

TEST(TagMap, FindPutTakeOnEmptyAndZero) {
  TagMap<std::string> m;
  EXPECT_TRUE(m.empty());
  EXPECT_EQ(m.find(7), nullptr);
  EXPECT_EQ(m.find(0), nullptr);
  EXPECT_FALSE(m.take(7).has_value());
  m.put(7, "seven");
  m.put(7, "SEVEN");  // replaces
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(*m.find(7), "SEVEN");
  auto v = m.take(7);
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(*v, "SEVEN");
  EXPECT_TRUE(m.empty());
  EXPECT_FALSE(m.erase(7));
}

// A table of 64 slots 31 entries full of random tags has runs of several
// entries, some wrapping past its end: erasing each one, from wherever it
// sits in its run, must leave every other entry findable.
TEST(TagMap, ErasingFromAnywhereInARunKeepsTheRest) {
  for (uint32_t seed = 1; seed <= 50; ++seed) {
    std::mt19937 rng(seed);
    TagMap<std::string> m;
    std::map<uint32_t, std::string> want;
    while (want.size() < 31) {
      const uint32_t tag = 1 + rng() % 1000000;
      m.put(tag, std::to_string(tag));
      want[tag] = std::to_string(tag);
    }
    std::vector<uint32_t> order;
    order.reserve(want.size());
    for (const auto& [tag, value] : want)
      order.push_back(tag);
    std::shuffle(order.begin(), order.end(), rng);
    for (uint32_t tag : order) {
      EXPECT_TRUE(m.erase(tag));
      want.erase(tag);
      expect_same(m, want);
    }
  }
}

TEST(TagMap, RandomOperationsMatchAStdMap) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    std::mt19937 rng(seed);
    TagMap<std::string> m;
    std::map<uint32_t, std::string> want;
    uint32_t next = 1;
    for (int step = 0; step < 5000; ++step) {
      const uint32_t r = rng() % 100;
      if (r < 45) {
        // Mostly sequential tags, as a worker hands them out; now and then a
        // far one (a tag that collides after a wrap).
        const uint32_t tag = (rng() % 10 == 0) ? 1 + rng() % 100000 : next++;
        const std::string value = std::to_string(rng());
        m.put(tag, value);
        want[tag] = value;
      } else if (r < 90 && !want.empty()) {
        auto it = want.begin();
        std::advance(it, rng() % want.size());
        auto got = m.take(it->first);
        ASSERT_TRUE(got.has_value()) << "seed " << seed << " tag " << it->first;
        EXPECT_EQ(*got, it->second);
        want.erase(it);
      } else {
        const uint32_t tag = 1 + rng() % (next + 10);
        EXPECT_EQ(m.find(tag) != nullptr, want.count(tag) == 1);
      }
      if (step % 500 == 0) expect_same(m, want);
    }
    expect_same(m, want);
  }
}

TEST(TagMap, TakeAllEmptiesAndReleasesValues) {
  TagMap<std::shared_ptr<int>> m;
  auto held = std::make_shared<int>(1);
  for (uint32_t tag = 1; tag <= 100; ++tag)
    m.put(tag, held);
  EXPECT_EQ(held.use_count(), 101);
  EXPECT_TRUE(m.erase(50));
  EXPECT_EQ(held.use_count(), 100);
  auto all = m.take_all();
  EXPECT_EQ(all.size(), 99u);
  EXPECT_TRUE(m.empty());
  EXPECT_EQ(m.find(1), nullptr);
  all.clear();
  EXPECT_EQ(held.use_count(), 1);
  m.put(3, held);  // usable again
  EXPECT_EQ(m.size(), 1u);
}

}  // namespace
}  // namespace psld
