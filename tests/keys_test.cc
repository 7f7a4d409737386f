#include "psld/keys.h"

#include <gtest/gtest.h>

namespace psld {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

// Chunks must tile the tensor exactly: contiguous, in order, none empty, none
// larger than chunk_bytes, all but the last exactly chunk_bytes.
void expect_tiles(const ChunkLayout& l) {
  uint64_t next = 0;
  for (uint64_t i = 0; i < l.num_chunks(); ++i) {
    ChunkSpan c = l.chunk(static_cast<uint32_t>(i));
    ASSERT_EQ(c.index, i);
    ASSERT_EQ(c.offset, next);
    ASSERT_GT(c.bytes, 0u);
    ASSERT_LE(c.bytes, l.chunk_bytes());
    if (i + 1 < l.num_chunks()) {
      ASSERT_EQ(c.bytes, l.chunk_bytes());
    }
    ASSERT_EQ(c.key, make_key(l.tensor(), static_cast<uint32_t>(i)));
    ASSERT_EQ(c.offset % l.element_bytes(), 0u);
    next += c.bytes;
  }
  EXPECT_EQ(next, l.tensor_bytes());
}

TEST(Keys, KeyPacksTensorAndChunk) {
  Key k = make_key(0xdeadbeef, 0x12345678);
  EXPECT_EQ(k, 0xdeadbeef12345678ull);
  EXPECT_EQ(key_tensor(k), 0xdeadbeefu);
  EXPECT_EQ(key_chunk(k), 0x12345678u);
  EXPECT_NE(make_key(1, 0), make_key(0, 1));
}

TEST(ChunkLayout, ZeroByteTensorHasNoChunks) {
  auto l = ChunkLayout::make(3, 0);
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_EQ(l->num_chunks(), 0u);
  expect_tiles(*l);
}

TEST(ChunkLayout, OneByteTensorIsOneChunk) {
  auto l = ChunkLayout::make(3, 1);
  ASSERT_TRUE(l.ok());
  ASSERT_EQ(l->num_chunks(), 1u);
  EXPECT_EQ(l->chunk(0).bytes, 1u);
  expect_tiles(*l);
}

TEST(ChunkLayout, ExactMultiplesHaveNoShortTail) {
  for (uint64_t n : {1u, 2u, 7u, 64u}) {
    auto l = ChunkLayout::make(9, n * 4 * kMiB);
    ASSERT_TRUE(l.ok());
    EXPECT_EQ(l->num_chunks(), n);
    EXPECT_EQ(l->chunk(static_cast<uint32_t>(n - 1)).bytes, 4 * kMiB);
    expect_tiles(*l);
  }
}

TEST(ChunkLayout, OneByteOverAMultipleAddsAOneByteChunk) {
  auto l = ChunkLayout::make(9, 8 * kMiB + 1);
  ASSERT_TRUE(l.ok());
  ASSERT_EQ(l->num_chunks(), 3u);
  EXPECT_EQ(l->chunk(2).bytes, 1u);
  EXPECT_EQ(l->chunk(2).offset, 8 * kMiB);
  expect_tiles(*l);
}

TEST(ChunkLayout, TensorsOver4GiBUse64BitOffsets) {
  const uint64_t bytes = 5 * kGiB + 12;
  auto l = ChunkLayout::make(1, bytes, 4 * kMiB, 4);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->num_chunks(), 1281u);
  ChunkSpan last = l->chunk(1280);
  EXPECT_EQ(last.offset, 1280 * 4 * kMiB);
  EXPECT_EQ(last.bytes, 12u);
  EXPECT_EQ(l->chunk_of_offset(bytes - 1), 1280u);
  expect_tiles(*l);
}

TEST(ChunkLayout, HugeTensorWithSmallChunksHitsTheKeyLimit) {
  // 2^32 chunks of 1 byte is the most a key can address.
  auto at_limit = ChunkLayout::make(1, uint64_t{1} << 32, 1);
  ASSERT_TRUE(at_limit.ok());
  EXPECT_EQ(at_limit->num_chunks(), uint64_t{1} << 32);
  EXPECT_EQ(at_limit->chunk(UINT32_MAX).offset, UINT32_MAX);

  auto over = ChunkLayout::make(1, (uint64_t{1} << 32) + 1, 1);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(over.status().message().find("raise chunk_bytes"), std::string::npos);

  auto near_max = ChunkLayout::make(1, UINT64_MAX, uint64_t{1} << 40);
  ASSERT_TRUE(near_max.ok());
  EXPECT_EQ(near_max->num_chunks(), uint64_t{1} << 24);
  EXPECT_EQ(near_max->chunk(static_cast<uint32_t>((uint64_t{1} << 24) - 1)).bytes,
            (uint64_t{1} << 40) - 1);
}

TEST(ChunkLayout, ChunksFallOnElementBoundaries) {
  auto l = ChunkLayout::make(2, 4 * 1001, 4 * 100, 4);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->num_chunks(), 11u);
  expect_tiles(*l);

  auto split_element = ChunkLayout::make(2, 4 * 1001, 402, 4);
  ASSERT_FALSE(split_element.ok());
  EXPECT_EQ(split_element.status().code(), StatusCode::kInvalidArgument);

  auto ragged = ChunkLayout::make(2, 4 * 1001 + 2, 400, 4);
  ASSERT_FALSE(ragged.ok());
}

TEST(ChunkLayout, RejectsZeroSizes) {
  EXPECT_EQ(ChunkLayout::make(1, 10, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ChunkLayout::make(1, 10, 4, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(ChunkLayout, DefaultChunkIsFourMiB) {
  auto l = ChunkLayout::make(1, 10 * kMiB);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->chunk_bytes(), 4 * kMiB);
  EXPECT_EQ(l->num_chunks(), 3u);
}

}  // namespace
}  // namespace psld
