#include "psld/keys.h"

#include <fmt/format.h>

namespace psld {

Result<ChunkLayout> ChunkLayout::make(TensorId tensor, uint64_t tensor_bytes, uint64_t chunk_bytes,
                                      uint32_t element_bytes) {
  if (element_bytes == 0) return InvalidArgument("element_bytes must be at least 1");
  if (chunk_bytes == 0) return InvalidArgument("chunk_bytes must be at least 1");
  if (chunk_bytes % element_bytes != 0) {
    return InvalidArgument(fmt::format(
        "chunk_bytes ({}) must be a multiple of the element size ({} bytes) so that no element "
        "is split across chunks",
        chunk_bytes, element_bytes));
  }
  if (tensor_bytes % element_bytes != 0) {
    return InvalidArgument(
        fmt::format("tensor {} has {} bytes, not a whole number of {}-byte elements", tensor,
                    tensor_bytes, element_bytes));
  }
  // Rounded-up division without overflow for tensor_bytes near 2^64.
  const uint64_t chunks = tensor_bytes / chunk_bytes + (tensor_bytes % chunk_bytes != 0 ? 1 : 0);
  if (chunks > (uint64_t{1} << 32)) {
    return InvalidArgument(fmt::format(
        "tensor {} of {} bytes needs {} chunks of {} bytes; at most 2^32 fit in a key: raise "
        "chunk_bytes",
        tensor, tensor_bytes, chunks, chunk_bytes));
  }
  ChunkLayout layout;
  layout.tensor_ = tensor;
  layout.tensor_bytes_ = tensor_bytes;
  layout.chunk_bytes_ = chunk_bytes;
  layout.element_bytes_ = element_bytes;
  layout.num_chunks_ = chunks;
  return layout;
}

ChunkSpan ChunkLayout::chunk(uint32_t index) const {
  ChunkSpan span;
  span.key = make_key(tensor_, index);
  span.index = index;
  span.offset = static_cast<uint64_t>(index) * chunk_bytes_;
  const uint64_t rest = span.offset < tensor_bytes_ ? tensor_bytes_ - span.offset : 0;
  span.bytes = rest < chunk_bytes_ ? rest : chunk_bytes_;
  return span;
}

}  // namespace psld
