// lib/coordinator/job_view.h — what the coordinator knows of a running job,
// as one copy: the members, each server's traffic, queue and share of the
// model, what the balancer predicts and decided, each worker's pace and the
// answer times it sees per server. The coordinator fills it from the load
// reports it already receives (CoordinatorService::view); the metrics
// endpoint serves it as Prometheus text (/metrics) and as JSON
// (/status.json), which `psld top` shows (docs/operations.md).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "psld/status.h"

namespace psld {

struct JobView {
  // Upper bounds (seconds) of the round-time histogram's buckets.
  static constexpr std::array<double, 14> kRoundBuckets = {
      0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30};
  static constexpr size_t kMaxDecisions = 16;  // the newest balancer steps kept

  struct Member {
    std::string role;  // "worker", "server"
    uint32_t rank = 0;
    std::string host;
    uint32_t pid = 0;
    // "up", "finished" (a worker that said goodbye), "lost" (a server the
    // job went on without: aborted transfer or failover).
    std::string state = "up";
    double silent_s = 0;  // since the coordinator last heard from it
  };
  struct Server {
    uint32_t rank = 0;
    // "active", "draining", "standby" (holds no keys), "lost".
    std::string state = "active";
    double share = 0;          // of the registered model's bytes it owns, [0, 1]
    uint64_t owned_bytes = 0;  // of parameters
    // Totals since the job started, from its load reports.
    uint64_t bytes_in = 0;
    uint64_t bytes_out = 0;
    uint64_t reports = 0;
    // Its newest window.
    double in_bytes_per_s = 0;
    double out_bytes_per_s = 0;
    double busy = 0;  // fraction of the window it had a request in service
    double queue_p50_s = 0;
    double queue_p99_s = 0;
    // The balancer's belief at its last decision (0: no decision yet).
    double predicted_rate = 0;  // bytes/s
    double predicted_round_s = 0;
    bool straggler = false;  // a straggler for balancer.straggler_windows windows in a row
    // What the workers' newest reports say of it: the mean answer time
    // (weighted by answers), the worst p99, and how many workers named it
    // (all of them in a small job; a rotating sample in a large one,
    // stats.worker_peers).
    double answer_mean_s = 0;
    double answer_p99_s = 0;
    uint32_t answer_workers = 0;
  };
  struct Answers {
    uint32_t server = 0;
    uint64_t answers = 0;  // in the worker's newest window
    double mean_s = 0;
    double p99_s = 0;
  };
  struct Worker {
    uint32_t rank = 0;
    uint64_t round = 0;  // the highest round it pushed
    double round_s = 0;  // mean over its newest window with a round in it
    // Cumulative histogram of round times: every round of a window counts
    // as that window's mean.
    std::array<uint64_t, kRoundBuckets.size()> buckets{};
    uint64_t rounds = 0;           // observed: the +Inf bucket
    double rounds_sum_s = 0;       // their total time
    std::vector<Answers> answers;  // by server
  };
  struct Decision {
    uint64_t decision = 0;  // the balancer's decision number
    double at_s = 0;        // job time
    uint64_t epoch = 0;     // the epoch it proposed
    std::string kind;       // step_kind_name
    std::string reason;
  };

  double time_s = 0;  // since the coordinator started
  // "joining", "running", "finished" or "failed".
  std::string state = "joining";
  std::string failure;  // why, when failed
  uint32_t num_workers = 0;
  uint32_t num_servers = 0;
  uint32_t num_standby = 0;
  uint64_t epoch = 0;
  uint64_t round = 0;  // the highest round any worker reported
  bool switching = false;
  uint64_t switches = 0;
  uint64_t aborts = 0;
  uint64_t failovers = 0;
  uint64_t checkpoints = 0;
  uint64_t last_checkpoint_round = 0;
  uint64_t model_bytes = 0;  // of the registered tensors
  uint64_t tensors = 0;
  uint64_t migrated_bytes = 0;  // parameter bytes whose owner changed, all switches
  bool balancer = false;        // balancer.enabled
  uint64_t balancer_decisions = 0;
  std::map<std::string, uint64_t> steps;  // published steps by kind
  uint64_t unadmitted = 0;                // connections not (yet) admitted
  uint64_t refused = 0;                   // connections refused so far
  std::vector<Member> members;            // workers, then servers, by rank
  std::vector<Server> servers;            // by rank
  std::vector<Worker> workers;            // by rank
  std::vector<Decision> decisions;        // oldest first, at most kMaxDecisions
};

// /metrics: the Prometheus text format (docs/operations.md lists the metrics).
std::string to_prometheus(const JobView& view);
// /status.json, and back (psld top): InvalidArgument for a document that is
// not one.
std::string to_json(const JobView& view);
Result<JobView> job_view_from_json(const std::string& text);

}  // namespace psld
