// The TCP side channel of a verbs connection: it carries the hello that sets
// up the queue pair, and then stays open as the connection's liveness and
// close signal (a peer that exits or crashes closes it; the kernel says so at
// once, long before the queue pair's retry timer would).
//
// Non-blocking throughout; the transport polls the fds with epoll inside
// progress() and wait().
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include "psld/status.h"
#include "transports/common/side_channel.h"
#include "transports/verbs/verbs_protocol.h"

namespace psld::transport::verbs {

using transport::SideChannel;
using transport::tune_side_channel_socket;

// A non-blocking listening socket on `where` (port 0: any free port).
Result<int> tcp_listen(const HostPort& where);
// The address a socket is bound to (numeric host).
Result<HostPort> socket_address(int fd, bool peer);
// Connects to `to`, waiting at most `timeout`; returns a connected
// non-blocking socket. Unavailable when nobody listens or the time runs out.
Result<int> tcp_connect(const HostPort& to, std::chrono::milliseconds timeout);

}  // namespace psld::transport::verbs
