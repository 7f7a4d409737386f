#include "lib/coordinator/job_view.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "lib/stats/prometheus.h"

namespace psld {

namespace {

using prometheus::Labels;
using prometheus::Type;
using json = nlohmann::json;

std::string str(uint32_t v) {
  return std::to_string(v);
}

constexpr std::array<const char*, 4> kStates = {"joining", "running", "finished", "failed"};
constexpr std::array<const char*, 4> kServerStates = {"active", "draining", "standby", "lost"};

}  // namespace

std::string to_prometheus(const JobView& v) {
  prometheus::Writer w;
  w.family("psld_job_state", Type::kGauge,
           "1 for the state the job is in: joining, running, finished or failed");
  for (const char* s : kStates)
    w.sample({{"state", s}}, v.state == s ? 1 : 0);
  w.family("psld_job_seconds", Type::kGauge, "seconds since the coordinator started");
  w.sample({}, v.time_s);
  w.family("psld_round", Type::kGauge, "the highest round any worker reported");
  w.sample({}, static_cast<double>(v.round));
  w.family("psld_model_bytes", Type::kGauge, "bytes of the tensors registered");
  w.sample({}, static_cast<double>(v.model_bytes));
  w.family("psld_tensors", Type::kGauge, "tensors registered");
  w.sample({}, static_cast<double>(v.tensors));

  w.family("psld_member_up", Type::kGauge,
           "1 while a member is connected and heard from; 0 once it finished or was lost");
  for (const auto& m : v.members) {
    w.sample({{"role", m.role}, {"rank", str(m.rank)}, {"host", m.host}}, m.state == "up" ? 1 : 0);
  }
  w.family("psld_member_silent_seconds", Type::kGauge,
           "seconds since the coordinator last heard from the member");
  for (const auto& m : v.members)
    w.sample({{"role", m.role}, {"rank", str(m.rank)}, {"host", m.host}}, m.silent_s);
  w.family("psld_connections_unadmitted", Type::kGauge,
           "connections to the coordinator not (yet) admitted");
  w.sample({}, static_cast<double>(v.unadmitted));
  w.family("psld_connections_refused_total", Type::kCounter,
           "connections the coordinator refused: over the cap, a wrong proof, no hello in time");
  w.sample({}, static_cast<double>(v.refused));

  w.family("psld_server_state", Type::kGauge,
           "1 for the state a server is in: active, draining, standby (no keys) or lost");
  for (const auto& s : v.servers) {
    for (const char* st : kServerStates)
      w.sample({{"server", str(s.rank)}, {"state", st}}, s.state == st ? 1 : 0);
  }
  w.family("psld_server_bytes_total", Type::kCounter,
           "bytes a server received (in: pushes) and sent (out: answers) since the job started");
  for (const auto& s : v.servers) {
    w.sample({{"server", str(s.rank)}, {"direction", "in"}}, static_cast<double>(s.bytes_in));
    w.sample({{"server", str(s.rank)}, {"direction", "out"}}, static_cast<double>(s.bytes_out));
  }
  w.family("psld_server_bytes_per_second", Type::kGauge,
           "a server's traffic over its newest statistics window");
  for (const auto& s : v.servers) {
    w.sample({{"server", str(s.rank)}, {"direction", "in"}}, s.in_bytes_per_s);
    w.sample({{"server", str(s.rank)}, {"direction", "out"}}, s.out_bytes_per_s);
  }
  w.family("psld_server_busy_ratio", Type::kGauge,
           "fraction of its newest window a server had a request in service");
  for (const auto& s : v.servers)
    w.sample({{"server", str(s.rank)}}, s.busy);
  w.family("psld_server_queue_seconds", Type::kGauge,
           "delay from a request's arrival to its processing, newest window");
  for (const auto& s : v.servers) {
    w.sample({{"server", str(s.rank)}, {"quantile", "0.5"}}, s.queue_p50_s);
    w.sample({{"server", str(s.rank)}, {"quantile", "0.99"}}, s.queue_p99_s);
  }
  w.family("psld_server_answer_seconds", Type::kGauge,
           "from a worker issuing a chunk to a server to its answer, as the workers' newest "
           "reports saw it: their mean, weighted by answers, and their worst p99");
  for (const auto& s : v.servers) {
    if (s.answer_workers == 0) continue;
    w.sample({{"server", str(s.rank)}, {"stat", "mean"}}, s.answer_mean_s);
    w.sample({{"server", str(s.rank)}, {"stat", "p99"}}, s.answer_p99_s);
  }
  w.family("psld_server_answer_workers", Type::kGauge,
           "workers whose newest report named the server (a sample in large jobs)");
  for (const auto& s : v.servers)
    w.sample({{"server", str(s.rank)}}, s.answer_workers);
  w.family("psld_server_share", Type::kGauge,
           "fraction of the registered model's bytes a server owns in the committed placement");
  for (const auto& s : v.servers)
    w.sample({{"server", str(s.rank)}}, s.share);
  w.family("psld_server_predicted_rate_bytes_per_second", Type::kGauge,
           "the balancer's estimate of a server's service rate at its last decision");
  for (const auto& s : v.servers)
    w.sample({{"server", str(s.rank)}}, s.predicted_rate);
  w.family("psld_server_straggler", Type::kGauge,
           "1 while the balancer counts a server as a straggler");
  for (const auto& s : v.servers)
    w.sample({{"server", str(s.rank)}}, s.straggler ? 1 : 0);

  w.family("psld_worker_round", Type::kGauge, "the highest round a worker pushed");
  for (const auto& wk : v.workers)
    w.sample({{"worker", str(wk.rank)}}, static_cast<double>(wk.round));
  w.family("psld_worker_round_seconds", Type::kHistogram,
           "time per round as a worker's load reports measure it (each round of a statistics "
           "window counts as the window's mean)");
  for (const auto& wk : v.workers) {
    std::array<double, JobView::kRoundBuckets.size()> bounds = JobView::kRoundBuckets;
    w.histogram({{"worker", str(wk.rank)}}, bounds, wk.buckets, wk.rounds, wk.rounds_sum_s);
  }
  w.family("psld_worker_answer_mean_seconds", Type::kGauge,
           "mean time from issuing a chunk to a server to its answer, a worker's newest window");
  for (const auto& wk : v.workers) {
    for (const auto& a : wk.answers)
      w.sample({{"worker", str(wk.rank)}, {"server", str(a.server)}}, a.mean_s);
  }
  w.family("psld_worker_answer_p99_seconds", Type::kGauge,
           "99th percentile of the same, newest window");
  for (const auto& wk : v.workers) {
    for (const auto& a : wk.answers)
      w.sample({{"worker", str(wk.rank)}, {"server", str(a.server)}}, a.p99_s);
  }

  w.family("psld_placement_epoch", Type::kGauge, "the committed placement epoch");
  w.sample({}, static_cast<double>(v.epoch));
  w.family("psld_placement_switching", Type::kGauge, "1 while an epoch switch is being voted on");
  w.sample({}, v.switching ? 1 : 0);
  w.family("psld_placement_switches_total", Type::kCounter, "epoch switches committed");
  w.sample({}, static_cast<double>(v.switches));
  w.family("psld_balancer_decisions_total", Type::kCounter,
           "balancer decisions by the step they published (none: no change)");
  uint64_t stepped = 0;
  for (const auto& [kind, n] : v.steps) {
    w.sample({{"kind", kind}}, static_cast<double>(n));
    stepped += n;
  }
  w.sample(
      {{"kind", "none"}},
      static_cast<double>(v.balancer_decisions > stepped ? v.balancer_decisions - stepped : 0));
  w.family("psld_migrated_bytes_total", Type::kCounter,
           "parameter bytes whose owner changed in committed switches (optimizer state moves "
           "with them)");
  w.sample({}, static_cast<double>(v.migrated_bytes));
  w.family("psld_transfer_aborts_total", Type::kCounter,
           "transfers aborted because a server gaining keys died");
  w.sample({}, static_cast<double>(v.aborts));
  w.family("psld_failovers_total", Type::kCounter, "servers lost whose ranges went to backups");
  w.sample({}, static_cast<double>(v.failovers));
  w.family("psld_checkpoints_total", Type::kCounter, "complete checkpoints written");
  w.sample({}, static_cast<double>(v.checkpoints));
  return w.text();
}

// One list of fields serves both ways: a field missing or of the wrong type
// makes the document "not a psld job status".
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(JobView::Member, role, rank, host, pid, state, silent_s)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(JobView::Server, rank, state, share, owned_bytes, bytes_in,
                                   bytes_out, reports, in_bytes_per_s, out_bytes_per_s, busy,
                                   queue_p50_s, queue_p99_s, predicted_rate, predicted_round_s,
                                   straggler, answer_mean_s, answer_p99_s, answer_workers)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(JobView::Answers, server, answers, mean_s, p99_s)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(JobView::Worker, rank, round, round_s, buckets, rounds,
                                   rounds_sum_s, answers)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(JobView::Decision, decision, at_s, epoch, kind, reason)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(JobView, time_s, state, failure, num_workers, num_servers,
                                   num_standby, epoch, round, switching, switches, aborts,
                                   failovers, checkpoints, last_checkpoint_round, model_bytes,
                                   tensors, migrated_bytes, balancer, balancer_decisions, steps,
                                   unadmitted, refused, members, servers, workers, decisions)

std::string to_json(const JobView& v) {
  // A member's host or a reason that is not UTF-8 is written with U+FFFD
  // rather than failing the page.
  return json(v).dump(-1, ' ', false, json::error_handler_t::replace);
}

Result<JobView> job_view_from_json(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return InvalidArgument("not a psld job status: the document is not a JSON object");
  }
  try {
    return j.get<JobView>();
  } catch (const json::exception& e) {
    return InvalidArgument(fmt::format("not a psld job status: {}", e.what()));
  }
}

}  // namespace psld
