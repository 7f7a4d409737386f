// The verbs backend's wire formats and option checks: the TCP hello that sets
// up a queue pair, the packed remote key, and the address syntax. Kept free of
// libibverbs types so that all of it is tested on machines without an RDMA
// device (tests/verbs_transport_test.cc).
//
// Everything a peer sends is validated here before the transport uses it: a
// truncated, foreign or absurd blob is an error value, never followed.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "psld/status.h"
#include "transports/transport.h"

namespace psld::transport::verbs {

inline constexpr uint32_t kHelloMagic = 0x48565350;      // "PSVH" little-endian
inline constexpr uint32_t kRemoteKeyMagic = 0x4b565350;  // "PSVK" little-endian
// Bumped on any change of the hello, the key or the side-channel bytes; a
// peer with another version is refused at hello, with both versions named.
inline constexpr uint16_t kProtocolVersion = 1;

// Values as libibverbs numbers them (IBV_LINK_LAYER_*, enum ibv_mtu);
// verbs_transport.cc static_asserts that they match.
enum class LinkLayer : uint8_t { kInfiniBand = 1, kEthernet = 2 };
inline constexpr uint8_t kMtu256 = 1;
inline constexpr uint8_t kMtu4096 = 5;
// Queue pair numbers and packet sequence numbers are 24-bit on the wire.
inline constexpr uint32_t kMax24Bit = 0xffffff;
// Unicast LIDs are 0x0001..0xbfff; 0xc000 and up are multicast.
inline constexpr uint16_t kMaxUnicastLid = 0xbfff;
// The SGID index travels in ibv_global_route::sgid_index, a uint8_t.
inline constexpr int kMaxGidIndex = 255;
// More work requests than this per queue pair is a typo, not a tuning choice
// (ConnectX devices allow 32768; the device limit is applied on top).
inline constexpr uint32_t kMaxInflightLimit = 1u << 16;

struct Gid {
  std::array<uint8_t, 16> raw{};
  bool is_zero() const;
  // ::ffff:a.b.c.d, the form RoCE v2 uses for an IPv4 address.
  bool is_ipv4_mapped() const;
  std::string to_string() const;  // "fe80:0000:...", or "::ffff:10.0.0.1"
};

// What each side tells the other over TCP before its queue pair can talk.
// The client sends one with a fresh nonce; the server answers with its own,
// echoing that nonce, so a reply is tied to the request it answers.
struct Hello {
  uint16_t version = kProtocolVersion;
  LinkLayer link_layer = LinkLayer::kInfiniBand;
  uint8_t mtu = 0;  // active path MTU, enum ibv_mtu
  uint16_t lid = 0;
  uint32_t qp_num = 0;
  uint32_t psn = 0;  // first packet sequence number this side sends
  Gid gid;
  uint64_t transport_id = 0;  // random per transport; remote keys carry it
  uint64_t nonce = 0;
  uint32_t max_message_bytes = kMaxMessageBytes;  // must match: receive buffers
};
inline constexpr size_t kHelloBytes = 4 + 2 + 1 + 1 + 2 + 4 + 4 + 16 + 8 + 8 + 4;

std::vector<uint8_t> encode_hello(const Hello& hello);
// Exactly kHelloBytes, validated field by field: DataLoss for a malformed
// hello, FailedPrecondition for a well-formed one of another version.
Result<Hello> decode_hello(std::span<const uint8_t> bytes);
// Whether a (decoded) peer hello can talk to ours: same link layer, same
// message size. FailedPrecondition names the mismatch.
Status check_peer_hello(const Hello& local, const Hello& peer);
// The server's reply must echo the client's nonce.
Status check_hello_reply(const Hello& request, const Hello& reply);

// The packed remote key, MemoryRegion::remote_key() of a verbs region.
//
// addr, length and rkey are what the NIC checks: a peer can write into
// [addr, addr + length) of that registration and nowhere else. transport_id
// ties the key to the transport that exported it, so a key imported on a
// connection to another peer is refused before anything is sent. secret is a
// random tag per registration: it tells two registrations of the same range
// apart (a key kept across invalidate() and re-registration is visibly
// another key) and is not an access control of its own; the rkey is.
struct RemoteKey {
  uint64_t transport_id = 0;
  uint64_t region_id = 0;
  uint64_t addr = 0;
  uint64_t length = 0;
  uint32_t rkey = 0;
  uint64_t secret = 0;
};
inline constexpr size_t kRemoteKeyBytes = 4 + 2 + 8 + 8 + 8 + 8 + 4 + 8;

std::vector<uint8_t> encode_remote_key(const RemoteKey& key);
// DataLoss for anything but a well-formed key of this version.
Result<RemoteKey> decode_remote_key(std::span<const uint8_t> bytes);

// "host:port" or "[v6]:port". port_required: port 0 is refused (connect).
struct HostPort {
  std::string host;
  uint16_t port = 0;
};
Result<HostPort> parse_host_port(std::string_view text, bool port_required);
std::string format_host_port(const HostPort& hp);

// The checks create_transport("verbs") makes before it touches a device, so a
// wrong value is a clear InvalidArgument on every machine.
Status validate_verbs_options(const TransportOptions& options);

}  // namespace psld::transport::verbs
