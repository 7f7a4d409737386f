// psld's one little-endian codec, for every binary layout it writes: the
// small blobs transports exchange (remote keys, addresses, message headers),
// the control messages, serialized placements and deltas, UCX's in-place
// headers and ring records. The reader never reads past its span: every get
// reports failure instead, so a malformed blob from a peer is an error, never
// an out-of-bounds read.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace psld {

// A little-endian field of `n` bytes (at most 8) at `p`, for layouts filled
// or read in place (a header inside a buffer, a record in shared memory). On
// a little-endian host these are single unaligned moves: the byte loops they
// replaced were not merged by the compiler and cost ~10 ns per UCX ring
// record on each side.
inline void store_le(uint8_t* p, uint64_t v, size_t n) {
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(p, &v, n);
  } else {
    for (size_t i = 0; i < n; ++i)
      p[i] = static_cast<uint8_t>(v >> (8 * i));
  }
}
inline uint64_t load_le(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&v, p, n);
  } else {
    for (size_t i = 0; i < n; ++i)
      v |= static_cast<uint64_t>(p[i]) << (8 * i);
  }
  return v;
}

class WireWriter {
 public:
  // `reserve`: the encoding's size, where the caller knows it.
  explicit WireWriter(size_t reserve = 0) { out_.resize(reserve); }
  // Writes into `buffer` from its start, with its capacity: take() gives it
  // back.
  explicit WireWriter(std::vector<uint8_t>&& buffer) : out_(std::move(buffer)) {
    out_.resize(out_.capacity());
  }
  void u8(uint8_t v) { le(v); }
  void u16(uint16_t v) { le(v); }
  void u32(uint32_t v) { le(v); }
  void u64(uint64_t v) { le(v); }
  // As its IEEE-754 bits.
  void f64(double v) { u64(std::bit_cast<uint64_t>(v)); }
  void bytes(std::span<const uint8_t> b) {
    if (b.empty()) return;
    std::memcpy(room(b.size()), b.data(), b.size());
  }
  // A u32 length, then the bytes.
  void blob(std::span<const uint8_t> b) {
    u32(static_cast<uint32_t>(b.size()));
    bytes(b);
  }
  void str(const std::string& s) {
    blob(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
  }
  // The next `n` bytes, to be filled with fixed-size fields through the
  // returned cursor: room is made once for a run of records (a batch's
  // entries), not checked for each field. The caller writes exactly `n`.
  class Fixed {
   public:
    explicit Fixed(uint8_t* p) : p_(p) {}
    void u8(uint8_t v) { put(v); }
    void u32(uint32_t v) { put(v); }
    void u64(uint64_t v) { put(v); }
    void f64(double v) { put(std::bit_cast<uint64_t>(v)); }

   private:
    template <typename T>
    void put(T v) {
      store_le(p_, v, sizeof(T));
      p_ += sizeof(T);
    }
    uint8_t* p_;
  };
  Fixed fixed(size_t n) { return Fixed(room(n)); }
  std::vector<uint8_t> take() {
    out_.resize(used_);
    used_ = 0;
    return std::move(out_);
  }
  std::span<const uint8_t> data() const { return {out_.data(), used_}; }

 private:
  // Sized by the type, so that the store is a move, not a call to memcpy.
  template <typename T>
  void le(T v) {
    store_le(room(sizeof(T)), v, sizeof(T));
  }
  // Where the next n bytes go. out_ is written up to used_ and grows by
  // doubling: a field is a compare and a store, not a vector insert.
  uint8_t* room(size_t n) {
    if (out_.size() - used_ < n) out_.resize(std::max(2 * out_.size(), used_ + n));
    uint8_t* at = out_.data() + used_;
    used_ += n;
    return at;
  }
  std::vector<uint8_t> out_;
  size_t used_ = 0;
};

class WireReader {
 public:
  explicit WireReader(std::span<const uint8_t> in) : in_(in) {}
  bool u8(uint8_t* v) { return le(v); }
  bool u16(uint16_t* v) { return le(v); }
  bool u32(uint32_t* v) { return le(v); }
  bool u64(uint64_t* v) { return le(v); }
  bool f64(double* v) {
    uint64_t bits = 0;
    if (!u64(&bits)) return false;
    *v = std::bit_cast<double>(bits);
    return true;
  }
  // For a decoder that checked the buffer's length against its counts before
  // reading (the placement's): the value, and 0 past the end rather than
  // trusting that check.
  uint8_t u8() { return value<uint8_t>(); }
  uint16_t u16() { return value<uint16_t>(); }
  uint32_t u32() { return value<uint32_t>(); }
  uint64_t u64() { return value<uint64_t>(); }
  double f64() { return std::bit_cast<double>(u64()); }
  // A u32 length (at most max_len), then that many bytes, viewed in place.
  bool blob(std::span<const uint8_t>* b, size_t max_len) {
    uint32_t n = 0;
    if (!u32(&n) || n > max_len || n > remaining()) return false;
    *b = in_.subspan(pos_, n);
    pos_ += n;
    return true;
  }
  bool str(std::string* s, size_t max_len) {
    std::span<const uint8_t> b;
    if (!blob(&b, max_len)) return false;
    s->assign(reinterpret_cast<const char*>(b.data()), b.size());
    return true;
  }
  size_t remaining() const { return in_.size() - pos_; }
  bool done() const { return pos_ == in_.size(); }

  // A run of `n` bytes of fixed-size fields, read through a cursor after one
  // check of the length (WireWriter::fixed). The caller reads exactly `n`.
  class Fixed {
   public:
    Fixed() = default;
    explicit Fixed(const uint8_t* p) : p_(p) {}
    uint8_t u8() { return get<uint8_t>(); }
    uint32_t u32() { return get<uint32_t>(); }
    uint64_t u64() { return get<uint64_t>(); }
    double f64() { return std::bit_cast<double>(u64()); }

   private:
    template <typename T>
    T get() {
      const auto v = static_cast<T>(load_le(p_, sizeof(T)));
      p_ += sizeof(T);
      return v;
    }
    const uint8_t* p_ = nullptr;
  };
  // False (nothing taken) when fewer than `n` bytes remain.
  bool fixed(size_t n, Fixed* out) {
    if (remaining() < n) return false;
    *out = Fixed(in_.data() + pos_);
    pos_ += n;
    return true;
  }

 private:
  // Sized by the type, so that the load is a move, not a call to memcpy.
  template <typename T>
  bool le(T* v) {
    if (remaining() < sizeof(T)) return false;
    *v = static_cast<T>(load_le(in_.data() + pos_, sizeof(T)));
    pos_ += sizeof(T);
    return true;
  }
  template <typename T>
  T value() {
    T v = 0;
    le(&v);
    return v;
  }
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
};

}  // namespace psld
