// bench/failover_bench.cc — what replication costs a job's rounds, and how long
// a job takes to fail over when a server dies or hangs (docs/replication.md,
// "Measured").
//
//   failover_bench [--psld PATH] [--workers W] [--servers S] [--tensors N]
//                  [--bytes B] [--rounds R] [--fault-round K] [--heartbeat-ms H]
//                  [--tls tcp|shm] [--repeat M] [--json FILE]
//
// Real processes: each job is `psld launch -w W -s S --standby 1` over UCX,
// server mode sum, BSP, balancer off. Every worker push_pulls N fp32 tensors
// of B bytes per round and checks the first and last element of each
// against the exact sum (a failover that lost anything fails the job).
// Worker 0 stamps the end of every round with CLOCK_MONOTONIC, which this
// process reads too, so a signal sent here and a round completed there are
// on one clock. Four jobs, one after another, M times:
//
//   r1       replication.factor 1, no fault: the yardstick
//   r2       replication.factor 2, no fault: round time r2 / r1 is the cost of
//            the copies (target: at most 1.3x)
//   r2 kill  r2, server 1 killed (SIGKILL) at round K: its sockets close and
//            the coordinator knows at once
//   r2 stop  r2, server 1 stopped (SIGSTOP) at round K: a hung host, found
//            only by the heartbeat timeout H; killed once the job went on
//
// Per job: the median round time before the fault (rounds K/2..K-1; the
// same rounds of the jobs without one) and after it (from 20 rounds after
// the first round completed after the signal to R); for the faults, the
// failover time: from the signal to the first round completed after it,
// against the heartbeat timeout (target: under 2 H). The table goes to
// stdout, progress to stderr; --json FILE writes the rows as Google
// Benchmark-shaped JSON (bench/report.h): failover/BM_round/<job> with
// real_time the median round before and ratio = r1's / this one's, and
// failover/BM_failover/<fault> with real_time the failover time and ratio =
// 2 H / failover time (above 1: within target).
//
// --trainer (with --tensors, --bytes, --rounds) is what psld launch runs as
// each worker.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "bench/report.h"
#include "psld/config.h"
#include "psld/worker.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using psld::Status;

int64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

struct Options {
  std::string psld;
  int workers = 3;
  int servers = 4;
  int tensors = 64;
  uint64_t bytes = 64 * 1024;
  int rounds = 400;
  int fault_round = 200;
  int heartbeat_ms = 2000;
  std::string tls = "tcp";
  int repeat = 1;
  std::string json;
};

// ---- The trainer: one worker of the job ---------------------------------------

int trainer(const Options& o) {
  auto config = psld::load_config({});
  if (!config.ok()) {
    std::fprintf(stderr, "trainer: %s\n", config.status().to_string().c_str());
    return 1;
  }
  auto joined = psld::Worker::join(*config);
  if (!joined.ok()) {
    std::fprintf(stderr, "trainer: %s\n", joined.status().to_string().c_str());
    return 1;
  }
  psld::Worker& w = **joined;
  const int rank = static_cast<int>(w.rank());
  const int n = static_cast<int>(w.num_workers());
  const size_t elems = o.bytes / sizeof(float);
  std::vector<std::vector<float>> data(o.tensors, std::vector<float>(elems));
  std::vector<psld::TensorHandle> handles;
  for (int t = 0; t < o.tensors; ++t) {
    auto h =
        w.register_tensor("t" + std::to_string(t), psld::DType::kFloat32, o.bytes, data[t].data());
    if (!h.ok()) {
      std::fprintf(stderr, "trainer: %s\n", h.status().to_string().c_str());
      return 1;
    }
    handles.push_back(*h);
  }
  for (int r = 1; r <= o.rounds; ++r) {
    std::vector<psld::Request> reqs;
    for (int t = 0; t < o.tensors; ++t) {
      std::fill(data[t].begin(), data[t].end(), static_cast<float>(rank + r + t % 3));
      auto req = w.push_pull(handles[t]);
      if (!req.ok()) {
        std::fprintf(stderr, "trainer: round %d: %s\n", r, req.status().to_string().c_str());
        return 1;
      }
      reqs.push_back(*req);
    }
    for (auto& q : reqs) {
      Status s = q.wait(std::chrono::seconds(60));
      if (!s.ok()) {
        std::fprintf(stderr, "trainer: round %d: %s\n", r, s.to_string().c_str());
        return 1;
      }
    }
    for (int t = 0; t < o.tensors; ++t) {
      const float want = static_cast<float>(n * (n - 1) / 2 + n * (r + t % 3));
      if (data[t][0] != want || data[t][elems - 1] != want) {
        std::fprintf(stderr, "trainer: round %d tensor %d: %g, not the sum %g\n", r, t,
                     static_cast<double>(data[t][0]), static_cast<double>(want));
        return 1;
      }
    }
    if (rank == 0) {
      std::printf("round %d %lld\n", r, static_cast<long long>(monotonic_ns()));
      std::fflush(stdout);
    }
  }
  return w.shutdown().ok() ? 0 : 1;
}

// ---- The driver: jobs under psld launch ---------------------------------------

enum class Fault { kNone, kKill, kStop };

struct JobSpec {
  std::string name;  // "r1", "r2", "r2 kill", "r2 stop"
  int factor = 1;
  Fault fault = Fault::kNone;
};

struct JobResult {
  std::map<int, int64_t> done;  // round -> when worker 0 completed it
  int64_t fault_at = 0;         // when the signal went
  double before_ms = 0, after_ms = 0, failover_ms = 0;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

// The median round time, in ms, of rounds [from, to] (each round's end minus
// the previous one's).
double median_round_ms(const std::map<int, int64_t>& done, int from, int to) {
  std::vector<double> d;
  for (int r = std::max(from, 2); r <= to; ++r) {
    auto a = done.find(r - 1), b = done.find(r);
    if (a != done.end() && b != done.end()) d.push_back((b->second - a->second) / 1e6);
  }
  return median(std::move(d));
}

// The job's server `rank`: a child of `launcher` whose environment says so.
pid_t find_server(pid_t launcher, int rank) {
  const std::string role = "PSLD_JOB_ROLE=server", want = "PSLD_JOB_RANK=" + std::to_string(rank);
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.empty() || name[0] < '1' || name[0] > '9') continue;
    std::ifstream stat(e.path() / "stat");
    std::string text;
    std::getline(stat, text);  // one line
    const auto paren = text.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream rest(text.substr(paren + 1));
    char state = 0;
    pid_t parent = 0;
    if (!(rest >> state >> parent) || parent != launcher) continue;
    std::ifstream env(e.path() / "environ");
    bool role_ok = false, rank_ok = false;
    for (std::string kv; std::getline(env, kv, '\0');) {
      role_ok |= kv == role;
      rank_ok |= kv == want;
    }
    if (role_ok && rank_ok) return static_cast<pid_t>(std::stol(name));
  }
  return -1;
}

psld::Result<JobResult> run_job(const Options& o, const JobSpec& spec, const std::string& self) {
  std::vector<std::string> args = {o.psld,
                                   "launch",
                                   "-w",
                                   std::to_string(o.workers),
                                   "-s",
                                   std::to_string(o.servers),
                                   "--standby",
                                   "1",
                                   "--",
                                   self,
                                   "--trainer",
                                   "--tensors",
                                   std::to_string(o.tensors),
                                   "--bytes",
                                   std::to_string(o.bytes),
                                   "--rounds",
                                   std::to_string(o.rounds)};
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "PSLD_", 5) != 0) env.emplace_back(*e);
  }
  const std::string tls = o.tls == "shm" ? "sm,tcp" : "tcp";
  for (const std::string& kv :
       {std::string("PSLD_SERVER_MODE=sum"), std::string("PSLD_DATA_SYNC=bsp"),
        std::string("PSLD_BALANCER_ENABLED=false"), "PSLD_UCX_TLS=" + tls,
        "PSLD_REPLICATION_FACTOR=" + std::to_string(spec.factor),
        "PSLD_LIVENESS_HEARTBEAT_TIMEOUT_MS=" + std::to_string(o.heartbeat_ms),
        "PSLD_LIVENESS_HEARTBEAT_INTERVAL_MS=" + std::to_string(std::max(1, o.heartbeat_ms / 8)),
        std::string("PSLD_LOG=warn"), std::string("UCX_WARN_UNUSED_ENV_VARS=n")}) {
    env.push_back(kv);
  }
  std::vector<char*> argv, envp;
  for (auto& a : args)
    argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& kv : env)
    envp.push_back(kv.data());
  envp.push_back(nullptr);

  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return psld::Internal("pipe: " + std::string(strerror(errno)));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);  // a group of its own: killed whole on a timeout
  pid_t launcher = -1;
  const int err = posix_spawn(&launcher, argv[0], &fa, &attr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  close(fds[1]);
  if (err != 0) {
    close(fds[0]);
    return psld::NotFound(fmt::format("cannot run {}: {}", o.psld, strerror(err)));
  }

  JobResult out;
  std::deque<std::string> tail;  // the last lines, for a failure's message
  std::string pending;
  pid_t victim = -1;
  bool victim_killed = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
  std::string why;
  for (bool open = true; open;) {
    if (std::chrono::steady_clock::now() > deadline) {
      why = "the job did not end within 300 s";
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    char buf[65536];
    const ssize_t got = read(fds[0], buf, sizeof(buf));
    if (got <= 0) {
      open = false;
      continue;
    }
    pending.append(buf, static_cast<size_t>(got));
    for (size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
      std::string line = pending.substr(0, nl);
      pending.erase(0, nl + 1);
      int round = 0;
      long long at = 0;
      if (std::sscanf(line.c_str(), "[worker 0] round %d %lld", &round, &at) == 2) {
        out.done[round] = at;
      } else {
        tail.push_back(line);
        if (tail.size() > 40) tail.pop_front();
      }
      if (spec.fault != Fault::kNone && round == o.fault_round && victim < 0) {
        victim = find_server(launcher, 1);
        if (victim < 0) {
          why = "no process for server 1";
          break;
        }
        out.fault_at = monotonic_ns();
        kill(victim, spec.fault == Fault::kKill ? SIGKILL : SIGSTOP);
        std::fprintf(stderr, "failover_bench: %s: server 1 (pid %d) %s at round %d\n",
                     spec.name.c_str(), victim, spec.fault == Fault::kKill ? "killed" : "stopped",
                     round);
      }
      // A stopped server is killed once the job went on without it.
      if (spec.fault == Fault::kStop && victim > 0 && !victim_killed && out.fault_at > 0 &&
          round > 0 && at > out.fault_at) {
        kill(victim, SIGKILL);
        victim_killed = true;
      }
    }
    if (!why.empty()) break;
  }
  close(fds[0]);
  if (!why.empty()) {
    if (victim > 0) kill(victim, SIGKILL);
    kill(-launcher, SIGKILL);
  }
  int status = 0;
  waitpid(launcher, &status, 0);
  std::string lines;
  for (const auto& l : tail)
    lines += "  " + l + "\n";
  if (why.empty() && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
    why = WIFEXITED(status) ? fmt::format("psld launch exited with status {}", WEXITSTATUS(status))
                            : fmt::format("psld launch ended by signal {}", WTERMSIG(status));
  }
  if (why.empty() && static_cast<int>(out.done.size()) < o.rounds) {
    why = fmt::format("worker 0 reported {} rounds of {}", out.done.size(), o.rounds);
  }
  if (!why.empty()) {
    return psld::Internal(fmt::format("job '{}': {}; its last lines:\n{}", spec.name, why, lines));
  }

  out.before_ms = median_round_ms(out.done, o.fault_round / 2, o.fault_round - 1);
  int after_from = o.fault_round + 20;
  if (spec.fault != Fault::kNone) {
    for (const auto& [r, at] : out.done) {
      if (at > out.fault_at) {
        out.failover_ms = (at - out.fault_at) / 1e6;
        after_from = r + 20;
        break;
      }
    }
  }
  out.after_ms = median_round_ms(out.done, after_from, o.rounds);
  return out;
}

int usage(const char* why) {
  std::fprintf(stderr,
               "failover_bench: %s\n"
               "usage: failover_bench [--psld PATH] [--workers W] [--servers S] [--tensors N]\n"
               "                      [--bytes B] [--rounds R] [--fault-round K] "
               "[--heartbeat-ms H]\n"
               "                      [--tls tcp|shm] [--repeat M] [--json FILE]\n",
               why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  bool is_trainer = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--trainer") {
      is_trainer = true;
      continue;
    }
    if (i + 1 >= argc) return usage(("missing value of " + a).c_str());
    const char* v = argv[++i];
    auto number = [&](int lo, int hi, int* to) {
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (*v == '\0' || *end != '\0' || n < lo || n > hi) return false;
      *to = static_cast<int>(n);
      return true;
    };
    int bytes = 0;
    bool ok = true;
    if (a == "--psld") {
      o.psld = v;
    } else if (a == "--workers") {
      ok = number(1, 64, &o.workers);
    } else if (a == "--servers") {
      ok = number(2, 64, &o.servers);
    } else if (a == "--tensors") {
      ok = number(1, 4096, &o.tensors);
    } else if (a == "--bytes") {
      ok = number(4, 1 << 28, &bytes) && bytes % 4 == 0;
      o.bytes = static_cast<uint64_t>(bytes);
    } else if (a == "--rounds") {
      ok = number(10, 1000000, &o.rounds);
    } else if (a == "--fault-round") {
      ok = number(4, 1000000, &o.fault_round);
    } else if (a == "--heartbeat-ms") {
      ok = number(100, 600000, &o.heartbeat_ms);
    } else if (a == "--tls") {
      o.tls = v;
      ok = o.tls == "tcp" || o.tls == "shm";
    } else if (a == "--repeat") {
      ok = number(1, 100, &o.repeat);
    } else if (a == "--json") {
      o.json = v;
    } else {
      return usage(("unknown flag " + a).c_str());
    }
    if (!ok) return usage(fmt::format("bad value '{}' for {}", v, a).c_str());
  }
  if (is_trainer) return trainer(o);
  if (o.fault_round + 40 >= o.rounds) {
    return usage("--fault-round must leave at least 40 rounds after it");
  }
  const std::string self = fs::canonical("/proc/self/exe").string();
  if (o.psld.empty()) o.psld = (fs::path(self).parent_path().parent_path() / "tools" / "psld");

  const std::vector<JobSpec> jobs = {{"r1", 1, Fault::kNone},
                                     {"r2", 2, Fault::kNone},
                                     {"r2 kill", 2, Fault::kKill},
                                     {"r2 stop", 2, Fault::kStop}};
  std::map<std::string, std::vector<JobResult>> results;
  for (int m = 0; m < o.repeat; ++m) {
    for (const JobSpec& spec : jobs) {
      std::fprintf(stderr, "failover_bench: repetition %d of %d: job '%s'\n", m + 1, o.repeat,
                   spec.name.c_str());
      auto r = run_job(o, spec, self);
      if (!r.ok()) {
        std::fprintf(stderr, "failover_bench: %s\n", r.status().to_string().c_str());
        return 1;
      }
      results[spec.name].push_back(std::move(r).value());
    }
  }

  auto med = [&](const std::string& job, double JobResult::*field) {
    std::vector<double> v;
    for (const JobResult& r : results[job])
      v.push_back(r.*field);
    return median(std::move(v));
  };
  const double r1 = med("r1", &JobResult::before_ms);
  std::printf(
      "%d workers x %d servers (+1 standby), %d tensors of %llu bytes, %s, heartbeat timeout "
      "%d ms, fault at round %d of %d, medians of %d repetitions\n\n",
      o.workers, o.servers, o.tensors, static_cast<unsigned long long>(o.bytes), o.tls.c_str(),
      o.heartbeat_ms, o.fault_round, o.rounds, o.repeat);
  std::printf(
      "| job | round before (ms) | vs r1 | round after (ms) | after / before | failover (ms) | vs "
      "heartbeat timeout |\n|---|---|---|---|---|---|---|\n");
  psld::bench::Report report;
  report.context["psld"] = {{"suite", "failover"},
                            {"workers", o.workers},
                            {"servers", o.servers},
                            {"tensors", o.tensors},
                            {"bytes", o.bytes},
                            {"tls", o.tls},
                            {"heartbeat_timeout_ms", o.heartbeat_ms}};
  for (const JobSpec& spec : jobs) {
    const double before = med(spec.name, &JobResult::before_ms);
    const double after = med(spec.name, &JobResult::after_ms);
    const double failover = med(spec.name, &JobResult::failover_ms);
    const bool fault = spec.fault != Fault::kNone;
    std::printf("| %s | %.2f | %.2fx | %.2f | %.2fx | %s | %s |\n", spec.name.c_str(), before,
                before / r1, after, after / before,
                fault ? fmt::format("{:.0f}", failover).c_str() : "",
                fault ? fmt::format("{:.2f}x", failover / o.heartbeat_ms).c_str() : "");
    std::string name = spec.name;
    std::replace(name.begin(), name.end(), ' ', '_');
    for (size_t m = 0; m < results[spec.name].size(); ++m) {
      const JobResult& r = results[spec.name][m];
      psld::bench::Row row;
      row.name = "failover/BM_round/" + name;
      row.repetition = static_cast<int>(m);
      row.repetitions = o.repeat;
      if (spec.name != "r1") row.yardstick = "failover/BM_round/r1";
      row.values = {{"real_time", r.before_ms * 1e6},
                    {"cpu_time", r.before_ms * 1e6},
                    {"iterations", 1},
                    {"after_ns", r.after_ms * 1e6}};
      if (spec.name != "r1") row.values["ratio"] = results["r1"][m].before_ms / r.before_ms;
      report.rows.push_back(row);
      if (!fault) continue;
      psld::bench::Row f;
      f.name = "failover/BM_failover/" + name.substr(3);
      f.repetition = static_cast<int>(m);
      f.repetitions = o.repeat;
      f.values = {{"real_time", r.failover_ms * 1e6},
                  {"cpu_time", r.failover_ms * 1e6},
                  {"iterations", 1},
                  {"heartbeat_timeout_ns", o.heartbeat_ms * 1e6},
                  {"ratio", 2.0 * o.heartbeat_ms / std::max(r.failover_ms, 1e-3)}};
      report.rows.push_back(f);
    }
  }
  if (!o.json.empty()) {
    Status st = psld::bench::write_report(o.json, report);
    if (!st.ok()) {
      std::fprintf(stderr, "failover_bench: %s\n", st.to_string().c_str());
      return 1;
    }
  }
  return 0;
}
