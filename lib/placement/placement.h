// lib/placement/placement.h — which server owns which key: the consistent-hash ring.
//
// A key belongs to the arc of the 64-bit hash space that hash_key(key) falls
// in; every arc has one owner. A Placement is one immutable epoch of the ring
// (its number, its arcs and its membership). Every change produces the next
// epoch together with a PlacementDelta, and applying the delta to the old epoch
// reproduces the new one bit for bit, so epochs can travel as small deltas and
// every process ends up with the same bytes.
//
// The module is pure: no threads, no clocks, no I/O. The same code runs in the
// coordinator, in every worker and server, and in the balancer's simulator.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "base/hash.h"
#include "psld/keys.h"
#include "psld/status.h"

namespace psld {

using ServerId = uint32_t;

enum class ServerState : uint8_t {
  kActive = 0,    // owns arcs and may be given more
  kDraining = 1,  // still a member (it may own arcs), but takes no new ones
};
std::string_view server_state_name(ServerState state);

// A server to add: its id and its relative capacity (weight). A server of
// weight 2 is meant to hold twice the keys of a server of weight 1.
struct ServerSpec {
  ServerId id = 0;
  double weight = 1.0;
};

struct ServerInfo {
  ServerId id = 0;
  double weight = 1.0;
  ServerState state = ServerState::kActive;
  bool operator==(const ServerInfo&) const = default;
};

// Where each server sits in a list of distinct ids (a placement's servers(),
// a plan's servers), for code that looks up the owner of every arc: a table
// for ids below four times the count (the coordinator numbers servers by rank
// from 0, standby ones after them), a binary search above it. A placement of
// a million arcs asks once per arc; a binary search per arc took most of a
// balancer decision.
class ServerIndex {
 public:
  static constexpr uint32_t kNone = UINT32_MAX;

  explicit ServerIndex(std::span<const ServerId> ids);
  explicit ServerIndex(std::span<const ServerInfo> servers);  // by their ids
  // i with ids[i] == id, or kNone.
  uint32_t find(ServerId id) const { return id < table_.size() ? table_[id] : search(id); }

 private:
  template <typename IdOf>
  void build(size_t count, IdOf id_of);
  uint32_t search(ServerId id) const;

  std::vector<uint32_t> table_;                       // by id: its position, or kNone
  std::vector<std::pair<ServerId, uint32_t>> above_;  // ids beyond the table, sorted
};

// An inclusive range [lo, hi] of hash values and its owner.
struct Arc {
  uint64_t lo = 0;
  uint64_t hi = 0;
  ServerId owner = 0;
  bool operator==(const Arc&) const = default;
};

// One membership step of a delta. Fields a kind does not use are zero.
struct MembershipChange {
  enum class Kind : uint8_t {
    kAdd = 1,       // a new member {id, weight} in `state`
    kSetState = 2,  // member `id` becomes `state`
    kRemove = 3,    // member `id` leaves; it must own nothing in the result
    // Member `id` leaves and every arc it owns goes to member `to` at once:
    // a failover in one fixed-size step, however many arcs `id` held.
    kHandOver = 4,
  };
  Kind kind = Kind::kAdd;
  ServerId id = 0;
  double weight = 0.0;                       // kAdd only
  ServerState state = ServerState::kActive;  // kAdd and kSetState
  ServerId to = 0;                           // kHandOver only

  static MembershipChange add(ServerSpec spec, ServerState state = ServerState::kActive);
  static MembershipChange set_state(ServerId id, ServerState state);
  static MembershipChange remove(ServerId id);
  static MembershipChange hand_over(ServerId id, ServerId to);
  bool operator==(const MembershipChange&) const = default;
};

// After it is applied, [lo, hi] is exactly one arc owned by `owner`: arcs are
// cut at lo and at hi + 1 where needed and boundaries inside are removed.
// Nothing outside [lo, hi] changes.
struct RangeAssignment {
  uint64_t lo = 0;
  uint64_t hi = 0;
  ServerId owner = 0;
  bool operator==(const RangeAssignment&) const = default;
};

// How epoch `from_epoch` becomes `to_epoch`: first the membership changes, in
// order, then the range assignments, in order (a later one wins where two
// overlap). The deltas that Placement's operations produce always have
// to_epoch == from_epoch + 1 and assignments sorted by lo, not overlapping.
struct PlacementDelta {
  uint64_t from_epoch = 0;
  uint64_t to_epoch = 0;
  std::vector<MembershipChange> membership;
  std::vector<RangeAssignment> assignments;

  // Little-endian, versioned, checksummed; see placement.cc for the layout.
  std::vector<uint8_t> serialize() const;
  // Validates magic, version, checksum, counts against the buffer length and
  // every field (kinds, states, weights, lo <= hi, to_epoch > from_epoch).
  // Whether the servers it names exist is checked by Placement::apply.
  static Result<PlacementDelta> deserialize(std::span<const uint8_t> bytes);

  bool operator==(const PlacementDelta&) const = default;
};

struct PlacementChange;

class Placement {
 public:
  // 256 virtual nodes per unit of weight: with equal arcs (see initial()) any
  // count balances epoch 0 exactly; 256 leaves each server enough arcs that
  // add_server() and drain_server() can move whole arcs and spread them over
  // the ring.
  static constexpr uint32_t kDefaultVnodesPerUnitWeight = 256;
  // Bounds on what a placement may hold; they also bound what a hostile
  // buffer can make deserialize() allocate. 2^22 arcs are 48 MiB serialized.
  static constexpr size_t kMaxServers = size_t{1} << 16;
  static constexpr size_t kMaxArcs = size_t{1} << 22;
  // Weights are relative; the bound keeps sums of weights finite and exact
  // enough for the share arithmetic.
  static constexpr double kMaxWeight = 1e6;

  // Epoch 0. Each server gets max(1, round(vnodes_per_unit_weight * weight))
  // virtual nodes; the ring is cut into as many equal arcs and the i-th arc
  // goes to the i-th virtual node in the order of hash_pair(id, replica).
  // InvalidArgument for no servers, a duplicate id, a weight that is not in
  // (0, kMaxWeight], vnodes_per_unit_weight == 0, or more than kMaxArcs arcs.
  static Result<Placement> initial(std::vector<ServerSpec> servers,
                                   uint32_t vnodes_per_unit_weight = kDefaultVnodesPerUnitWeight);

  // Epoch 0 as initial() makes it, except that each listed key is an arc of
  // its own, owned by the given server: a static key-to-server map (MXNet's,
  // BytePS's) expressed on the ring, to start a job from. Keys not listed
  // fall where initial() puts them. InvalidArgument as initial(), for a key
  // listed twice, or for an owner that is not among `servers`.
  struct KeyOwner {
    Key key = 0;
    ServerId owner = 0;
  };
  static Result<Placement> initial_with_keys(
      std::vector<ServerSpec> servers, std::span<const KeyOwner> keys,
      uint32_t vnodes_per_unit_weight = kDefaultVnodesPerUnitWeight);

  // The bytes of this epoch: stable across processes and builds.
  std::vector<uint8_t> serialize() const;
  // DataLoss for a buffer that is not a valid placement (bad magic, version,
  // checksum or length; arcs not sorted or not covering the hash space; an
  // owner that is not a member; ...). Never trusts a count before checking it
  // against the buffer's length.
  static Result<Placement> deserialize(std::span<const uint8_t> bytes);

  uint64_t epoch() const { return epoch_; }
  size_t num_arcs() const { return upper_.size(); }
  // The i-th arc in hash order; i < num_arcs().
  Arc arc(size_t i) const { return Arc{i == 0 ? 0 : upper_[i - 1] + 1, upper_[i], owner_[i]}; }

  // The hot path: a bucket of the lookup index (top bits of the hash) gives
  // the range of arcs that can hold h, usually one or two.
  size_t arc_index_of_hash(uint64_t h) const {
    const uint64_t bucket = h >> index_shift_;
    uint32_t i = index_[bucket];
    const uint32_t last = index_[bucket + 1];
    if (last - i > kLinearScanArcs) {
      return static_cast<size_t>(std::lower_bound(upper_.data() + i, upper_.data() + last, h) -
                                 upper_.data());
    }
    while (upper_[i] < h)
      ++i;  // stops at `last` at the latest: upper_[last] >= h
    return i;
  }
  ServerId owner_of_hash(uint64_t h) const { return owner_[arc_index_of_hash(h)]; }
  ServerId owner_of_key(Key key) const { return owner_of_hash(hash_key(key)); }

  // Members sorted by id, draining ones included.
  const std::vector<ServerInfo>& servers() const { return servers_; }
  // The member with this id, or nullptr.
  const ServerInfo* find_server(ServerId id) const;
  // The servers that own at least one arc.
  std::set<ServerId> owners() const { return std::set<ServerId>(owner_.begin(), owner_.end()); }
  // The arcs `id` owns, in hash order (empty for a non-member).
  std::vector<Arc> arcs_of(ServerId id) const;
  // The fraction of the hash space `id` owns, in [0, 1].
  double share_of(ServerId id) const;

  // The epoch that `delta` makes of this one. FailedPrecondition when
  // delta.from_epoch is not this epoch; InvalidArgument / NotFound when a
  // change does not fit (adding a member twice, an unknown id, an owner that
  // is not a member of the result, a removed server that still owns arcs).
  Result<Placement> apply(const PlacementDelta& delta) const;

  // ---- Changes. Each returns the next epoch (epoch() + 1) and its delta and
  // leaves this one untouched. A server that receives arcs must be an active
  // member (NotFound for an unknown id, FailedPrecondition for a draining one).

  // Give the whole arc `arc_index` to `to` (OutOfRange for a bad index). To
  // move the arc that holds a hash, pass arc_index_of_hash(h).
  Result<PlacementChange> move_arc(size_t arc_index, ServerId to) const;
  // Give hashes [lo, hi] to `to` as one arc (InvalidArgument if lo > hi).
  Result<PlacementChange> move_range(uint64_t lo, uint64_t hi, ServerId to) const;
  // Cut the arc [lo, hi] that holds at_hash into [lo, at_hash - 1] and
  // [at_hash, hi], same owner. InvalidArgument when at_hash == lo.
  Result<PlacementChange> split_arc(uint64_t at_hash) const;
  // Cut arcs so that the key's hash h is an arc [h, h] of its own (same
  // owner), found in the result at next.arc_index_of_hash(hash_key(key)).
  // hash_key is a bijection, so that arc holds this key and no other.
  Result<PlacementChange> isolate_key(Key key) const;
  // A new active member that takes arcs from the servers above their weighted
  // target, most overloaded first, until it holds its own target share
  // (weight / total active weight) and never more: adding one server to n
  // equal ones moves 1/(n+1) of the keys, all of them to the new server.
  Result<PlacementChange> add_server(ServerSpec spec) const;
  // A new active member that owns nothing yet (a standby for the balancer).
  Result<PlacementChange> add_server_empty(ServerSpec spec) const;
  // Mark `id` draining and give each of its arcs to the active server furthest
  // below its weighted target. Only its keys move. FailedPrecondition when no
  // other active server is left.
  Result<PlacementChange> drain_server(ServerId id) const;
  // Remove a member that owns nothing (FailedPrecondition otherwise).
  Result<PlacementChange> remove_server(ServerId id) const;
  // Remove `id` and give every arc it owns to the member `to` (NotFound for
  // an unknown id, InvalidArgument when id == to). The delta is one
  // membership change, whatever the number of arcs: a failover always fits
  // one message. With a `replacement`, that server joins in the same step,
  // active and owning nothing (InvalidArgument when it is a member already).
  Result<PlacementChange> hand_over(ServerId id, ServerId to,
                                    std::optional<ServerSpec> replacement = std::nullopt) const;
  // Mark a member active or draining without moving anything (the balancer
  // drains gradually with move_range). At least one member must stay active.
  Result<PlacementChange> set_state(ServerId id, ServerState state) const;
  // Merge neighbouring arcs with the same owner. No key changes owner. With
  // nothing to merge the delta is empty (the epoch still advances).
  Result<PlacementChange> coalesce() const;

  // Same epoch, membership and arcs (what serialize() writes).
  bool operator==(const Placement& other) const {
    return epoch_ == other.epoch_ && servers_ == other.servers_ && upper_ == other.upper_ &&
           owner_ == other.owner_;
  }

 private:
  // Within this many arcs a linear scan beats a binary search.
  static constexpr uint32_t kLinearScanArcs = 8;

  Placement() = default;
  void build_index();
  // Every owner is a member; arcs are already sorted and covering by
  // construction, deserialize() checks that before calling this.
  Status check_owners() const;
  // An active member that may receive arcs.
  Status check_receiver(ServerId to) const;
  // Stamps `delta` with this epoch and the next, applies it, and packages both.
  Result<PlacementChange> commit(PlacementDelta delta) const;

  uint64_t epoch_ = 0;
  std::vector<ServerInfo> servers_;  // sorted by id
  // The arcs: arc i is [upper_[i-1] + 1, upper_[i]] (from 0 for i == 0),
  // owned by owner_[i]; upper_ is strictly increasing, upper_.back() is
  // UINT64_MAX.
  std::vector<uint64_t> upper_;
  std::vector<ServerId> owner_;
  // The lookup index: bucket b holds hashes [b << index_shift_, (b+1) <<
  // index_shift_); index_[b] is the first arc that reaches into bucket b, and
  // index_[b + 1] bounds the search (it is the arc holding the next bucket's
  // first hash; the extra last entry is the last arc). 2-4 buckets per arc, so
  // a lookup usually inspects one or two arcs; at most 2^20 buckets (4 MiB).
  unsigned index_shift_ = 63;
  std::vector<uint32_t> index_;
};

struct PlacementChange {
  Placement next;
  PlacementDelta delta;
};

// Replication (docs/replication.md): the server that keeps the copy of
// `primary`'s ranges in `p`, the member after it in id order (the first
// after the last) that is not draining: a server the balancer drains (a
// straggler, or one going away) holds no copies, which would slow the
// rounds of the server it backs up. When every other member is draining,
// the next member. nullopt when `primary` is the only member or none.
std::optional<ServerId> backup_of(const Placement& p, ServerId primary);

}  // namespace psld
