// base/block_pool.h — freed blocks of one size kept for reuse, for objects
// made and freed at a high rate on the data path (a worker's RequestState:
// one per tensor per round).
//
// glibc's per-thread cache holds 7 freed blocks of a size; a round of a
// model's small tensors frees dozens of requests together, so each one went
// through malloc's bins (about 400 instructions a request;
// docs/ps-bench-results.md, "Instructions per chunk"). A BlockPool keeps up
// to `max_free` blocks of the first size asked of it; other sizes, and
// blocks beyond that, go to operator new and delete. Any thread may get and
// put; a block may be put by another thread than the one that got it.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

#include "base/mutex.h"

namespace psld {

class BlockPool {
 public:
  explicit BlockPool(size_t max_free) : max_free_(max_free) {
    MutexLock lock(mu_);
    free_.reserve(max_free);  // put() never allocates
  }
  ~BlockPool() {
    MutexLock lock(mu_);
    for (void* p : free_)
      ::operator delete(p);
  }
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  void* get(size_t bytes) {
    {
      MutexLock lock(mu_);
      if (block_bytes_ == 0) block_bytes_ = bytes;
      if (bytes == block_bytes_ && !free_.empty()) {
        void* p = free_.back();
        free_.pop_back();
        return p;
      }
    }
    return ::operator new(bytes);
  }

  void put(void* p, size_t bytes) noexcept {
    {
      MutexLock lock(mu_);
      if (bytes == block_bytes_ && free_.size() < max_free_) {
        free_.push_back(p);
        return;
      }
    }
    ::operator delete(p);
  }

  size_t num_free() const {
    MutexLock lock(mu_);
    return free_.size();
  }

 private:
  const size_t max_free_;
  mutable Mutex mu_;
  size_t block_bytes_ GUARDED_BY(mu_) = 0;  // the pooled size: the first asked for
  std::vector<void*> free_ GUARDED_BY(mu_);
};

// An allocator over a BlockPool that outlives every block it hands out (a
// process-wide one, for objects that users may keep past their maker),
// e.g. std::allocate_shared<T>(PoolAllocator<T>(&pool), ...).
template <typename T>
class PoolAllocator {
 public:
  using value_type = T;
  static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__);

  explicit PoolAllocator(BlockPool* pool) noexcept : pool_(pool) {}
  template <typename U>
  PoolAllocator(const PoolAllocator<U>& other) noexcept : pool_(other.pool()) {}

  T* allocate(size_t n) { return static_cast<T*>(pool_->get(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { pool_->put(p, n * sizeof(T)); }
  BlockPool* pool() const noexcept { return pool_; }

  template <typename U>
  bool operator==(const PoolAllocator<U>& other) const noexcept {
    return pool_ == other.pool();
  }

 private:
  BlockPool* pool_;
};

}  // namespace psld
