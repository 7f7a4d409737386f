// free_loopback_port: a TCP port on 127.0.0.1 that nothing listens on now
// (the kernel's choice for port 0), or -1. For `psld launch`'s coordinator
// and the tests' jobs; another process may take it before it is bound again,
// which a caller that binds it reports as an address in use.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>

namespace psld {

// The same on `address` (host byte order): INADDR_ANY for a port free on
// every address (psld doctor's ucx_perftest server).
inline int free_tcp_port(uint32_t address) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(address);
  socklen_t len = sizeof(a);
  int port = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

inline int free_loopback_port() {
  return free_tcp_port(INADDR_LOOPBACK);
}

}  // namespace psld
