// The verbs backend's software side of posting: how many work requests a
// queue pair may have outstanding, what waits in software meanwhile, and how
// long wait() spins before it sleeps. Device-free so it is unit-tested here.
//
// None of these classes locks; the transport holds its mutex around them.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

namespace psld::transport::verbs {

// A count of free slots shared by several queues: the send completion queue.
// Every posted work request is signalled and produces exactly one completion,
// so the number posted across all queue pairs must never exceed the CQ's
// capacity, or the CQ overruns and the device fails every queue pair on it.
class SlotBudget {
 public:
  explicit SlotBudget(uint32_t capacity) : capacity_(capacity) {}
  bool try_acquire() {
    if (used_ >= capacity_) return false;
    ++used_;
    return true;
  }
  // False when more is released than was acquired (a completion the queue
  // did not post): the budget is then left at zero, never wrapped around.
  bool release(uint32_t n = 1) {
    const bool ok = n <= used_;
    used_ -= std::min(n, used_);
    return ok;
  }
  uint32_t used() const { return used_; }
  uint32_t capacity() const { return capacity_; }

 private:
  uint32_t capacity_;
  uint32_t used_ = 0;
};

// What a post attempt did with the item it was handed.
enum class PostResult {
  kPosted,   // on the wire; its slot stays taken until complete()
  kNotNow,   // a resource other than a slot is short (a bounce buffer): the
             // item stays at the head, draining stops until the next drain()
  kFailed,   // the post failed; the caller has failed the item's operation
  kDropped,  // the item is not to be sent (its operation already completed,
             // e.g. timed out while waiting): removed, draining goes on
};

// One queue pair's send side: at most `depth` work requests posted (the QP's
// send queue size), each also holding a slot of the shared budget, and up to
// `max_backlog` more waiting in software, in the order they were submitted.
// Items are posted strictly in submission order: a message sent after a write
// must not overtake it, since RC ordering is what tells the receiver that the
// write's bytes are in place.
//
// Full backlog: push() refuses, so the caller answers ResourceExhausted
// without sending anything. Nothing is ever dropped once accepted, and no
// call blocks.
template <typename Item>
class SendQueue {
 public:
  SendQueue(uint32_t depth, size_t max_backlog, SlotBudget* shared)
      : depth_(depth), max_backlog_(max_backlog), shared_(shared) {}

  bool push(Item item) {
    if (backlog_.size() >= max_backlog_) return false;
    backlog_.push_back(std::move(item));
    return true;
  }

  // Hands waiting items, oldest first, to `post` (PostResult(Item&)) while
  // this queue and the shared budget both have a free slot. Returns how many
  // were posted.
  template <typename Post>
  size_t drain(Post&& post) {
    size_t n = 0;
    while (!backlog_.empty() && posted_ < depth_) {
      if (!shared_->try_acquire()) break;
      const PostResult r = post(backlog_.front());
      if (r == PostResult::kNotNow) {
        shared_->release();
        break;
      }
      backlog_.pop_front();
      if (r == PostResult::kDropped) {
        shared_->release();
        continue;
      }
      if (r == PostResult::kFailed) {
        shared_->release();
        break;
      }
      ++posted_;
      ++n;
    }
    return n;
  }

  // A posted work request completed (successfully or not). False for a
  // completion of nothing posted (a device that reports one twice), which
  // changes nothing.
  bool complete() {
    if (posted_ == 0) return false;
    --posted_;
    return shared_->release();
  }

  // Returns every posted slot to the shared budget without completions: only
  // when the queue pair was destroyed with work requests whose completions
  // will never be polled.
  void abandon_posted() {
    shared_->release(posted_);
    posted_ = 0;
  }

  // Removes and returns the waiting items for which pred(const Item&) holds.
  template <typename Pred>
  std::vector<Item> extract_if(Pred&& pred) {
    std::vector<Item> out;
    for (auto it = backlog_.begin(); it != backlog_.end();) {
      if (pred(*it)) {
        out.push_back(std::move(*it));
        it = backlog_.erase(it);
      } else {
        ++it;
      }
    }
    return out;
  }

  // Removes and returns everything waiting (the connection closed).
  std::deque<Item> take_backlog() { return std::exchange(backlog_, {}); }

  uint32_t posted() const { return posted_; }
  size_t backlog() const { return backlog_.size(); }
  uint32_t depth() const { return depth_; }
  size_t max_backlog() const { return max_backlog_; }

 private:
  uint32_t depth_;
  size_t max_backlog_;
  SlotBudget* shared_;
  uint32_t posted_ = 0;
  std::deque<Item> backlog_;
};

// How long wait() polls the completion queue before it arms the completion
// channel and sleeps. Sleeping costs a system call and an interrupt on the
// way back (several microseconds); spinning costs a core. The budget doubles
// while spinning finds work (a busy phase: stay hot) and halves when a spin
// found nothing (going idle: stop burning CPU), so an idle transport sleeps at
// once and costs no CPU.
class AdaptiveSpin {
 public:
  using Micros = std::chrono::microseconds;
  explicit AdaptiveSpin(Micros max) : max_(max), budget_(max / 8) {}

  Micros budget() const { return budget_; }
  void found_work() { budget_ = std::min(max_, std::max(budget_ * 2, Micros(1))); }
  void found_nothing() { budget_ /= 2; }

 private:
  Micros max_;
  Micros budget_;
};

}  // namespace psld::transport::verbs
