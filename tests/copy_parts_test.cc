// When a backup takes a replication copy (lib/server/copy_parts.h): a whole
// copy at once, or its body and its header in either order, never one part
// alone; the two slots apart.
#include "lib/server/copy_parts.h"

#include <gtest/gtest.h>

namespace psld {
namespace {

using Landed = CopyParts::Landed;

constexpr uint32_t kTag = 40;  // a multiple of 4, as ReplicaOpen's
constexpr uint64_t kSlot = kStateHeader + 4096;
constexpr uint64_t kBodyBytes = kSlot - kStateHeader;

TEST(CopyParts, AWholeCopyLandsInOneWrite) {
  CopyParts parts;
  EXPECT_EQ(parts.land(kTag, kSlot, kSlot), Landed::kWhole);
  EXPECT_EQ(parts.land(kTag + 1, kSlot, kSlot), Landed::kWhole);
}

TEST(CopyParts, BodyAndHeaderInEitherOrderMakeOneCopy) {
  CopyParts parts;
  EXPECT_EQ(parts.land(kTag | kCopyBody, kBodyBytes, kSlot), Landed::kPart);
  EXPECT_EQ(parts.land(kTag, kStateHeader, kSlot), Landed::kWhole);
  EXPECT_EQ(parts.land(kTag, kStateHeader, kSlot), Landed::kPart);
  EXPECT_EQ(parts.land(kTag | kCopyBody, kBodyBytes, kSlot), Landed::kWhole);
}

TEST(CopyParts, OnePartAloneIsNeverACopy) {
  // The next copy into a slot starts over: a part left from the last whole
  // one does not complete it.
  CopyParts parts;
  EXPECT_EQ(parts.land(kTag, kStateHeader, kSlot), Landed::kPart);
  EXPECT_EQ(parts.land(kTag | kCopyBody, kBodyBytes, kSlot), Landed::kWhole);
  EXPECT_EQ(parts.land(kTag | kCopyBody, kBodyBytes, kSlot), Landed::kPart);
  EXPECT_EQ(parts.land(kTag | kCopyBody, kBodyBytes, kSlot), Landed::kPart);
  EXPECT_EQ(parts.land(kTag, kStateHeader, kSlot), Landed::kWhole);
}

TEST(CopyParts, TheTwoSlotsAreCountedApart) {
  CopyParts parts;
  EXPECT_EQ(parts.land(kTag, kStateHeader, kSlot), Landed::kPart);                  // slot 0
  EXPECT_EQ(parts.land((kTag + 1) | kCopyBody, kBodyBytes, kSlot), Landed::kPart);  // slot 1
  EXPECT_EQ(parts.land(kTag + 1, kStateHeader, kSlot), Landed::kWhole);             // slot 1
  EXPECT_EQ(parts.land(kTag | kCopyBody, kBodyBytes, kSlot), Landed::kWhole);       // slot 0
}

TEST(CopyParts, OtherLengthsAreRefused) {
  CopyParts parts;
  EXPECT_EQ(parts.land(kTag | kCopyBody, kSlot, kSlot), Landed::kBad);  // a body with its header
  EXPECT_EQ(parts.land(kTag | kCopyBody, kStateHeader, kSlot), Landed::kBad);
  EXPECT_EQ(parts.land(kTag, kBodyBytes, kSlot), Landed::kBad);  // a body not marked so
  EXPECT_EQ(parts.land(kTag, 0, kSlot), Landed::kBad);
  EXPECT_EQ(parts.land(kTag, kStateHeader, kStateHeader), Landed::kBad);  // no room for a state
  // Refusals leave nothing behind: a header then still needs its body.
  EXPECT_EQ(parts.land(kTag, kStateHeader, kSlot), Landed::kPart);
  EXPECT_EQ(parts.land(kTag | kCopyBody, kBodyBytes, kSlot), Landed::kWhole);
}

}  // namespace
}  // namespace psld
