#include "lib/placement/placement.h"

#include <bit>
#include <cmath>
#include <map>
#include <optional>
#include <queue>
#include <string>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "base/wire.h"

namespace psld {
namespace {

// Hash counts need 65 bits: one arc can cover all 2^64 hashes.
__extension__ typedef unsigned __int128 u128;
__extension__ typedef __int128 i128;

constexpr uint64_t kMaxHash = UINT64_MAX;
constexpr u128 kRingSize = u128{1} << 64;

// ---- Serialized layouts (all integers little-endian, doubles as their IEEE-754
// bits; reserved bytes are zero; the trailing checksum is fnv1a64 of every byte
// before it).
//
// Placement, version 1:
//   0  u32 magic "PSLP"       4  u16 version      6  u16 reserved
//   8  u64 epoch             16  u32 num_servers 20  u32 num_arcs
//   24 num_servers x 16 bytes: u32 id, u8 state, u8[3] reserved, f64 weight
//      (sorted by id)
//   .. num_arcs x 12 bytes: u64 upper (inclusive), u32 owner (sorted by upper;
//      an arc starts after the previous one's upper, so there is no gap to
//      validate away, and the last upper is 2^64 - 1)
//   .. u64 checksum
//
// Delta, version 1:
//   0  u32 magic "PSLD"       4  u16 version      6  u16 reserved
//   8  u64 from_epoch        16  u64 to_epoch
//   24 u32 num_changes       28  u32 num_assignments
//   32 num_changes x 16 bytes: u8 kind, u8 state, u16 reserved, u32 id, u64 argument
//      (kAdd: the weight as f64 bits; kHandOver: u32 to, u32 reserved; other
//      kinds: zero)
//   .. num_assignments x 20 bytes: u64 lo, u64 hi, u32 owner
//   .. u64 checksum
constexpr uint32_t kPlacementMagic = 0x504c5350;  // "PSLP"
constexpr uint32_t kDeltaMagic = 0x444c5350;      // "PSLD"
constexpr uint16_t kFormatVersion = 1;
constexpr size_t kPlacementHeaderBytes = 24;
constexpr size_t kServerBytes = 16;
constexpr size_t kArcBytes = 12;
constexpr size_t kDeltaHeaderBytes = 32;
constexpr size_t kChangeBytes = 16;
constexpr size_t kAssignmentBytes = 20;
constexpr size_t kChecksumBytes = 8;
// A delta never needs more steps than a placement has members or arcs.
constexpr size_t kMaxDeltaChanges = Placement::kMaxServers;
constexpr size_t kMaxDeltaAssignments = Placement::kMaxArcs;

// Appends the checksum of everything written so far.
std::vector<uint8_t> finish(WireWriter& w) {
  w.u64(fnv1a64(w.data()));
  return w.take();
}

// The checks both formats share, in the order that gives the clearest message:
// length, magic, version, reserved, then (once the caller has checked the
// exact length) the checksum.
Status check_envelope(std::span<const uint8_t> bytes, uint32_t magic, size_t header_bytes,
                      std::string_view what) {
  if (bytes.size() < header_bytes + kChecksumBytes) {
    return DataLoss(
        fmt::format("a serialized {} is at least {} bytes, this buffer has {}: truncated", what,
                    header_bytes + kChecksumBytes, bytes.size()));
  }
  WireReader r(bytes);
  const uint32_t got_magic = r.u32();
  if (got_magic != magic) {
    return DataLoss(fmt::format("not a serialized {}: magic is {:#010x}, expected {:#010x}", what,
                                got_magic, magic));
  }
  const uint16_t version = r.u16();
  if (version != kFormatVersion) {
    return DataLoss(
        fmt::format("{} format version {} is not supported (this build reads version {})", what,
                    version, kFormatVersion));
  }
  if (r.u16() != 0) return DataLoss(fmt::format("{} header: reserved bytes are not zero", what));
  return Status::Ok();
}

Status check_length_and_checksum(std::span<const uint8_t> bytes, uint64_t expected,
                                 std::string_view what, std::string_view counts) {
  if (bytes.size() != expected) {
    return DataLoss(fmt::format("{} header says {} ({} bytes), but the buffer has {} bytes", what,
                                counts, expected, bytes.size()));
  }
  const auto payload = bytes.first(bytes.size() - kChecksumBytes);
  const uint64_t stored = WireReader(bytes.last(kChecksumBytes)).u64();
  const uint64_t computed = fnv1a64(payload);
  if (stored != computed) {
    return DataLoss(
        fmt::format("{} checksum mismatch (stored {:#018x}, computed {:#018x}): the "
                    "bytes were corrupted",
                    what, stored, computed));
  }
  return Status::Ok();
}

Status check_weight(ServerId id, double weight) {
  // Written so that NaN fails too.
  if (!(weight > 0.0 && weight <= Placement::kMaxWeight)) {
    return InvalidArgument(fmt::format(
        "server {}: weight {} is not in (0, {}]; a weight is a relative capacity, e.g. 1.0", id,
        weight, Placement::kMaxWeight));
  }
  return Status::Ok();
}

bool valid_state(ServerState s) {
  return s == ServerState::kActive || s == ServerState::kDraining;
}

bool valid_kind(MembershipChange::Kind k) {
  return k == MembershipChange::Kind::kAdd || k == MembershipChange::Kind::kSetState ||
         k == MembershipChange::Kind::kRemove || k == MembershipChange::Kind::kHandOver;
}

// What apply() needs of a delta's own fields before it looks at a placement.
Status check_delta_shape(const PlacementDelta& d) {
  if (d.to_epoch <= d.from_epoch) {
    return InvalidArgument(fmt::format("delta goes from epoch {} to epoch {}; epochs only increase",
                                       d.from_epoch, d.to_epoch));
  }
  if (d.membership.size() > kMaxDeltaChanges || d.assignments.size() > kMaxDeltaAssignments) {
    return InvalidArgument(fmt::format(
        "delta has {} membership changes and {} assignments; at most {} and {} are allowed",
        d.membership.size(), d.assignments.size(), kMaxDeltaChanges, kMaxDeltaAssignments));
  }
  for (size_t i = 0; i < d.membership.size(); ++i) {
    const MembershipChange& c = d.membership[i];
    if (!valid_kind(c.kind)) {
      return InvalidArgument(
          fmt::format("membership change {}: unknown kind {}", i, static_cast<unsigned>(c.kind)));
    }
    if ((c.kind == MembershipChange::Kind::kAdd || c.kind == MembershipChange::Kind::kSetState) &&
        !valid_state(c.state)) {
      return InvalidArgument(fmt::format("membership change {}: unknown server state {}", i,
                                         static_cast<unsigned>(c.state)));
    }
    if (c.kind == MembershipChange::Kind::kAdd) {
      PSLD_RETURN_IF_ERROR(
          check_weight(c.id, c.weight).with_context(fmt::format("membership change {}", i)));
    }
    if (c.kind == MembershipChange::Kind::kHandOver && c.to == c.id) {
      return InvalidArgument(
          fmt::format("membership change {}: server {} hands its arcs over to itself", i, c.id));
    }
  }
  for (size_t i = 0; i < d.assignments.size(); ++i) {
    const RangeAssignment& a = d.assignments[i];
    if (a.lo > a.hi) {
      return InvalidArgument(
          fmt::format("assignment {}: empty range [{:#x}, {:#x}] (lo > hi)", i, a.lo, a.hi));
    }
  }
  return Status::Ok();
}

// The number of hashes in [lo, hi].
u128 width(uint64_t lo, uint64_t hi) {
  return u128{hi} - lo + 1;
}

// `fraction` of the ring, in hashes. Doubles carry 53 bits, so a target is
// exact to ~2^11 hashes out of 2^64, which is what add_server's split
// threshold absorbs.
u128 fraction_to_hashes(double fraction) {
  if (!(fraction > 0.0)) return 0;
  if (fraction >= 1.0) return kRingSize;
  return static_cast<u128>(std::ldexp(fraction, 64));
}

std::string percent(u128 hashes) {
  return fmt::format("{:.4f}%", 100.0 * static_cast<double>(hashes) / 18446744073709551616.0);
}

// The arcs of `upper`/`owner` after the sorted, disjoint assignments `as`, in
// one pass: old arcs (or their pieces) between assignments, each assignment
// as one arc.
void merge_disjoint(const std::vector<uint64_t>& upper, const std::vector<ServerId>& owner,
                    const std::vector<RangeAssignment>& as, std::vector<uint64_t>* out_upper,
                    std::vector<ServerId>* out_owner) {
  out_upper->reserve(upper.size() + 2 * as.size());
  out_owner->reserve(upper.size() + 2 * as.size());
  auto emit = [&](uint64_t hi, ServerId o) {
    out_upper->push_back(hi);
    out_owner->push_back(o);
  };
  size_t i = 0;    // the old arc that holds p
  uint64_t p = 0;  // the first hash not yet emitted
  for (const RangeAssignment& a : as) {
    while (p < a.lo) {
      const uint64_t end = std::min(upper[i], a.lo - 1);
      emit(end, owner[i]);
      p = end + 1;  // end < a.lo, no overflow
      if (end == upper[i]) ++i;
    }
    emit(a.hi, a.owner);
    if (a.hi == kMaxHash) return;  // disjoint and sorted: this was the last one
    p = a.hi + 1;
    while (upper[i] < p)
      ++i;  // skip what the assignment covered; upper.back() == max
  }
  for (; i < upper.size(); ++i)
    emit(upper[i], owner[i]);
}

// The general case: assignments that overlap, applied one after the other on
// an ordered map from upper bound to owner. O((arcs + assignments) log arcs).
Status apply_sequential(const std::vector<uint64_t>& upper, const std::vector<ServerId>& owner,
                        const std::vector<RangeAssignment>& as, std::vector<uint64_t>* out_upper,
                        std::vector<ServerId>* out_owner) {
  std::map<uint64_t, ServerId> arcs;
  for (size_t i = 0; i < upper.size(); ++i)
    arcs.emplace_hint(arcs.end(), upper[i], owner[i]);
  for (const RangeAssignment& a : as) {
    // Cut where the range starts (an arc must end at lo - 1) and ends (one
    // must end at hi); a new bound inherits the owner of the arc it cuts.
    if (a.lo > 0) {
      auto it = arcs.lower_bound(a.lo - 1);
      if (it->first != a.lo - 1) arcs.emplace_hint(it, a.lo - 1, it->second);
    }
    auto end = arcs.lower_bound(a.hi);
    if (end->first != a.hi) end = arcs.emplace_hint(end, a.hi, end->second);
    arcs.erase(arcs.lower_bound(a.lo), end);
    end->second = a.owner;
    if (arcs.size() > Placement::kMaxArcs) break;  // reported by the caller
  }
  if (arcs.size() > Placement::kMaxArcs) {
    return InvalidArgument(
        fmt::format("the delta cuts the ring into more than {} arcs", Placement::kMaxArcs));
  }
  out_upper->reserve(arcs.size());
  out_owner->reserve(arcs.size());
  for (const auto& [hi, o] : arcs) {
    out_upper->push_back(hi);
    out_owner->push_back(o);
  }
  return Status::Ok();
}

}  // namespace

std::string_view server_state_name(ServerState state) {
  switch (state) {
    case ServerState::kActive:
      return "active";
    case ServerState::kDraining:
      return "draining";
  }
  return "unknown";
}

MembershipChange MembershipChange::add(ServerSpec spec, ServerState state) {
  return MembershipChange{Kind::kAdd, spec.id, spec.weight, state};
}
MembershipChange MembershipChange::set_state(ServerId id, ServerState state) {
  return MembershipChange{Kind::kSetState, id, 0.0, state};
}
MembershipChange MembershipChange::remove(ServerId id) {
  return MembershipChange{Kind::kRemove, id, 0.0, ServerState::kActive};
}
MembershipChange MembershipChange::hand_over(ServerId id, ServerId to) {
  return MembershipChange{Kind::kHandOver, id, 0.0, ServerState::kActive, to};
}

// ---- PlacementDelta ----------------------------------------------------------

std::vector<uint8_t> PlacementDelta::serialize() const {
  WireWriter w(kDeltaHeaderBytes + kChangeBytes * membership.size() +
               kAssignmentBytes * assignments.size() + kChecksumBytes);
  w.u32(kDeltaMagic);
  w.u16(kFormatVersion);
  w.u16(0);
  w.u64(from_epoch);
  w.u64(to_epoch);
  w.u32(static_cast<uint32_t>(membership.size()));
  w.u32(static_cast<uint32_t>(assignments.size()));
  for (const MembershipChange& c : membership) {
    // Fields the kind does not use are written as zero, so one delta has one
    // encoding.
    const bool add = c.kind == MembershipChange::Kind::kAdd;
    const bool has_state = add || c.kind == MembershipChange::Kind::kSetState;
    w.u8(static_cast<uint8_t>(c.kind));
    w.u8(has_state ? static_cast<uint8_t>(c.state) : 0);
    w.u16(0);
    w.u32(c.id);
    if (c.kind == MembershipChange::Kind::kHandOver) {
      w.u64(c.to);
    } else {
      w.f64(add ? c.weight : 0.0);
    }
  }
  for (const RangeAssignment& a : assignments) {
    w.u64(a.lo);
    w.u64(a.hi);
    w.u32(a.owner);
  }
  return finish(w);
}

Result<PlacementDelta> PlacementDelta::deserialize(std::span<const uint8_t> bytes) {
  PSLD_RETURN_IF_ERROR(check_envelope(bytes, kDeltaMagic, kDeltaHeaderBytes, "placement delta"));
  WireReader r(bytes.subspan(8));
  PlacementDelta d;
  d.from_epoch = r.u64();
  d.to_epoch = r.u64();
  const uint32_t num_changes = r.u32();
  const uint32_t num_assignments = r.u32();
  if (num_changes > kMaxDeltaChanges || num_assignments > kMaxDeltaAssignments) {
    return DataLoss(fmt::format(
        "placement delta claims {} membership changes and {} assignments; at most {} and {} are "
        "allowed",
        num_changes, num_assignments, kMaxDeltaChanges, kMaxDeltaAssignments));
  }
  // Cannot overflow: both counts are below 2^23.
  const uint64_t expected = kDeltaHeaderBytes + uint64_t{kChangeBytes} * num_changes +
                            uint64_t{kAssignmentBytes} * num_assignments + kChecksumBytes;
  PSLD_RETURN_IF_ERROR(check_length_and_checksum(
      bytes, expected, "placement delta",
      fmt::format("{} changes and {} assignments", num_changes, num_assignments)));

  r = WireReader(bytes.subspan(kDeltaHeaderBytes));
  d.membership.reserve(num_changes);
  for (uint32_t i = 0; i < num_changes; ++i) {
    MembershipChange c;
    const uint8_t kind = r.u8();
    const uint8_t state = r.u8();
    const uint16_t reserved = r.u16();
    c.id = r.u32();
    const uint64_t argument = r.u64();
    c.kind = static_cast<MembershipChange::Kind>(kind);
    c.state = static_cast<ServerState>(state);
    if (!valid_kind(c.kind)) {
      return DataLoss(fmt::format("placement delta: membership change {} has unknown kind {}", i,
                                  static_cast<unsigned>(kind)));
    }
    const bool add = c.kind == MembershipChange::Kind::kAdd;
    const bool hand_over = c.kind == MembershipChange::Kind::kHandOver;
    const bool has_state = add || c.kind == MembershipChange::Kind::kSetState;
    if (add) c.weight = std::bit_cast<double>(argument);
    if (hand_over) c.to = static_cast<ServerId>(argument);
    const bool argument_ok = add || (hand_over ? argument <= UINT32_MAX : argument == 0);
    if (reserved != 0 || !argument_ok || (!has_state && state != 0)) {
      return DataLoss(fmt::format(
          "placement delta: membership change {} has non-zero reserved or unused fields", i));
    }
    d.membership.push_back(c);
  }
  d.assignments.reserve(num_assignments);
  for (uint32_t i = 0; i < num_assignments; ++i) {
    RangeAssignment a;
    a.lo = r.u64();
    a.hi = r.u64();
    a.owner = r.u32();
    d.assignments.push_back(a);
  }
  Status shape = check_delta_shape(d);
  if (!shape.ok()) return DataLoss("placement delta: " + shape.message());
  return d;
}

// ---- Placement: construction and (de)serialization ---------------------------

Result<Placement> Placement::initial(std::vector<ServerSpec> servers,
                                     uint32_t vnodes_per_unit_weight) {
  if (servers.empty()) return InvalidArgument("a placement needs at least one server");
  if (servers.size() > kMaxServers) {
    return InvalidArgument(
        fmt::format("{} servers; a placement holds at most {}", servers.size(), kMaxServers));
  }
  if (vnodes_per_unit_weight == 0) {
    return InvalidArgument("vnodes_per_unit_weight must be at least 1 (the default is 256)");
  }
  std::sort(servers.begin(), servers.end(),
            [](const ServerSpec& a, const ServerSpec& b) { return a.id < b.id; });
  for (size_t i = 0; i < servers.size(); ++i) {
    if (i > 0 && servers[i].id == servers[i - 1].id) {
      return InvalidArgument(fmt::format("server id {} appears twice", servers[i].id));
    }
    PSLD_RETURN_IF_ERROR(check_weight(servers[i].id, servers[i].weight));
  }

  // Why equal arcs and not virtual nodes at hashed points: with hashed points
  // the arcs' lengths are random, and the largest of 64 servers with 256
  // virtual nodes each holds ~1.15x the mean, right at our balance bound.
  // Cutting the ring into equal arcs makes every share exactly proportional to
  // the number of virtual nodes; handing the arcs out in the hashed order of
  // the tokens still interleaves the servers pseudo-randomly around the ring,
  // so a server's arcs are spread out and any other server can take a few.
  struct Token {
    uint64_t hash;
    ServerId id;
    uint32_t replica;
  };
  std::vector<Token> tokens;
  uint64_t total = 0;
  for (const ServerSpec& s : servers) {
    const double vnodes = std::round(static_cast<double>(vnodes_per_unit_weight) * s.weight);
    const uint64_t count = vnodes < 1.0 ? 1 : static_cast<uint64_t>(std::min(vnodes, 1e18));
    total += count;  // each count is below 1e18 and there are at most 2^16
    if (total > kMaxArcs) {
      return InvalidArgument(fmt::format(
          "{} virtual nodes per unit weight with these weights make more than {} arcs; lower "
          "vnodes_per_unit_weight",
          vnodes_per_unit_weight, kMaxArcs));
    }
    for (uint64_t r = 0; r < count; ++r) {
      tokens.push_back(Token{hash_pair(s.id, r), s.id, static_cast<uint32_t>(r)});
    }
  }
  std::sort(tokens.begin(), tokens.end(), [](const Token& a, const Token& b) {
    return std::tie(a.hash, a.id, a.replica) < std::tie(b.hash, b.id, b.replica);
  });

  Placement p;
  p.epoch_ = 0;
  p.servers_.reserve(servers.size());
  for (const ServerSpec& s : servers) {
    p.servers_.push_back(ServerInfo{s.id, s.weight, ServerState::kActive});
  }
  const uint64_t n = tokens.size();
  p.upper_.resize(n);
  p.owner_.resize(n);
  for (uint64_t i = 0; i < n; ++i) {
    // Arc i is [floor(i * 2^64 / n), floor((i+1) * 2^64 / n) - 1].
    p.upper_[i] = i + 1 < n ? static_cast<uint64_t>((u128{i + 1} << 64) / n) - 1 : kMaxHash;
    p.owner_[i] = tokens[i].id;
  }
  p.build_index();
  return p;
}

std::vector<uint8_t> Placement::serialize() const {
  WireWriter w(kPlacementHeaderBytes + kServerBytes * servers_.size() + kArcBytes * upper_.size() +
               kChecksumBytes);
  w.u32(kPlacementMagic);
  w.u16(kFormatVersion);
  w.u16(0);
  w.u64(epoch_);
  w.u32(static_cast<uint32_t>(servers_.size()));
  w.u32(static_cast<uint32_t>(upper_.size()));
  for (const ServerInfo& s : servers_) {
    w.u32(s.id);
    w.u8(static_cast<uint8_t>(s.state));
    w.u8(0);
    w.u16(0);
    w.f64(s.weight);
  }
  for (size_t i = 0; i < upper_.size(); ++i) {
    w.u64(upper_[i]);
    w.u32(owner_[i]);
  }
  return finish(w);
}

Result<Placement> Placement::deserialize(std::span<const uint8_t> bytes) {
  PSLD_RETURN_IF_ERROR(check_envelope(bytes, kPlacementMagic, kPlacementHeaderBytes, "placement"));
  WireReader r(bytes.subspan(8));
  Placement p;
  p.epoch_ = r.u64();
  const uint32_t num_servers = r.u32();
  const uint32_t num_arcs = r.u32();
  if (num_servers == 0 || num_servers > kMaxServers || num_arcs == 0 || num_arcs > kMaxArcs) {
    return DataLoss(fmt::format(
        "placement claims {} servers and {} arcs; a placement has 1 to {} of each and at most {} "
        "arcs",
        num_servers, num_arcs, kMaxServers, kMaxArcs));
  }
  const uint64_t expected = kPlacementHeaderBytes + uint64_t{kServerBytes} * num_servers +
                            uint64_t{kArcBytes} * num_arcs + kChecksumBytes;
  PSLD_RETURN_IF_ERROR(check_length_and_checksum(
      bytes, expected, "placement", fmt::format("{} servers and {} arcs", num_servers, num_arcs)));

  r = WireReader(bytes.subspan(kPlacementHeaderBytes));
  p.servers_.reserve(num_servers);
  for (uint32_t i = 0; i < num_servers; ++i) {
    ServerInfo s;
    s.id = r.u32();
    const uint8_t state = r.u8();
    const uint8_t reserved8 = r.u8();
    const uint16_t reserved16 = r.u16();
    s.weight = r.f64();
    s.state = static_cast<ServerState>(state);
    if (!valid_state(s.state) || reserved8 != 0 || reserved16 != 0) {
      return DataLoss(
          fmt::format("placement: server entry {} (id {}) has state {} or non-zero "
                      "reserved bytes",
                      i, s.id, static_cast<unsigned>(state)));
    }
    if (i > 0 && s.id <= p.servers_.back().id) {
      return DataLoss(fmt::format("placement: server ids are not strictly increasing ({} after {})",
                                  s.id, p.servers_.back().id));
    }
    Status weight = check_weight(s.id, s.weight);
    if (!weight.ok()) return DataLoss("placement: " + weight.message());
    p.servers_.push_back(s);
  }
  p.upper_.reserve(num_arcs);
  p.owner_.reserve(num_arcs);
  for (uint32_t i = 0; i < num_arcs; ++i) {
    const uint64_t upper = r.u64();
    const ServerId owner = r.u32();
    if (i > 0 && upper <= p.upper_.back()) {
      return DataLoss(fmt::format(
          "placement: arc {} ends at {:#x}, not after arc {} ({:#x}): arcs must be sorted and "
          "non-empty",
          i, upper, i - 1, p.upper_.back()));
    }
    p.upper_.push_back(upper);
    p.owner_.push_back(owner);
  }
  if (p.upper_.back() != kMaxHash) {
    return DataLoss(
        fmt::format("placement: the last arc ends at {:#x}, so hashes above it have no owner",
                    p.upper_.back()));
  }
  Status owners = p.check_owners();
  if (!owners.ok()) return DataLoss("placement: " + owners.message());
  p.build_index();
  return p;
}

void Placement::build_index() {
  // 2-4 buckets per arc: a bucket then meets one or two arcs when arcs are
  // about equal, which is what epoch 0 and the balancer's moves keep them.
  constexpr unsigned kMaxIndexBits = 20;
  unsigned bits = 1;
  while (bits < kMaxIndexBits && (size_t{1} << bits) < 2 * upper_.size())
    ++bits;
  index_shift_ = 64 - bits;
  const size_t buckets = size_t{1} << bits;
  index_.assign(buckets + 1, 0);
  uint32_t i = 0;
  for (size_t b = 0; b < buckets; ++b) {
    const uint64_t first_hash = static_cast<uint64_t>(b) << index_shift_;
    while (upper_[i] < first_hash)
      ++i;
    index_[b] = i;
  }
  index_[buckets] = static_cast<uint32_t>(upper_.size() - 1);
}

// ---- Queries ------------------------------------------------------------------

const ServerInfo* Placement::find_server(ServerId id) const {
  auto it = std::lower_bound(servers_.begin(), servers_.end(), id,
                             [](const ServerInfo& s, ServerId v) { return s.id < v; });
  return it != servers_.end() && it->id == id ? &*it : nullptr;
}

std::optional<ServerId> backup_of(const Placement& p, ServerId primary) {
  const auto& members = p.servers();
  if (members.size() < 2 || p.find_server(primary) == nullptr) return std::nullopt;
  const auto next = std::upper_bound(members.begin(), members.end(), primary,
                                     [](ServerId v, const ServerInfo& s) { return v < s.id; });
  const size_t from = static_cast<size_t>(next - members.begin());
  std::optional<ServerId> first;  // the next member, draining or not
  for (size_t k = 0; k < members.size(); ++k) {
    const ServerInfo& s = members[(from + k) % members.size()];
    if (s.id == primary) continue;
    if (!first) first = s.id;
    if (s.state != ServerState::kDraining) return s.id;
  }
  return first;
}

std::vector<Arc> Placement::arcs_of(ServerId id) const {
  std::vector<Arc> arcs;
  for (size_t i = 0; i < upper_.size(); ++i) {
    if (owner_[i] == id) arcs.push_back(arc(i));
  }
  return arcs;
}

double Placement::share_of(ServerId id) const {
  u128 hashes = 0;
  for (size_t i = 0; i < upper_.size(); ++i) {
    if (owner_[i] == id) {
      const Arc a = arc(i);
      hashes += width(a.lo, a.hi);
    }
  }
  return static_cast<double>(hashes) / 18446744073709551616.0;
}

template <typename IdOf>
void ServerIndex::build(size_t count, IdOf id_of) {
  ServerId highest = 0;
  for (size_t i = 0; i < count; ++i)
    highest = std::max(highest, id_of(i));
  table_.assign(count == 0 ? 0 : std::min<size_t>(size_t{highest} + 1, 4 * count), kNone);
  for (size_t i = 0; i < count; ++i) {
    const ServerId id = id_of(i);
    if (id < table_.size()) {
      table_[id] = static_cast<uint32_t>(i);
    } else {
      above_.emplace_back(id, static_cast<uint32_t>(i));
    }
  }
  std::sort(above_.begin(), above_.end());
}

ServerIndex::ServerIndex(std::span<const ServerId> ids) {
  build(ids.size(), [&](size_t i) { return ids[i]; });
}

ServerIndex::ServerIndex(std::span<const ServerInfo> servers) {
  build(servers.size(), [&](size_t i) { return servers[i].id; });
}

uint32_t ServerIndex::search(ServerId id) const {
  auto it = std::lower_bound(
      above_.begin(), above_.end(), id,
      [](const std::pair<ServerId, uint32_t>& e, ServerId v) { return e.first < v; });
  return it != above_.end() && it->first == id ? it->second : kNone;
}

Status Placement::check_owners() const {
  const ServerIndex members(servers_);
  for (size_t i = 0; i < owner_.size(); ++i) {
    if (members.find(owner_[i]) == ServerIndex::kNone) {
      const Arc a = arc(i);
      return InvalidArgument(
          fmt::format("arc {} [{:#x}, {:#x}] is owned by server {}, which is not a member", i, a.lo,
                      a.hi, a.owner));
    }
  }
  return Status::Ok();
}

Status Placement::check_receiver(ServerId to) const {
  const ServerInfo* s = find_server(to);
  if (s == nullptr) {
    return NotFound(fmt::format("server {} is not a member of placement epoch {}", to, epoch_));
  }
  if (s->state != ServerState::kActive) {
    return FailedPrecondition(
        fmt::format("server {} is {} and takes no new arcs; set_state it active first", to,
                    server_state_name(s->state)));
  }
  return Status::Ok();
}

// ---- apply ----------------------------------------------------------------------

Result<Placement> Placement::initial_with_keys(std::vector<ServerSpec> servers,
                                               std::span<const KeyOwner> keys,
                                               uint32_t vnodes_per_unit_weight) {
  PSLD_ASSIGN_OR_RETURN(Placement base, initial(std::move(servers), vnodes_per_unit_weight));
  PlacementDelta delta;
  delta.from_epoch = 0;
  delta.to_epoch = 1;
  for (const KeyOwner& k : keys) {
    if (base.find_server(k.owner) == nullptr) {
      return InvalidArgument(
          fmt::format("key {:#x} is given to server {}, which is not a member", k.key, k.owner));
    }
    const uint64_t h = hash_key(k.key);
    delta.assignments.push_back({h, h, k.owner});
  }
  std::sort(delta.assignments.begin(), delta.assignments.end(),
            [](const RangeAssignment& a, const RangeAssignment& b) { return a.lo < b.lo; });
  for (size_t i = 1; i < delta.assignments.size(); ++i) {
    if (delta.assignments[i].lo == delta.assignments[i - 1].lo) {
      return InvalidArgument("a key is listed twice");
    }
  }
  PSLD_ASSIGN_OR_RETURN(Placement out, base.apply(delta));
  out.epoch_ = 0;  // the job's first epoch, not a change of one
  return out;
}

Result<Placement> Placement::apply(const PlacementDelta& delta) const {
  if (delta.from_epoch != epoch_) {
    return FailedPrecondition(fmt::format(
        "the delta goes from epoch {} to {}, but this placement is epoch {}: apply deltas in order",
        delta.from_epoch, delta.to_epoch, epoch_));
  }
  PSLD_RETURN_IF_ERROR(check_delta_shape(delta));

  Placement next;
  next.epoch_ = delta.to_epoch;
  next.servers_ = servers_;
  std::vector<ServerInfo>& members = next.servers_;
  std::vector<std::pair<ServerId, ServerId>> hand_overs;  // (from, to), in order
  for (size_t i = 0; i < delta.membership.size(); ++i) {
    const MembershipChange& c = delta.membership[i];
    auto it = std::lower_bound(members.begin(), members.end(), c.id,
                               [](const ServerInfo& s, ServerId v) { return s.id < v; });
    const bool present = it != members.end() && it->id == c.id;
    if (c.kind == MembershipChange::Kind::kAdd) {
      if (present) {
        return InvalidArgument(
            fmt::format("membership change {}: server {} is already a member", i, c.id));
      }
      if (members.size() >= kMaxServers) {
        return InvalidArgument(fmt::format(
            "membership change {}: a placement holds at most {} servers", i, kMaxServers));
      }
      members.insert(it, ServerInfo{c.id, c.weight, c.state});
      continue;
    }
    if (!present) {
      return NotFound(fmt::format("membership change {}: server {} is not a member", i, c.id));
    }
    if (c.kind == MembershipChange::Kind::kSetState) {
      it->state = c.state;
      continue;
    }
    if (c.kind == MembershipChange::Kind::kHandOver) {
      const bool to_present = std::any_of(members.begin(), members.end(),
                                          [&](const ServerInfo& s) { return s.id == c.to; });
      if (!to_present) {
        return NotFound(
            fmt::format("membership change {}: server {} hands its arcs to server {}, "
                        "which is not a member",
                        i, c.id, c.to));
      }
      hand_overs.emplace_back(c.id, c.to);
    }
    members.erase(it);
  }

  // Hand-overs rename owners before the assignments cut the ring; a chain
  // (a to b, then b to c) ends at c, as applying them one by one would.
  const std::vector<ServerId>* base_owner = &owner_;
  std::vector<ServerId> handed;
  if (!hand_overs.empty()) {
    handed = owner_;
    for (const auto& [from, to] : hand_overs) {
      std::replace(handed.begin(), handed.end(), from, to);
    }
    base_owner = &handed;
  }

  const std::vector<RangeAssignment>& as = delta.assignments;
  bool disjoint_sorted = true;
  for (size_t i = 1; i < as.size() && disjoint_sorted; ++i) {
    disjoint_sorted = as[i].lo > as[i - 1].hi;
  }
  if (disjoint_sorted) {
    merge_disjoint(upper_, *base_owner, as, &next.upper_, &next.owner_);
    if (next.upper_.size() > kMaxArcs) {
      return InvalidArgument(fmt::format("the delta cuts the ring into {} arcs; at most {}",
                                         next.upper_.size(), kMaxArcs));
    }
  } else {
    PSLD_RETURN_IF_ERROR(apply_sequential(upper_, *base_owner, as, &next.upper_, &next.owner_));
  }
  // Every owner of this epoch is a member; when no member leaves, only the
  // owners the delta names can be strangers. The full check looks up every
  // arc's owner: a million of them for a balancer step on a big ring.
  const bool none_leaves =
      std::none_of(delta.membership.begin(), delta.membership.end(), [](const MembershipChange& c) {
        return c.kind == MembershipChange::Kind::kRemove ||
               c.kind == MembershipChange::Kind::kHandOver;
      });
  const ServerIndex next_members(next.servers_);
  const bool named_are_members = std::all_of(as.begin(), as.end(), [&](const RangeAssignment& a) {
    return next_members.find(a.owner) != ServerIndex::kNone;
  });
  if (!none_leaves || !named_are_members) {
    PSLD_RETURN_IF_ERROR(next.check_owners().with_context(
        fmt::format("delta from epoch {} to {}", delta.from_epoch, delta.to_epoch)));
  }
  next.build_index();
  return next;
}

Result<PlacementChange> Placement::commit(PlacementDelta delta) const {
  if (epoch_ == UINT64_MAX) return FailedPrecondition("the placement epoch counter is exhausted");
  delta.from_epoch = epoch_;
  delta.to_epoch = epoch_ + 1;
  PSLD_ASSIGN_OR_RETURN(Placement next, apply(delta));
  return PlacementChange{std::move(next), std::move(delta)};
}

// ---- Changes --------------------------------------------------------------------

Result<PlacementChange> Placement::move_arc(size_t arc_index, ServerId to) const {
  if (arc_index >= upper_.size()) {
    return OutOfRange(fmt::format("arc index {} is out of range: epoch {} has {} arcs", arc_index,
                                  epoch_, upper_.size()));
  }
  PSLD_RETURN_IF_ERROR(check_receiver(to));
  const Arc a = arc(arc_index);
  PlacementDelta d;
  d.assignments.push_back(RangeAssignment{a.lo, a.hi, to});
  return commit(std::move(d));
}

Result<PlacementChange> Placement::move_range(uint64_t lo, uint64_t hi, ServerId to) const {
  if (lo > hi) {
    return InvalidArgument(fmt::format("move_range: empty range [{:#x}, {:#x}] (lo > hi)", lo, hi));
  }
  PSLD_RETURN_IF_ERROR(check_receiver(to));
  PlacementDelta d;
  d.assignments.push_back(RangeAssignment{lo, hi, to});
  return commit(std::move(d));
}

Result<PlacementChange> Placement::split_arc(uint64_t at_hash) const {
  const size_t i = arc_index_of_hash(at_hash);
  const Arc a = arc(i);
  if (at_hash == a.lo) {
    return InvalidArgument(fmt::format(
        "split_arc: {:#x} is already where arc {} [{:#x}, {:#x}] starts; nothing to split", at_hash,
        i, a.lo, a.hi));
  }
  // Re-assigning [at_hash, hi] to its owner cuts the arc at at_hash.
  PlacementDelta d;
  d.assignments.push_back(RangeAssignment{at_hash, a.hi, a.owner});
  return commit(std::move(d));
}

Result<PlacementChange> Placement::isolate_key(Key key) const {
  const uint64_t h = hash_key(key);
  PlacementDelta d;
  d.assignments.push_back(RangeAssignment{h, h, owner_of_hash(h)});
  return commit(std::move(d));
}

Result<PlacementChange> Placement::add_server_empty(ServerSpec spec) const {
  PSLD_RETURN_IF_ERROR(check_weight(spec.id, spec.weight));
  if (find_server(spec.id) != nullptr) {
    return InvalidArgument(fmt::format("server {} is already a member", spec.id));
  }
  PlacementDelta d;
  d.membership.push_back(MembershipChange::add(spec));
  return commit(std::move(d));
}

Result<PlacementChange> Placement::add_server(ServerSpec spec) const {
  PSLD_RETURN_IF_ERROR(check_weight(spec.id, spec.weight));
  if (find_server(spec.id) != nullptr) {
    return InvalidArgument(fmt::format("server {} is already a member", spec.id));
  }

  // What each member holds (hashes and arc indices), indexed like servers_.
  struct Holdings {
    std::vector<u128> hashes;
    std::vector<std::vector<uint32_t>> arcs;
  };
  Holdings held{std::vector<u128>(servers_.size(), 0),
                std::vector<std::vector<uint32_t>>(servers_.size())};
  for (uint32_t i = 0; i < upper_.size(); ++i) {
    const size_t m = static_cast<size_t>(find_server(owner_[i]) - servers_.data());
    const Arc a = arc(i);
    held.hashes[m] += width(a.lo, a.hi);
    held.arcs[m].push_back(i);
  }

  double total_weight = spec.weight;
  for (const ServerInfo& s : servers_) {
    if (s.state == ServerState::kActive) total_weight += s.weight;
  }
  // Donors: everyone above its target in the new membership (a draining
  // server's target is 0), most overloaded first, ties by id.
  struct Donor {
    u128 excess;
    size_t member;
  };
  std::vector<Donor> donors;
  for (size_t m = 0; m < servers_.size(); ++m) {
    const ServerInfo& s = servers_[m];
    const u128 target =
        s.state == ServerState::kActive ? fraction_to_hashes(s.weight / total_weight) : u128{0};
    if (held.hashes[m] > target) donors.push_back(Donor{held.hashes[m] - target, m});
  }
  std::sort(donors.begin(), donors.end(), [&](const Donor& a, const Donor& b) {
    if (a.excess != b.excess) return a.excess > b.excess;
    return servers_[a.member].id < servers_[b.member].id;
  });

  PlacementDelta d;
  d.membership.push_back(MembershipChange::add(spec));
  // The donors' excesses add up to at least the new server's target, so it
  // reaches its target (to within the split threshold below) and never more.
  u128 need = fraction_to_hashes(spec.weight / total_weight);
  for (const Donor& donor : donors) {
    if (need == 0) break;
    const u128 quota = std::min(donor.excess, need);
    u128 left = quota;
    // Whole arcs first, in a pseudo-random order keyed by the new server, so
    // what it takes is spread over the ring and over the donor's arcs.
    std::vector<std::pair<uint64_t, uint32_t>> order;  // (rank, arc index)
    for (uint32_t i : held.arcs[donor.member]) {
      order.emplace_back(hash_pair(arc(i).lo, spec.id), i);
    }
    std::sort(order.begin(), order.end());
    std::optional<Arc> first_left_over;
    for (const auto& [rank, i] : order) {
      const Arc a = arc(i);
      const u128 w = width(a.lo, a.hi);
      if (w <= left) {
        d.assignments.push_back(RangeAssignment{a.lo, a.hi, spec.id});
        left -= w;
      } else if (!first_left_over) {
        first_left_over = a;
      }
    }
    // The rest of the quota is smaller than every arc not taken: cut it off
    // the first of them. A remainder below an eighth of the donor's mean arc
    // is left alone: it is rounding residue (targets are doubles, exact to
    // ~2^11 hashes) or too few keys to be worth a new arc.
    const u128 min_split = held.hashes[donor.member] / (8 * u128{held.arcs[donor.member].size()});
    if (left > 0 && left >= min_split && first_left_over) {
      const uint64_t lo = first_left_over->lo;
      d.assignments.push_back(RangeAssignment{lo, lo + static_cast<uint64_t>(left - 1), spec.id});
      left = 0;
    }
    need -= quota - left;
  }
  std::sort(d.assignments.begin(), d.assignments.end(),
            [](const RangeAssignment& a, const RangeAssignment& b) { return a.lo < b.lo; });
  return commit(std::move(d));
}

Result<PlacementChange> Placement::drain_server(ServerId id) const {
  const ServerInfo* drained = find_server(id);
  if (drained == nullptr) {
    return NotFound(fmt::format("server {} is not a member of placement epoch {}", id, epoch_));
  }
  double total_weight = 0.0;
  for (const ServerInfo& s : servers_) {
    if (s.state == ServerState::kActive && s.id != id) total_weight += s.weight;
  }
  if (total_weight == 0.0) {
    return FailedPrecondition(
        fmt::format("server {} is the last active server; add another before draining it", id));
  }

  // Each receiver's deficit against its weighted target without `id`.
  std::vector<i128> deficit(servers_.size(), 0);
  for (size_t m = 0; m < servers_.size(); ++m) {
    const ServerInfo& s = servers_[m];
    if (s.state == ServerState::kActive && s.id != id) {
      deficit[m] = static_cast<i128>(fraction_to_hashes(s.weight / total_weight));
    }
  }
  std::vector<uint32_t> mine;
  for (uint32_t i = 0; i < upper_.size(); ++i) {
    const Arc a = arc(i);
    if (a.owner == id) {
      mine.push_back(i);
    } else {
      deficit[static_cast<size_t>(find_server(a.owner) - servers_.data())] -=
          static_cast<i128>(width(a.lo, a.hi));
    }
  }
  // Largest arcs first (the classic LPT order), each to the receiver furthest
  // below its target; ties go to the lower id, so the plan is deterministic.
  std::sort(mine.begin(), mine.end(), [&](uint32_t x, uint32_t y) {
    const u128 wx = width(arc(x).lo, arc(x).hi);
    const u128 wy = width(arc(y).lo, arc(y).hi);
    return wx != wy ? wx > wy : x < y;
  });
  auto less_urgent = [&](size_t a, size_t b) {
    if (deficit[a] != deficit[b]) return deficit[a] < deficit[b];
    return servers_[a].id > servers_[b].id;
  };
  std::priority_queue<size_t, std::vector<size_t>, decltype(less_urgent)> receivers(less_urgent);
  for (size_t m = 0; m < servers_.size(); ++m) {
    if (servers_[m].state == ServerState::kActive && servers_[m].id != id) receivers.push(m);
  }

  PlacementDelta d;
  if (drained->state != ServerState::kDraining) {
    d.membership.push_back(MembershipChange::set_state(id, ServerState::kDraining));
  }
  for (uint32_t i : mine) {
    const size_t m = receivers.top();
    receivers.pop();
    const Arc a = arc(i);
    d.assignments.push_back(RangeAssignment{a.lo, a.hi, servers_[m].id});
    deficit[m] -= static_cast<i128>(width(a.lo, a.hi));
    receivers.push(m);
  }
  std::sort(d.assignments.begin(), d.assignments.end(),
            [](const RangeAssignment& a, const RangeAssignment& b) { return a.lo < b.lo; });
  return commit(std::move(d));
}

Result<PlacementChange> Placement::hand_over(ServerId id, ServerId to,
                                             std::optional<ServerSpec> replacement) const {
  if (find_server(id) == nullptr) {
    return NotFound(fmt::format("server {} is not a member of placement epoch {}", id, epoch_));
  }
  if (find_server(to) == nullptr) {
    return NotFound(fmt::format("server {} is not a member of placement epoch {}", to, epoch_));
  }
  if (id == to) {
    return InvalidArgument(fmt::format("hand_over: server {} cannot take over its own arcs", id));
  }
  PlacementDelta d;
  d.membership.push_back(MembershipChange::hand_over(id, to));
  if (replacement) {
    if (find_server(replacement->id) != nullptr) {
      return InvalidArgument(
          fmt::format("hand_over: server {} cannot replace server {}: it is a member already",
                      replacement->id, id));
    }
    // Its weight is checked with the delta's shape in apply().
    d.membership.push_back(MembershipChange::add(*replacement));
  }
  return commit(std::move(d));
}

Result<PlacementChange> Placement::remove_server(ServerId id) const {
  if (find_server(id) == nullptr) {
    return NotFound(fmt::format("server {} is not a member of placement epoch {}", id, epoch_));
  }
  size_t owned = 0;
  u128 hashes = 0;
  for (size_t i = 0; i < upper_.size(); ++i) {
    if (owner_[i] != id) continue;
    ++owned;
    const Arc a = arc(i);
    hashes += width(a.lo, a.hi);
  }
  if (owned > 0) {
    return FailedPrecondition(
        fmt::format("server {} still owns {} arcs ({} of the hash space); drain_server it first",
                    id, owned, percent(hashes)));
  }
  PlacementDelta d;
  d.membership.push_back(MembershipChange::remove(id));
  return commit(std::move(d));
}

Result<PlacementChange> Placement::set_state(ServerId id, ServerState state) const {
  if (!valid_state(state)) {
    return InvalidArgument(fmt::format("unknown server state {}", static_cast<unsigned>(state)));
  }
  if (find_server(id) == nullptr) {
    return NotFound(fmt::format("server {} is not a member of placement epoch {}", id, epoch_));
  }
  if (state == ServerState::kDraining) {
    const bool other_active = std::any_of(
        servers_.begin(), servers_.end(),
        [&](const ServerInfo& s) { return s.id != id && s.state == ServerState::kActive; });
    if (!other_active) {
      return FailedPrecondition(
          fmt::format("server {} is the last active server; add another before draining it", id));
    }
  }
  PlacementDelta d;
  d.membership.push_back(MembershipChange::set_state(id, state));
  return commit(std::move(d));
}

Result<PlacementChange> Placement::coalesce() const {
  PlacementDelta d;
  size_t run = 0;  // first arc of the current run of one owner
  for (size_t i = 1; i <= upper_.size(); ++i) {
    if (i < upper_.size() && owner_[i] == owner_[run]) continue;
    if (i - run > 1) {
      d.assignments.push_back(RangeAssignment{arc(run).lo, upper_[i - 1], owner_[run]});
    }
    run = i;
  }
  return commit(std::move(d));
}

}  // namespace psld
