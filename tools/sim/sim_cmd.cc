// tools/sim/sim_cmd.cc — `psld sim`: the straggler scenarios (or a cluster
// of your own) simulated under every placement policy, reported with the
// same table as `psld bench stragglers`.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/profiles.h"
#include "bench/report.h"
#include "tools/sim/sim.h"

namespace psld::sim {
namespace {

constexpr const char* kUsage = R"(usage: psld sim [flags]

Simulates BSP jobs under each placement policy, with the real balancer,
placement and load history deciding on simulated time, and prints the table
`psld bench stragglers` prints (docs/sim.md). Deterministic for a seed.

  --scenario LIST   S1,S2,S3,S4,S5 or all (default: all), as in
                    `psld bench stragglers --help`
  --trace SPEC      instead of a scenario, a cluster of your own whose
                    capacities follow SPEC (repeatable; see below)
  --servers N       with --trace: servers (default 4)
  --standby N       with --trace: standby servers (default 0)
  --profile NAME    with --trace: resnet50, vgg16, bert-base or a .tsv
                    (default resnet50)
  --policies LIST   mxnet,byteps,round-robin,psld,oracle or all (default: all)
  --rounds N        rounds per run (default: the scenario's; 300 with --trace)
  --workers N       workers (default 4)
  --rate MB/S       each server's capacity: its link each way, or its reduce
                    for S4 (default 100)
  --scale F         model scale, 0 < F <= 1, as a fraction or 1/N (default:
                    the scenario's; 1/32 with --trace)
  --chunk-kb KB     with --trace: every policy's chunk size (default: the
                    policy's own, as in the benchmark)
  --noise L         a shared machine's noise: each server's time a round x
                    (1 + L x a correlated series of mean ~0.35 with spikes)
                    (default 0)
  --chunk-us US     CPU per chunk and worker, worker and server together
                    (default 10.5)
  --cores N         cores the whole job shares; 0: each server its own
                    (default 2: this machine)
  --other-ms MS     the rest of a round: workers' own work (default 4.7)
  --stats-ms MS     servers' and workers' load windows (default 50)
  --interval-ms MS  the balancer's interval (default 250)
  --worker-peers N  servers a worker's report names, as stats.worker_peers:
                    0 auto, 'all' every server (default 0)
  --seed N          (default 1)
  --steps           print every balancer step with its reason
  --out DIR         also write DIR/results.md, DIR/<scenario>.tsv and, with
                    gnuplot, DIR/<scenario>.png
  --json FILE       the round times as Google Benchmark-shaped JSON

Trace specs (factors of the nominal capacity, from a round on):
  step:SERVER:ROUND:FACTOR        moving:FACTOR:PERIOD
  oscillate:SERVER:FACTOR:PERIOD  walk:SIGMA:LO   file:PATH
)";

struct Options {
  std::vector<bench::Scenario> scenarios;
  std::vector<std::string> traces;
  std::vector<bench::Policy> policies;
  uint32_t workers = 4;
  uint32_t servers = 4;
  uint32_t standby = 0;
  std::string profile = "resnet50";
  std::optional<uint64_t> rounds;
  std::optional<double> scale;
  double rate = 100e6;
  double noise = 0;
  double chunk_s = 10.5e-6;
  uint32_t cores = 2;
  double other_s = 4.7e-3;
  double stats_s = 0.05;
  double interval_s = 0.25;
  uint32_t worker_peers = 0;
  uint64_t chunk_bytes = 0;  // 0: the policy's
  uint64_t seed = 1;
  bool steps = false;
  std::string out_dir;
  std::string json;
};

Result<double> parse_number(const std::string& flag, const std::string& text, double lo,
                            double hi) {
  char* end = nullptr;
  double v = 0;
  if (text.rfind("1/", 0) == 0 && flag == "--scale") {
    const double d = std::strtod(text.c_str() + 2, &end);
    v = d > 0 ? 1 / d : 0;
  } else {
    v = std::strtod(text.c_str(), &end);
  }
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v) || v < lo || v > hi) {
    return InvalidArgument(fmt::format("{} '{}': a number from {} to {}", flag, text, lo, hi));
  }
  return v;
}

Result<Options> parse_args(int argc, char** argv) {
  Options o;
  std::string scenarios, policies = "all";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--steps") {
      o.steps = true;
      continue;
    }
    if (i + 1 >= argc) return InvalidArgument(fmt::format("{} needs a value\n{}", arg, kUsage));
    const std::string value = argv[++i];
    auto whole = [&](double lo, double hi) -> Result<uint64_t> {
      PSLD_ASSIGN_OR_RETURN(double v, parse_number(arg, value, lo, hi));
      if (v != std::floor(v))
        return InvalidArgument(fmt::format("{} '{}': a whole number", arg, value));
      return static_cast<uint64_t>(v);
    };
    if (arg == "--scenario") {
      scenarios = value;
    } else if (arg == "--trace") {
      o.traces.push_back(value);
    } else if (arg == "--policies") {
      policies = value;
    } else if (arg == "--profile") {
      o.profile = value;
    } else if (arg == "--servers") {
      PSLD_ASSIGN_OR_RETURN(uint64_t v, whole(1, 65536));
      o.servers = static_cast<uint32_t>(v);
    } else if (arg == "--standby") {
      PSLD_ASSIGN_OR_RETURN(uint64_t v, whole(0, 65536));
      o.standby = static_cast<uint32_t>(v);
    } else if (arg == "--workers") {
      PSLD_ASSIGN_OR_RETURN(uint64_t v, whole(1, 1e6));
      o.workers = static_cast<uint32_t>(v);
    } else if (arg == "--cores") {
      PSLD_ASSIGN_OR_RETURN(uint64_t v, whole(0, 4096));
      o.cores = static_cast<uint32_t>(v);
    } else if (arg == "--rounds") {
      PSLD_ASSIGN_OR_RETURN(uint64_t v, whole(1, 1e7));
      o.rounds = v;
    } else if (arg == "--seed") {
      PSLD_ASSIGN_OR_RETURN(o.seed, whole(0, 1e15));
    } else if (arg == "--rate") {
      PSLD_ASSIGN_OR_RETURN(double v, parse_number(arg, value, 1e-3, 1e9));
      o.rate = v * 1e6;
    } else if (arg == "--scale") {
      PSLD_ASSIGN_OR_RETURN(double v, parse_number(arg, value, 1e-9, 1));
      o.scale = v;
    } else if (arg == "--noise") {
      PSLD_ASSIGN_OR_RETURN(o.noise, parse_number(arg, value, 0, 100));
    } else if (arg == "--chunk-us") {
      PSLD_ASSIGN_OR_RETURN(double v, parse_number(arg, value, 0, 1e6));
      o.chunk_s = v * 1e-6;
    } else if (arg == "--other-ms" || arg == "--stats-ms" || arg == "--interval-ms") {
      PSLD_ASSIGN_OR_RETURN(double v,
                            parse_number(arg, value, arg == "--other-ms" ? 0 : 0.001, 1e7));
      (arg == "--other-ms" ? o.other_s : arg == "--stats-ms" ? o.stats_s : o.interval_s) = v / 1e3;
    } else if (arg == "--worker-peers") {
      if (value == "all") {
        o.worker_peers = 65536;
      } else {
        PSLD_ASSIGN_OR_RETURN(uint64_t v, whole(0, 65536));
        o.worker_peers = static_cast<uint32_t>(v);
      }
    } else if (arg == "--chunk-kb") {
      PSLD_ASSIGN_OR_RETURN(double v, parse_number(arg, value, 0.004, 1e6));
      o.chunk_bytes = std::max<uint64_t>(4, static_cast<uint64_t>(v * 1024 / 4) * 4);
    } else if (arg == "--out") {
      o.out_dir = value;
    } else if (arg == "--json") {
      if (value.empty()) return InvalidArgument("--json needs a file name");
      o.json = value;
    } else {
      return InvalidArgument(fmt::format("unknown flag '{}'\n{}", arg, kUsage));
    }
  }
  if (!o.traces.empty() && !scenarios.empty()) {
    return InvalidArgument("--scenario and --trace are alternatives: give one");
  }
  if (o.chunk_bytes > 0 && o.traces.empty()) {
    return InvalidArgument("--chunk-kb goes with --trace (a scenario has the benchmark's chunks)");
  }
  if (o.traces.empty()) {
    PSLD_ASSIGN_OR_RETURN(o.scenarios, bench::parse_scenarios(scenarios.empty() ? "all" : scenarios,
                                                              o.rounds, o.scale));
  } else {
    bench::Scenario s;
    s.id = "custom";
    s.profile = o.profile;
    s.scale = o.scale.value_or(1.0 / 32);
    s.servers = o.servers;
    s.standby = o.standby;
    s.rounds = o.rounds.value_or(300);
    for (const std::string& t : o.traces) {
      if (!s.title.empty()) s.title += ", ";
      s.title += t;
      PSLD_ASSIGN_OR_RETURN(auto events, parse_trace(t, o.servers + o.standby, s.rounds, o.seed));
      s.events.insert(s.events.end(), events.begin(), events.end());
    }
    std::stable_sort(s.events.begin(), s.events.end(),
                     [](const auto& a, const auto& b) { return a.round < b.round; });
    o.scenarios.push_back(std::move(s));
  }
  PSLD_ASSIGN_OR_RETURN(o.policies, bench::parse_policies(policies));
  return o;
}

Result<SimResult> run_policy(const Options& o, const bench::Scenario& sc, bench::Policy policy,
                             const std::vector<bench::ModelTensor>& tensors) {
  const bool oracle = policy == bench::Policy::kOracle;
  SimOptions s;
  s.workers = o.workers;
  s.servers = oracle ? sc.servers + sc.standby : sc.servers;
  s.standby = oracle ? 0 : sc.standby;
  s.rounds = sc.rounds;
  s.keys = bench::model_keys(
      tensors, o.chunk_bytes > 0 ? o.chunk_bytes : bench::chunk_bytes_for(policy, sc.scale));
  s.resource = sc.resource;
  s.capacity = o.rate;
  s.events = sc.events;
  s.chunk_s = o.chunk_s;
  s.cores = o.cores;
  s.other_s = o.other_s;
  s.noise = o.noise;
  s.seed = o.seed;
  s.balance = policy == bench::Policy::kPsld;
  s.stats_interval_s = o.stats_s;
  s.balancer_interval_s = o.interval_s;
  s.worker_peers = o.worker_peers;
  std::vector<ServerId> owners;
  switch (policy) {
    case bench::Policy::kMxnet:
      owners = bench::mxnet_owners(tensors, s.keys, s.servers);
      break;
    case bench::Policy::kBytePs:
      owners = bench::byteps_owners(s.keys, s.servers);
      break;
    case bench::Policy::kRoundRobin:
      owners = bench::round_robin_owners(s.keys, s.servers);
      break;
    case bench::Policy::kOracle:
      owners = bench::oracle_owners(s.keys, bench::capacity_phases(sc, s.servers));
      break;
    case bench::Policy::kPsld:
      break;
  }
  if (!owners.empty()) {
    PSLD_ASSIGN_OR_RETURN(Placement p, bench::static_placement(s.keys, owners, s.servers));
    s.initial = std::make_shared<const Placement>(std::move(p));
  }
  PSLD_ASSIGN_OR_RETURN(SimResult r, simulate(s));
  r.run.policy = policy;
  return r;
}

std::string describe(const Options& o, const bench::Scenario& sc,
                     const std::vector<bench::ModelTensor>& tensors) {
  uint64_t bytes = 0;
  for (const bench::ModelTensor& t : tensors)
    bytes += t.elements * 4;
  return fmt::format(
      "Simulated (psld sim, seed {}): {} at 1/{:.0f} scale: {} tensors, {:.2f} MB pushed and "
      "pulled by each worker a round; {} workers, {} servers{}; capacity {:.0f} MB/s ({}); "
      "{:.1f} us a chunk on {} cores, {:.1f} ms a round besides; {} rounds; the balancer plans "
      "every {:.0f} ms on {:.0f} ms windows{}",
      o.seed, sc.profile, 1 / sc.scale, tensors.size(), static_cast<double>(bytes) / 1e6, o.workers,
      sc.servers, sc.standby ? fmt::format(" + {} standby", sc.standby) : "", o.rate / 1e6,
      sc.resource == bench::Resource::kLink ? "each server's link, each way"
                                            : "each server's reduce; links unlimited",
      o.chunk_s * 1e6, o.cores == 0 ? "the servers' own" : std::to_string(o.cores), o.other_s * 1e3,
      sc.rounds, o.interval_s * 1e3, o.stats_s * 1e3,
      o.noise > 0 ? fmt::format("; noise {}", o.noise) : "");
}

}  // namespace

int run_sim(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "-h" || std::string_view(argv[i]) == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
  }
  auto parsed = parse_args(argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "psld sim: %s\n", parsed.status().message().c_str());
    return 2;
  }
  const Options& o = *parsed;
  bench::ScenarioReport out("psld sim", o.out_dir, o.json);
  if (Status s = out.open(); !s.ok()) {
    std::fprintf(stderr, "psld sim: %s\n", s.message().c_str());
    return 2;
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (const bench::Scenario& sc : o.scenarios) {
    auto profile = bench::load_profile(sc.profile);
    if (!profile.ok()) {
      std::fprintf(stderr, "psld sim: %s\n", profile.status().to_string().c_str());
      return 2;
    }
    const auto tensors = bench::scale_profile(*profile, sc.scale);
    std::fprintf(stderr, "%s: %s\n", sc.id.c_str(), sc.title.c_str());
    std::vector<bench::RunResult> results;
    std::string extra;
    for (bench::Policy p : o.policies) {
      const auto p0 = std::chrono::steady_clock::now();
      auto r = run_policy(o, sc, p, tensors);
      if (!r.ok()) {
        std::fprintf(stderr, "psld sim: %s %s: %s\n", sc.id.c_str(),
                     std::string(bench::policy_name(p)).c_str(), r.status().to_string().c_str());
        return 1;
      }
      std::fprintf(stderr, "  %-11s %llu rounds simulated in %.2f s\n",
                   std::string(bench::policy_name(p)).c_str(),
                   static_cast<unsigned long long>(sc.rounds),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count());
      if (p == bench::Policy::kPsld) {
        extra =
            fmt::format("psld: {} decisions, {} steps, {:.2f} MB migrated, {} load reports taken",
                        r->decisions, r->steps.size(), r->migrated_bytes / 1e6, r->reports);
        extra += fmt::format(
            "\ncoordinator: {} worker reports naming {} servers in all, {} arc entries from "
            "servers; its code took {:.2f} s of CPU (ingest {:.2f} s) over {:.1f} s simulated: "
            "{:.1f}% of a core",
            r->worker_reports, r->peer_entries, r->arc_entries, r->coordinator_s, r->ingest_s,
            r->run.seconds, 100 * r->coordinator_s / std::max(r->run.seconds, 1e-9));
        if (o.steps) {
          for (const SimStep& st : r->steps)
            extra += fmt::format("\n- round {}: {}: {}", st.round, st.kind, st.reason);
        }
      }
      results.push_back(std::move(r->run));
    }
    Status s = out.add(sc, describe(o, sc, tensors), results, extra);
    if (!s.ok()) {
      std::fprintf(stderr, "psld sim: %s\n", s.to_string().c_str());
      return 1;
    }
  }
  Status s = out.finish({{"seed", std::to_string(o.seed)}, {"noise", std::to_string(o.noise)}});
  if (!s.ok()) {
    std::fprintf(stderr, "psld sim: %s\n", s.to_string().c_str());
    return 1;
  }
  std::fprintf(stderr, "psld sim: done in %.1f s\n",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}

}  // namespace psld::sim
