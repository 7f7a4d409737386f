// psld — the command-line tool.
//
//   psld launch -w N -s M [--standby K] [--transport T] [--slow-server R:RATE] [--resume DIR]
//               [--] PROGRAM ARGS...
//   psld coordinator [--key=value ...]
//   psld server [--key=value ...]
//   psld config [--key=value ...]
//   psld top [HOST:PORT] [--once] [--json] [--interval SECONDS]
//   psld doctor [--key=value ...]
//   psld bench run [flags]
//   psld bench compare BASE NEW [flags]
//   psld bench merge OUT IN...
//   psld bench stragglers [flags]
//   psld sim [flags]
//
// Every subcommand but launch reads the configuration the same way a worker
// does (PSLD_CONFIG file, launcher environment, PSLD_* variables, flags).
#include <fmt/format.h>

#include <cstdio>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/compare_cmd.h"
#include "bench/run_cmd.h"
#include "bench/stragglers.h"
#include "lib/config/interface.h"
#include "lib/server/server_device.h"
#include "lib/worker/device_staging.h"
#include "psld/config.h"
#include "psld/coordinator.h"
#include "psld/server.h"
#include "tools/doctor.h"
#include "tools/launch.h"
#include "tools/sim/sim.h"
#include "tools/top.h"

namespace {

using namespace std::chrono_literals;

constexpr const char* kUsage = R"(usage:
  psld launch -w N -s M [--standby K] [--transport ucx|verbs]
              [--slow-server R:RATE] [--resume DIR] [--] PROGRAM [ARGS...]
      Runs a job on this machine: a coordinator (in this process), M servers
      and K standby servers (`psld server`), and N copies of PROGRAM as
      workers, each with PSLD_* variables that tell it its role and rank.
      Output is prefixed with who printed it. When one process fails the job
      stops and psld exits non-zero naming it; every child is stopped.
      --slow-server R:RATE puts server R behind an emulated link of RATE
      bytes/s each way (suffixes K, M, G: 25M), a bandwidth straggler;
      repeatable. The job's secret comes from PSLD_JOB_SECRET or
      PSLD_SECRET_FILE; without either, a random one for this job alone.
      --resume DIR starts the job from the newest complete checkpoint in DIR
      (parameters, optimizer state and rounds as they were; set
      PSLD_CHECKPOINT_EVERY_ROUNDS to go on checkpointing there).
  psld coordinator [--key=value ...]   run the coordinator of a job
  psld server [--key=value ...]        run one parameter server
  psld config [--key=value ...]        print the effective configuration
  psld top [HOST:PORT] [--once] [--json]  a live view of a running job from
                                       its coordinator's metrics.listen
                                       (--help; docs/operations.md)
  psld doctor [--key=value ...]        what this node offers a job and
                                       lacks (RDMA, UCX, GPUs, memlock,
                                       interface), with the fix for each
  psld bench stragglers [flags]        the straggler scenarios S1-S5 under
                                       every placement policy (--help for
                                       flags; docs/stragglers.md)
  psld sim [flags]                     the same scenarios (or your own
                                       cluster) simulated with the real
                                       balancer (--help; docs/sim.md)
  psld bench run [flags]               the benchmark suites into one JSON
                                       report (--help for flags)
  psld bench compare BASE NEW [flags]  compare two benchmark reports; exit 1
                                       on a regression (docs/perf-ci.md)
  psld bench merge OUT IN...           several runs' reports in one (a baseline)
Configuration keys and their PSLD_* variables: docs/configuration.md.
)";

int fail(const std::string& message) {
  std::fprintf(stderr, "psld: %s\n", message.c_str());
  return 1;
}

// `prefix` goes first, so a flag the user gives still wins.
psld::Result<psld::Config> config_from(int argc, char** argv, int first,
                                       std::vector<std::string> prefix = {}) {
  psld::ConfigSources sources;
  sources.args = std::move(prefix);
  for (int i = first; i < argc; ++i)
    sources.args.emplace_back(argv[i]);
  return psld::load_config(sources);
}

int cmd_config(int argc, char** argv) {
  auto config = config_from(argc, argv, 2);
  if (!config.ok()) return fail(config.status().message());
  std::fputs(psld::to_string(*config).c_str(), stdout);
  psld::RuntimeOptions options = psld::runtime_options_from_config(*config);
  // The interface this process would use (docs/cluster.md), resolved here.
  if (!config->job.interface.empty()) {
    if (psld::Status s = psld::apply_interface(*config, options); !s.ok()) {
      return fail(s.to_string());  // the start would fail the same way
    }
    std::printf("\n# interface: %s, listening on %s\n",
                options.net.options.common.interface.c_str(),
                options.net.options.common.listen_address.c_str());
  }
  // What the data path would do with tensors in GPU memory (docs/gpu.md).
  std::printf("\n# CUDA tensors: %s\n", psld::describe_gpu_path(options).c_str());
  // Where servers keep their keys (docs/gpu.md, "GPU servers").
  if (config->server.device == "cuda") {
    auto device = psld::describe_server_device();
    if (device.ok()) {
      std::printf("# server keys: in GPU memory (server.device = cuda): %s\n", device->c_str());
    } else {
      std::printf("# server keys: server.device = cuda, but a server cannot start here: %s\n",
                  device.status().message().c_str());
    }
  } else {
    std::printf("# server keys: in host memory (server.device = cpu)\n");
  }
  return 0;
}

int cmd_coordinator(int argc, char** argv) {
  auto config = config_from(argc, argv, 2, {"--job.role=coordinator"});
  if (!config.ok()) return fail(config.status().message());
  auto c = psld::Coordinator::start(*config);
  if (!c.ok()) return fail(c.status().to_string());
  std::fprintf(stderr, "psld coordinator listening at %s\n", (*c)->address().c_str());
  psld::Status s = (*c)->wait();
  if (!s.ok()) return fail(s.message());
  return 0;
}

int cmd_server(int argc, char** argv) {
  // The role is known before the launcher's world size is read, so that
  // `srun -n 2 psld server` makes two servers.
  auto config = config_from(argc, argv, 2, {"--job.role=server"});
  if (!config.ok()) return fail(config.status().message());
  auto s = psld::Server::start(*config);
  if (!s.ok()) return fail(s.status().to_string());
  psld::Status st = (*s)->wait();
  if (!st.ok()) return fail(st.message());
  return 0;
}

}  // namespace

// psld returns errors as values; what could still leave main is
// std::bad_alloc, and ending the tool then is right.
int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape)
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const std::string cmd = argv[1];
  if (cmd == "launch") return psld::tools::cmd_launch(argc, argv, kUsage);
  if (cmd == "coordinator") return cmd_coordinator(argc, argv);
  if (cmd == "server") return cmd_server(argc, argv);
  if (cmd == "config") return cmd_config(argc, argv);
  if (cmd == "top") return psld::tools::cmd_top(argc, argv);
  if (cmd == "doctor") return psld::tools::cmd_doctor(argc, argv);
  if (cmd == "sim") return psld::sim::run_sim(argc - 1, argv + 1);
  if (cmd == "bench") {
    if (argc >= 3 && std::string(argv[2]) == "compare") {
      return psld::bench::cmd_compare(argc - 3, argv + 3);
    }
    if (argc >= 3 && std::string(argv[2]) == "merge") {
      return psld::bench::cmd_merge(argc - 3, argv + 3);
    }
    if (argc >= 3 && std::string(argv[2]) == "run") {
      return psld::bench::cmd_run(argc - 3, argv + 3);
    }
    if (argc < 3 || std::string(argv[2]) != "stragglers") {
      std::fputs(kUsage, stderr);
      return fail("psld bench: the subcommands are `run`, `compare`, `merge` and `stragglers`");
    }
    psld::bench::reexec_with_ucx_defaults(argv);
    return psld::bench::run_stragglers(argc - 2, argv + 2);
  }
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  std::fputs(kUsage, stderr);
  return fail("unknown command '" + cmd + "'");
}
