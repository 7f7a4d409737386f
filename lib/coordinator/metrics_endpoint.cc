#include "lib/coordinator/metrics_endpoint.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>

#include "base/log.h"
#include "base/thread.h"
#include "lib/config/fields.h"

namespace psld {

namespace {

using Clock = std::chrono::steady_clock;

struct Connection {
  int fd = -1;
  Clock::time_point deadline;
  std::string in;
  std::string out;
  size_t sent = 0;
  bool answering = false;
};

std::string reason_phrase(int code) {
  switch (code) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 431:
      return "Request Header Fields Too Large";
    default:
      return "Error";
  }
}

std::string response(int code, const std::string& type, const std::string& body, bool head) {
  std::string out = fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\n"
      "Connection: close\r\n\r\n",
      code, reason_phrase(code), type, body.size());
  if (!head) out += body;
  return out;
}

std::string plain(int code, const std::string& text) {
  return response(code, "text/plain; charset=utf-8", text + "\n", false);
}

// The host and port of a bound socket, IPv6 in brackets.
std::string local_address(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[NI_MAXHOST];
  char port[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof(host), port, sizeof(port),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "?";
  }
  return ss.ss_family == AF_INET6 ? fmt::format("[{}]:{}", host, port)
                                  : fmt::format("{}:{}", host, port);
}

}  // namespace

Result<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::start(const std::string& listen,
                                                                std::vector<std::string> paths,
                                                                Source source) {
  std::string host;
  std::string port;
  if (!config_detail::split_endpoint_unbracketed(listen, &host, &port)) {
    return InvalidArgument(
        fmt::format("metrics.listen '{}': {}", listen, config_detail::check_endpoint(listen, 0)));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return InvalidArgument(fmt::format("metrics.listen '{}': cannot resolve '{}': {}", listen, host,
                                       gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> addrs(found, freeaddrinfo);
  std::unique_ptr<MetricsEndpoint> e(new MetricsEndpoint());
  std::string why = "no address";
  for (addrinfo* a = addrs.get(); a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 64) == 0) {
      e->listen_fd_ = fd;
      break;
    }
    why = std::strerror(errno);
    close(fd);
  }
  if (e->listen_fd_ < 0) {
    return Unavailable(fmt::format("metrics.listen '{}': cannot listen: {}", listen, why));
  }
  e->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (e->wake_fd_ < 0) return ResourceExhausted(fmt::format("eventfd: {}", std::strerror(errno)));
  e->address_ = local_address(e->listen_fd_);
  e->paths_ = std::move(paths);
  e->source_ = std::move(source);
  MetricsEndpoint* self = e.get();
  if (Status s = start_thread(e->thread_, "metrics endpoint", [self] { self->run(); }); !s.ok()) {
    return s;
  }
  return e;
}

MetricsEndpoint::~MetricsEndpoint() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    if (write(wake_fd_, &one, sizeof(one)) < 0) {
      PSLD_LOG_WARN("metrics endpoint: cannot wake its thread: {}", std::strerror(errno));
    }
    thread_.join();
  }
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void MetricsEndpoint::run() {
  std::map<int, Connection> conns;
  std::vector<pollfd> fds;
  for (;;) {
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    auto now = Clock::now();
    int timeout_ms = 1000;
    for (auto& [fd, c] : conns) {
      fds.push_back({fd, static_cast<short>(c.answering ? POLLOUT : POLLIN), 0});
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(c.deadline - now).count();
      timeout_ms = static_cast<int>(std::clamp<int64_t>(left + 1, 0, timeout_ms));
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
      PSLD_LOG_WARN("metrics endpoint: poll: {}; it stops serving", std::strerror(errno));
      break;
    }
    if (fds[0].revents != 0) break;
    if (fds[1].revents & POLLIN) {
      for (;;) {
        const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) break;  // EAGAIN, or a connection that went away meanwhile
        if (conns.size() >= kMaxConnections) {
          close(fd);
          ++refused_;
          continue;
        }
        conns[fd] = Connection{fd, Clock::now() + kDeadline, {}, {}, 0, false};
      }
    }
    now = Clock::now();
    for (size_t i = 2; i < fds.size(); ++i) {
      auto it = conns.find(fds[i].fd);
      Connection& c = it->second;
      bool done = false;
      if (!c.answering && (fds[i].revents & (POLLIN | POLLHUP | POLLERR))) {
        char buf[2048];
        const ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
        if (n <= 0 && !(n < 0 && (errno == EAGAIN || errno == EINTR))) {
          done = true;  // closed before asking
        } else if (n > 0) {
          c.in.append(buf, static_cast<size_t>(n));
          const size_t end = c.in.find("\r\n\r\n");
          if (end != std::string::npos || c.in.size() > kMaxRequestBytes) {
            c.answering = true;
            if (end == std::string::npos) {
              c.out = plain(431, "request head larger than 8 KiB");
            } else {
              // "GET /path HTTP/1.1": method, target, version.
              const std::string line = c.in.substr(0, c.in.find("\r\n"));
              const size_t sp1 = line.find(' ');
              const size_t sp2 = line.rfind(' ');
              if (sp1 == std::string::npos || sp2 <= sp1 ||
                  line.compare(sp2 + 1, 5, "HTTP/") != 0) {
                c.out = plain(400, "not an HTTP/1 request");
              } else {
                const std::string method = line.substr(0, sp1);
                std::string path = line.substr(sp1 + 1, sp2 - sp1 - 1);
                path = path.substr(0, path.find('?'));
                if (method != "GET" && method != "HEAD") {
                  c.out = plain(405, "only GET and HEAD");
                } else if (std::find(paths_.begin(), paths_.end(), path) == paths_.end()) {
                  std::string known;
                  for (const auto& p : paths_)
                    known += " " + p;
                  c.out = plain(404, "no such page; there are:" + known);
                } else {
                  Page page = source_(path);
                  c.out = response(200, page.content_type, page.body, method == "HEAD");
                  ++served_;
                }
              }
            }
          }
        }
      }
      if (c.answering && !done && (fds[i].revents & POLLOUT)) {
        const ssize_t n = send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
        if (n > 0) c.sent += static_cast<size_t>(n);
        if (n < 0 && errno != EAGAIN && errno != EINTR) done = true;
        if (c.sent == c.out.size()) done = true;
      }
      if (done || now >= c.deadline) {
        close(c.fd);
        conns.erase(it);
      }
    }
  }
  for (auto& [fd, c] : conns)
    close(fd);
}

}  // namespace psld
