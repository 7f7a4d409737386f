// psld/config.h — the configuration of one psld process, and where it comes from.
//
// Everything a worker, server or coordinator can be told lives in one plain
// struct, `Config`. `load_config` fills it from five sources, each overriding
// the one before:
//
//   1. the defaults below;
//   2. a TOML file: `--config=PATH`, else the PSLD_CONFIG environment variable;
//   3. the environment a launcher sets (torchrun, BytePS/ps-lite's DMLC_*,
//      OpenMPI, MVAPICH, MPICH/Intel MPI, Slurm srun, PMIx, a Kubernetes
//      Indexed Job): rank, world size, local rank, the coordinator's address
//      (and, from DMLC_ROLE, the role);
//   4. PSLD_* environment variables, one per key;
//   5. flags, `--key=value` or `--key value`.
//
// One name per setting, in every source. The key is the member's path in the
// struct: `job.num_workers` is `Config::job.num_workers`, set in the file as
// `num_workers = 4` under `[job]`, by `PSLD_JOB_NUM_WORKERS=4` (PSLD_ + the key
// in capitals, '.' written '_') and by `--job.num_workers=4`. docs/configuration.md
// lists every key with its default and accepted values.
//
// The result is validated once (`validate`); a wrong value is an
// InvalidArgument that names the key, where the value came from (file:line,
// variable, flag) and what is accepted. Unknown keys, unknown PSLD_ variables
// and unknown flags are errors too, with the closest valid name: a typo must
// not silently run a job with a default.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "psld/keys.h"
#include "psld/status.h"

namespace psld {

// What a process does in the job.
enum class Role : uint8_t {
  kAuto,         // decided at start: a launched trainer process is a worker
  kWorker,       // pushes gradients and pulls parameters
  kServer,       // owns key ranges, aggregates and updates
  kCoordinator,  // control plane only: membership, heartbeats, balancer
};

// When a server applies the pushes of round r of a key.
enum class SyncMode : uint8_t {
  kBsp,        // once every worker pushed round r; pulls of round r wait for it
  kAsync,      // on arrival of each push
  kStaleness,  // on arrival, but no worker may run more than staleness_rounds ahead
};

// What a server does with the sum of the pushes.
enum class ServerMode : uint8_t {
  kSum,        // summation service: workers pull the sum and update themselves
  kOptimizer,  // applies the optimizer; workers pull parameters
};

// The server's update rule, with PyTorch torch.optim semantics.
enum class OptimizerKind : uint8_t {
  kSgd,       // SGD; with momentum > 0 it is SGD with momentum, as in PyTorch
  kMomentum,  // SGD with momentum; momentum defaults to 0.9 instead of 0
  kAdam,      // Adam (weight decay added to the gradient)
  kAdamW,     // AdamW (decoupled weight decay); weight_decay defaults to 0.01
};

// The names used in files, variables and flags ("auto", "bsp", "adamw", ...).
std::string_view role_name(Role role);
std::string_view sync_mode_name(SyncMode mode);
std::string_view server_mode_name(ServerMode mode);
std::string_view optimizer_kind_name(OptimizerKind kind);

// [job]: who is in the job and how they find each other.
struct JobConfig {
  Role role = Role::kAuto;
  // This process's rank among the processes of its role (worker rank for
  // workers, server rank for servers); -1: assigned by the coordinator.
  int rank = -1;
  // Rank among the processes of this job on this machine (picks a GPU or NIC);
  // -1: unknown.
  int local_rank = -1;
  int num_workers = 1;  // 1..65536
  int num_servers = 1;  // 1..65536; equal to num_workers when colocate_servers
  // Extra server processes that hold no keys at start; the balancer may scale
  // out to them. 0..65536.
  int num_standby = 0;
  // Every worker process also runs a server: how a plain `mpirun -np N` or
  // `srun -n N` job gets N servers without separate server processes.
  bool colocate_servers = false;
  // "host:port" the coordinator listens on and every other process dials.
  // IPv6 hosts in brackets: "[fe80::1]:29600".
  std::string coordinator = "127.0.0.1:29600";
  // Shared job secret every connection proves at its hello (HMAC-SHA256
  // challenge-response, both ways); empty: none (anyone who reaches the
  // ports can join). Also read from the file PSLD_SECRET_FILE names. Never
  // printed: to_string writes "<set>" or "<unset>".
  std::string secret;
  std::string transport = "ucx";       // "ucx", "verbs" or "loopback"
  std::string listen = "127.0.0.1:0";  // "host:port" this process listens on; port 0: any
  // The network interface to use ("eth0"), "auto" (the one on the route to
  // the coordinator) or "" (none chosen): its address becomes the listen
  // host when `listen` is not set, and UCX's TCP transport uses only it.
  std::string interface;

  bool operator==(const JobConfig&) const = default;
};

// [data]: the data path.
struct DataConfig {
  // Largest chunk a tensor is cut into: the unit of transfer, aggregation and
  // placement. A multiple of 8 (so no fp64/fp32/fp16 element is split) in
  // 8 B .. 1 GiB. A server grants each worker slots_per_worker landing slots of
  // this size: num_workers * slots_per_worker * chunk_bytes of memory.
  uint64_t chunk_bytes = kDefaultChunkBytes;
  uint32_t slots_per_worker = 16;  // landing slots (credits) per worker; 1..4096
  // Pushes of chunks of at most this many bytes that wait for the same
  // server together go out as one batch (one message and one write into one
  // landing slot, or one message for pushes read in place); 0: never. 0 ..
  // 1 GiB. docs/runtime.md, "Batches".
  uint64_t batch_chunk_bytes = 16384;
  // Largest batch: how many bytes one batch's write carries (also at most
  // chunk_bytes, the slot's size); 1 KiB .. 1 GiB.
  uint64_t batch_bytes = 262144;
  SyncMode sync = SyncMode::kBsp;
  // With sync = staleness: how many rounds a worker may run ahead of the
  // slowest; 1..1000000. Ignored by the other modes.
  uint32_t staleness_rounds = 1;
  // A push or pull not complete after this long fails with Timeout; 0: never
  // (heartbeats still detect a dead peer).
  int64_t request_timeout_ms = 60000;
  // Tensors in CUDA device memory (docs/gpu.md): "auto" (direct where the
  // transport can register device memory, else staged through pinned host
  // memory), "direct" (an error where it cannot) or "staged".
  std::string gpu_path = "auto";

  bool operator==(const DataConfig&) const = default;
};

// [server]
struct ServerConfig {
  ServerMode mode = ServerMode::kOptimizer;
  int threads = 1;  // aggregation and update threads per server; 1..1024
  // Where the server keeps its keys and runs reduce and optimizer
  // (docs/gpu.md, "GPU servers"): "cpu", or "cuda" (GPU memory and the CUDA
  // kernels on the process's current device).
  std::string device = "cpu";

  bool operator==(const ServerConfig&) const = default;
};

// [optimizer]: PyTorch's defaults and checks (torch.optim.SGD, Adam, AdamW).
struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kSgd;
  double lr = 1e-3;
  double momentum = 0;  // kind sgd, momentum; load_config makes it 0.9 for momentum
  double dampening = 0;
  bool nesterov = false;    // needs momentum > 0 and dampening == 0
  double beta1 = 0.9;       // adam, adamw
  double beta2 = 0.999;     // adam, adamw
  double eps = 1e-8;        // adam, adamw
  double weight_decay = 0;  // load_config makes it 0.01 for adamw, as PyTorch

  bool operator==(const OptimizerConfig&) const = default;
};

// [liveness]
struct LivenessConfig {
  int64_t heartbeat_interval_ms = 500;
  // A peer silent for this long is declared dead. Must exceed twice the
  // interval, so that one late heartbeat is not a death.
  int64_t heartbeat_timeout_ms = 5000;
  int64_t connect_timeout_ms = 10000;  // joining the job and dialling a peer

  bool operator==(const LivenessConfig&) const = default;
};

// [stats]
struct StatsConfig {
  int64_t interval_ms = 100;  // how often servers and workers report load
  // Servers a worker's report names each window (its per-server answer
  // times); 0: every server while num_workers x servers <= 65,536, else
  // 65,536 / num_workers (at least 4). docs/scale.md.
  int64_t worker_peers = 0;

  bool operator==(const StatsConfig&) const = default;
};

// [balancer]
struct BalancerConfig {
  // Off by default: it moves parameters between servers while the job runs,
  // which a job should ask for. docs/stragglers.md shows what it buys and
  // where it still reacts to noise; `--balancer.enabled` turns it on.
  bool enabled = false;
  int64_t interval_ms = 1000;  // how often it plans; at least stats.interval_ms
  // The options a job may want to tune; docs/balancer.md explains each, and
  // the defaults are lib/balancer/balancer.h's BalancerOptions.
  double straggler_threshold = 0.15;  // predicted time above the others' by this fraction ...
  uint32_t straggler_windows = 1;     // ... for this many windows in a row, ...
  // ... once a sequential test tells it from noise: its mean windows between
  // false alarms, per server.
  double false_alarm_windows = 1e5;
  double horizon_rounds = 100;      // rounds a migration's cost is amortised over
  double max_step_fraction = 0.25;  // of a server's load moved per decision, at most
  uint32_t evaluation_windows = 2;  // windows at a new epoch before judging a move
  double rollback_tolerance = 0.1;  // roll back when the round grew by more than this
  bool scale_out = true;            // may add standby servers
  bool scale_in = true;             // may drain servers
  double scale_out_utilisation = 0.8;
  double scale_in_utilisation = 0.5;
  uint32_t min_active_servers = 1;

  bool operator==(const BalancerConfig&) const = default;
};

// [ucx]: read only by the ucx transport.
struct UcxConfig {
  std::string tls;  // UCX_TLS for psld's UCX context ("tcp", "rc,sm,self"); empty: UCX decides
  // "auto" (true put where the lane is RDMA or shared memory, else
  // active-message rendezvous), "put" or "am".
  std::string write_path = "auto";
  // Slots of the shared-memory notification ring a local peer writes its
  // notifications into; 0 or a power of two from 16 to 65536 (0: none).
  uint32_t notify_ring_slots = 256;

  bool operator==(const UcxConfig&) const = default;
};

// [verbs]: read only by the verbs transport.
struct VerbsConfig {
  std::string device;  // e.g. "mlx5_0"; empty: the first active port
  int port = 1;        // 1..255
  int gid_index = -1;  // -1: a RoCE v2 GID chosen automatically; else 0..255

  bool operator==(const VerbsConfig&) const = default;
};

// [link]: an emulated link around the transport, for straggler experiments.
struct LinkConfig {
  uint64_t egress_bytes_per_second = 0;   // 0: unlimited
  uint64_t ingress_bytes_per_second = 0;  // 0: unlimited
  uint64_t latency_us = 0;                // one way, added to everything sent

  bool operator==(const LinkConfig&) const = default;
};

// [checkpoint]: consistent checkpoints of every server's keys
// (docs/checkpoint.md). Needs data.sync = bsp.
struct CheckpointConfig {
  // Where checkpoints go: DIR/round-R/ holds one file per server and a
  // MANIFEST, written last. Servers and the coordinator must all see it (a
  // shared file system on a cluster). Empty: no checkpoints.
  std::string dir;
  uint32_t every_rounds = 0;  // a checkpoint after every this many rounds; 0: none
  uint32_t keep = 2;          // complete checkpoints kept; older ones are removed
  // Start from the newest complete checkpoint in dir (psld launch --resume
  // DIR): every key's parameter and optimizer state as they were, and every
  // tensor's round where it stopped (Worker::round).
  bool resume = false;

  bool operator==(const CheckpointConfig&) const = default;
};

// [replication]: copies of every key range on other servers, so that a
// server's loss loses nothing (docs/replication.md).
struct ReplicationConfig {
  // Copies of every key range: 1, only the owner (a lost server fails the
  // job); 2, the owner (primary) and one backup on another server, which
  // takes the range over when the primary dies. In async and staleness
  // modes the balancer must be off (replicated ranges move in BSP only).
  uint32_t factor = 1;

  bool operator==(const ReplicationConfig&) const = default;
};

// [metrics]: what the coordinator serves to operators (docs/operations.md).
struct MetricsConfig {
  // "host:port" (port 0: any) where the coordinator serves /metrics
  // (Prometheus text) and /status.json (`psld top`) over HTTP, read-only
  // and unauthenticated: keep it on loopback or a trusted network. Empty:
  // nothing served. Members other than the coordinator ignore it.
  std::string listen;

  bool operator==(const MetricsConfig&) const = default;
};

// [trace]: Chrome traces of a range of rounds (docs/operations.md, "Traces").
struct TraceConfig {
  // Where each process writes psld-<role><rank>-<pid>.json; empty: no trace.
  // Every process writes its own file: a shared directory, or one per host.
  std::string dir;
  // "A:B": rounds A to B (1 <= A <= B), the first round being 1.
  std::string rounds = "1:10";

  bool operator==(const TraceConfig&) const = default;
};

struct Config {
  // Log level: "error", "warn", "info" or "debug" (key `log`, PSLD_LOG).
  std::string log = "warn";
  JobConfig job;
  DataConfig data;
  ServerConfig server;
  OptimizerConfig optimizer;
  LivenessConfig liveness;
  StatsConfig stats;
  BalancerConfig balancer;
  UcxConfig ucx;
  VerbsConfig verbs;
  LinkConfig link;
  CheckpointConfig checkpoint;
  ReplicationConfig replication;
  MetricsConfig metrics;
  TraceConfig trace;

  // Where the values came from; filled by load_config, printed by to_string,
  // ignored by validate's checks and by ==.
  // The launcher whose environment was read: "torchrun", "dmlc", "openmpi",
  // "mvapich", "mpich", "slurm", "pmix", "kubernetes", "psld" (PSLD_JOB_RANK
  // set and no other launcher) or "none" (docs/configuration.md, Launchers).
  std::string launcher = "none";
  // Key -> "default", "file PATH:LINE", "env NAME", "flag --KEY", or a note
  // for a value derived from another key. Keys absent: set in code.
  std::map<std::string, std::string> sources;

  // Equal settings, wherever they came from (launcher and sources ignored).
  friend bool operator==(const Config& a, const Config& b);
};

// Where load_config reads from. Tests inject the environment.
struct ConfigSources {
  // The command line after the program and subcommand: `--key=value`,
  // `--key value`, `--config=PATH`. A boolean key alone (`--balancer.enabled`)
  // means true. Anything else is an error.
  std::vector<std::string> args;
  // args came from a command line, which `ps` shows every user: a
  // --job.secret among them is refused. false for settings a program makes
  // itself (the Python package's keyword arguments).
  bool args_on_command_line = true;
  std::function<const char*(const char*)> getenv = ::getenv;
  // Names of the variables in the environment, to find unknown PSLD_ ones.
  // Empty: the process environment. A test that injects getenv should inject
  // this too; a listed name that getenv does not return is ignored.
  std::function<std::vector<std::string>()> env_names;
};

// defaults -> file -> launcher environment -> PSLD_ environment -> flags, then
// validate(). InvalidArgument for any wrong or unknown key (every problem
// found, one per line); NotFound when the config file cannot be read.
Result<Config> load_config(const ConfigSources& sources);

// Every rule on every key and between keys. The message names the key, the
// value, where it came from (when config.sources knows) and what is accepted,
// e.g. "data.sync: 'bps' from flag --data.sync is not one of bsp, async, staleness".
Status validate(const Config& config);

// What `psld config` prints: a TOML document with one `key = value` line per
// key, `# source` after it when with_sources. Loading it as a file gives an
// equal Config. The secret is never printed: its line is a comment saying
// "<set>" or "<unset>".
std::string to_string(const Config& config, bool with_sources = true);

// One key, for help text and documentation.
struct ConfigKeyInfo {
  std::string key;            // "job.num_workers": TOML key and flag --job.num_workers
  std::string env;            // "PSLD_JOB_NUM_WORKERS"
  std::string default_value;  // as to_string prints it
  std::string accepted;       // "an integer in 1..65536"
  std::string meaning;
};
// Every key, in the order to_string prints them.
std::vector<ConfigKeyInfo> config_keys();

}  // namespace psld
