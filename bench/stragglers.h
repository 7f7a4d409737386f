// bench/stragglers.h — the straggler scenarios (`psld bench stragglers`,
// docs/stragglers.md): the placement policies compared, the scenarios, and
// the measures taken of a run.
//
// Everything here but run_stragglers() is pure (no clock, no I/O) and unit
// tested; run_stragglers() runs each scenario as an in-process job of real
// servers and workers behind emulated links.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "bench/profiles.h"
#include "lib/placement/placement.h"
#include "psld/keys.h"

namespace psld::bench {

// ---- The model a scenario trains, scaled to this machine.

struct ModelTensor {
  std::string name;
  uint64_t real_elements = 0;  // in the real model (the policies decide on these)
  uint64_t elements = 0;       // pushed by the benchmark (fp32)
};

// Every tensor keeps max(1, round(elements x scale)) elements, so that the
// relative sizes (one 392 MiB fc6 in VGG-16) survive on a 2-core machine.
std::vector<ModelTensor> scale_profile(const std::vector<TensorSpec>& profile, double scale);

// One chunk of the model, as the job's keys cut it.
struct ModelKey {
  Key key = 0;
  uint32_t tensor = 0;  // index into the model's tensors (registration order)
  uint32_t chunk = 0;
  uint32_t chunks = 0;  // of its tensor
  uint64_t bytes = 0;
};

// The keys of fp32 tensors cut into chunk_bytes chunks, when tensor i has id
// first_id + i (the coordinator numbers tensors 1, 2, ... in the order their
// names are first registered).
std::vector<ModelKey> model_keys(const std::vector<ModelTensor>& tensors, uint64_t chunk_bytes,
                                 TensorId first_id = 1);

// ---- Policies.

enum class Policy : uint8_t {
  kMxnet,       // static: MXNet's kvstore_dist
  kBytePs,      // static: BytePS
  kRoundRobin,  // static: whole tensors to servers in turn
  kPsld,        // psld's ring at epoch 0, then the balancer
  kOracle,      // static: the best placement for the true capacities
};
inline constexpr Policy kAllPolicies[] = {Policy::kMxnet, Policy::kBytePs, Policy::kRoundRobin,
                                          Policy::kPsld, Policy::kOracle};
// The static placements psld's speedup is reported against.
inline constexpr Policy kBaselines[] = {Policy::kMxnet, Policy::kBytePs, Policy::kRoundRobin};
std::string_view policy_name(Policy policy);
std::optional<Policy> parse_policy(std::string_view name);

// MXNet (kvstore_dist.h, EncodeDefaultKey): an array of fewer than
// MXNET_KVSTORE_BIGARRAY_BOUND elements goes whole to server
// (key x 9973) mod n, key being its index; a larger one is split evenly over
// all servers.
inline constexpr uint64_t kMxnetBigArrayBound = 1000000;
// BytePS: tensors are cut into BYTEPS_PARTITION_BYTES partitions, and
// partition p of tensor key k goes to server djb2(decimal(k << 16 | p)) mod n.
inline constexpr uint64_t kBytePsPartitionBytes = 4096000;
uint64_t djb2(std::string_view text);

// Owners of `keys` (same order). MXNet splits a big array's chunks into n
// runs of consecutive chunks, as even as the chunk count allows.
std::vector<ServerId> mxnet_owners(const std::vector<ModelTensor>& tensors,
                                   const std::vector<ModelKey>& keys, uint32_t servers);
std::vector<ServerId> byteps_owners(const std::vector<ModelKey>& keys, uint32_t servers);
std::vector<ServerId> round_robin_owners(const std::vector<ModelKey>& keys, uint32_t servers);

// The oracle knows each server's capacity (relative; 0: it cannot serve) in
// each phase of the run, and how many rounds each phase lasts. It places
// keys, largest first, where they add least to the predicted run time
// sum over phases of rounds x max over servers of load / capacity; then a
// server slower than the fastest in some phase takes that share of bytes
// in the model's smallest keys instead (a big key behind a slow link is a
// long tail of pulls: docs/stragglers.md, "The oracle").
struct CapacityPhase {
  double rounds = 0;
  std::vector<double> capacity;  // one per server, indexed by id
};
std::vector<ServerId> oracle_owners(const std::vector<ModelKey>& keys,
                                    const std::vector<CapacityPhase>& phases);
// The predicted time of one round of `phase` under `owners`, in units of
// (bytes / capacity): what the oracle minimises (for tests and reports).
double predicted_round(const std::vector<ModelKey>& keys, const std::vector<ServerId>& owners,
                       const CapacityPhase& phase);

// Epoch 0 of servers 0..servers-1 (weight 1) with every key where `owners`
// puts it.
Result<Placement> static_placement(const std::vector<ModelKey>& keys,
                                   const std::vector<ServerId>& owners, uint32_t servers);

// ---- Measures.

// Rounds [from, to) of a run (indices into round_ms) form one phase between
// two changes. Its level is the median of its last quarter; it has settled at
// the first round i >= from from which the median of the next `window`
// rounds stays within (1 + tolerance) x level. Returns i - from, or nullopt
// when the phase is too short to tell (fewer than 2 x window rounds).
std::optional<size_t> rounds_to_settle(std::span<const double> round_ms, size_t from, size_t to,
                                       double tolerance = 0.1, size_t window = 10);
double median(std::vector<double> values);

// ---- Scenarios.

enum class Resource : uint8_t {
  kLink,     // every server behind an emulated link of capacity R
  kCompute,  // every server's reduce paced at capacity C, links unlimited
};

// Before round `round` (0: from the start), server `server` gets `factor`
// times the nominal capacity of the scenario's resource.
struct CapacityEvent {
  uint64_t round = 0;
  ServerId server = 0;
  double factor = 1;
};

struct Scenario {
  std::string id;  // "S1"
  std::string title;
  std::string profile;  // a shipped profile's name
  // The model's scale here (see scale_profile): each round moves a few MB per
  // worker, so that hundreds of rounds take minutes on 2 cores.
  double scale = 1.0 / 32;
  uint32_t servers = 4;
  uint32_t standby = 0;
  uint64_t rounds = 300;
  Resource resource = Resource::kLink;
  std::vector<CapacityEvent> events;  // sorted by round
};

// S1-S5 with their default round counts.
std::vector<Scenario> default_scenarios();
// The scenario run for `rounds` rounds instead, its events at the same
// fractions of the run.
Scenario with_rounds(const Scenario& s, uint64_t rounds);
// The phases the events make, over `servers` servers (the scenario's servers,
// plus its standby ones for the oracle, which may use every server the job
// has).
std::vector<CapacityPhase> capacity_phases(const Scenario& s, uint32_t servers);

// ---- The benchmark.

// `psld bench stragglers [flags]`; argv[0] is "stragglers". Prints progress to
// stderr and the tables to stdout; returns the process's exit code.
int run_stragglers(int argc, char** argv);

}  // namespace psld::bench
