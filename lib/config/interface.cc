// lib/config/interface.cc — job.interface: find_interface, interface_toward,
// apply_interface.
#include "lib/config/interface.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>

#include "lib/config/fields.h"

namespace psld {
namespace {

using IfAddrs = std::unique_ptr<ifaddrs, decltype(&freeifaddrs)>;

Result<IfAddrs> list_interfaces() {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) {
    return Unavailable(fmt::format("getifaddrs: {}", std::strerror(errno)));
  }
  return IfAddrs(all, &freeifaddrs);
}

// "10.0.0.5", "[fd00::5]"; nullopt for other families and link-local IPv6.
std::optional<std::string> text_of(const sockaddr* a) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (a == nullptr) return std::nullopt;
  if (a->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(a);
    if (::inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf)) == nullptr) return std::nullopt;
    return std::string(buf);
  }
  if (a->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a);
    if (IN6_IS_ADDR_LINKLOCAL(&in6->sin6_addr)) return std::nullopt;
    if (::inet_ntop(AF_INET6, &in6->sin6_addr, buf, sizeof(buf)) == nullptr) return std::nullopt;
    return "[" + std::string(buf) + "]";
  }
  return std::nullopt;
}

// "lo 127.0.0.1, eth0 10.0.0.5": what a NotFound offers instead.
std::string available(const ifaddrs* all) {
  std::string out;
  for (const ifaddrs* i = all; i != nullptr; i = i->ifa_next) {
    const std::optional<std::string> text = text_of(i->ifa_addr);
    if (!text) continue;
    if (!out.empty()) out += ", ";
    out += fmt::format("{} {}", i->ifa_name, *text);
  }
  return out.empty() ? "none with an address" : out;
}

}  // namespace

Result<InterfaceAddress> find_interface(std::string_view name) {
  PSLD_ASSIGN_OR_RETURN(IfAddrs all, list_interfaces());
  std::optional<std::string> v6;
  for (const ifaddrs* i = all.get(); i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || name != i->ifa_name) continue;
    const std::optional<std::string> text = text_of(i->ifa_addr);
    if (!text) continue;
    if (i->ifa_addr->sa_family == AF_INET) return InterfaceAddress{std::string(name), *text};
    if (!v6) v6 = text;
  }
  if (v6) return InterfaceAddress{std::string(name), *v6};
  return NotFound(fmt::format("no network interface '{}' with an address here (there are: {})",
                              name, available(all.get())));
}

Result<InterfaceAddress> interface_toward(const std::string& host_port) {
  std::string host;
  std::string port;
  if (!config_detail::split_endpoint_unbracketed(host_port, &host, &port)) {
    return InvalidArgument(fmt::format("'{}' is not host:port", host_port));
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return NotFound(fmt::format("cannot resolve '{}': {}", host, ::gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> release(found, &freeaddrinfo);
  std::string why = "no address";
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      why = fmt::format("socket: {}", std::strerror(errno));
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    // A UDP connect only asks the kernel for the route; nothing is sent.
    const bool routed = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
                        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
    if (!routed) why = fmt::format("no route: {}", std::strerror(errno));
    ::close(fd);
    if (!routed) continue;
    const std::optional<std::string> source = text_of(reinterpret_cast<const sockaddr*>(&local));
    if (!source) continue;
    PSLD_ASSIGN_OR_RETURN(IfAddrs all, list_interfaces());
    for (const ifaddrs* i = all.get(); i != nullptr; i = i->ifa_next) {
      if (text_of(i->ifa_addr) == source) return InterfaceAddress{i->ifa_name, *source};
    }
    why = fmt::format("the route's source address {} is on no interface", *source);
  }
  return NotFound(fmt::format("no interface toward {}: {}", host_port, why));
}

Status apply_interface(const Config& config, RuntimeOptions& o) {
  const std::string& want = config.job.interface;
  if (want.empty()) return Status::Ok();
  Result<InterfaceAddress> found =
      want == "auto" ? interface_toward(config.job.coordinator) : find_interface(want);
  if (!found.ok()) {
    return found.status().with_context(fmt::format("job.interface = {}", want));
  }
  o.net.options.common.interface = found->name;
  // Set by a source, or in code.
  const auto source = config.sources.find("job.listen");
  const bool listen_set = (source != config.sources.end() && source->second != "default") ||
                          config.job.listen != JobConfig{}.listen;
  if (!listen_set) {
    const std::string& listen = o.net.options.common.listen_address;
    const std::string port = listen.substr(listen.rfind(':') + 1);
    o.net.options.common.listen_address = found->address + ":" + port;
  }
  return Status::Ok();
}

}  // namespace psld
