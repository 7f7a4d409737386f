// How a backup tells that a replication copy landed whole
// (docs/replication.md, "A copy after every change"). A copy comes as one
// write of its slot, or as two: its body (the state without its header,
// kCopyBody in the notification) and its header, in either order. Pure, so
// that the rule is tested alone (tests/copy_parts_test.cc).
#pragma once

#include <cstdint>

namespace psld {

// A shipped or copied key's state: {u64 version, u64 arrays or reserved},
// then parameter, first and second moment, fp32.
inline constexpr uint64_t kStateHeader = 16;

// The notification of a replication copy's write: the key's copy tag (a
// multiple of 4, from ReplicaOpen) plus the slot (bit 0), and kCopyBody
// (bit 1) where the write holds the copy without its header.
inline constexpr uint32_t kCopyBody = 2;
inline constexpr uint32_t kCopyPart = 3;  // the bits that are not the tag

// The parts of the copies in a key's two slots that have landed.
class CopyParts {
 public:
  enum class Landed {
    kWhole,  // the slot now holds a whole copy (and its record starts over)
    kPart,   // one part of two: the other follows
    kBad,    // a length that is neither a copy nor one of its parts
  };
  // A write of `length` bytes with notification `notify` landed in a copy
  // whose slots hold `slot_bytes` each.
  Landed land(uint32_t notify, uint64_t length, uint64_t slot_bytes) {
    if (slot_bytes <= kStateHeader) return Landed::kBad;
    const uint32_t slot = notify & 1u;
    uint8_t part = 0;
    if ((notify & kCopyBody) != 0) {
      if (length == slot_bytes - kStateHeader) part = kBody;
    } else if (length == kStateHeader) {
      part = kHeader;
    } else if (length == slot_bytes) {
      part = kHeader | kBody;
    }
    if (part == 0) return Landed::kBad;
    landed_[slot] |= part;
    if (landed_[slot] != (kHeader | kBody)) return Landed::kPart;
    landed_[slot] = 0;
    return Landed::kWhole;
  }

 private:
  static constexpr uint8_t kHeader = 1;
  static constexpr uint8_t kBody = 2;
  uint8_t landed_[2] = {0, 0};
};

}  // namespace psld
