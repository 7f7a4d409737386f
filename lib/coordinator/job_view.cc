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

std::string to_json(const JobView& v) {
  json j;
  j["time_s"] = v.time_s;
  j["state"] = v.state;
  j["failure"] = v.failure;
  j["num_workers"] = v.num_workers;
  j["num_servers"] = v.num_servers;
  j["num_standby"] = v.num_standby;
  j["epoch"] = v.epoch;
  j["round"] = v.round;
  j["switching"] = v.switching;
  j["switches"] = v.switches;
  j["aborts"] = v.aborts;
  j["failovers"] = v.failovers;
  j["checkpoints"] = v.checkpoints;
  j["last_checkpoint_round"] = v.last_checkpoint_round;
  j["model_bytes"] = v.model_bytes;
  j["tensors"] = v.tensors;
  j["migrated_bytes"] = v.migrated_bytes;
  j["balancer"] = v.balancer;
  j["balancer_decisions"] = v.balancer_decisions;
  j["steps"] = v.steps;
  j["unadmitted"] = v.unadmitted;
  j["refused"] = v.refused;
  j["members"] = json::array();
  for (const auto& m : v.members) {
    j["members"].push_back({{"role", m.role},
                            {"rank", m.rank},
                            {"host", m.host},
                            {"pid", m.pid},
                            {"state", m.state},
                            {"silent_s", m.silent_s}});
  }
  j["servers"] = json::array();
  for (const auto& s : v.servers) {
    j["servers"].push_back({{"rank", s.rank},
                            {"state", s.state},
                            {"share", s.share},
                            {"owned_bytes", s.owned_bytes},
                            {"bytes_in", s.bytes_in},
                            {"bytes_out", s.bytes_out},
                            {"reports", s.reports},
                            {"in_bytes_per_s", s.in_bytes_per_s},
                            {"out_bytes_per_s", s.out_bytes_per_s},
                            {"busy", s.busy},
                            {"queue_p50_s", s.queue_p50_s},
                            {"queue_p99_s", s.queue_p99_s},
                            {"predicted_rate", s.predicted_rate},
                            {"predicted_round_s", s.predicted_round_s},
                            {"straggler", s.straggler}});
  }
  j["workers"] = json::array();
  for (const auto& wk : v.workers) {
    json answers = json::array();
    for (const auto& a : wk.answers) {
      answers.push_back(
          {{"server", a.server}, {"answers", a.answers}, {"mean_s", a.mean_s}, {"p99_s", a.p99_s}});
    }
    j["workers"].push_back({{"rank", wk.rank},
                            {"round", wk.round},
                            {"round_s", wk.round_s},
                            {"buckets", wk.buckets},
                            {"rounds", wk.rounds},
                            {"rounds_sum_s", wk.rounds_sum_s},
                            {"answers", std::move(answers)}});
  }
  j["decisions"] = json::array();
  for (const auto& d : v.decisions) {
    j["decisions"].push_back({{"decision", d.decision},
                              {"at_s", d.at_s},
                              {"epoch", d.epoch},
                              {"kind", d.kind},
                              {"reason", d.reason}});
  }
  return j.dump();
}

Result<JobView> job_view_from_json(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return InvalidArgument("not a psld job status: the document is not a JSON object");
  }
  try {
    JobView v;
    v.time_s = j.at("time_s").get<double>();
    v.state = j.at("state").get<std::string>();
    v.failure = j.value("failure", std::string());
    v.num_workers = j.at("num_workers").get<uint32_t>();
    v.num_servers = j.at("num_servers").get<uint32_t>();
    v.num_standby = j.value("num_standby", 0U);
    v.epoch = j.at("epoch").get<uint64_t>();
    v.round = j.at("round").get<uint64_t>();
    v.switching = j.value("switching", false);
    v.switches = j.value("switches", uint64_t{0});
    v.aborts = j.value("aborts", uint64_t{0});
    v.failovers = j.value("failovers", uint64_t{0});
    v.checkpoints = j.value("checkpoints", uint64_t{0});
    v.last_checkpoint_round = j.value("last_checkpoint_round", uint64_t{0});
    v.model_bytes = j.value("model_bytes", uint64_t{0});
    v.tensors = j.value("tensors", uint64_t{0});
    v.migrated_bytes = j.value("migrated_bytes", uint64_t{0});
    v.balancer = j.value("balancer", false);
    v.balancer_decisions = j.value("balancer_decisions", uint64_t{0});
    v.steps = j.value("steps", std::map<std::string, uint64_t>());
    v.unadmitted = j.value("unadmitted", uint64_t{0});
    v.refused = j.value("refused", uint64_t{0});
    for (const auto& m : j.at("members")) {
      v.members.push_back({m.at("role").get<std::string>(), m.at("rank").get<uint32_t>(),
                           m.value("host", std::string()), m.value("pid", 0U),
                           m.at("state").get<std::string>(), m.value("silent_s", 0.0)});
    }
    for (const auto& s : j.at("servers")) {
      JobView::Server e;
      e.rank = s.at("rank").get<uint32_t>();
      e.state = s.at("state").get<std::string>();
      e.share = s.value("share", 0.0);
      e.owned_bytes = s.value("owned_bytes", uint64_t{0});
      e.bytes_in = s.value("bytes_in", uint64_t{0});
      e.bytes_out = s.value("bytes_out", uint64_t{0});
      e.reports = s.value("reports", uint64_t{0});
      e.in_bytes_per_s = s.value("in_bytes_per_s", 0.0);
      e.out_bytes_per_s = s.value("out_bytes_per_s", 0.0);
      e.busy = s.value("busy", 0.0);
      e.queue_p50_s = s.value("queue_p50_s", 0.0);
      e.queue_p99_s = s.value("queue_p99_s", 0.0);
      e.predicted_rate = s.value("predicted_rate", 0.0);
      e.predicted_round_s = s.value("predicted_round_s", 0.0);
      e.straggler = s.value("straggler", false);
      v.servers.push_back(std::move(e));
    }
    for (const auto& w : j.at("workers")) {
      JobView::Worker e;
      e.rank = w.at("rank").get<uint32_t>();
      e.round = w.value("round", uint64_t{0});
      e.round_s = w.value("round_s", 0.0);
      if (w.contains("buckets")) e.buckets = w.at("buckets").get<decltype(e.buckets)>();
      e.rounds = w.value("rounds", uint64_t{0});
      e.rounds_sum_s = w.value("rounds_sum_s", 0.0);
      for (const auto& a : w.value("answers", json::array())) {
        e.answers.push_back({a.at("server").get<uint32_t>(), a.value("answers", uint64_t{0}),
                             a.value("mean_s", 0.0), a.value("p99_s", 0.0)});
      }
      v.workers.push_back(std::move(e));
    }
    for (const auto& d : j.at("decisions")) {
      v.decisions.push_back({d.at("decision").get<uint64_t>(), d.value("at_s", 0.0),
                             d.value("epoch", uint64_t{0}), d.at("kind").get<std::string>(),
                             d.value("reason", std::string())});
    }
    return v;
  } catch (const json::exception& e) {
    return InvalidArgument(fmt::format("not a psld job status: {}", e.what()));
  }
}

}  // namespace psld
