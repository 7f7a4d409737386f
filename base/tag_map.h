// base/tag_map.h — a map from nonzero 32-bit tags to values: the operations a
// worker has in flight, found by the tag their completion carries.
//
// Open addressing with linear probing in one array, at most half full (it
// doubles then; it never shrinks). A tag's home slot is a Fibonacci hash of
// it: tags are handed out one after another, and the tags in flight would
// otherwise fill one long run of slots, which every erasure walks to its
// end. Erasure shifts the following entries of the run back (no
// tombstones), so probes stay short however long the map lives.
// Iteration order is unspecified: tags() gives them sorted.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace psld {

template <typename V>
class TagMap {
 public:
  TagMap() : slots_(kInitial), mask_(kInitial - 1), shift_(32 - std::countr_zero(kInitial)) {}

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  // The value of `tag`, or nullptr. Tag 0 is never present.
  V* find(uint32_t tag) {
    if (tag == 0) return nullptr;
    for (size_t i = home(tag);; i = (i + 1) & mask_) {
      if (slots_[i].tag == tag) return &slots_[i].value;
      if (slots_[i].tag == 0) return nullptr;
    }
  }
  bool contains(uint32_t tag) { return find(tag) != nullptr; }

  // Sets `tag` (nonzero) to `value`, replacing what it had.
  void put(uint32_t tag, V value) {
    // One probe: it ends at the tag or at the empty slot the tag goes in
    // (made room for first, even if the tag is there: growing is harmless).
    if (2 * (size_ + 1) > slots_.size()) grow();
    size_t i = home(tag);
    while (slots_[i].tag != tag && slots_[i].tag != 0)
      i = (i + 1) & mask_;
    if (slots_[i].tag == 0) {
      slots_[i].tag = tag;
      ++size_;
    }
    slots_[i].value = std::move(value);
  }

  // Removes `tag` and returns its value; nullopt if it was not there.
  std::optional<V> take(uint32_t tag) {
    if (tag == 0) return std::nullopt;
    size_t i = home(tag);
    while (slots_[i].tag != tag) {
      if (slots_[i].tag == 0) return std::nullopt;
      i = (i + 1) & mask_;
    }
    std::optional<V> out(std::move(slots_[i].value));
    remove_at(i);
    return out;
  }
  bool erase(uint32_t tag) { return take(tag).has_value(); }

  // fn(tag, value) for every entry, in no particular order. fn must not
  // change the map.
  template <typename Fn>
  void for_each(Fn&& fn) const {
    for (const Slot& s : slots_) {
      if (s.tag != 0) fn(s.tag, s.value);
    }
  }

  // Every tag, ascending (the order they were handed out in, until they wrap).
  std::vector<uint32_t> tags() const {
    std::vector<uint32_t> out;
    out.reserve(size_);
    for (const Slot& s : slots_) {
      if (s.tag != 0) out.push_back(s.tag);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  // Moves every entry out, leaving the map empty (its table kept).
  std::vector<std::pair<uint32_t, V>> take_all() {
    std::vector<std::pair<uint32_t, V>> out;
    out.reserve(size_);
    for (Slot& s : slots_) {
      if (s.tag == 0) continue;
      out.emplace_back(s.tag, std::move(s.value));
      s = Slot{};
    }
    size_ = 0;
    return out;
  }

 private:
  static constexpr size_t kInitial = 64;
  static_assert(std::has_single_bit(kInitial));
  struct Slot {
    uint32_t tag = 0;  // 0: empty
    V value{};
  };

  // The top bits of tag x 2^32/phi: consecutive tags land far apart.
  size_t home(uint32_t tag) const { return (tag * 0x9e3779b9u) >> shift_; }

  void place(uint32_t tag, V value) {
    size_t i = home(tag);
    while (slots_[i].tag != 0)
      i = (i + 1) & mask_;
    slots_[i].tag = tag;
    slots_[i].value = std::move(value);
    ++size_;
  }

  // Empties slot `hole`, then moves back each following entry of the run
  // whose home slot is not cyclically within (hole, its slot]: a lookup of
  // it would otherwise stop at the hole.
  void remove_at(size_t hole) {
    for (size_t j = (hole + 1) & mask_; slots_[j].tag != 0; j = (j + 1) & mask_) {
      const size_t h = home(slots_[j].tag);
      const bool stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
      if (stays) continue;
      slots_[hole] = std::move(slots_[j]);
      hole = j;
    }
    slots_[hole] = Slot{};
    --size_;
  }

  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    mask_ = slots_.size() - 1;
    --shift_;
    size_ = 0;
    for (Slot& s : old) {
      if (s.tag != 0) place(s.tag, std::move(s.value));
    }
  }

  std::vector<Slot> slots_;
  size_t mask_;
  int shift_;  // 32 - log2(slots)
  size_t size_ = 0;
};

}  // namespace psld
