// bench/stragglers.cc — policies, scenarios and measures of the straggler
// benchmark (the pure part; the job runs in stragglers_run.cc).
#include "bench/stragglers.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace psld::bench {

std::vector<ModelTensor> scale_profile(const std::vector<TensorSpec>& profile, double scale) {
  std::vector<ModelTensor> out;
  out.reserve(profile.size());
  for (const TensorSpec& t : profile) {
    const double scaled = std::round(static_cast<double>(t.elements) * scale);
    out.push_back({t.name, t.elements, std::max<uint64_t>(1, static_cast<uint64_t>(scaled))});
  }
  return out;
}

std::vector<ModelKey> model_keys(const std::vector<ModelTensor>& tensors, uint64_t chunk_bytes,
                                 TensorId first_id) {
  std::vector<ModelKey> keys;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t bytes = tensors[i].elements * 4;
    const uint64_t chunks = (bytes + chunk_bytes - 1) / chunk_bytes;
    for (uint64_t c = 0; c < chunks; ++c) {
      keys.push_back({make_key(first_id + static_cast<TensorId>(i), static_cast<uint32_t>(c)),
                      static_cast<uint32_t>(i), static_cast<uint32_t>(c),
                      static_cast<uint32_t>(chunks),
                      std::min(chunk_bytes, bytes - c * chunk_bytes)});
    }
  }
  return keys;
}

std::string_view policy_name(Policy policy) {
  switch (policy) {
    case Policy::kMxnet:
      return "mxnet";
    case Policy::kBytePs:
      return "byteps";
    case Policy::kRoundRobin:
      return "round-robin";
    case Policy::kPsld:
      return "psld";
    case Policy::kOracle:
      return "oracle";
  }
  return "?";
}

std::optional<Policy> parse_policy(std::string_view name) {
  for (Policy p : kAllPolicies) {
    if (policy_name(p) == name) return p;
  }
  return std::nullopt;
}

uint64_t djb2(std::string_view text) {
  uint64_t h = 5381;
  for (char c : text)
    h = h * 33 + static_cast<unsigned char>(c);
  return h;
}

std::vector<ServerId> mxnet_owners(const std::vector<ModelTensor>& tensors,
                                   const std::vector<ModelKey>& keys, uint32_t servers) {
  std::vector<ServerId> owners;
  owners.reserve(keys.size());
  for (const ModelKey& k : keys) {
    if (tensors[k.tensor].real_elements < kMxnetBigArrayBound) {
      owners.push_back(static_cast<ServerId>((uint64_t{k.tensor} * 9973) % servers));
    } else {
      owners.push_back(static_cast<ServerId>(uint64_t{k.chunk} * servers / k.chunks));
    }
  }
  return owners;
}

std::vector<ServerId> byteps_owners(const std::vector<ModelKey>& keys, uint32_t servers) {
  std::vector<ServerId> owners;
  owners.reserve(keys.size());
  for (const ModelKey& k : keys) {
    const uint64_t byteps_key = (uint64_t{k.tensor} << 16) | k.chunk;
    owners.push_back(static_cast<ServerId>(djb2(std::to_string(byteps_key)) % servers));
  }
  return owners;
}

std::vector<ServerId> round_robin_owners(const std::vector<ModelKey>& keys, uint32_t servers) {
  std::vector<ServerId> owners;
  owners.reserve(keys.size());
  for (const ModelKey& k : keys)
    owners.push_back(k.tensor % servers);
  return owners;
}

namespace {

// sum over phases of rounds x max over servers of load / capacity; a server
// of capacity 0 that holds load makes it infinite.
double predicted_run(const std::vector<double>& load, const std::vector<CapacityPhase>& phases) {
  double total = 0;
  for (const CapacityPhase& p : phases) {
    double worst = 0;
    for (size_t s = 0; s < load.size(); ++s) {
      if (load[s] == 0) continue;
      worst = p.capacity[s] > 0 ? std::max(worst, load[s] / p.capacity[s])
                                : std::numeric_limits<double>::infinity();
    }
    total += p.rounds * worst;
  }
  return total;
}

}  // namespace

namespace {

// The greedy: keys, largest first, each where it adds least to the predicted
// run; `owners` and `load` hold what is placed already (a key of
// owners[i] != kUnplaced is left where it is), `allowed` the servers it may
// use.
constexpr ServerId kUnplaced = std::numeric_limits<ServerId>::max();

void place_greedily(const std::vector<ModelKey>& keys, const std::vector<CapacityPhase>& phases,
                    const std::vector<bool>& allowed, std::vector<ServerId>& owners,
                    std::vector<double>& load) {
  std::vector<size_t> order;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (owners[i] == kUnplaced) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return keys[a].bytes > keys[b].bytes; });
  for (size_t i : order) {
    size_t best = 0;
    double best_cost = std::numeric_limits<double>::infinity();
    double best_load = std::numeric_limits<double>::infinity();
    for (size_t s = 0; s < load.size(); ++s) {
      if (!allowed[s]) continue;
      load[s] += static_cast<double>(keys[i].bytes);
      const double cost = predicted_run(load, phases);
      load[s] -= static_cast<double>(keys[i].bytes);
      // Ties (a key too small to move the maximum) go to the least loaded.
      if (cost < best_cost || (cost == best_cost && load[s] < best_load)) {
        best = s;
        best_cost = cost;
        best_load = load[s];
      }
    }
    owners[i] = static_cast<ServerId>(best);
    load[best] += static_cast<double>(keys[i].bytes);
  }
}

}  // namespace

std::vector<ServerId> oracle_owners(const std::vector<ModelKey>& keys,
                                    const std::vector<CapacityPhase>& phases) {
  const size_t n = phases.empty() ? 0 : phases.front().capacity.size();
  // Each server's share of the bytes: the greedy's.
  std::vector<ServerId> owners(keys.size(), kUnplaced);
  std::vector<double> share(n, 0.0);
  place_greedily(keys, phases, std::vector<bool>(n, true), owners, share);

  // Which keys make up a share matters too. A server's round is its pushes
  // in, then its pulls out, and a key's pulls wait for every worker's push
  // of it: the last key in is still all to go out. Behind a slow link or
  // reduce, one big key makes that tail long (two 128 KiB chunks at R/4
  // turned S1's rounds from about 55 ms into 140 ms in half of them), while
  // many small ones go out as the next come in. So a server that is slower
  // than the fastest in some phase takes its share in the smallest keys,
  // the slowest such server first, and the others share the rest greedily.
  double fastest = 0;
  std::vector<double> slowest(n, std::numeric_limits<double>::infinity());
  for (const CapacityPhase& p : phases) {
    for (size_t s = 0; s < n; ++s) {
      fastest = std::max(fastest, p.capacity[s]);
      slowest[s] = std::min(slowest[s], p.capacity[s]);
    }
  }
  std::vector<size_t> slow;
  for (size_t s = 0; s < n; ++s) {
    if (slowest[s] < fastest && share[s] > 0) slow.push_back(s);
  }
  if (slow.empty()) return owners;
  std::stable_sort(slow.begin(), slow.end(),
                   [&](size_t a, size_t b) { return slowest[a] < slowest[b]; });
  std::vector<size_t> smallest_first(keys.size());
  std::iota(smallest_first.begin(), smallest_first.end(), size_t{0});
  std::stable_sort(smallest_first.begin(), smallest_first.end(),
                   [&](size_t a, size_t b) { return keys[a].bytes < keys[b].bytes; });
  std::fill(owners.begin(), owners.end(), kUnplaced);
  std::vector<double> load(n, 0.0);
  std::vector<bool> allowed(n, true);
  size_t next = 0;
  for (size_t s : slow) {
    // Up to its share, to the nearest key.
    while (next < smallest_first.size()) {
      const double bytes = static_cast<double>(keys[smallest_first[next]].bytes);
      if (load[s] + bytes / 2 > share[s]) break;
      owners[smallest_first[next]] = static_cast<ServerId>(s);
      load[s] += bytes;
      ++next;
    }
    allowed[s] = false;
  }
  place_greedily(keys, phases, allowed, owners, load);
  return owners;
}

double predicted_round(const std::vector<ModelKey>& keys, const std::vector<ServerId>& owners,
                       const CapacityPhase& phase) {
  std::vector<double> load(phase.capacity.size(), 0.0);
  for (size_t i = 0; i < keys.size(); ++i)
    load[owners[i]] += static_cast<double>(keys[i].bytes);
  CapacityPhase one = phase;
  one.rounds = 1;
  return predicted_run(load, {one});
}

Result<Placement> static_placement(const std::vector<ModelKey>& keys,
                                   const std::vector<ServerId>& owners, uint32_t servers) {
  if (keys.size() != owners.size()) {
    return InvalidArgument(
        fmt::format("{} keys but {} owners: one owner per key", keys.size(), owners.size()));
  }
  std::vector<ServerSpec> specs;
  for (uint32_t s = 0; s < servers; ++s)
    specs.push_back({s, 1.0});
  std::vector<Placement::KeyOwner> assigned;
  assigned.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i)
    assigned.push_back({keys[i].key, owners[i]});
  return Placement::initial_with_keys(std::move(specs), assigned);
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<ptrdiff_t>(mid), values.end());
  return values[mid];
}

std::optional<size_t> rounds_to_settle(std::span<const double> round_ms, size_t from, size_t to,
                                       double tolerance, size_t window) {
  to = std::min(to, round_ms.size());
  if (window == 0 || to < from || to - from < 2 * window) return std::nullopt;
  const size_t quarter = std::max<size_t>(window, (to - from) / 4);
  const double level =
      median(std::vector<double>(round_ms.begin() + static_cast<ptrdiff_t>(to - quarter),
                                 round_ms.begin() + static_cast<ptrdiff_t>(to)));
  const double bound = (1 + tolerance) * level;
  // Scanning backwards, the earliest start from which every later window is
  // within the bound.
  size_t settled = to - window;
  for (size_t i = to - window + 1; i-- > from;) {
    const double m =
        median(std::vector<double>(round_ms.begin() + static_cast<ptrdiff_t>(i),
                                   round_ms.begin() + static_cast<ptrdiff_t>(i + window)));
    if (m > bound) break;
    settled = i;
  }
  return settled - from;
}

std::vector<Scenario> default_scenarios() {
  std::vector<Scenario> out;
  // ResNet-50 at 1/32 is 3.2 MB a worker a round; VGG-16 at 1/128 is 4.3 MB.
  const double resnet = 1.0 / 32, vgg = 1.0 / 128;
  out.push_back({"S1",
                 "one of 4 servers at R/4 from the start",
                 "resnet50",
                 resnet,
                 4,
                 0,
                 300,
                 Resource::kLink,
                 {{0, 0, 0.25}}});
  out.push_back({"S2",
                 "a straggler (R/4) appears at round 200 and moves to another server at 600",
                 "resnet50",
                 resnet,
                 4,
                 0,
                 800,
                 Resource::kLink,
                 {{200, 1, 0.25}, {600, 1, 1.0}, {600, 2, 0.25}}});
  out.push_back({"S3",
                 "no straggler, heavily imbalanced tensor sizes (placement alone)",
                 "vgg16",
                 vgg,
                 4,
                 0,
                 200,
                 Resource::kLink,
                 {}});
  out.push_back({"S4",
                 "compute interference: one server's reduce 4x slower",
                 "resnet50",
                 resnet,
                 4,
                 0,
                 300,
                 Resource::kCompute,
                 {{0, 0, 0.25}}});
  out.push_back({"S5",
                 "scale-out: 3 servers saturated, 1 standby",
                 "resnet50",
                 resnet,
                 3,
                 1,
                 300,
                 Resource::kLink,
                 {}});
  return out;
}

Scenario with_rounds(const Scenario& s, uint64_t rounds) {
  Scenario out = s;
  out.rounds = rounds;
  for (CapacityEvent& e : out.events) {
    if (e.round == 0) continue;
    e.round = std::max<uint64_t>(1, (e.round * rounds + s.rounds / 2) / s.rounds);
  }
  return out;
}

std::vector<CapacityPhase> capacity_phases(const Scenario& s, uint32_t servers) {
  std::vector<CapacityPhase> phases;
  std::vector<double> capacity(servers, 1.0);
  uint64_t start = 1;  // rounds are numbered from 1
  size_t e = 0;
  while (e < s.events.size() && s.events[e].round <= 1) {
    if (s.events[e].server < servers) capacity[s.events[e].server] = s.events[e].factor;
    ++e;
  }
  while (start <= s.rounds) {
    const uint64_t next = e < s.events.size()
                              ? std::clamp<uint64_t>(s.events[e].round, start + 1, s.rounds + 1)
                              : s.rounds + 1;
    phases.push_back({static_cast<double>(next - start), capacity});
    start = next;
    while (e < s.events.size() && s.events[e].round <= start) {
      if (s.events[e].server < servers) capacity[s.events[e].server] = s.events[e].factor;
      ++e;
    }
  }
  return phases;
}

}  // namespace psld::bench
