#include "transports/verbs/side_channel.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

namespace psld::transport::verbs {
namespace {

std::string errno_text(int err) {
  return fmt::format("{} ({})", std::strerror(err), err);
}

using AddrInfoPtr = std::unique_ptr<addrinfo, void (*)(addrinfo*)>;

Result<AddrInfoPtr> resolve(const HostPort& hp, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* res = nullptr;
  const std::string port = std::to_string(hp.port);
  const int rc = getaddrinfo(hp.host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return Unavailable(
        fmt::format("cannot resolve '{}': {}", format_host_port(hp), gai_strerror(rc)));
  }
  return AddrInfoPtr(res, freeaddrinfo);
}

}  // namespace

Result<int> tcp_listen(const HostPort& where) {
  PSLD_ASSIGN_OR_RETURN(AddrInfoPtr ai, resolve(where, /*passive=*/true));
  const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return Unavailable("socket() for the verbs side channel: " + errno_text(errno));
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    const int err = errno;
    ::close(fd);
    return Unavailable(
        fmt::format("cannot listen on {}: {}", format_host_port(where), errno_text(err)));
  }
  return fd;
}

Result<HostPort> socket_address(int fd, bool peer) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  auto* sa = reinterpret_cast<sockaddr*>(&ss);
  if ((peer ? getpeername(fd, sa, &len) : getsockname(fd, sa, &len)) != 0) {
    return Unavailable(
        fmt::format("{}: {}", peer ? "getpeername" : "getsockname", errno_text(errno)));
  }
  char host[NI_MAXHOST] = {};
  char port[NI_MAXSERV] = {};
  const int rc =
      getnameinfo(sa, len, host, sizeof(host), port, sizeof(port), NI_NUMERICHOST | NI_NUMERICSERV);
  if (rc != 0) return Unavailable(fmt::format("getnameinfo: {}", gai_strerror(rc)));
  return HostPort{host, static_cast<uint16_t>(std::stoul(port))};
}

Result<int> tcp_connect(const HostPort& to, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  PSLD_ASSIGN_OR_RETURN(AddrInfoPtr ai, resolve(to, /*passive=*/false));
  std::string errors;
  for (addrinfo* a = ai.get(); a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      errors += " socket: " + errno_text(errno) + ";";
      continue;
    }
    int err = 0;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      err = errno;
      while (err == EINPROGRESS || err == EINTR) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) {
          err = ETIMEDOUT;
          break;
        }
        pollfd p{fd, POLLOUT, 0};
        const int rc = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), INT32_MAX)));
        if (rc < 0 && errno == EINTR) continue;
        if (rc < 0) {
          err = errno;
          break;
        }
        if (rc == 0) continue;  // the loop re-checks the deadline
        socklen_t len = sizeof(err);
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
        break;
      }
    }
    if (err == 0) {
      tune_side_channel_socket(fd);
      return fd;
    }
    ::close(fd);
    errors += " " + errno_text(err) + ";";
  }
  return Unavailable(fmt::format("cannot connect to verbs peer {}:{}", format_host_port(to),
                                 errors.empty() ? " no address" : errors));
}

}  // namespace psld::transport::verbs
