// `psld bench run`: every suite's benchmark program, once per repetition,
// suites interleaved, into one report (bench/run_cmd.h, docs/perf-ci.md).
#include "bench/run_cmd.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string_view>
#include <thread>

#include "bench/build_info.h"
#include "bench/stats.h"
#include "kernels/cpu/cpu_kernels.h"

extern char** environ;

namespace psld::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// ---- the suites

// BM_reduce_fp32/4096 -> BM_memcpy/4096.
std::string kernel_yardstick(const std::string& name) {
  const size_t slash = name.find('/');
  if (slash == std::string::npos || name.rfind("BM_memcpy/", 0) == 0) return "";
  return "BM_memcpy" + name.substr(slash);
}
// BM_placement_lookup/1000 -> BM_placement_yardstick/1000.
std::string placement_yardstick(const std::string& name) {
  const std::string prefix = "BM_placement_lookup/";
  if (name.rfind(prefix, 0) != 0) return "";
  return "BM_placement_yardstick/" + name.substr(prefix.size());
}
// BM_balancer_decide/<case> -> BM_balancer_yardstick, and each size's own:
// BM_balancer_decide_1m/<case> -> BM_balancer_yardstick_1m.
std::string balancer_yardstick(const std::string& name) {
  const std::string prefix = "BM_balancer_decide";
  const size_t slash = name.find('/');
  if (name.rfind(prefix, 0) != 0 || slash == std::string::npos) return "";
  return "BM_balancer_yardstick" + name.substr(prefix.size(), slash - prefix.size());
}

struct Suite {
  const char* name;
  // In the bench directory ("../tools/psld": the build's psld), or a script
  // of the source tree (script_measures), relative to its root.
  const char* program;
  const char* what;
  std::vector<std::string> quick_args, full_args;
  // A Google Benchmark program (ratios computed here), or one that writes
  // bench/report.h's JSON with its ratios itself given --json FILE.
  bool google_benchmark;
  std::string (*yardstick_of)(const std::string&);
  Speed speed;
  int timeout_s;  // one run
  bool in_quick = true;
  // A script of the source tree measuring this bench program (passed as
  // `measures_flag DIR/PROGRAM`), run by `interpreter` (relative to the
  // source root) when one is given.
  const char* script_measures = nullptr;
  // The program's rows are many samples each (rounds): repetition r keeps
  // them all, numbered r * kSamplesPerRun + their own index.
  bool samples_within_run = false;
  const char* measures_flag = "--bench";
  const char* interpreter = nullptr;
  const char* json_flag = "--json";  // how a non-Google Benchmark program is told its output
};

constexpr int kSamplesPerRun = 100000;

#ifndef PSLD_SOURCE_DIR
#define PSLD_SOURCE_DIR "."
#endif

// The program a suite runs, and the one it measures, when a script.
std::vector<fs::path> programs_of(const Suite& s, const fs::path& dir) {
  if (s.script_measures == nullptr) return {(dir / s.program).lexically_normal()};
  std::vector<fs::path> p = {fs::path(PSLD_SOURCE_DIR) / s.program, dir / s.script_measures};
  if (s.interpreter != nullptr) p.push_back(fs::path(PSLD_SOURCE_DIR) / s.interpreter);
  return p;
}

const std::vector<Suite>& all_suites() {
  static const std::vector<Suite> suites = {
      {"kernels",
       "kernels_bench",
       "CPU kernels (reduce, optimizers, conversions) vs memcpy of the same size",
       {"--benchmark_filter=^BM_(memcpy|reduce_fp32|reduce_bf16|scale_fp32|sgd_fp32|adam_fp32|"
        "cvt_fp32_to_fp16)/(1048576|67108864)$",
        "--benchmark_min_time=0.1"},
       {"--benchmark_filter=^BM_(memcpy|reduce|scale|sgd|momentum|adam|cvt)",
        "--benchmark_min_time=0.2"},
       true,
       kernel_yardstick,
       Speed::kBytesPerSecond,
       300},
      {"placement",
       "kernels_bench",
       "key -> server lookups vs a hash and a plain binary search",
       {"--benchmark_filter=^BM_placement_", "--benchmark_min_time=0.1"},
       {"--benchmark_filter=^BM_placement_", "--benchmark_min_time=0.3"},
       true,
       placement_yardstick,
       Speed::kItemsPerSecond,
       120},
      {"balancer",
       "balancer_bench",
       "one decision on 512 servers (full: also on 1,024) vs sorting the arcs' loads",
       {"--benchmark_filter=^BM_balancer_(decide/(hold|rebalance)|yardstick)$",
        "--benchmark_min_time=0.1"},
       {"--benchmark_min_time=0.2"},
       true,
       balancer_yardstick,
       Speed::kInverseTime,
       300},
      {"ps",
       "ps_bench",
       "push_pull goodput of a 2x2 job over UCX vs raw transport writes",
       {"--tls", "shm", "--workers", "2", "--servers", "2", "--sizes", "1M,4M", "--mode",
        "push_pull", "--seconds", "0.3"},
       {"--tls", "all", "--workers", "2", "--servers", "2", "--sizes", "64K,1M,4M,16M", "--mode",
        "all", "--seconds", "0.5"},
       false,
       nullptr,
       Speed::kBytesPerSecond,
       300},
      // Not in quick: ucx_perftest's runs take ~10 s per repetition even narrowed.
      {"transport",
       "tools/transport-bench",
       "UCX transport writes (and latency, full) vs the best ucx_perftest primitive",
       {"--media", "shm", "--sizes", "1048576,4194304", "--bandwidth-only", "--quick"},
       {"--quick"},
       false,
       nullptr,
       Speed::kBytesPerSecond,
       600,
       false,
       "transport_bench"},
      // Not in quick: a scenario takes ~10 s per policy even shortened. Its
      // samples are rounds: psld's round times against MXNet's and the
      // oracle's median round of the same run.
      {"stragglers",
       "../tools/psld",
       "S1 (one server at R/4): psld's rounds vs MXNet-static and the oracle (psld bench "
       "stragglers)",
       {"bench", "stragglers", "--scenario", "S1", "--rounds", "60", "--workers", "2", "--policies",
        "mxnet,psld,oracle"},
       {"bench", "stragglers", "--scenario", "S1,S4", "--rounds", "100", "--workers", "4",
        "--policies", "mxnet,psld,oracle"},
       false,
       nullptr,
       Speed::kInverseTime,
       900,
       false,
       nullptr,
       true},
      // Not in quick: needs .venv with the package (tools/dev python), and
      // its processes start slowly. C++ and Python alternate within a run.
      {"python",
       "bench/python/register_push_pull.py",
       "register + push_pull of a heap tensor from Python (numpy) vs the same from C++",
       {"--mib", "16", "--rounds", "2", "--repeat", "4"},
       {"--mib", "64", "--rounds", "4", "--repeat", "6"},
       false,
       nullptr,
       Speed::kInverseTime,
       600,
       false,
       "register_push_pull",
       false,
       "--cxx",
       ".venv/bin/python",
       "--report"},
  };
  return suites;
}

const Suite* find_suite(const std::string& name) {
  for (const Suite& s : all_suites()) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

constexpr const char* kRunUsage =
    "usage: psld bench run [--suite quick|full|NAME,...] [--size quick|full]\n"
    "                      [--repetitions N] [--json FILE] [--bench-dir DIR] [--verbose]\n"
    "                      [--list]\n"
    "  Runs every suite's benchmark program once per repetition, the suites\n"
    "  interleaved, and writes one Google Benchmark-shaped report (default\n"
    "  psld-bench.json) whose rows carry a ratio against a yardstick measured in\n"
    "  the same run. quick (default): short runs of kernels, placement, balancer\n"
    "  and ps; full: every suite, more rows, longer runs; NAME,...: those suites (--list\n"
    "  names them), full unless --size quick. --repetitions: 9 by default\n"
    "  (fewer cannot show a 10% change under 3% noise). The programs are looked\n"
    "  for in DIR (default: ../bench beside this psld, a build directory's).\n"
    "  Their output goes to a log, shown when one fails (--verbose: to stderr).\n";

int usage_error(const std::string& why) {
  std::fprintf(stderr, "psld bench run: %s\n%s", why.c_str(), kRunUsage);
  return 2;
}

// ---- running a program

std::atomic<int> g_interrupted{0};

void on_signal(int sig) {
  g_interrupted.store(sig);
}

std::string tail_of(const std::string& path, size_t lines) {
  std::ifstream in(path);
  std::vector<std::string> all;
  for (std::string line; std::getline(in, line);)
    all.push_back(line);
  std::string out;
  for (size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i)
    out += "  | " + all[i] + "\n";
  return out;
}

// Runs argv to completion within timeout_s: stdin from /dev/null, stdout and
// stderr to `log` (or to this process's stderr when verbose). A child still
// running at the deadline or on SIGINT/SIGTERM is stopped (TERM, then KILL).
Status run_program(const std::vector<std::string>& argv,
                   const std::map<std::string, std::string>& env_overrides, const std::string& log,
                   bool verbose, int timeout_s) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  if (verbose) {
    posix_spawn_file_actions_adddup2(&fa, 2, 1);
  } else {
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
  }
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const std::string& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // This environment, with the overrides replacing (or adding) their names.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view kv(*e);
    if (env_overrides.count(std::string(kv.substr(0, kv.find('=')))) == 0) {
      env_strings.emplace_back(kv);
    }
  }
  for (const auto& [name, value] : env_overrides)
    env_strings.push_back(name + "=" + value);
  std::vector<char*> envp;
  envp.reserve(env_strings.size() + 1);
  for (std::string& e : env_strings)
    envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = -1;
  const int err = posix_spawn(&pid, args[0], &fa, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (err != 0) return Unavailable(fmt::format("cannot start {}: {}", argv[0], std::strerror(err)));

  const auto deadline = Clock::now() + std::chrono::seconds(timeout_s);
  int status = 0;
  std::string stopped;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) return Internal(fmt::format("waitpid: {}", std::strerror(errno)));
    if (stopped.empty() && (g_interrupted.load() != 0 || Clock::now() > deadline)) {
      stopped = g_interrupted.load() != 0 ? "interrupted" : fmt::format("over {} s", timeout_s);
      kill(pid, SIGTERM);
      const auto grace = Clock::now() + std::chrono::seconds(5);
      while (waitpid(pid, &status, WNOHANG) == 0 && Clock::now() < grace)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::string why;
  if (!stopped.empty()) {
    why = fmt::format("stopped ({})", stopped);
  } else if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    return Status::Ok();
  } else if (WIFEXITED(status)) {
    why = fmt::format("exited with status {}", WEXITSTATUS(status));
  } else {
    why = fmt::format("killed by signal {}", WTERMSIG(status));
  }
  std::string cmd;
  for (const std::string& a : argv)
    cmd += (cmd.empty() ? "" : " ") + a;
  return Unavailable(fmt::format("{} {}{}", cmd, why,
                                 verbose ? "" : "; the end of its output:\n" + tail_of(log, 20)));
}

// ---- the report's context

double load_average() {
  double load[1] = {0};
  return getloadavg(load, 1) == 1 ? load[0] : -1;
}

std::string host_name() {
  char name[256] = {0};
  return gethostname(name, sizeof name - 1) == 0 ? std::string(name) : "";
}

std::string now_utc() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char out[32];
  std::strftime(out, sizeof out, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return out;
}

fs::path default_bench_dir() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "bench";
  return self.parent_path().parent_path() / "bench";
}

struct Options {
  std::vector<std::string> suites;
  bool quick = true;
  int repetitions = 9;
  std::string json = "psld-bench.json";
  fs::path bench_dir = default_bench_dir();
  bool verbose = false;
};

// ---- one run of one suite

// The rows of one run of one suite, and the program's own context.
Result<Report> run_suite_once(const Suite& s, const RunPlan& plan, size_t side,
                              const fs::path& work, int rep) {
  const fs::path dir = plan.bench_dirs[side];
  const std::string tag = fmt::format("{}-{}-{}", s.name, rep, side);
  const fs::path out = work / (tag + ".json");
  const fs::path log = work / (tag + ".log");
  const std::vector<fs::path> programs = programs_of(s, dir);
  std::vector<std::string> argv;
  if (programs.size() > 2) argv.push_back(programs[2].string());  // the interpreter
  argv.push_back(programs[0].string());
  if (programs.size() > 1) {
    argv.push_back(s.measures_flag);
    argv.push_back(programs[1].string());
  }
  for (const std::string& a : plan.quick ? s.quick_args : s.full_args)
    argv.push_back(a);
  if (s.google_benchmark) {
    argv.push_back("--benchmark_out=" + out.string());
    argv.push_back("--benchmark_out_format=json");
  } else {
    argv.push_back(s.json_flag);
    argv.push_back(out.string());
  }
  const std::map<std::string, std::string> none;
  PSLD_RETURN_IF_ERROR(run_program(argv, side < plan.env.size() ? plan.env[side] : none,
                                   log.string(), plan.verbose, s.timeout_s));
  PSLD_ASSIGN_OR_RETURN(Report r, read_report(out.string()));
  if (s.google_benchmark) {
    add_ratios(r.rows, s.name, s.yardstick_of, s.speed);
  } else {
    for (Row& row : r.rows) {
      row.name = std::string(s.name) + "/" + row.name;
      if (!row.yardstick.empty()) row.yardstick = std::string(s.name) + "/" + row.yardstick;
    }
  }
  for (Row& row : r.rows) {
    row.repetition = s.samples_within_run ? rep * kSamplesPerRun + row.repetition : rep;
    row.repetitions = plan.repetitions;
  }
  return r;
}

void print_summary(const Report& report) {
  std::map<std::string, bool> seen;
  std::printf(
      "| row | ratio (median) | yardstick | CV of ratio | n |\n| --- | ---: | --- | ---: | ---: "
      "|\n");
  for (const Row& r : report.rows) {
    if (r.yardstick.empty() || !seen.emplace(r.name, true).second) continue;
    const std::vector<double> s = samples_of(report, r.name, "ratio");
    std::printf("| %s | %.3f | %s | %.1f%% | %zu |\n", r.name.c_str(), median(s),
                r.yardstick.c_str(), 100 * coefficient_of_variation(s), s.size());
  }
}

Result<Options> parse_options(int argc, char** argv, bool& list, bool& help) {
  Options o;
  std::string suite = "quick";
  std::string size;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> Result<std::string> {
      if (i + 1 >= argc) return InvalidArgument(fmt::format("{} needs a value", arg));
      return std::string(argv[++i]);
    };
    if (arg == "-h" || arg == "--help") {
      help = true;
    } else if (arg == "--list") {
      list = true;
    } else if (arg == "--verbose") {
      o.verbose = true;
    } else if (arg == "--suite") {
      PSLD_ASSIGN_OR_RETURN(suite, value());
    } else if (arg == "--size") {
      PSLD_ASSIGN_OR_RETURN(size, value());
      if (size != "quick" && size != "full") {
        return InvalidArgument(fmt::format("--size '{}' is not quick or full", size));
      }
    } else if (arg == "--repetitions") {
      PSLD_ASSIGN_OR_RETURN(std::string v, value());
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || n < 1 || n > 100) {
        return InvalidArgument(fmt::format("--repetitions '{}' is not a number in [1, 100]", v));
      }
      o.repetitions = static_cast<int>(n);
    } else if (arg == "--json") {
      PSLD_ASSIGN_OR_RETURN(o.json, value());
      if (o.json.empty()) return InvalidArgument("--json needs a file name");
    } else if (arg == "--bench-dir") {
      PSLD_ASSIGN_OR_RETURN(std::string v, value());
      o.bench_dir = v;
    } else {
      return InvalidArgument(fmt::format("unknown argument '{}'", arg));
    }
  }
  if (suite == "quick" || suite == "full") {
    if (!size.empty() && size != suite) {
      return InvalidArgument(fmt::format("--suite {} and --size {} disagree", suite, size));
    }
    o.quick = suite == "quick";
    for (const Suite& s : all_suites()) {
      if (s.in_quick || !o.quick) o.suites.push_back(s.name);
    }
  } else {
    o.quick = size == "quick";
    std::stringstream names(suite);
    for (std::string name; std::getline(names, name, ',');) {
      const Suite* s = find_suite(name);
      if (s == nullptr) {
        std::string known;
        for (const Suite& k : all_suites())
          known += std::string(known.empty() ? "" : ", ") + k.name;
        return InvalidArgument(
            fmt::format("--suite: no suite '{}'; quick, full, or a list of: {}", name, known));
      }
      o.suites.push_back(s->name);
    }
    if (o.suites.empty()) return InvalidArgument("--suite needs quick, full or suite names");
  }
  return o;
}

}  // namespace

void add_ratios(std::vector<Row>& rows, const std::string& suite,
                std::string (*yardstick_of)(const std::string& name), Speed speed) {
  std::map<std::string, const Row*> by_name;
  for (const Row& r : rows)
    by_name.emplace(r.name, &r);
  auto speed_of = [speed](const Row& r) -> double {
    const char* key = speed == Speed::kBytesPerSecond   ? "bytes_per_second"
                      : speed == Speed::kItemsPerSecond ? "items_per_second"
                                                        : "real_time";
    auto it = r.values.find(key);
    if (it == r.values.end() || it->second <= 0) return 0;
    return speed == Speed::kInverseTime ? 1 / it->second : it->second;
  };
  std::vector<std::pair<std::string, double>> ratios(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::string y = yardstick_of(rows[i].name);
    auto it = y.empty() ? by_name.end() : by_name.find(y);
    if (it == by_name.end()) continue;
    const double mine = speed_of(rows[i]), theirs = speed_of(*it->second);
    if (mine > 0 && theirs > 0) ratios[i] = {suite + "/" + y, mine / theirs};
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    rows[i].name = suite + "/" + rows[i].name;
    if (!ratios[i].first.empty()) {
      rows[i].yardstick = ratios[i].first;
      rows[i].values["ratio"] = ratios[i].second;
    }
  }
}

std::vector<std::string> suite_names() {
  std::vector<std::string> names;
  for (const Suite& s : all_suites())
    names.emplace_back(s.name);
  return names;
}

Result<std::vector<Report>> run_suites(const RunPlan& plan) {
  std::vector<const Suite*> suites;
  for (const std::string& name : plan.suites) {
    const Suite* s = find_suite(name);
    if (s == nullptr) return InvalidArgument(fmt::format("no suite '{}'", name));
    suites.push_back(s);
  }
  if (suites.empty() || plan.bench_dirs.empty() || plan.repetitions < 1) {
    return InvalidArgument("nothing to run: no suite, no bench directory or no repetition");
  }
  for (const std::string& dir : plan.bench_dirs) {
    for (const Suite* s : suites) {
      const std::vector<fs::path> programs = programs_of(*s, dir);
      for (size_t i = 0; i < programs.size(); ++i) {
        // A script run by an interpreter needs only be readable.
        const int mode = i == 0 && s->interpreter != nullptr ? R_OK : X_OK;
        if (access(programs[i].c_str(), mode) == 0) continue;
        if (i == 2) {
          return NotFound(fmt::format(
              "{} is not there: the {} suite needs the Python package in the source tree's .venv "
              "(tools/dev python)",
              programs[i].string(), s->name));
        }
        return NotFound(
            fmt::format("{} is not there: psld bench run needs a build with -Dbench=true (its "
                        "bench/ directory), or --bench-dir DIR",
                        programs[i].string()));
      }
    }
  }
  std::string tmpl = (fs::temp_directory_path() / "psld-bench-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) {
    return Unavailable(fmt::format("cannot make a directory in {}: {}",
                                   fs::temp_directory_path().string(), std::strerror(errno)));
  }
  const fs::path work = tmpl;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  struct sigaction old_int {
  }, old_term{};
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);

  std::vector<Report> reports(plan.bench_dirs.size());
  const double load_start = load_average();
  // The first Google Benchmark context seen (CPU, caches, library build type).
  nlohmann::json gbench = nlohmann::json::object();
  Status failed = Status::Ok();
  for (int rep = 0; rep < plan.repetitions && failed.ok(); ++rep) {
    for (size_t d = 0; d < plan.bench_dirs.size() && failed.ok(); ++d) {
      const std::string which =
          plan.bench_dirs.size() > 1 ? fmt::format(" ({})", d == 0 ? "BASE" : "NEW") : "";
      for (const Suite* s : suites) {
        const auto started = Clock::now();
        auto run = run_suite_once(*s, plan, d, work, rep);
        if (g_interrupted.load() != 0) {
          failed = Aborted("interrupted");
          break;
        }
        if (!run.ok()) {
          failed =
              run.status().with_context(fmt::format("suite {}, repetition {}", s->name, rep + 1));
          break;
        }
        std::fprintf(stderr, "[bench] %d/%d %s%s: %zu rows in %.1f s\n", rep + 1, plan.repetitions,
                     s->name, which.c_str(), run->rows.size(),
                     std::chrono::duration<double>(Clock::now() - started).count());
        if (gbench.empty() && run->context.contains("num_cpus")) gbench = run->context;
        for (Row& r : run->rows)
          reports[d].rows.push_back(std::move(r));
      }
    }
  }
  const double load_end = load_average();
  std::error_code ec;
  fs::remove_all(work, ec);
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  PSLD_RETURN_IF_ERROR(failed);

  for (size_t d = 0; d < reports.size(); ++d) {
    const char* isa_request = std::getenv("PSLD_KERNEL_ISA");
    if (d < plan.env.size() && plan.env[d].count("PSLD_KERNEL_ISA") != 0) {
      isa_request = plan.env[d].at("PSLD_KERNEL_ISA").c_str();
    }
    nlohmann::json c = gbench;
    c["date"] = now_utc();
    c["host_name"] = host_name();
    c["executable"] = "psld bench run";
    c["psld"] = {
        {"git_sha", kGitDescribe},
        {"build_type", kBuildType},
        {"compiler", kCompiler},
        {"isa",
         std::string(kernels::isa_name(kernels::select_isa(isa_request ? isa_request : "")))},
        {"transport", "ucx"},
        {"medium", plan.quick ? "shm" : "tcp,shm"},
        {"cores", std::thread::hardware_concurrency()},
        {"load_avg_start", load_start},
        {"load_avg_end", load_end},
        {"suites", plan.suites},
        {"size", plan.quick ? "quick" : "full"},
        {"repetitions", plan.repetitions},
        {"command", plan.command},
        {"bench_dir", fs::absolute(plan.bench_dirs[d]).string()},
    };
    reports[d].context = std::move(c);
  }
  return reports;
}

int cmd_run(int argc, char** argv) {
  bool list = false, help = false;
  auto parsed = parse_options(argc, argv, list, help);
  if (help) {
    std::fputs(kRunUsage, stdout);
    return 0;
  }
  if (!parsed.ok()) return usage_error(parsed.status().message());
  const Options& o = *parsed;
  if (list) {
    for (const Suite& s : all_suites())
      std::printf("%-10s %s (%s%s)\n", s.name, s.what, s.program,
                  s.in_quick ? "" : "; not in quick");
    return 0;
  }
  RunPlan plan;
  plan.suites = o.suites;
  plan.quick = o.quick;
  plan.repetitions = o.repetitions;
  plan.bench_dirs = {o.bench_dir.string()};
  plan.verbose = o.verbose;
  plan.command = "psld bench run";
  for (int i = 0; i < argc; ++i)
    plan.command += std::string(" ") + argv[i];
  const auto t0 = Clock::now();
  auto reports = run_suites(plan);
  if (!reports.ok()) {
    if (reports.status().code() == StatusCode::kNotFound) {
      return usage_error(reports.status().message());
    }
    std::fprintf(stderr, "psld bench run: %s\n", reports.status().to_string().c_str());
    return g_interrupted.load() != 0 ? 130 : 1;
  }
  const Report& report = reports->front();
  Status w = write_report(o.json, report);
  if (!w.ok()) {
    std::fprintf(stderr, "psld bench run: %s\n", w.to_string().c_str());
    return 1;
  }
  print_summary(report);
  const auto& c = report.context["psld"];
  std::fprintf(stderr,
               "[bench] wrote %s: %zu rows (%d repetitions) in %.0f s; load average %.2f -> %.2f "
               "on %u cores\n",
               o.json.c_str(), report.rows.size(), o.repetitions,
               std::chrono::duration<double>(Clock::now() - t0).count(),
               c["load_avg_start"].get<double>(), c["load_avg_end"].get<double>(),
               std::thread::hardware_concurrency());
  return 0;
}

}  // namespace psld::bench
