// BlockPool and PoolAllocator: freed blocks of the pooled size come back,
// other sizes and blocks past the cap go to operator delete, and objects
// made through allocate_shared live and die normally, from many threads.
#include "base/block_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <set>
#include <thread>
#include <vector>

namespace psld {
namespace {

TEST(BlockPool, AFreedBlockOfThePooledSizeIsReused) {
  BlockPool pool(4);
  void* a = pool.get(96);
  void* b = pool.get(96);
  EXPECT_NE(a, b);
  pool.put(a, 96);
  EXPECT_EQ(pool.num_free(), 1u);
  EXPECT_EQ(pool.get(96), a);
  EXPECT_EQ(pool.num_free(), 0u);
  pool.put(a, 96);
  pool.put(b, 96);
}

TEST(BlockPool, OtherSizesAndBlocksPastTheCapAreNotKept) {
  BlockPool pool(2);
  void* first = pool.get(64);  // 64 is the pooled size from now on
  void* other = pool.get(128);
  pool.put(other, 128);
  EXPECT_EQ(pool.num_free(), 0u);
  std::vector<void*> blocks{first, pool.get(64), pool.get(64)};
  for (void* p : blocks)
    pool.put(p, 64);
  EXPECT_EQ(pool.num_free(), 2u);  // the third went to operator delete
}

struct Counted {
  explicit Counted(std::atomic<int>* alive) : alive(alive) { ++*alive; }
  ~Counted() { --*alive; }
  std::atomic<int>* alive;
  char payload[100] = {};
};

TEST(PoolAllocator, SharedObjectsLiveAndDieAndTheirBlocksComeBack) {
  BlockPool pool(64);
  std::atomic<int> alive{0};
  std::set<const void*> seen;
  for (int round = 0; round < 5; ++round) {
    std::vector<std::shared_ptr<Counted>> objects;
    for (int i = 0; i < 32; ++i) {
      objects.push_back(std::allocate_shared<Counted>(PoolAllocator<Counted>(&pool), &alive));
      seen.insert(objects.back().get());
    }
    EXPECT_EQ(alive.load(), 32);
    objects.clear();
    EXPECT_EQ(alive.load(), 0);
    EXPECT_EQ(pool.num_free(), 32u);
  }
  EXPECT_EQ(seen.size(), 32u);  // rounds 2-5 reused round 1's blocks
}

// Made on this thread, freed on four others while this one makes more.
TEST(PoolAllocator, ObjectsFreedOnOtherThreadsThanTheirMakers) {
  BlockPool pool(256);
  std::atomic<int> alive{0};
  constexpr int kThreads = 4;
  constexpr int kEach = 2000;
  std::vector<std::vector<std::shared_ptr<Counted>>> batches(kThreads);
  for (auto& batch : batches) {
    for (int i = 0; i < kEach; ++i)
      batch.push_back(std::allocate_shared<Counted>(PoolAllocator<Counted>(&pool), &alive));
  }
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (auto& batch : batches)
    threads.emplace_back([&batch] { batch.clear(); });
  std::vector<std::shared_ptr<Counted>> more;
  for (int i = 0; i < kEach; ++i) {
    more.push_back(std::allocate_shared<Counted>(PoolAllocator<Counted>(&pool), &alive));
    if (more.size() == 50) more.clear();
  }
  for (auto& th : threads)
    th.join();
  more.clear();
  EXPECT_EQ(alive.load(), 0);
  EXPECT_EQ(pool.num_free(), 256u);  // the cap: the rest went back to operator delete
}

}  // namespace
}  // namespace psld
