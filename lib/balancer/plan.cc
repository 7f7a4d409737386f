// lib/balancer/plan.cc — exploit: water-filling, moves cut from arcs, the rebalance step.
#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <queue>
#include <span>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "lib/balancer/internal.h"

namespace psld {

using namespace balancer_detail;

namespace {

// Water levels are found by bisection. 100 halvings shrink any bracket below
// the spacing of doubles, and a fixed count keeps the result deterministic.
constexpr int kBisectionSteps = 100;
// Relative slack when two loads computed along different paths are compared.
constexpr double kSlack = 1e-9;
// A probe takes arcs of at most this fraction of its amount (realise).
constexpr double kProbeArcFraction = 0.25;

// A hash range on its way to a new owner.
struct Piece {
  uint64_t lo = 0;
  uint64_t hi = 0;
  double load = 0;
  size_t from = 0;    // the source's node
  bool must = false;  // its source is being emptied: it cannot stay
};

}  // namespace

// ---- Plan moves -----------------------------------------------------------------

std::vector<Balancer::Decision::Node> Balancer::Decision::base_nodes() const {
  std::vector<Node> nodes(members_.size());
  for (size_t i = 0; i < members_.size(); ++i) {
    nodes[i].id = members_[i].id;
    nodes[i].load = members_[i].load;
    nodes[i].rate = members_[i].rate;
  }
  return nodes;
}

// Sources give down to a common level lambda (each at most max_out, draining
// ones everything) and receivers fill up to it: the level at which what the
// sources can give equals what the receivers can take. Unbounded, that is the
// rate-proportional split, lambda = total load / total rate.
void Balancer::Decision::water_fill(std::vector<Node>& nodes) const {
  double receiving_rate = 0;
  double total = 0;
  double top = 0;
  for (const Node& n : nodes) {
    total += n.load;
    if (n.must_empty) continue;
    if (n.receives) receiving_rate += n.rate;
    if (n.rate > 0) top = std::max(top, n.time());
  }
  if (!(receiving_rate > 0)) return;
  auto out_at = [](const Node& n, double level) {
    return n.must_empty ? n.load : std::min(n.max_out, std::max(0.0, n.load - level * n.rate));
  };
  auto in_at = [](const Node& n, double level) {
    return n.receives && !n.must_empty ? std::min(n.max_in, std::max(0.0, level * n.rate - n.load))
                                       : 0.0;
  };
  double lo = 0;
  double hi = std::max(top, total / receiving_rate);
  for (int step = 0; step < kBisectionSteps; ++step) {
    const double mid = 0.5 * (lo + hi);
    double out = 0;
    double in = 0;
    for (const Node& n : nodes) {
      out += out_at(n, mid);
      in += in_at(n, mid);
    }
    (out > in ? lo : hi) = mid;
  }
  // Where the trust region holds a source above the level, the round cannot
  // get below that source's time this step: the others give only down to
  // it, and moves that would not shorten this round wait for the next step.
  double level = hi;
  for (const Node& n : nodes) {
    if (!n.must_empty && n.rate > 0) level = std::max(level, (n.load - out_at(n, hi)) / n.rate);
  }
  double total_out = 0;
  for (Node& n : nodes) {
    n.out = out_at(n, level);
    if (!n.must_empty && n.out > 0) {
      if (n.load - n.out < min_move_) {
        n.out = n.load;  // leave no dust behind
      } else if (n.out < min_move_ * (1 - kSlack)) {
        n.out = 0;  // not worth a migration
      }
    }
    total_out += n.out;
  }
  fill_receivers(nodes, total_out);
}

// Which receivers take `total_out`, and how much each. Filling every server
// below the level would cut a piece for each of them (511 pieces for one
// straggler among 512 servers); instead the emptiest k receivers fill to a
// common level mu_k (each up to its max_in): as many as can each take at
// least a minimal move, but never so few that they would rise above the
// highest time a server keeps.
void Balancer::Decision::fill_receivers(std::vector<Node>& nodes, double total_out) const {
  if (!(total_out > 0)) return;
  auto candidate = [](const Node& n) {
    return n.receives && !n.must_empty && n.out == 0 && n.rate > 0 && n.max_in > 0;
  };
  // The highest time any server keeps after giving: receivers need not
  // rise above it.
  double top = 0;
  for (const Node& n : nodes) {
    if (n.must_empty || !(n.rate > 0)) continue;
    top = std::max(top, (n.load - n.out) / n.rate);
  }
  std::vector<size_t> cand;
  for (size_t i = 0; i < nodes.size(); ++i)
    if (candidate(nodes[i])) cand.push_back(i);
  if (cand.empty()) return;
  auto in_at = [&](size_t i, double level) {
    const Node& n = nodes[cand[i]];
    return std::min(n.max_in, std::max(0.0, level * n.rate - n.load));
  };
  // The level at which the first k candidates take total_out (the highest
  // useful one when their room is not enough).
  auto level = [&](size_t k) {
    double lo = 0;
    double hi = 0;
    for (size_t i = 0; i < k; ++i) {
      const Node& n = nodes[cand[i]];
      hi = std::max(hi, std::isfinite(n.max_in) ? (n.load + n.max_in) / n.rate
                                                : (n.load + total_out) / n.rate);
    }
    for (int step = 0; step < kBisectionSteps; ++step) {
      const double mid = 0.5 * (lo + hi);
      double in = 0;
      for (size_t i = 0; i < k; ++i)
        in += in_at(i, mid);
      (in < total_out ? lo : hi) = mid;
    }
    return hi;
  };
  // A server that cannot take a minimal move below the level all candidates
  // would share (a very slow one) takes nothing: a crumb would not be worth
  // its migration. Better a crumb than nothing, though.
  const double shared = std::max(top, level(cand.size()));
  std::vector<size_t> useful;
  for (size_t i = 0; i < cand.size(); ++i)
    if (in_at(i, shared) >= min_move_) useful.push_back(cand[i]);
  if (!useful.empty()) cand = std::move(useful);
  std::sort(cand.begin(), cand.end(), [&](size_t a, size_t b) {
    const double ta = nodes[a].time();
    const double tb = nodes[b].time();
    return ta != tb ? ta < tb : nodes[a].id < nodes[b].id;
  });
  auto least_in = [&](size_t k) {
    const double mu = level(k);
    double least = kInf;
    for (size_t i = 0; i < k; ++i)
      least = std::min(least, in_at(i, mu));
    return least;
  };
  // Binary searches: the level does not rise and least_in does not grow
  // with k (more receivers share the same bytes).
  const size_t n = cand.size();
  size_t lo = 1;
  size_t hi = n;
  auto enough = [&](size_t k) {  // k receivers take it all and stay at or below `top`
    const double mu = level(k);
    double in = 0;
    for (size_t i = 0; i < k; ++i)
      in += in_at(i, mu);
    return mu <= top && in >= total_out * (1 - kSlack);
  };
  while (lo < hi) {  // the fewest receivers that are enough
    const size_t mid = lo + (hi - lo) / 2;
    if (enough(mid)) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  const size_t k_level = lo;
  size_t k_min = 0;  // the most receivers that each take a minimal move
  if (least_in(1) >= min_move_) {
    lo = 1;
    hi = n;
    while (lo < hi) {
      const size_t mid = lo + (hi - lo + 1) / 2;
      if (least_in(mid) >= min_move_) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    k_min = lo;
  }
  const size_t k = std::max(k_level, k_min);
  const double mu = level(k);
  for (size_t i = 0; i < k; ++i)
    nodes[cand[i]].in = in_at(i, mu);
}

namespace {

// The first part of `p` holding about `want` of its load, and the rest;
// nothing when `want` covers p or p cannot be cut. Without chunks, p's load
// is taken as uniform over its hashes and cut at `want` exactly. With them
// (BalancerInput::chunks), p is cut just before one of its chunks, each
// part holding its chunks' share of p's load: the cut whose first part is
// nearest to `want`, or with `at_most` (a receiver's room) the largest
// first part not above it. A piece of one chunk does not split.
std::optional<std::pair<Piece, Piece>> split_piece(const Piece& p, double want,
                                                   std::span<const ChunkPoint> chunks,
                                                   bool at_most) {
  if (!(p.load > 0) || !(want < p.load)) return std::nullopt;
  const auto first = std::lower_bound(chunks.begin(), chunks.end(), p.lo,
                                      [](const ChunkPoint& c, uint64_t h) { return c.hash < h; });
  const auto last = std::upper_bound(first, chunks.end(), p.hi,
                                     [](uint64_t h, const ChunkPoint& c) { return h < c.hash; });
  double total = 0;
  for (auto it = first; it != last; ++it)
    total += it->bytes;
  Piece a = p;
  Piece b = p;
  if (total > 0) {
    // The cut before chunk j leaves [first, j) in the first part.
    std::optional<std::span<const ChunkPoint>::iterator> best;
    double best_load = 0;
    double held = 0;
    for (auto j = first + 1; j < last; ++j) {
      held += (j - 1)->bytes;
      const double load = p.load * (held / total);
      const bool fits = load <= want * (1 + kSlack);
      if (at_most ? fits : (!best || std::fabs(load - want) < std::fabs(best_load - want))) {
        best = j;
        best_load = load;
      }
      if (!fits) break;  // further cuts only hold more
    }
    if (!best || !(best_load > 0)) return std::nullopt;
    a.hi = (*best)->hash - 1;
    a.load = best_load;
    b.lo = (*best)->hash;
    b.load = p.load - a.load;
    return std::make_pair(a, b);
  }
  const u128 width = hashes_in(p.lo, p.hi);
  if (width < 2) return std::nullopt;
  const long double x = static_cast<long double>(want) / p.load;
  u128 head = static_cast<u128>(x * static_cast<long double>(width));
  head = std::max<u128>(head, 1);
  if (head >= width) return std::nullopt;
  a.hi = p.lo + static_cast<uint64_t>(head - 1);
  a.load = p.load * fraction_of(head, width);
  b.lo = a.hi + 1;
  b.load = p.load - a.load;
  return std::make_pair(a, b);
}

// An arc of a source, with its load, while the source's arcs are ranked.
struct Held {
  double load;
  uint32_t arc;
};

// Heaviest first, then by arc: a total order, so every sort gives the same.
bool heavier_first(const Held& a, const Held& b) {
  return a.load != b.load ? a.load > b.load : a.arc < b.arc;
}

// The order in which receivers take pieces: heaviest first, then by hash.
bool piece_first(const Piece& a, const Piece& b) {
  return a.load != b.load ? a.load > b.load : a.lo < b.lo;
}

// Puts the items `keep` accepts into `out` by load, heaviest bucket first,
// and the end of each bucket in `ends`: a bucket per two items, by where the
// load falls between the lightest and the heaviest. The map never puts a
// heavier item in a later bucket, so sorting each bucket alone sorts them
// all, in about linear time when the loads spread over a range: std::sort of
// every source's ~1,000 arcs was half of a scale-out decision on 1,024
// servers. False, and nothing done, when they do not spread (fewer than 64
// items, all loads equal, or one not finite): std::sort is as good there.
template <typename T, typename Keep>
bool bucket_by_load(std::span<const T> items, Keep keep, std::vector<T>& out,
                    std::vector<size_t>& ends) {
  constexpr size_t kPerBucket = 2;
  constexpr size_t kFewest = 64;
  size_t n = 0;
  double lightest = kInf;
  double heaviest = -kInf;
  for (const T& x : items) {
    if (!keep(x)) continue;
    if (!std::isfinite(x.load)) return false;
    ++n;
    lightest = std::min(lightest, x.load);
    heaviest = std::max(heaviest, x.load);
  }
  const size_t buckets = n / kPerBucket;
  const double scale = static_cast<double>(buckets) / (heaviest - lightest);
  if (n < kFewest || !(heaviest > lightest) || !std::isfinite(scale)) return false;
  auto bucket = [&](double load) {  // 0 for the heaviest
    const auto above = static_cast<size_t>((load - lightest) * scale);
    return buckets - 1 - std::min(buckets - 1, above);
  };
  ends.assign(buckets, 0);
  for (const T& x : items)
    if (keep(x)) ++ends[bucket(x.load)];
  size_t end = 0;
  for (size_t& e : ends) {
    end += e;
    e = end - e;  // the bucket's start, until it is filled
  }
  out.resize(n);
  for (const T& x : items)
    if (keep(x)) out[ends[bucket(x.load)]++] = x;
  return true;
}

// Sorts `items` by `before`, an order that puts heavier items first.
template <typename T, typename Before>
void sort_heaviest_first(std::vector<T>& items, Before before, std::vector<T>& scratch,
                         std::vector<size_t>& ends) {
  if (!bucket_by_load(
          std::span<const T>(items), [](const T&) { return true; }, scratch, ends)) {
    std::sort(items.begin(), items.end(), before);
    return;
  }
  size_t start = 0;
  for (const size_t e : ends) {
    std::sort(scratch.begin() + static_cast<ptrdiff_t>(start),
              scratch.begin() + static_cast<ptrdiff_t>(e), before);
    start = e;
  }
  items.swap(scratch);
}

// A source's arcs heaviest first (heavier_first): each arc that fits what is
// left to give, `want` (with kSlack), is taken and `want` shrinks by its
// load; the others are passed over. Returns the last arc passed over, the
// one to cut. Arcs without load are neither. Only what the scan reaches is
// put in order: a bucket of arcs is sorted when the scan gets to it, and once
// `want` is below the lightest arc nothing more fits, so the rest is passed
// over unsorted, the lightest arc (the last in the order) last. A scale-out
// takes about a quarter of each source's arcs and passes over the rest.
template <typename Take>
std::optional<Held> scan_heaviest_first(std::span<Held> list, double& want, Take take,
                                        std::vector<Held>& scratch, std::vector<size_t>& ends) {
  std::optional<Held> cut;
  auto visit = [&](const Held& h) {
    if (h.load <= want * (1 + kSlack)) {
      take(h);
      want -= h.load;
    } else {
      cut = h;
    }
  };
  auto has_load = [](const Held& h) { return h.load > 0; };
  if (!bucket_by_load(std::span<const Held>(list), has_load, scratch, ends)) {
    std::sort(list.begin(), list.end(), heavier_first);
    for (const Held& h : list) {
      if (!has_load(h)) break;
      visit(h);
    }
    return cut;
  }
  // The last arc in the order: the last of the last bucket that holds any.
  size_t last_bucket = ends.size() - 1;
  while (last_bucket > 0 && ends[last_bucket - 1] == ends[last_bucket])
    --last_bucket;
  const Held last = *std::max_element(
      scratch.begin() + static_cast<ptrdiff_t>(last_bucket == 0 ? 0 : ends[last_bucket - 1]),
      scratch.begin() + static_cast<ptrdiff_t>(ends[last_bucket]), heavier_first);
  size_t start = 0;
  for (const size_t end : ends) {
    if (start == end) continue;
    if (want * (1 + kSlack) < last.load) return last;  // none of the rest fits
    std::sort(scratch.begin() + static_cast<ptrdiff_t>(start),
              scratch.begin() + static_cast<ptrdiff_t>(end), heavier_first);
    for (size_t i = start; i < end; ++i)
      visit(scratch[i]);
    start = end;
  }
  return cut;
}

}  // namespace

// Turns the planned out / in amounts into hash ranges: whole arcs where they
// fit, and one cut arc per source and per receiver at most.
Result<PlanStep> Balancer::Decision::realise(StepKind kind, std::vector<Node>& nodes,
                                             std::vector<MembershipChange> membership) const {
  std::vector<char> source(nodes.size(), 0);
  for (size_t i = 0; i < members_.size(); ++i)
    source[i] = nodes[i].must_empty ? members_[i].arcs > 0 : nodes[i].out > 0;
  // Each source's arcs with their loads, side by side: ranking them by load
  // then reads no other memory.
  std::vector<size_t> first(nodes.size() + 1, 0);  // source i's: [first[i], first[i + 1])
  for (size_t i = 0; i < nodes.size(); ++i)
    first[i + 1] = first[i] + (i < members_.size() && source[i] ? members_[i].arcs : 0);
  const auto held = std::make_unique_for_overwrite<Held[]>(first.back());
  std::vector<size_t> fill(first.begin(), first.end() - 1);
  for (size_t k = 0; k < arc_member_.size(); ++k) {
    const uint32_t m = arc_member_[k];
    if (source[m]) held[fill[m]++] = Held{arc_load_[k], static_cast<uint32_t>(k)};
  }

  // Every piece on its way, in the order the receivers take them; pieces
  // cut off later wait in `cut_off`, the two merged by piece_first.
  std::vector<Piece> pieces;
  std::vector<Held> scratch;
  std::vector<size_t> ends;
  auto arc_piece = [&](const Held& h, size_t from, bool must) {
    const Arc a = placement_.arc(h.arc);
    return Piece{a.lo, a.hi, h.load, from, must};
  };
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (!source[i]) continue;
    std::span<Held> list(held.get() + first[i], held.get() + first[i + 1]);
    double want = nodes[i].out;
    const bool all = want >= nodes[i].load * (1 - kSlack);  // every arc that carries load
    if (nodes[i].must_empty || all) {
      for (const Held& h : list)
        if (nodes[i].must_empty || h.load > 0) pieces.push_back(arc_piece(h, i, true));
      continue;
    }
    if (kind == StepKind::kProbe) {
      // A probe feeds a server whose rate is stale, perhaps a straggler
      // still: small arcs only, when the source has enough of them. A big
      // chunk behind a slow link is a tail of pulls (a key's pulls wait for
      // every worker's push of it) that made half of S1's rounds 2-3x
      // longer after a probe of 102 KiB in one chunk (docs/stragglers.md,
      // "The oracle"), and the servers' service times, by which the probe
      // is judged, do not show it.
      const double most = kProbeArcFraction * want;
      const auto small_end =
          std::partition(list.begin(), list.end(), [&](const Held& h) { return h.load <= most; });
      double small = 0;
      for (auto it = list.begin(); it != small_end; ++it)
        small += it->load;
      if (small >= 0.5 * want) list = list.first(static_cast<size_t>(small_end - list.begin()));
    }
    // Biggest arcs first while they fit; then a cut of the smallest arc that
    // did not fit, for what is left (unless that is dust).
    const std::optional<Held> cut = scan_heaviest_first(
        list, want, [&](const Held& h) { pieces.push_back(arc_piece(h, i, false)); }, scratch,
        ends);
    if (cut && want > std::max(0.5 * min_move_, kSlack * nodes[i].out)) {
      if (auto parts = split_piece(arc_piece(*cut, i, false), want, input_.chunks, false)) {
        pieces.push_back(parts->first);
      } else if (!input_.chunks.empty()) {
        // One chunk, which does not split: offered whole, and a receiver
        // takes it only where that pays (below). A straggler left with one
        // chunk kept it for good when only cuts were offered.
        pieces.push_back(arc_piece(*cut, i, false));
      }
    }
  }
  std::vector<Piece> piece_scratch;
  sort_heaviest_first(pieces, piece_first, piece_scratch, ends);
  auto later = [](const Piece& a, const Piece& b) { return piece_first(b, a); };
  std::priority_queue<Piece, std::vector<Piece>, decltype(later)> cut_off(later);

  struct Slot {
    double left = 0;
    ServerId id = 0;
    size_t node = 0;
  };
  auto roomier = [](const Slot& a, const Slot& b) {
    return a.left != b.left ? a.left < b.left : a.id > b.id;
  };
  std::priority_queue<Slot, std::vector<Slot>, decltype(roomier)> slots(roomier);
  std::optional<size_t> fallback;  // for pieces that must leave when no room is left
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = nodes[i];
    if (n.in > 0) slots.push(Slot{n.in, n.id, i});
    if (n.receives && !n.must_empty && n.out <= 0 && n.rate > 0 &&
        (!fallback || n.time() < nodes[*fallback].time())) {
      fallback = i;
    }
  }

  std::vector<Move> moves;
  auto give = [&](const Piece& piece, size_t to) {
    moves.push_back(Move{piece.lo, piece.hi, nodes[piece.from].id, nodes[to].id, piece.load});
  };
  const double dust = kSlack * std::max(min_move_, 1.0);
  size_t next = 0;
  while (next < pieces.size() || !cut_off.empty()) {
    Piece piece;
    if (cut_off.empty() || (next < pieces.size() && piece_first(pieces[next], cut_off.top()))) {
      piece = pieces[next++];
    } else {
      piece = cut_off.top();
      cut_off.pop();
    }
    while (!slots.empty() && slots.top().left <= dust)
      slots.pop();
    if (slots.empty()) {
      if (piece.must) {
        if (!fallback) {
          return FailedPrecondition(
              fmt::format("server {} must be emptied but no active server can take its arcs",
                          nodes[piece.from].id));
        }
        give(piece, *fallback);
      }
      continue;  // a piece that may stay, stays
    }
    Slot slot = slots.top();
    slots.pop();
    if (piece.load <= slot.left * (1 + kSlack)) {
      give(piece, slot.node);
      slot.left -= piece.load;
      slots.push(slot);
      continue;
    }
    if (slot.left < 0.5 * min_move_) {  // room too small to cut a piece for
      if (piece.must) {
        give(piece, slot.node);  // this is the roomiest receiver left
        slot.left -= piece.load;
        slots.push(slot);
      }
      continue;
    }
    auto parts = split_piece(piece, slot.left, input_.chunks, true);
    if (!parts) {  // one hash or chunk, heavier than the room
      // Whole, it overfills the receiver; still worth it when the receiver
      // then ends below the source's time now (the rest of a straggler's
      // excess is often one chunk heavier than any receiver's room).
      const Node& to = nodes[slot.node];
      const double taken = to.in - slot.left;
      const bool worth = to.rate > 0 && (to.load + taken + piece.load) / to.rate <
                                            (1 - options_.settle_gain) * nodes[piece.from].time();
      if (piece.must || worth) {
        give(piece, slot.node);
        slot.left -= piece.load;
        slots.push(slot);
      } else {
        slots.push(slot);  // the piece stays where it is; the room is for others
      }
      continue;
    }
    give(parts->first, slot.node);
    cut_off.push(parts->second);
  }
  return finish(kind, std::move(moves), std::move(membership), nodes);
}

Result<PlanStep> Balancer::Decision::finish(StepKind kind, std::vector<Move> moves,
                                            std::vector<MembershipChange> membership,
                                            std::vector<Node>& nodes) const {
  std::sort(moves.begin(), moves.end(), [](const Move& a, const Move& b) { return a.lo < b.lo; });
  std::vector<Move> merged;
  for (const Move& m : moves) {
    if (!merged.empty() && merged.back().hi + 1 == m.lo && merged.back().from == m.from &&
        merged.back().to == m.to) {
      merged.back().hi = m.hi;
      merged.back().bytes_per_round += m.bytes_per_round;
    } else {
      merged.push_back(m);
    }
  }

  PlacementDelta delta;
  delta.from_epoch = placement_.epoch();
  delta.to_epoch = placement_.epoch() + 1;  // run() checked that the counter is not exhausted
  delta.membership = std::move(membership);
  for (const Move& m : merged) {
    if (!delta.assignments.empty() && delta.assignments.back().hi + 1 == m.lo &&
        delta.assignments.back().owner == m.to) {
      delta.assignments.back().hi = m.hi;
    } else {
      delta.assignments.push_back(RangeAssignment{m.lo, m.hi, m.to});
    }
  }
  PSLD_ASSIGN_OR_RETURN(Placement next, placement_.apply(delta));
  const ServerIndex next_members(next.servers());
  for (const RangeAssignment& a : delta.assignments) {
    const uint32_t s = next_members.find(a.owner);
    if (s == ServerIndex::kNone || next.servers()[s].state != ServerState::kActive) {
      return Internal(
          fmt::format("the balancer planned a move to server {}, which is not active", a.owner));
    }
  }

  // Every server of a move is a node (members, and the standby servers a
  // scale-out adds, which are never members).
  std::vector<ServerId> node_ids(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i)
    node_ids[i] = nodes[i].id;
  const ServerIndex node_of(node_ids);
  for (Node& n : nodes)
    n.gave = n.got = 0;
  double moved = 0;
  for (const Move& m : merged) {
    nodes[node_of.find(m.from)].gave += m.bytes_per_round;
    nodes[node_of.find(m.to)].got += m.bytes_per_round;
    moved += m.bytes_per_round;
  }
  double before = 0;
  double after = 0;
  double cost = 0;
  for (const Node& n : nodes) {
    const double load = std::max(0.0, n.load - n.gave + n.got);
    before = std::max(before, n.time());
    if (load > 0) after = std::max(after, n.rate > 0 ? load / n.rate : kInf);
    if (n.rate > 0) {
      cost = std::max(cost, (n.gave + n.got) * options_.migration_bytes_per_load_byte / n.rate);
    }
  }
  return PlanStep{kind,
                  PlacementChange{std::move(next), std::move(delta)},
                  std::move(merged),
                  before,
                  after,
                  moved,
                  moved * options_.migration_bytes_per_load_byte,
                  cost,
                  {}};
}

// ---- The steps ------------------------------------------------------------------

// The predicted round after a filled step: its largest time per round.
double Balancer::Decision::round_after(const std::vector<Node>& nodes) const {
  double round = 0;
  for (const Node& n : nodes) {
    const double load = std::max(0.0, n.load - n.out + n.in);
    if (load > 0) round = std::max(round, n.rate > 0 ? load / n.rate : kInf);
  }
  return round;
}

// The same, with each rate at the low end of its 95% interval (a server
// never measured: at half its prior); infinite if that leaves nothing of a
// rate that carries load. The interval is Student's t with n - 1 degrees of
// freedom for n samples: an error estimated from three samples is itself
// uncertain (x4.3 rather than x2).
double Balancer::Decision::worst_round_after(const std::vector<Node>& nodes) const {
  static constexpr double kT975[] = {12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31,
                                     2.26,  2.23, 2.20, 2.18, 2.16, 2.14, 2.13};
  double round = 0;
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = nodes[i];
    const double load = std::max(0.0, n.load - n.out + n.in);
    if (load <= 0) continue;
    double low = 0.5;
    if (i < members_.size() && members_[i].estimated) {
      const Tracked& t = *members_[i].tracked;
      const uint64_t df = t.rate_samples > 1 ? t.rate_samples - 1 : 1;
      const double z = df <= std::size(kT975) ? kT975[df - 1] : 2.0;
      low = 1 - z * relative_error(t);
    }
    if (!(low > 0) || !(n.rate > 0)) return kInf;
    round = std::max(round, load / (n.rate * low));
  }
  return round;
}

Result<std::optional<PlanStep>> Balancer::Decision::rebalance_step(std::string* note) {
  std::vector<ServerId> stragglers;
  for (const Member& m : members_)
    if (m.active() && m.tracked->straggler_windows >= options_.straggler_windows)
      stragglers.push_back(m.id);
  if (!balancer_.rebalancing_ && stragglers.empty()) return std::optional<PlanStep>();

  // With every active rate known well, one step goes all the way; otherwise
  // the trust region holds each server to a fraction of its load. A server
  // never measured takes no more than a probe's worth: the prior (the
  // others' median) is a guess, and it may be the straggler.
  bool sure = true;
  uint64_t fewest = UINT64_MAX;  // samples of the least measured active rate
  for (const Member& m : members_) {
    if (!m.active()) continue;
    sure = sure && confident(*m.tracked);
    if (m.tracked->rate_samples > 0) fewest = std::min(fewest, m.tracked->rate_samples);
  }
  auto fill = [&](bool all_the_way) {
    std::vector<Node> nodes = base_nodes();
    for (size_t i = 0; i < members_.size(); ++i) {
      if (!members_[i].active()) continue;
      nodes[i].max_out = all_the_way ? members_[i].load : step_limit(members_[i].load);
      nodes[i].max_in = all_the_way ? kInf : take_limit(members_[i].load);
      if (!members_[i].estimated) nodes[i].max_in = std::min(nodes[i].max_in, probe_load_);
      nodes[i].receives = !cooling(*members_[i].tracked);
    }
    water_fill(nodes);
    return nodes;
  };
  std::vector<Node> nodes = fill(sure);
  bool all_the_way = sure;
  if (!sure && options_.confident_samples > 0) {
    // The trust region is there for estimates that may be wrong. A step all
    // the way that beats the trust region's step even with every rate at the
    // low end of its 95% interval (worst_round_after; a straggler 4x slower,
    // seen in 3 windows of +-20%, passes) is taken at once: waiting for the
    // estimates to tighten would cost more rounds at the straggler's pace
    // than any error could.
    std::vector<Node> full = fill(true);
    if (worst_round_after(full) < round_after(nodes)) {
      nodes = std::move(full);
      all_the_way = true;
    }
  }
  // Too few samples yet to tell: a window or two more decides between one
  // step all the way and the trust region, instead of a cautious step now and
  // another soon after. Unless two samples of each rate already tell: the
  // step all the way above passed with every rate at the low end of its 95%
  // interval (at two samples Student's t is x12.7, so only rates that agree
  // within a few percent pass).
  if (!sure && fewest < options_.confident_samples && !(all_the_way && fewest >= 2)) {
    *note = fmt::format("stragglers: {}; waiting for {} rate samples of each server",
                        stragglers.empty() ? std::string("none now") : straggler_text(),
                        options_.confident_samples);
    return std::optional<PlanStep>();
  }
  bool any = false;
  for (const Node& n : nodes)
    any = any || n.out > 0;
  if (!any) {
    balancer_.rebalancing_ = false;
    *note = "balanced: every move would be below the minimum";
    return std::optional<PlanStep>();
  }
  PSLD_ASSIGN_OR_RETURN(PlanStep step, realise(StepKind::kRebalance, nodes, {}));
  const double before = step.predicted_round_s_before;
  const double gain = before - step.predicted_round_s_after;
  const double cost = step.migration_cost_s / options_.horizon_rounds;
  // Going on, a gain within the prediction's own uncertainty (twice the
  // largest relative standard error of an active rate) is noise, not
  // imbalance. (A new straggler has passed the sequential test already.)
  double uncertain = 0;
  if (stragglers.empty()) {
    for (const Member& m : members_) {
      const Tracked& t = *m.tracked;
      if (m.active() && t.rate_samples > 0 && t.rate > 0)
        uncertain = std::max(uncertain, 2 * rate_error(t) / t.rate);
    }
  }
  if (!(gain > cost) || gain < std::max(options_.settle_gain, uncertain) * before) {
    balancer_.rebalancing_ = false;
    const std::string best = fmt::format(
        "the best step would gain {} per round ({}) against {} of migration per round",
        seconds_text(gain), change_text(before, step.predicted_round_s_after), seconds_text(cost));
    *note = stragglers.empty() ? "balanced: " + best
                               : fmt::format("stragglers: {}, but {}", straggler_text(), best);
    return std::optional<PlanStep>();
  }
  const bool started = !balancer_.rebalancing_;
  if (started) balancer_.flat_steps_ = 0;
  balancer_.rebalancing_ = true;
  step.reason = fmt::format(
      "rebalance -> epoch {}: {}; predicted round {} -> {} ({}, balanced {}); {}; {}",
      step.change.next.epoch(),
      started ? fmt::format("stragglers: {}", straggler_text())
              : fmt::format("continues (stragglers: {})",
                            stragglers.empty() ? std::string("none now") : straggler_text()),
      seconds_text(before), seconds_text(step.predicted_round_s_after),
      change_text(before, step.predicted_round_s_after), seconds_text(plan_.balanced_round_s),
      moves_text(step), cost_text(step));
  remember(step, nodes);
  return std::optional<PlanStep>(std::move(step));
}

}  // namespace psld
