// UCX backend helpers: UCX status codes, socket addresses, lane summaries, UCX_TLS, ids.
#include "transports/ucx/core.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <string_view>

namespace psld::transport {

namespace ucx_detail {

Status ucs_to_status(ucs_status_t st, std::string_view what) {
  if (st == UCS_OK) return Status::Ok();  // every completion passes here: no message to format
  std::string msg = fmt::format("{}: {}", what, ucs_status_string(st));
  switch (st) {
    case UCS_ERR_CANCELED:
      return Aborted(std::move(msg));
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return ResourceExhausted(std::move(msg));
    case UCS_ERR_INVALID_PARAM:
      return InvalidArgument(std::move(msg));
    case UCS_ERR_UNSUPPORTED:
      return Unimplemented(std::move(msg));
    default:
      return Unavailable(std::move(msg));
  }
}

// "host:port" or "[v6]:port" -> a socket address.
Status parse_socket_address(const std::string& text, bool passive, sockaddr_storage* out,
                            socklen_t* out_len) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon + 1 == text.size()) {
    return InvalidArgument(
        fmt::format("'{}' is not a socket address; use host:port, e.g. 127.0.0.1:0", text));
  }
  std::string host = text.substr(0, colon);
  const std::string port = text.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return InvalidArgument(fmt::format("cannot resolve '{}': {}", text, gai_strerror(rc)));
  }
  std::memcpy(out, res->ai_addr, res->ai_addrlen);
  *out_len = res->ai_addrlen;
  freeaddrinfo(res);
  return Status::Ok();
}

std::string socket_address_string(const sockaddr_storage& sa) {
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (sa.ss_family == AF_INET) {
    sockaddr_in in;
    std::memcpy(&in, &sa, sizeof(in));
    inet_ntop(AF_INET, &in.sin_addr, host, sizeof(host));
    port = ntohs(in.sin_port);
    return fmt::format("{}:{}", host, port);
  }
  if (sa.ss_family == AF_INET6) {
    sockaddr_in6 in6;
    std::memcpy(&in6, &sa, sizeof(in6));
    inet_ntop(AF_INET6, &in6.sin6_addr, host, sizeof(host));
    port = ntohs(in6.sin6_port);
    return fmt::format("[{}]:{}", host, port);
  }
  return "unknown";
}

// Parses UCX 1.13's ucp_ep_print_info, e.g.
//   #  lane[1]:  2:sysv/memory.0 md[1] -> md[1]/sysv/sysdev[255] am am_bw#0 keepalive
//   #  lane[3]:  0:tcp/lo.0 md[0]      -> md[0]/tcp/sysdev[255] rma_bw#0 wireup
//   #  am_send: 0..<egr/short>..93..<egr/bcopy>..8256..<rndv>..(inf)
//   #  put[1]: 0..<short>..4294967296..<bcopy>..(inf)
// "put[N]" lines exist only for lanes that carry native RMA; over tcp there
// are none, because UCX 1.13 emulates put with active messages there.
LaneSummary summarize_lanes(const std::string& info) {
  struct Lane {
    std::string name;  // tl/dev
    std::string tl;
    std::vector<std::string> roles;
  };
  std::map<int, Lane> lanes;
  std::set<int> rma_lanes;
  std::string am_send;
  std::istringstream in(info);
  std::string line;
  while (std::getline(in, line)) {
    size_t p = line.find_first_not_of("# \t");
    if (p == std::string::npos) continue;
    std::string_view l(line);
    l.remove_prefix(p);
    auto index_of = [&](std::string_view prefix) -> int {
      if (l.substr(0, prefix.size()) != prefix) return -1;
      return std::atoi(std::string(l.substr(prefix.size())).c_str());
    };
    if (int i = index_of("lane["); i >= 0) {
      const size_t colon = l.find("]:");
      if (colon == std::string_view::npos) continue;
      std::istringstream words{std::string(l.substr(colon + 2))};
      std::vector<std::string> tokens;
      for (std::string w; words >> w;)
        tokens.push_back(w);
      if (tokens.empty() || tokens[0] == "cm") continue;  // the connection manager lane
      Lane lane;
      const size_t c = tokens[0].find(':');
      lane.name = c == std::string::npos ? tokens[0] : tokens[0].substr(c + 1);
      lane.tl = lane.name.substr(0, lane.name.find('/'));
      auto arrow = std::find(tokens.begin(), tokens.end(), "->");
      if (arrow != tokens.end() && arrow + 1 != tokens.end()) {
        lane.roles.assign(arrow + 2, tokens.end());
      }
      lanes[i] = lane;
    } else if (int j = index_of("put["); j >= 0) {
      rma_lanes.insert(j);
    } else if (l.substr(0, 8) == "am_send:") {
      am_send = std::string(l.substr(8));
      am_send.erase(0, am_send.find_first_not_of(' '));
    }
  }
  static const std::set<std::string> kShm = {"posix", "sysv", "xpmem", "knem", "cma", "self"};
  LaneSummary s;
  std::vector<std::string> am, rma, rndv, keepalive;
  for (auto& [i, lane] : lanes) {
    for (const std::string& role : lane.roles) {
      if (role == "am") am.push_back(lane.name);
      if (role.rfind("rma_bw", 0) == 0) rndv.push_back(lane.name);
      if (role == "keepalive") keepalive.push_back(lane.name);
    }
    if (rma_lanes.count(i) && lane.tl != "tcp") {
      rma.push_back(lane.name);
      const RmaKind k = kShm.count(lane.tl) ? RmaKind::kSharedMemory : RmaKind::kRdma;
      if (static_cast<int>(k) > static_cast<int>(s.rma)) s.rma = k;
    }
  }
  auto join = [](const std::vector<std::string>& v) {
    return v.empty() ? std::string("none") : fmt::format("{}", fmt::join(v, ","));
  };
  s.text = fmt::format("am={} rma={} rndv={} keepalive={} am_send={}", join(am),
                       rma.empty() ? std::string("emulated") : join(rma), join(rndv),
                       join(keepalive), am_send.empty() ? std::string("?") : am_send);
  return s;
}

std::string endpoint_info(ucp_ep_h ep) {
  char* buf = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&buf, &size);
  if (f == nullptr) return {};
  ucp_ep_print_info(ep, f);
  std::fclose(f);
  std::string out(buf, size);
  std::free(buf);
  return out;
}

// Whether a UCX_TLS list can select a shared-memory (mm) transport; only then
// is MM_ERROR_HANDLING meaningful (UCX warns about it otherwise).
bool tls_may_use_shared_memory(const std::string& option) {
  std::string tls = option;
  if (tls.empty()) {
    const char* env = std::getenv("UCX_TLS");
    tls = env != nullptr ? env : "all";
  }
  if (tls.empty() || tls[0] == '^') return true;  // an exclusion list keeps the rest
  std::istringstream in(tls);
  for (std::string name; std::getline(in, name, ',');) {
    if (name == "all" || name == "sm" || name == "shm" || name == "mm" || name == "posix" ||
        name == "sysv" || name == "xpmem") {
      return true;
    }
  }
  return false;
}

uint64_t process_namespace_key() {
  char boot_id[64];
  const int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  const ssize_t got = read(fd, boot_id, sizeof(boot_id));
  close(fd);
  if (got <= 0) return 0;
  char ns[128];
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns));
  if (n <= 0) return 0;
  const std::string text =
      std::string(boot_id, static_cast<size_t>(got)) + std::string(ns, static_cast<size_t>(n));
  return fnv1a64({reinterpret_cast<const uint8_t*>(text.data()), text.size()}) | 1;
}

bool process_ended(uint32_t pid) {
  const std::string path = fmt::format("/proc/{}/stat", pid);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT || errno == ESRCH;
  char buf[512];
  const ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0) return n < 0 && errno == ESRCH;  // it ended while being read
  const std::string_view stat(buf, static_cast<size_t>(n));
  // "pid (comm) state ...": comm may hold spaces and parentheses.
  const size_t paren = stat.rfind(')');
  if (paren == std::string_view::npos || paren + 2 >= stat.size()) return false;
  const char state = stat[paren + 2];
  return state == 'Z' || state == 'X';
}

bool tls_without_network_rdma(const std::string& option) {
  std::string tls = option;
  if (tls.empty()) {
    const char* env = std::getenv("UCX_TLS");
    tls = env != nullptr ? env : "";
  }
  if (tls.empty() || tls[0] == '^') return false;  // UCX's choice may include RDMA
  std::istringstream in(tls);
  for (std::string name; std::getline(in, name, ',');) {
    if (!(name == "tcp" || name == "self" || name == "sm" || name == "shm" || name == "mm" ||
          name == "posix" || name == "sysv" || name == "xpmem" || name == "cma" ||
          name == "knem")) {
      return false;
    }
  }
  return true;
}

}  // namespace ucx_detail

}  // namespace psld::transport
