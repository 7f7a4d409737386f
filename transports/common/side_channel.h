// A non-blocking stream socket with bounded input and output buffers: the
// TCP side channel of a verbs connection (transports/verbs/side_channel.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "psld/status.h"

namespace psld::transport {

// A non-blocking stream socket with bounded input and output buffers.
class SideChannel {
 public:
  // Bounds: a hello is 54 bytes and then single bytes follow, so 4 KiB in
  // either direction means the peer (or this side) misbehaves.
  static constexpr size_t kMaxBufferedBytes = 4096;

  SideChannel() = default;
  explicit SideChannel(int fd) : fd_(fd) {}
  // `limit` bytes instead of kMaxBufferedBytes in either direction.
  SideChannel(int fd, size_t limit) : fd_(fd), limit_(limit) {}
  ~SideChannel() { close(); }
  SideChannel(SideChannel&& other) noexcept;
  SideChannel& operator=(SideChannel&& other) noexcept;
  SideChannel(const SideChannel&) = delete;
  SideChannel& operator=(const SideChannel&) = delete;

  int fd() const { return fd_; }
  bool is_open() const { return fd_ >= 0; }

  // Queues bytes and writes as much as the socket takes now. Unavailable on
  // a socket error; ResourceExhausted if the output buffer would overflow.
  Status send(std::span<const uint8_t> bytes);
  // Writes queued output; Unavailable on a socket error.
  Status flush();
  bool has_pending_output() const { return !out_.empty(); }

  // Reads what the socket has. Ok also at end of stream (see eof()); DataLoss
  // if the peer sent more than the limit that was not consumed;
  // Unavailable on a socket error.
  Status read_available();
  bool eof() const { return eof_; }
  std::span<const uint8_t> input() const { return in_; }
  void consume(size_t n);

  void close();

 private:
  int fd_ = -1;
  size_t limit_ = kMaxBufferedBytes;
  bool eof_ = false;
  std::vector<uint8_t> in_;
  std::vector<uint8_t> out_;
};

// Sets TCP_NODELAY and keepalive (dead host noticed after ~25 s of silence:
// idle 10 s, then 3 probes 5 s apart). Best effort: failures are ignored.
void tune_side_channel_socket(int fd);

}  // namespace psld::transport
