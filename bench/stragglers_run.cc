// bench/stragglers_run.cc — `psld bench stragglers`: each scenario (S1-S5),
// each policy, as an in-process job of real servers and workers behind
// emulated links, one after the other in one run (docs/stragglers.md).
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "bench/report.h"
#include "bench/stats.h"
#include "bench/stragglers.h"
#include "bench/stragglers_report.h"
#include "lib/coordinator/service.h"
#include "lib/server/service.h"
#include "lib/worker/service.h"
#include "transports/emulated_link/emulated_link.h"
#include "transports/loopback/loopback.h"

namespace psld::bench {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr const char* kUsage = R"(usage: psld bench stragglers [flags]

Runs the straggler scenarios, each under every placement policy, one after the
other in this process, and prints one table per scenario (docs/stragglers.md).

  --scenario LIST   S1,S2,S3,S4,S5 or all (default: all)
                      S1 one of 4 servers at R/4 from the start (ResNet-50)
                      S2 a straggler appears at round 200, moves at 600 (ResNet-50)
                      S3 no straggler, imbalanced sizes (VGG-16)
                      S4 one server's reduce 4x slower (ResNet-50)
                      S5 3 saturated servers and 1 standby (ResNet-50)
  --policies LIST   mxnet,byteps,round-robin,psld,oracle or all (default: all)
  --rounds N        rounds per run (default: the scenario's: 300, 800, 200, 300,
                    300); events move to the same fraction of the run
  --workers N       workers (default 4)
  --rate MB/S       R, each server's capacity: its link each way (S4: its
                    reduce); the straggler gets R/4 (default 100)
  --scale F         model scale, 0 < F <= 1, as a fraction or 1/N (default:
                    the scenario's, 1/32 for ResNet-50 and 1/128 for VGG-16)
  --transport T     ucx (tcp) or loopback (default ucx)
  --noise N         N busy threads for the whole run, each spinning
                    --noise-duty of every 10 ms (random phase): a machine
                    noisy on purpose, to measure how calm the balancer stays
                    (default 0)
  --noise-duty D    0 < D <= 1 (default 0.5)
  --out DIR         also write DIR/results.md, DIR/<scenario>.tsv and, when
                    gnuplot is installed, DIR/<scenario>.png
  --json FILE       also write the round times as Google Benchmark-shaped JSON
                    (docs/perf-ci.md): BM_stragglers/<scenario>/<policy>, one
                    row per round, and psld_vs_mxnet / psld_vs_oracle, whose
                    ratio is that policy's median round time over psld's round
)";

struct Options {
  std::vector<Scenario> scenarios;
  std::vector<Policy> policies;
  uint32_t workers = 4;
  double rate = 100e6;
  std::optional<double> scale;  // overrides the scenarios'
  std::string transport = "ucx";
  std::string out_dir;
  std::string json;
  uint32_t noise = 0;  // busy threads
  double noise_duty = 0.5;
};

// --noise: threads that spin `duty` of every period and sleep the rest, each
// at a random phase, until destroyed.
class Noise {
 public:
  Noise(uint32_t threads, double duty) {
    std::random_device seed;
    for (uint32_t i = 0; i < threads; ++i) {
      const auto phase = std::chrono::microseconds(seed() % 10000);
      threads_.emplace_back([this, duty, phase] {
        constexpr auto kPeriod = std::chrono::microseconds(10000);
        const auto busy = std::chrono::duration_cast<std::chrono::microseconds>(kPeriod * duty);
        auto start = Clock::now() + phase;
        std::this_thread::sleep_until(start);
        volatile uint64_t sink = 0;
        while (!stop_.load(std::memory_order_relaxed)) {
          while (Clock::now() < start + busy)
            sink = sink + 1;
          start += kPeriod;
          std::this_thread::sleep_until(start);
        }
      });
    }
  }
  ~Noise() {
    stop_ = true;
    for (auto& t : threads_)
      t.join();
  }
  Noise(const Noise&) = delete;
  Noise& operator=(const Noise&) = delete;

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

Result<double> parse_number(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v)) {
    return InvalidArgument(fmt::format("{} '{}' is not a number", flag, text));
  }
  return v;
}

Result<Options> parse_args(int argc, char** argv) {
  Options o;
  std::optional<uint64_t> rounds;
  std::string scenarios = "all", policies = "all";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) return InvalidArgument(fmt::format("{} needs a value\n{}", arg, kUsage));
    const std::string value = argv[++i];
    if (arg == "--scenario") {
      scenarios = value;
    } else if (arg == "--policies") {
      policies = value;
    } else if (arg == "--rounds" || arg == "--workers") {
      PSLD_ASSIGN_OR_RETURN(double v, parse_number(arg, value));
      if (v < 1 || v > 1e6 || v != std::floor(v)) {
        return InvalidArgument(fmt::format("{} {}: a whole number from 1 to 1000000", arg, value));
      }
      if (arg == "--rounds") rounds = static_cast<uint64_t>(v);
      if (arg == "--workers") {
        if (v > 64) return InvalidArgument("--workers: at most 64 on one machine");
        o.workers = static_cast<uint32_t>(v);
      }
    } else if (arg == "--rate") {
      PSLD_ASSIGN_OR_RETURN(double v, parse_number(arg, value));
      if (!(v > 0)) return InvalidArgument(fmt::format("--rate {}: MB/s, above 0", value));
      o.rate = v * 1e6;
    } else if (arg == "--scale") {
      double v = 0;
      if (value.rfind("1/", 0) == 0) {
        PSLD_ASSIGN_OR_RETURN(double d, parse_number(arg, value.substr(2)));
        v = d > 0 ? 1 / d : 0;
      } else {
        PSLD_ASSIGN_OR_RETURN(v, parse_number(arg, value));
      }
      if (!(v > 0 && v <= 1)) {
        return InvalidArgument(fmt::format("--scale {}: a fraction in (0, 1], e.g. 1/32", value));
      }
      o.scale = v;
    } else if (arg == "--transport") {
      if (value != "ucx" && value != "loopback") {
        return InvalidArgument(
            fmt::format("--transport '{}': accepted values are ucx, loopback", value));
      }
      o.transport = value;
    } else if (arg == "--noise") {
      PSLD_ASSIGN_OR_RETURN(double v, parse_number(arg, value));
      if (v < 0 || v > 64 || v != std::floor(v)) {
        return InvalidArgument(
            fmt::format("--noise {}: busy threads, a whole number 0 to 64", value));
      }
      o.noise = static_cast<uint32_t>(v);
    } else if (arg == "--noise-duty") {
      PSLD_ASSIGN_OR_RETURN(double v, parse_number(arg, value));
      if (!(v > 0 && v <= 1)) {
        return InvalidArgument(fmt::format("--noise-duty {}: a fraction in (0, 1]", value));
      }
      o.noise_duty = v;
    } else if (arg == "--out") {
      o.out_dir = value;
    } else if (arg == "--json") {
      if (value.empty()) return InvalidArgument("--json needs a file name");
      o.json = value;
    } else {
      return InvalidArgument(fmt::format("unknown flag '{}'\n{}", arg, kUsage));
    }
  }
  PSLD_ASSIGN_OR_RETURN(o.scenarios, parse_scenarios(scenarios, rounds, o.scale));
  PSLD_ASSIGN_OR_RETURN(o.policies, parse_policies(policies));
  return o;
}

// The in-process job: coordinator, servers, workers, and the memory the
// workers' tensors live in. Stopped in order by the destructor.
struct Job {
  std::unique_ptr<CoordinatorService> coordinator;
  std::vector<std::unique_ptr<ServerService>> servers;
  std::vector<std::unique_ptr<WorkerService>> workers;
  std::vector<std::vector<float>> memory;  // per worker, every tensor back to back

  ~Job() {
    for (auto& w : workers) {
      if (w) (void)w->shutdown();
    }
    if (coordinator) (void)coordinator->wait(5s);
    for (auto& s : servers) {
      if (s) s->shutdown();
    }
    if (coordinator) coordinator->shutdown();
    workers.clear();  // before their tensors' memory
  }
};

Status apply_event(const Options& o, const Scenario& sc, Job& job, const CapacityEvent& e) {
  for (auto& s : job.servers) {
    if (s->rank() != e.server) continue;
    if (sc.resource == Resource::kCompute) {
      s->set_compute_rate(o.rate * e.factor);
      return Status::Ok();
    }
    transport::LinkOptions link = transport::get_link(s->transport());
    link.egress_bytes_per_second = o.rate * e.factor;
    link.ingress_bytes_per_second = o.rate * e.factor;
    return transport::set_link(s->transport(), link);
  }
  return Status::Ok();  // a server this run does not have
}

std::string policy_label(Policy p) {
  return fmt::format("{:<11}", policy_name(p));
}

Result<RunResult> run_policy(const Options& o, const Scenario& sc, Policy policy,
                             const std::vector<ModelTensor>& tensors, Watchdog& watchdog) {
  // The oracle may use every server the job has, standby included.
  const bool oracle = policy == Policy::kOracle;
  const uint32_t num_servers = oracle ? sc.servers + sc.standby : sc.servers;
  const uint32_t num_standby = oracle ? 0 : sc.standby;
  const uint64_t chunk = chunk_bytes_for(policy, sc.scale);
  const std::vector<ModelKey> keys = model_keys(tensors, chunk);

  RuntimeOptions base;
  base.net.transport = o.transport;
  base.net.options.loopback.fabric = std::make_shared<transport::LoopbackFabric>();
  base.net.options.ucx.tls = "tcp";
  base.net.options.common.op_timeout = 30s;
  base.secret = "stragglers";
  base.num_workers = o.workers;
  base.num_servers = num_servers;
  base.num_standby = num_standby;
  base.chunk_bytes = chunk;
  base.slots_per_worker = 16;
  base.sync = SyncMode::kBsp;
  base.mode = ServerMode::kSum;
  base.heartbeat_timeout = 20s;  // two cores run every member's threads
  base.connect_timeout = 30s;
  base.stats_interval = 50ms;
  base.balancer_enabled = policy == Policy::kPsld;
  base.balancer_interval = 250ms;
  std::vector<ServerId> owners;
  switch (policy) {
    case Policy::kMxnet:
      owners = mxnet_owners(tensors, keys, num_servers);
      break;
    case Policy::kBytePs:
      owners = byteps_owners(keys, num_servers);
      break;
    case Policy::kRoundRobin:
      owners = round_robin_owners(keys, num_servers);
      break;
    case Policy::kOracle:
      owners = oracle_owners(keys, capacity_phases(sc, num_servers));
      break;
    case Policy::kPsld:
      break;
  }
  if (!owners.empty()) {
    PSLD_ASSIGN_OR_RETURN(Placement p, static_placement(keys, owners, num_servers));
    base.initial_placement = std::make_shared<const Placement>(std::move(p));
  }

  Job job;
  watchdog.arm(60s, fmt::format("{} {}: starting the job", sc.id, policy_name(policy)));
  PSLD_ASSIGN_OR_RETURN(job.coordinator, CoordinatorService::start(base));
  base.coordinator_address = job.coordinator->address();
  const uint32_t total_servers = num_servers + num_standby;
  job.servers.resize(total_servers);
  job.workers.resize(o.workers);
  PSLD_RETURN_IF_ERROR(on_threads(total_servers + o.workers, [&](uint32_t i) -> Status {
    RuntimeOptions opt = base;
    if (i < total_servers) {
      if (sc.resource == Resource::kLink) {
        opt.net.emulate_link = true;
        opt.net.link.egress_bytes_per_second = o.rate;
        opt.net.link.ingress_bytes_per_second = o.rate;
      } else {
        opt.compute_bytes_per_second = o.rate;
      }
      PSLD_ASSIGN_OR_RETURN(job.servers[i], ServerService::start(opt));
      return Status::Ok();
    }
    opt.rank = static_cast<int32_t>(i - total_servers);
    PSLD_ASSIGN_OR_RETURN(job.workers[i - total_servers], WorkerService::start(opt));
    return Status::Ok();
  }));
  for (const CapacityEvent& e : sc.events) {
    if (e.round <= 1) PSLD_RETURN_IF_ERROR(apply_event(o, sc, job, e));
  }

  // Registration: worker 0 first, one tensor at a time, so that tensor i
  // gets id i + 1 as the static placements assumed; then the others.
  uint64_t total_elements = 0;
  std::vector<uint64_t> offset;
  for (const ModelTensor& t : tensors) {
    offset.push_back(total_elements);
    total_elements += t.elements;
  }
  job.memory.assign(o.workers, std::vector<float>(total_elements, 0.0f));
  std::vector<std::vector<uint32_t>> handles(o.workers);
  auto register_all = [&](uint32_t w) -> Status {
    for (size_t t = 0; t < tensors.size(); ++t) {
      PSLD_ASSIGN_OR_RETURN(
          uint32_t h,
          job.workers[w]->register_tensor(tensors[t].name, DType::kFloat32, tensors[t].elements * 4,
                                          job.memory[w].data() + offset[t], nullptr));
      handles[w].push_back(h);
    }
    return Status::Ok();
  };
  watchdog.arm(120s, fmt::format("{} {}: registering tensors", sc.id, policy_name(policy)));
  PSLD_RETURN_IF_ERROR(register_all(0));
  PSLD_RETURN_IF_ERROR(on_threads(o.workers - 1, [&](uint32_t i) { return register_all(i + 1); }));

  RunResult result;
  result.policy = policy;
  result.round_ms.reserve(sc.rounds);
  // Generous: a round of the slowest policy takes well under a second here.
  watchdog.arm(std::chrono::milliseconds(120000 + 5000 * sc.rounds),
               fmt::format("{} {}: {} rounds", sc.id, policy_name(policy), sc.rounds));
  const auto start = Clock::now();
  auto last_progress = start;
  PSLD_RETURN_IF_ERROR(on_threads(o.workers, [&](uint32_t w) -> Status {
    WorkerService& worker = *job.workers[w];
    std::vector<std::shared_ptr<RequestState>> reqs(handles[w].size());
    for (uint64_t r = 1; r <= sc.rounds; ++r) {
      Clock::time_point t0{};
      uint64_t switches0 = 0;
      bool switching0 = false;
      if (w == 0) {
        for (const CapacityEvent& e : sc.events) {
          if (e.round == r && r > 1) PSLD_RETURN_IF_ERROR(apply_event(o, sc, job, e));
        }
        switches0 = job.coordinator->switches();
        switching0 = job.coordinator->switching();
        t0 = Clock::now();
      }
      for (size_t i = 0; i < handles[w].size(); ++i) {
        PSLD_ASSIGN_OR_RETURN(reqs[i], worker.submit(handles[w][i], RequestKind::kPushPull));
      }
      for (auto& req : reqs) {
        PSLD_RETURN_IF_ERROR(req->wait(60s).with_context(fmt::format("round {}", r)));
      }
      if (w != 0) continue;
      const auto t1 = Clock::now();
      result.round_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      result.migrating.push_back(switching0 || job.coordinator->switching() ||
                                 job.coordinator->switches() != switches0);
      if (t1 - last_progress >= 2s || r == sc.rounds) {
        last_progress = t1;
        const size_t n = std::min<size_t>(10, result.round_ms.size());
        const double recent = std::accumulate(result.round_ms.end() - static_cast<ptrdiff_t>(n),
                                              result.round_ms.end(), 0.0) /
                              static_cast<double>(n);
        std::fprintf(stderr, "  %s %s round %4llu/%llu  last %zu: %6.1f ms  epoch switches %llu\n",
                     sc.id.c_str(), policy_label(policy).c_str(),
                     static_cast<unsigned long long>(r), static_cast<unsigned long long>(sc.rounds),
                     n, recent, static_cast<unsigned long long>(job.coordinator->epoch()));
      }
    }
    return Status::Ok();
  }));
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.switches = job.coordinator->epoch();
  // Where the model's bytes sit at the end.
  const Placement placement = job.coordinator->current_placement();
  result.final_shares.assign(total_servers, 0.0);
  uint64_t model_bytes = 0;
  for (const ModelKey& k : keys) {
    const ServerId owner = placement.owner_of_key(k.key);
    if (owner < total_servers) result.final_shares[owner] += static_cast<double>(k.bytes);
    model_bytes += k.bytes;
  }
  for (double& s : result.final_shares)
    s /= static_cast<double>(model_bytes);
  watchdog.arm(60s, fmt::format("{} {}: stopping the job", sc.id, policy_name(policy)));
  return result;
}

std::string describe(const Options& o, const Scenario& sc,
                     const std::vector<ModelTensor>& tensors) {
  uint64_t bytes = 0;
  for (const ModelTensor& t : tensors)
    bytes += t.elements * 4;
  return fmt::format(
      "{} at 1/{:.0f} scale: {} tensors, {:.2f} MB pushed and pulled by each worker a round; "
      "{} workers, {} servers{}; R = {:.0f} MB/s ({}); {} transport; {} rounds; "
      "psld's balancer plans every 250 ms{}",
      sc.profile, 1 / sc.scale, tensors.size(), static_cast<double>(bytes) / 1e6, o.workers,
      sc.servers, sc.standby ? fmt::format(" + {} standby", sc.standby) : "", o.rate / 1e6,
      sc.resource == Resource::kLink ? "each server's emulated link, each way"
                                     : "each server's reduce; links unlimited",
      o.transport == "ucx" ? "ucx over tcp" : "loopback", sc.rounds,
      o.noise > 0 ? fmt::format("; noise: {} busy thread{} at {:.0f}% duty", o.noise,
                                o.noise == 1 ? "" : "s", o.noise_duty * 100)
                  : "");
}

}  // namespace

int run_stragglers(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "-h" || std::string_view(argv[i]) == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
  }
  auto parsed = parse_args(argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "psld bench stragglers: %s\n", parsed.status().message().c_str());
    return 2;
  }
  const Options& o = *parsed;
  if (o.transport == "ucx") {
    const auto backends = transport::available_transports();
    if (std::find(backends.begin(), backends.end(), "ucx") == backends.end()) {
      std::fprintf(stderr,
                   "psld bench stragglers: this build has no ucx transport; "
                   "use --transport loopback\n");
      return 2;
    }
  }
  ScenarioReport out("psld bench stragglers", o.out_dir, o.json);
  if (Status s = out.open(); !s.ok()) {
    std::fprintf(stderr, "psld bench stragglers: %s\n", s.message().c_str());
    return 2;
  }
  Watchdog watchdog("psld bench stragglers");
  std::optional<Noise> noise;
  if (o.noise > 0) noise.emplace(o.noise, o.noise_duty);
  const auto t0 = Clock::now();
  for (const Scenario& sc : o.scenarios) {
    auto profile = load_profile(sc.profile);
    if (!profile.ok()) {
      std::fprintf(stderr, "psld bench stragglers: %s\n", profile.status().to_string().c_str());
      return 1;
    }
    const std::vector<ModelTensor> tensors = scale_profile(*profile, sc.scale);
    std::fprintf(stderr, "%s: %s\n", sc.id.c_str(), sc.title.c_str());
    std::vector<RunResult> results;
    for (Policy p : o.policies) {
      auto r = run_policy(o, sc, p, tensors, watchdog);
      if (!r.ok()) {
        std::fprintf(stderr, "psld bench stragglers: %s %s: %s\n", sc.id.c_str(),
                     std::string(policy_name(p)).c_str(), r.status().to_string().c_str());
        return 1;
      }
      results.push_back(std::move(r).value());
    }
    watchdog.disarm();
    Status s = out.add(sc, describe(o, sc, tensors), results);
    if (!s.ok()) {
      std::fprintf(stderr, "psld bench stragglers: %s\n", s.to_string().c_str());
      return 1;
    }
  }
  Status s = out.finish(
      {{"noise",
        o.noise > 0 ? fmt::format("{} threads at {} duty", o.noise, o.noise_duty) : "none"}});
  if (!s.ok()) {
    std::fprintf(stderr, "psld bench stragglers: %s\n", s.to_string().c_str());
    return 1;
  }
  std::fprintf(stderr, "psld bench stragglers: done in %.0f s\n",
               std::chrono::duration<double>(Clock::now() - t0).count());
  return 0;
}

}  // namespace psld::bench
