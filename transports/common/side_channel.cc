#include "transports/common/side_channel.h"

#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

namespace psld::transport {
namespace {

std::string errno_text(int err) {
  return fmt::format("{} ({})", std::strerror(err), err);
}

}  // namespace

SideChannel::SideChannel(SideChannel&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      limit_(other.limit_),
      eof_(other.eof_),
      in_(std::move(other.in_)),
      out_(std::move(other.out_)) {}

SideChannel& SideChannel::operator=(SideChannel&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = std::exchange(other.fd_, -1);
    limit_ = other.limit_;
    eof_ = other.eof_;
    in_ = std::move(other.in_);
    out_ = std::move(other.out_);
  }
  return *this;
}

Status SideChannel::send(std::span<const uint8_t> bytes) {
  if (fd_ < 0) return Unavailable("side channel is closed");
  if (out_.size() + bytes.size() > limit_) {
    return ResourceExhausted("side channel output buffer is full (peer does not read)");
  }
  out_.insert(out_.end(), bytes.begin(), bytes.end());
  return flush();
}

Status SideChannel::flush() {
  if (fd_ < 0) return Unavailable("side channel is closed");
  size_t done = 0;
  while (done < out_.size()) {
    // MSG_NOSIGNAL: a peer that went away must be an error value here, not a
    // SIGPIPE that kills the trainer.
    const ssize_t n = ::send(fd_, out_.data() + done, out_.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      break;
    } else {
      const int err = errno;
      out_.erase(out_.begin(), out_.begin() + static_cast<ptrdiff_t>(done));
      return Unavailable("side channel send failed: " + errno_text(err));
    }
  }
  out_.erase(out_.begin(), out_.begin() + static_cast<ptrdiff_t>(done));
  return Status::Ok();
}

Status SideChannel::read_available() {
  if (fd_ < 0) return Unavailable("side channel is closed");
  uint8_t buf[512];
  while (!eof_) {
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    if (n > 0) {
      if (in_.size() + static_cast<size_t>(n) > limit_) {
        return DataLoss("peer sent more on the side channel than the protocol allows");
      }
      in_.insert(in_.end(), buf, buf + n);
    } else if (n == 0) {
      eof_ = true;
    } else if (errno == EINTR) {
      continue;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      break;
    } else {
      return Unavailable("side channel receive failed: " + errno_text(errno));
    }
  }
  return Status::Ok();
}

void SideChannel::consume(size_t n) {
  in_.erase(in_.begin(), in_.begin() + static_cast<ptrdiff_t>(std::min(n, in_.size())));
}

void SideChannel::close() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

void tune_side_channel_socket(int fd) {
  const int one = 1, idle = 10, interval = 5, count = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
}

}  // namespace psld::transport
