// lib/config/interface.h — job.interface: the network interface a process
// uses, by name or as the one on the route to the coordinator; and how it
// shapes the runtime's options (docs/cluster.md).
#pragma once

#include <string>
#include <string_view>

#include "lib/config/runtime_options.h"
#include "psld/config.h"
#include "psld/status.h"

namespace psld {

struct InterfaceAddress {
  std::string name;     // "eth0"
  std::string address;  // "10.0.0.5", "[fd00::5]": ready for "host:port"
};

// The interface `name`'s address: its first IPv4 one, else its first IPv6
// one that is not link-local. NotFound naming the interfaces there are.
Result<InterfaceAddress> find_interface(std::string_view name);
// The interface and address this host sends from to reach `host_port`
// ("head:29600", "[fd00::1]:29600"): the kernel's route, asked by
// connecting a UDP socket (which sends nothing).
Result<InterfaceAddress> interface_toward(const std::string& host_port);

// Applies config.job.interface to `o`: "" leaves it; a name or "auto" (the
// interface toward job.coordinator) becomes o.net.options.common.interface
// (UCX's TCP transport then uses only it) and, when no source set
// job.listen, the host of the listen address (its port kept).
Status apply_interface(const Config& config, RuntimeOptions& o);

}  // namespace psld
