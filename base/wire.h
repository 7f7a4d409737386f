// Little-endian encoding helpers for the small binary blobs transports
// exchange (remote keys, addresses, message headers). The reader never reads
// past its span: every get reports failure instead, so a malformed blob from
// a peer is an error, never an out-of-bounds read.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace psld::transport {

class WireWriter {
 public:
  void u8(uint8_t v) { out_.push_back(v); }
  void u16(uint16_t v) { le(v, 2); }
  void u32(uint32_t v) { le(v, 4); }
  void u64(uint64_t v) { le(v, 8); }
  void bytes(std::span<const uint8_t> b) { out_.insert(out_.end(), b.begin(), b.end()); }
  // A u32 length, then the bytes.
  void blob(std::span<const uint8_t> b) {
    u32(static_cast<uint32_t>(b.size()));
    bytes(b);
  }
  void str(const std::string& s) {
    blob(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
  }
  std::vector<uint8_t> take() { return std::move(out_); }
  const std::vector<uint8_t>& data() const { return out_; }

 private:
  void le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i)
      out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  std::vector<uint8_t> out_;
};

class WireReader {
 public:
  explicit WireReader(std::span<const uint8_t> in) : in_(in) {}
  bool u8(uint8_t* v) { return le(v, 1); }
  bool u16(uint16_t* v) { return le(v, 2); }
  bool u32(uint32_t* v) { return le(v, 4); }
  bool u64(uint64_t* v) { return le(v, 8); }
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

 private:
  template <typename T>
  bool le(T* v, size_t n) {
    if (remaining() < n) return false;
    uint64_t x = 0;
    for (size_t i = 0; i < n; ++i)
      x |= static_cast<uint64_t>(in_[pos_ + i]) << (8 * i);
    pos_ += n;
    *v = static_cast<T>(x);
    return true;
  }
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
};

}  // namespace psld::transport
