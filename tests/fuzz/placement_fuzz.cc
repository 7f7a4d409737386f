// Placement epochs and deltas (lib/placement/): a serialized Placement
// arrives in PlacementChunks at join, a PlacementDelta in every EpochChange.
//
// The first byte picks the decoder (bit 0: delta or placement) and whether
// the trailing checksum is recomputed before decoding (bit 1): without that
// almost every mutation would stop at the checksum. A decoded value must
// serialize to the same bytes; a placement must answer every lookup as its
// arcs say; a delta is applied to a small epoch 0 (and followed through an
// EpochLog), and the result must hold the same promises.
#include <string>
#include <vector>

#include "base/hash.h"
#include "base/wire.h"
#include "lib/placement/epoch_log.h"
#include "lib/placement/placement.h"
#include "tests/fuzz/fuzz.h"

namespace psld::fuzz {
namespace {

constexpr uint8_t kDelta = 0;
constexpr uint8_t kPlacement = 1;
constexpr uint8_t kFixChecksum = 2;

// Epoch 0 of three servers with 4 virtual nodes per unit of weight: 16 arcs,
// so that an assignment hits an arc boundary often.
const Placement& base() {
  static const Placement p = *Placement::initial({{0, 1.0}, {1, 1.0}, {2, 2.0}}, 4);
  return p;
}

// What a placement promises whoever looks a key up.
void check_placement(const Placement& p) {
  PSLD_FUZZ_CHECK(p.num_arcs() > 0);
  PSLD_FUZZ_CHECK(p.arc(0).lo == 0);
  PSLD_FUZZ_CHECK(p.arc(p.num_arcs() - 1).hi == UINT64_MAX);
  for (size_t i = 0; i < p.num_arcs(); ++i) {
    const Arc a = p.arc(i);
    PSLD_FUZZ_CHECK(a.lo <= a.hi);
    PSLD_FUZZ_CHECK(p.find_server(a.owner) != nullptr);
    PSLD_FUZZ_CHECK(p.arc_index_of_hash(a.lo) == i);
    PSLD_FUZZ_CHECK(p.arc_index_of_hash(a.hi) == i);
    PSLD_FUZZ_CHECK(p.owner_of_hash(a.lo + (a.hi - a.lo) / 2) == a.owner);
  }
  auto again = Placement::deserialize(p.serialize());
  PSLD_FUZZ_CHECK(again.ok() && *again == p);
}

// Applying `change`'s delta to `from` must give its next epoch bit for bit.
void check_change(const Placement& from, const Result<PlacementChange>& change) {
  if (!change.ok()) return;
  check_placement(change->next);
  auto applied = from.apply(change->delta);
  PSLD_FUZZ_CHECK(applied.ok() && *applied == change->next);
  auto delta = PlacementDelta::deserialize(change->delta.serialize());
  PSLD_FUZZ_CHECK(delta.ok() && *delta == change->delta);
}

void fuzz_delta(std::span<const uint8_t> in) {
  auto delta = PlacementDelta::deserialize(in);
  if (!delta.ok()) {
    PSLD_FUZZ_CHECK(delta.status().code() == StatusCode::kDataLoss);
    return;
  }
  PSLD_FUZZ_CHECK(same_bytes(delta->serialize(), in));
  PSLD_FUZZ_CHECK(delta->to_epoch > delta->from_epoch);
  auto next = base().apply(*delta);
  EpochLog log(std::make_shared<const Placement>(base()));
  auto followed = log.follow(delta->to_epoch, in);
  PSLD_FUZZ_CHECK(followed.ok() == next.ok());
  if (!next.ok()) return;
  PSLD_FUZZ_CHECK(next->epoch() == delta->to_epoch);
  PSLD_FUZZ_CHECK(**followed == *next);
  check_placement(*next);
  // Outside every assignment nothing moved, but for the arcs a hand-over
  // gave its `to` (in order: a to b, then b to c, ends at c).
  auto handed = [&](ServerId owner) {
    for (const MembershipChange& c : delta->membership)
      if (c.kind == MembershipChange::Kind::kHandOver && c.id == owner) owner = c.to;
    return owner;
  };
  for (size_t i = 0; i < base().num_arcs(); ++i) {
    const Arc a = base().arc(i);
    bool touched = false;
    for (const RangeAssignment& r : delta->assignments)
      touched = touched || (r.lo <= a.hi && a.lo <= r.hi);
    if (!touched) PSLD_FUZZ_CHECK(next->owner_of_hash(a.lo) == handed(a.owner));
  }
  // The last assignment covering a hash decides its owner.
  for (const RangeAssignment& r : delta->assignments) {
    ServerId owner = r.owner;
    for (const RangeAssignment& later : delta->assignments)
      if (later.lo <= r.lo && r.lo <= later.hi) owner = later.owner;
    PSLD_FUZZ_CHECK(next->owner_of_hash(r.lo) == owner);
  }
}

void fuzz_placement(std::span<const uint8_t> in) {
  auto p = Placement::deserialize(in);
  if (!p.ok()) {
    PSLD_FUZZ_CHECK(p.status().code() == StatusCode::kDataLoss);
    return;
  }
  PSLD_FUZZ_CHECK(same_bytes(p->serialize(), in));
  check_placement(*p);
  // Changes a balancer makes of a placement it received.
  check_change(*p, p->coalesce());
  const Arc first = p->arc(0);
  if (first.hi > first.lo) check_change(*p, p->split_arc(first.lo + (first.hi - first.lo) / 2));
  for (const ServerInfo& s : p->servers()) {
    if (s.state != ServerState::kActive) continue;
    check_change(*p, p->move_arc(p->num_arcs() - 1, s.id));
    break;
  }
  // A failover's: the first member's arcs to the last, a newcomer in its place.
  const auto& members = p->servers();
  if (members.size() >= 2) {
    check_change(*p, p->hand_over(members.front().id, members.back().id,
                                  ServerSpec{members.back().id + 1, 1.0}));
  }
}

Seed with_selector(std::string name, uint8_t selector, const std::vector<uint8_t>& bytes) {
  return tagged(std::move(name), selector, bytes);
}

}  // namespace

std::vector<Seed> seeds() {
  const Placement& p = base();
  std::vector<Seed> out;
  out.push_back(with_selector("epoch0", kPlacement, p.serialize()));
  auto added = p.add_server({3, 1.0});
  out.push_back(with_selector("delta_add_server", kDelta, added->delta.serialize()));
  out.push_back(with_selector("epoch1_add_server", kPlacement, added->next.serialize()));
  auto drained = p.drain_server(1);
  out.push_back(with_selector("delta_drain", kDelta, drained->delta.serialize()));
  out.push_back(with_selector("epoch1_drained", kPlacement, drained->next.serialize()));
  auto moved = p.move_range(1000, 1ull << 62, 2);
  out.push_back(with_selector("delta_move_range", kDelta, moved->delta.serialize()));
  auto isolated = p.isolate_key(42);
  out.push_back(with_selector("delta_isolate_key", kDelta, isolated->delta.serialize()));
  auto handed = p.hand_over(1, 2, ServerSpec{5, 1.0});
  out.push_back(with_selector("delta_hand_over", kDelta, handed->delta.serialize()));
  // Overlapping assignments and a removal, as only a hand-made delta has.
  PlacementDelta d;
  d.from_epoch = 0;
  d.to_epoch = 1;
  d.membership = {MembershipChange::add({7, 0.5}, ServerState::kDraining),
                  MembershipChange::set_state(0, ServerState::kDraining)};
  d.assignments = {{0, 1ull << 63, 7}, {5, 10, 1}, {1ull << 40, UINT64_MAX, 2}};
  out.push_back(with_selector("delta_overlapping", kDelta, d.serialize()));
  // The same with the checksum bit, whose checksum the harness recomputes.
  out.push_back(with_selector("delta_fix_checksum", kDelta | kFixChecksum, d.serialize()));
  out.push_back(with_selector("epoch0_fix_checksum", kPlacement | kFixChecksum, p.serialize()));
  return out;
}

}  // namespace psld::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace psld::fuzz;
  if (size == 0) return 0;
  const uint8_t selector = data[0];
  std::vector<uint8_t> in(data + 1, data + size);
  if ((selector & kFixChecksum) != 0 && in.size() >= 8) {
    const uint64_t sum = psld::fnv1a64(std::span<const uint8_t>(in).first(in.size() - 8));
    psld::store_le(in.data() + in.size() - 8, sum, 8);
  }
  if ((selector & 1) == kDelta) {
    fuzz_delta(in);
  } else {
    fuzz_placement(in);
  }
  return 0;
}
