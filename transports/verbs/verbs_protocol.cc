#include "transports/verbs/verbs_protocol.h"

#include <arpa/inet.h>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>

#include "base/wire.h"

namespace psld::transport::verbs {

bool Gid::is_zero() const {
  return std::all_of(raw.begin(), raw.end(), [](uint8_t b) { return b == 0; });
}

bool Gid::is_ipv4_mapped() const {
  for (size_t i = 0; i < 10; ++i) {
    if (raw[i] != 0) return false;
  }
  return raw[10] == 0xff && raw[11] == 0xff;
}

std::string Gid::to_string() const {
  char buf[INET6_ADDRSTRLEN] = {};
  if (inet_ntop(AF_INET6, raw.data(), buf, sizeof(buf)) == nullptr) return "?";
  return buf;
}

std::vector<uint8_t> encode_hello(const Hello& h) {
  WireWriter w;
  w.u32(kHelloMagic);
  w.u16(h.version);
  w.u8(static_cast<uint8_t>(h.link_layer));
  w.u8(h.mtu);
  w.u16(h.lid);
  w.u32(h.qp_num);
  w.u32(h.psn);
  w.bytes(h.gid.raw);
  w.u64(h.transport_id);
  w.u64(h.nonce);
  w.u32(h.max_message_bytes);
  return w.take();
}

Result<Hello> decode_hello(std::span<const uint8_t> bytes) {
  if (bytes.size() != kHelloBytes) {
    return DataLoss(fmt::format("verbs hello is {} bytes, expected {}", bytes.size(), kHelloBytes));
  }
  WireReader r(bytes);
  Hello h;
  uint32_t magic = 0;
  uint8_t link = 0;
  // The size was checked above, so the reads cannot run short; the checks
  // stay so that a later change of the layout cannot silently read garbage.
  if (!r.u32(&magic) || !r.u16(&h.version) || !r.u8(&link) || !r.u8(&h.mtu) || !r.u16(&h.lid) ||
      !r.u32(&h.qp_num) || !r.u32(&h.psn)) {
    return DataLoss("verbs hello is truncated");
  }
  for (uint8_t& b : h.gid.raw) {
    if (!r.u8(&b)) return DataLoss("verbs hello is truncated");
  }
  if (!r.u64(&h.transport_id) || !r.u64(&h.nonce) || !r.u32(&h.max_message_bytes) || !r.done()) {
    return DataLoss("verbs hello is truncated");
  }
  if (magic != kHelloMagic) {
    return DataLoss(
        fmt::format("not a psld verbs hello (magic {:#010x}); is the peer a psld verbs "
                    "transport?",
                    magic));
  }
  if (h.version != kProtocolVersion) {
    return FailedPrecondition(fmt::format(
        "peer speaks verbs protocol version {}, this build speaks {}; run the same psld version "
        "on both sides",
        h.version, kProtocolVersion));
  }
  if (link != static_cast<uint8_t>(LinkLayer::kInfiniBand) &&
      link != static_cast<uint8_t>(LinkLayer::kEthernet)) {
    return DataLoss(fmt::format("verbs hello has unknown link layer {}", link));
  }
  h.link_layer = static_cast<LinkLayer>(link);
  if (h.mtu < kMtu256 || h.mtu > kMtu4096) {
    return DataLoss(fmt::format("verbs hello has invalid path MTU code {}", h.mtu));
  }
  if (h.qp_num == 0 || h.qp_num > kMax24Bit) {
    return DataLoss(fmt::format("verbs hello has invalid QP number {:#x}", h.qp_num));
  }
  if (h.psn > kMax24Bit) {
    return DataLoss(fmt::format("verbs hello has invalid PSN {:#x}", h.psn));
  }
  if (h.link_layer == LinkLayer::kInfiniBand && (h.lid == 0 || h.lid > kMaxUnicastLid)) {
    return DataLoss(fmt::format("verbs hello has invalid InfiniBand LID {:#x}", h.lid));
  }
  if (h.link_layer == LinkLayer::kEthernet && h.gid.is_zero()) {
    return DataLoss("verbs hello from a RoCE port has an all-zero GID");
  }
  if (h.transport_id == 0 || h.nonce == 0) {
    return DataLoss("verbs hello has a zero transport id or nonce");
  }
  if (h.max_message_bytes == 0 || h.max_message_bytes > (1u << 30)) {
    return DataLoss(fmt::format("verbs hello has absurd message size {}", h.max_message_bytes));
  }
  return h;
}

Status check_peer_hello(const Hello& local, const Hello& peer) {
  if (local.link_layer != peer.link_layer) {
    return FailedPrecondition(
        fmt::format("link layers differ: this port is {}, the peer's is {}",
                    local.link_layer == LinkLayer::kEthernet ? "Ethernet (RoCE)" : "InfiniBand",
                    peer.link_layer == LinkLayer::kEthernet ? "Ethernet (RoCE)" : "InfiniBand"));
  }
  if (local.max_message_bytes != peer.max_message_bytes) {
    return FailedPrecondition(
        fmt::format("control messages are at most {} bytes here and {} on the peer; receive "
                    "buffers would not fit (build both sides from the same psld)",
                    local.max_message_bytes, peer.max_message_bytes));
  }
  return Status::Ok();
}

Status check_hello_reply(const Hello& request, const Hello& reply) {
  if (reply.nonce != request.nonce) {
    return DataLoss(fmt::format("verbs hello reply carries nonce {:#x}, the request sent {:#x}",
                                reply.nonce, request.nonce));
  }
  return check_peer_hello(request, reply);
}

std::vector<uint8_t> encode_remote_key(const RemoteKey& k) {
  WireWriter w;
  w.u32(kRemoteKeyMagic);
  w.u16(kProtocolVersion);
  w.u64(k.transport_id);
  w.u64(k.region_id);
  w.u64(k.addr);
  w.u64(k.length);
  w.u32(k.rkey);
  w.u64(k.secret);
  return w.take();
}

Result<RemoteKey> decode_remote_key(std::span<const uint8_t> bytes) {
  if (bytes.size() != kRemoteKeyBytes) {
    return DataLoss(
        fmt::format("verbs remote key is {} bytes, expected {}", bytes.size(), kRemoteKeyBytes));
  }
  WireReader r(bytes);
  RemoteKey k;
  uint32_t magic = 0;
  uint16_t version = 0;
  if (!r.u32(&magic) || !r.u16(&version) || !r.u64(&k.transport_id) || !r.u64(&k.region_id) ||
      !r.u64(&k.addr) || !r.u64(&k.length) || !r.u32(&k.rkey) || !r.u64(&k.secret) || !r.done()) {
    return DataLoss("verbs remote key is truncated");
  }
  if (magic != kRemoteKeyMagic) {
    return DataLoss(fmt::format("not a psld verbs remote key (magic {:#010x})", magic));
  }
  if (version != kProtocolVersion) {
    return DataLoss(fmt::format("verbs remote key of version {}, this build reads {}", version,
                                kProtocolVersion));
  }
  if (k.transport_id == 0 || k.region_id == 0) {
    return DataLoss("verbs remote key has a zero transport or region id");
  }
  if (k.length == 0 || k.addr > UINT64_MAX - k.length) {
    return DataLoss(fmt::format("verbs remote key has an impossible range ({} bytes at {:#x})",
                                k.length, k.addr));
  }
  return k;
}

Result<HostPort> parse_host_port(std::string_view text, bool port_required) {
  auto bad = [&](std::string_view why) {
    return InvalidArgument(fmt::format(
        "'{}' is not a verbs address ({}); expected \"host:port\" or \"[ipv6]:port\"", text, why));
  };
  HostPort hp;
  std::string_view port_text;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == std::string_view::npos) return bad("unclosed '['");
    hp.host = std::string(text.substr(1, close - 1));
    if (close + 1 >= text.size() || text[close + 1] != ':') return bad("no port");
    port_text = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) return bad("no port");
    hp.host = std::string(text.substr(0, colon));
    if (hp.host.find(':') != std::string::npos) return bad("an IPv6 host needs brackets");
    port_text = text.substr(colon + 1);
  }
  if (hp.host.empty()) return bad("no host");
  // format_host_port adds brackets around a host with a colon only; one with
  // a bracket of its own would not parse again.
  if (hp.host.find_first_of("[]") != std::string::npos) return bad("a bracket inside the host");
  unsigned port = 0;
  auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (port_text.empty() || ec != std::errc() || end != port_text.data() + port_text.size() ||
      port > 65535) {
    return bad("port is not a number in 0..65535");
  }
  if (port_required && port == 0) return bad("port 0 cannot be connected to");
  hp.port = static_cast<uint16_t>(port);
  return hp;
}

std::string format_host_port(const HostPort& hp) {
  if (hp.host.find(':') != std::string::npos) return fmt::format("[{}]:{}", hp.host, hp.port);
  return fmt::format("{}:{}", hp.host, hp.port);
}

Status validate_verbs_options(const TransportOptions& options) {
  const VerbsOptions& v = options.verbs;
  if (options.common.op_timeout.count() <= 0) {
    return InvalidArgument("common.op_timeout must be positive");
  }
  if (v.port == 0) {
    return InvalidArgument("verbs.port must be 1 or more (RDMA ports are numbered from 1)");
  }
  if (v.gid_index < -1 || v.gid_index > kMaxGidIndex) {
    return InvalidArgument(fmt::format(
        "verbs.gid_index is {}; accepted: -1 (pick a RoCE v2 GID automatically) or 0..{}",
        v.gid_index, kMaxGidIndex));
  }
  if (v.max_inflight == 0 || v.max_inflight > kMaxInflightLimit) {
    return InvalidArgument(fmt::format("verbs.max_inflight is {}; accepted: 1..{}", v.max_inflight,
                                       kMaxInflightLimit));
  }
  // IBV_SYSFS_NAME_MAX is 64 including the terminator.
  if (v.device.size() >= 64 || !std::all_of(v.device.begin(), v.device.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
               c == '_' || c == '-' || c == '.';
      })) {
    return InvalidArgument(fmt::format(
        "verbs.device '{}' is not an RDMA device name (like mlx5_0; see ibv_devices)", v.device));
  }
  if (!options.common.listen_address.empty()) {
    auto hp = parse_host_port(options.common.listen_address, /*port_required=*/false);
    if (!hp.ok()) return hp.status().with_context("common.listen_address");
  }
  return Status::Ok();
}

}  // namespace psld::transport::verbs
