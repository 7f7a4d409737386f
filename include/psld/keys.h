// psld/keys.h — tensor ids, chunk keys and how a tensor is cut into chunks.
//
// A registered tensor gets a 32-bit tensor id (agreed through the
// coordinator). It is cut into chunks of at most `chunk_bytes`; a chunk is the
// unit of transfer, aggregation and placement, and its 64-bit key is
// (tensor id << 32) | chunk index.
#pragma once

#include <cstddef>
#include <cstdint>

#include "psld/status.h"

namespace psld {

using TensorId = uint32_t;
using Key = uint64_t;

// 4 MiB: large enough that a chunk amortises per-message costs on a
// 100 Gb/s link (~0.3 ms of wire time), small enough to spread a big tensor
// over many servers.
inline constexpr uint64_t kDefaultChunkBytes = uint64_t{4} << 20;

constexpr Key make_key(TensorId tensor, uint32_t chunk) {
  return (static_cast<Key>(tensor) << 32) | chunk;
}
constexpr TensorId key_tensor(Key key) {
  return static_cast<TensorId>(key >> 32);
}
constexpr uint32_t key_chunk(Key key) {
  return static_cast<uint32_t>(key);
}

// One chunk of a tensor: bytes [offset, offset + bytes) of it.
struct ChunkSpan {
  Key key = 0;
  uint32_t index = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// How a tensor of `tensor_bytes` is cut into chunks. Every chunk but the last
// has exactly chunk_bytes(); the last holds the rest. A 0-byte tensor has no
// chunks. Chunk boundaries fall on element boundaries.
class ChunkLayout {
 public:
  // Fails with InvalidArgument when element_bytes is 0, when tensor_bytes or
  // chunk_bytes is not a multiple of element_bytes, when chunk_bytes is 0, or
  // when the tensor would need more than 2^32 chunks.
  static Result<ChunkLayout> make(TensorId tensor, uint64_t tensor_bytes,
                                  uint64_t chunk_bytes = kDefaultChunkBytes,
                                  uint32_t element_bytes = 1);

  TensorId tensor() const { return tensor_; }
  uint64_t tensor_bytes() const { return tensor_bytes_; }
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  uint32_t element_bytes() const { return element_bytes_; }
  uint64_t num_chunks() const { return num_chunks_; }

  // The i-th chunk; i must be < num_chunks().
  ChunkSpan chunk(uint32_t index) const;
  // The chunk that holds byte `offset` of the tensor (offset < tensor_bytes()).
  uint32_t chunk_of_offset(uint64_t offset) const {
    return static_cast<uint32_t>(offset / chunk_bytes_);
  }

 private:
  ChunkLayout() = default;
  TensorId tensor_ = 0;
  uint64_t tensor_bytes_ = 0;
  uint64_t chunk_bytes_ = kDefaultChunkBytes;
  uint32_t element_bytes_ = 1;
  uint64_t num_chunks_ = 0;
};

}  // namespace psld
