#include "psld/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "lib/balancer/balancer.h"
#include "lib/config/runtime_options.h"
#include "tests/temp_dir.h"

namespace psld {
namespace {

using psld::testing::TempDir;

using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// An environment the test controls: load_config sees only these variables.
class FakeEnv {
 public:
  FakeEnv(std::initializer_list<std::pair<const std::string, std::string>> vars = {})
      : vars_(vars) {}
  void set(const std::string& name, const std::string& value) { vars_[name] = value; }

  ConfigSources sources(std::vector<std::string> args = {}) const {
    ConfigSources s;
    s.args = std::move(args);
    s.getenv = [this](const char* name) -> const char* {
      auto it = vars_.find(name);
      return it == vars_.end() ? nullptr : it->second.c_str();
    };
    s.env_names = [this] {
      std::vector<std::string> names;
      for (const auto& [name, value] : vars_)
        names.push_back(name);
      return names;
    };
    return s;
  }

 private:
  std::map<std::string, std::string> vars_;
};

Result<Config> load(const FakeEnv& env, std::vector<std::string> args = {}) {
  return load_config(env.sources(std::move(args)));
}

// Settings a program makes itself, not a command line (the Python package).
Result<Config> load_in_code(const FakeEnv& env, std::vector<std::string> args) {
  ConfigSources s = env.sources(std::move(args));
  s.args_on_command_line = false;
  return load_config(s);
}

std::string error_of(const Result<Config>& r) {
  EXPECT_FALSE(r.ok()) << "expected an error";
  return r.ok() ? "" : r.status().message();
}

// ---- defaults --------------------------------------------------------------

TEST(Config, DefaultsAreValidAndDocumented) {
  Config c;
  EXPECT_TRUE(validate(c).ok()) << validate(c).to_string();
  EXPECT_EQ(c.job.role, Role::kAuto);
  EXPECT_EQ(c.job.rank, -1);
  EXPECT_EQ(c.data.chunk_bytes, uint64_t{4} << 20);
  EXPECT_EQ(c.data.slots_per_worker, 16u);
  EXPECT_EQ(c.data.sync, SyncMode::kBsp);
  EXPECT_EQ(c.liveness.heartbeat_interval_ms, 500);
  EXPECT_EQ(c.liveness.heartbeat_timeout_ms, 5000);
  EXPECT_EQ(c.liveness.connect_timeout_ms, 10000);
  EXPECT_EQ(c.stats.interval_ms, 100);
  EXPECT_FALSE(c.balancer.enabled);
  EXPECT_EQ(c.job.listen, "127.0.0.1:0");
  // PyTorch's defaults.
  EXPECT_EQ(c.optimizer.lr, 1e-3);
  EXPECT_EQ(c.optimizer.momentum, 0.0);
  EXPECT_EQ(c.optimizer.beta1, 0.9);
  EXPECT_EQ(c.optimizer.beta2, 0.999);
  EXPECT_EQ(c.optimizer.eps, 1e-8);
  EXPECT_EQ(c.optimizer.weight_decay, 0.0);
}

TEST(Config, LoadingNothingGivesTheDefaults) {
  auto r = load(FakeEnv{});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, Config{});
  EXPECT_EQ(r->launcher, "none");
  ASSERT_EQ(r->sources.size(), config_keys().size());
  for (const auto& [key, source] : r->sources)
    EXPECT_EQ(source, "default") << key;
}

TEST(Config, EnumNames) {
  EXPECT_EQ(role_name(Role::kCoordinator), "coordinator");
  EXPECT_EQ(sync_mode_name(SyncMode::kStaleness), "staleness");
  EXPECT_EQ(server_mode_name(ServerMode::kSum), "sum");
  EXPECT_EQ(optimizer_kind_name(OptimizerKind::kAdamW), "adamw");
}

// ---- naming: one table drives every source ---------------------------------

TEST(Config, KeysEnvNamesAndFlagsFollowOneRule) {
  std::set<std::string> keys;
  std::set<std::string> envs;
  for (const ConfigKeyInfo& k : config_keys()) {
    EXPECT_TRUE(keys.insert(k.key).second) << k.key;
    EXPECT_TRUE(envs.insert(k.env).second) << k.env;
    std::string expected = "PSLD_";
    for (char ch : k.key)
      expected += ch == '.' ? '_' : static_cast<char>(std::toupper(ch));
    EXPECT_EQ(k.env, expected);
    EXPECT_FALSE(k.default_value.empty()) << k.key;
    EXPECT_FALSE(k.accepted.empty()) << k.key;
    EXPECT_FALSE(k.meaning.empty()) << k.key;
  }
  EXPECT_TRUE(keys.count("job.num_workers"));
  EXPECT_TRUE(keys.count("optimizer.lr"));
  EXPECT_TRUE(envs.count("PSLD_LOG"));  // the variable base/log.cc reads
  EXPECT_GE(keys.size(), 40u);
}

TEST(Config, EveryKeyCanBeSetFromEachSource) {
  // Each key set to a non-default value by env, by flag and by file gives the
  // same config, and every source is recorded.
  std::map<std::string, std::string> values = {
      {"log", "debug"},
      {"job.role", "server"},
      {"job.rank", "1"},
      {"job.local_rank", "3"},
      {"job.num_workers", "5"},
      {"job.num_servers", "3"},
      {"job.num_standby", "2"},
      {"job.colocate_servers", "false"},
      {"job.coordinator", "10.0.0.1:4000"},
      {"job.secret", "s3cret"},
      {"job.transport", "loopback"},
      {"job.listen", "0.0.0.0:5000"},
      {"job.interface", "eth0"},
      {"data.chunk_bytes", "1048576"},
      {"data.slots_per_worker", "32"},
      {"data.batch_chunk_bytes", "8192"},
      {"data.batch_bytes", "131072"},
      {"data.sync", "staleness"},
      {"data.staleness_rounds", "3"},
      {"data.request_timeout_ms", "0"},
      {"data.gpu_path", "staged"},
      {"server.mode", "sum"},
      {"server.threads", "4"},
      {"server.device", "cuda"},
      {"optimizer.kind", "adam"},
      {"optimizer.lr", "0.25"},
      {"optimizer.momentum", "0.5"},
      {"optimizer.dampening", "0.125"},
      {"optimizer.nesterov", "false"},
      {"optimizer.beta1", "0.8"},
      {"optimizer.beta2", "0.99"},
      {"optimizer.eps", "1e-6"},
      {"optimizer.weight_decay", "0.0001"},
      {"liveness.heartbeat_interval_ms", "200"},
      {"liveness.heartbeat_timeout_ms", "1000"},
      {"liveness.connect_timeout_ms", "3000"},
      {"stats.interval_ms", "50"},
      {"stats.worker_peers", "16"},
      {"balancer.enabled", "false"},
      {"balancer.interval_ms", "500"},
      {"balancer.straggler_threshold", "0.25"},
      {"balancer.straggler_windows", "4"},
      {"balancer.false_alarm_windows", "500"},
      {"balancer.horizon_rounds", "200"},
      {"balancer.max_step_fraction", "0.5"},
      {"balancer.evaluation_windows", "3"},
      {"balancer.rollback_tolerance", "0.125"},
      {"balancer.scale_out", "false"},
      {"balancer.scale_in", "false"},
      {"balancer.scale_out_utilisation", "0.75"},
      {"balancer.scale_in_utilisation", "0.25"},
      {"balancer.min_active_servers", "2"},
      {"ucx.tls", "tcp,self"},
      {"ucx.write_path", "am"},
      {"ucx.notify_ring_slots", "1024"},
      {"verbs.device", "mlx5_1"},
      {"verbs.port", "2"},
      {"verbs.gid_index", "3"},
      {"link.egress_bytes_per_second", "125000000"},
      {"link.ingress_bytes_per_second", "250000000"},
      {"link.latency_us", "100"},
      {"checkpoint.dir", "/var/lib/psld/ckpt"},
      // 0 and false: data.sync is staleness above, and checkpoints need bsp
      // (EveryValidationRuleNamesItsKey has their rules).
      {"checkpoint.every_rounds", "0"},
      {"checkpoint.keep", "5"},
      {"checkpoint.resume", "false"},
      // 1: data.sync is staleness above, and replication needs bsp.
      {"replication.factor", "1"},
      {"metrics.listen", "[::1]:9464"},
      {"trace.dir", "/tmp/psld-trace"},
      {"trace.rounds", "5:8"},
  };
  ASSERT_EQ(values.size(), config_keys().size()) << "a key was added: give it a test value";

  FakeEnv env;
  std::vector<std::string> flags;
  std::map<std::string, std::string> tables;  // section -> TOML lines
  for (const ConfigKeyInfo& k : config_keys()) {
    ASSERT_TRUE(values.count(k.key)) << k.key;
    const std::string& v = values[k.key];
    env.set(k.env, v);
    flags.push_back("--" + k.key + "=" + v);
    bool is_text = k.accepted.find("one of") != std::string::npos ||
                   k.accepted.find("string") != std::string::npos ||
                   k.accepted.find("host:port") != std::string::npos ||
                   k.accepted.find("name") != std::string::npos ||
                   k.accepted.find("list") != std::string::npos;
    size_t dot = k.key.find('.');
    std::string section = dot == std::string::npos ? "" : k.key.substr(0, dot);
    std::string leaf = dot == std::string::npos ? k.key : k.key.substr(dot + 1);
    tables[section] += leaf + " = " + (is_text ? "\"" + v + "\"" : v) + "\n";
  }
  std::string toml = tables[""];
  for (const auto& [section, lines] : tables) {
    if (!section.empty()) toml += "[" + section + "]\n" + lines;
  }
  TempDir dir("psld-config");
  std::string path = dir.write("all.toml", toml);
  FakeEnv file_env{{"PSLD_CONFIG", path}};

  auto from_env = load(env);
  auto from_flags = load_in_code(FakeEnv{}, flags);  // job.secret is no command line's
  auto from_file = load(file_env);
  ASSERT_TRUE(from_env.ok()) << from_env.status().to_string();
  ASSERT_TRUE(from_flags.ok()) << from_flags.status().to_string();
  ASSERT_TRUE(from_file.ok()) << from_file.status().to_string() << "\n" << toml;
  EXPECT_EQ(*from_env, *from_flags);
  EXPECT_EQ(*from_env, *from_file);
  EXPECT_NE(*from_env, Config{});
  for (const ConfigKeyInfo& k : config_keys()) {
    EXPECT_EQ(from_env->sources.at(k.key), "env " + k.env);
    EXPECT_EQ(from_flags->sources.at(k.key), "flag --" + k.key);
    EXPECT_THAT(from_file->sources.at(k.key), StartsWith("file " + path + ":"));
  }
  // Spot checks that the values landed in the right members.
  EXPECT_EQ(from_env->job.role, Role::kServer);
  EXPECT_EQ(from_env->job.secret, "s3cret");
  EXPECT_EQ(from_env->data.sync, SyncMode::kStaleness);
  EXPECT_EQ(from_env->optimizer.eps, 1e-6);
  EXPECT_EQ(from_env->link.latency_us, 100u);
  EXPECT_EQ(from_env->log, "debug");
}

// ---- precedence --------------------------------------------------------------

TEST(Config, FileThenEnvThenFlags) {
  TempDir dir("psld-config");
  std::string path = dir.write("job.toml",
                               "# a job\n"
                               "[job]\n"
                               "num_workers = 4\n"
                               "num_servers = 2\n"
                               "transport = \"loopback\"\n"
                               "\n"
                               "[optimizer]\n"
                               "kind = \"adam\"\n"
                               "lr = 0.1\n"
                               "beta1 = 0.8\n"
                               "[data]\n"
                               "chunk_bytes = 65536\n");
  FakeEnv env{{"PSLD_CONFIG", path},
              {"PSLD_JOB_NUM_SERVERS", "3"},
              {"PSLD_OPTIMIZER_LR", "0.01"},
              {"PSLD_DATA_CHUNK_BYTES", "1024"}};
  auto r = load(env, {"--optimizer.lr=0.5", "--data.chunk_bytes", "2048"});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const Config& c = *r;
  EXPECT_EQ(c.job.num_workers, 4);  // file
  EXPECT_EQ(c.sources.at("job.num_workers"), "file " + path + ":3");
  EXPECT_EQ(c.job.transport, "loopback");
  EXPECT_EQ(c.job.num_servers, 3);  // env over file
  EXPECT_EQ(c.sources.at("job.num_servers"), "env PSLD_JOB_NUM_SERVERS");
  EXPECT_EQ(c.optimizer.kind, OptimizerKind::kAdam);
  EXPECT_EQ(c.optimizer.beta1, 0.8);
  EXPECT_EQ(c.sources.at("optimizer.beta1"), "file " + path + ":10");
  EXPECT_EQ(c.optimizer.lr, 0.5);  // flag over env over file
  EXPECT_EQ(c.sources.at("optimizer.lr"), "flag --optimizer.lr");
  EXPECT_EQ(c.data.chunk_bytes, 2048u);  // flag, `--key value` form
  EXPECT_EQ(c.sources.at("data.chunk_bytes"), "flag --data.chunk_bytes");
  EXPECT_EQ(c.optimizer.beta2, 0.999);  // default
  EXPECT_EQ(c.sources.at("optimizer.beta2"), "default");
}

TEST(Config, ConfigFlagWinsOverPsldConfig) {
  TempDir dir("psld-config");
  std::string a = dir.write("a.toml", "[job]\nnum_workers = 2\n");
  std::string b = dir.write("b.toml", "[job]\nnum_workers = 7\n");
  FakeEnv env{{"PSLD_CONFIG", a}};
  auto from_env = load(env);
  ASSERT_TRUE(from_env.ok()) << from_env.status().to_string();
  EXPECT_EQ(from_env->job.num_workers, 2);
  auto from_flag = load(env, {"--config", b});
  ASSERT_TRUE(from_flag.ok()) << from_flag.status().to_string();
  EXPECT_EQ(from_flag->job.num_workers, 7);
  auto from_eq_flag = load(env, {"--config=" + b});
  ASSERT_TRUE(from_eq_flag.ok());
  EXPECT_EQ(from_eq_flag->job.num_workers, 7);
}

TEST(Config, TopLevelKeysAndDottedKeysInTheFile) {
  TempDir dir("psld-config");
  FakeEnv env{{"PSLD_CONFIG", dir.write("c.toml",
                                        "log = \"info\"\n"
                                        "job.num_workers = 3\n"
                                        "[optimizer]\n"
                                        "lr = 1  # an integer is a fine number\n")}};
  auto r = load(env);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->log, "info");
  EXPECT_EQ(r->job.num_workers, 3);
  EXPECT_EQ(r->optimizer.lr, 1.0);
}

TEST(Config, BooleanFlags) {
  auto alone = load(FakeEnv{}, {"--job.colocate_servers", "--balancer.enabled", "false"});
  ASSERT_TRUE(alone.ok()) << alone.status().to_string();
  EXPECT_TRUE(alone->job.colocate_servers);
  EXPECT_FALSE(alone->balancer.enabled);
  auto eq = load(FakeEnv{}, {"--balancer.enabled=0", "--optimizer.nesterov=false"});
  ASSERT_TRUE(eq.ok()) << eq.status().to_string();
  EXPECT_FALSE(eq->balancer.enabled);
  auto env = load(FakeEnv{{"PSLD_BALANCER_ENABLED", "0"}});
  ASSERT_TRUE(env.ok());
  EXPECT_FALSE(env->balancer.enabled);
  EXPECT_THAT(error_of(load(FakeEnv{{"PSLD_BALANCER_ENABLED", "yes"}})),
              HasSubstr("balancer.enabled: 'yes' from env PSLD_BALANCER_ENABLED is not true or "
                        "false"));
}

TEST(Config, LastFlagWins) {
  auto r = load(FakeEnv{}, {"--job.num_workers=2", "--job.num_workers=6"});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->job.num_workers, 6);
}

// ---- derived defaults --------------------------------------------------------

TEST(Config, DefaultsThatDependOnAnotherKey) {
  auto momentum = load(FakeEnv{{"PSLD_OPTIMIZER_KIND", "momentum"}});
  ASSERT_TRUE(momentum.ok());
  EXPECT_EQ(momentum->optimizer.momentum, 0.9);
  EXPECT_THAT(momentum->sources.at("optimizer.momentum"), HasSubstr("optimizer.kind = momentum"));

  auto adamw = load(FakeEnv{}, {"--optimizer.kind=adamw"});
  ASSERT_TRUE(adamw.ok());
  EXPECT_EQ(adamw->optimizer.weight_decay, 0.01);  // torch.optim.AdamW

  // An explicit value, even the plain default, is kept.
  auto explicit_zero = load(FakeEnv{}, {"--optimizer.kind=adamw", "--optimizer.weight_decay=0"});
  ASSERT_TRUE(explicit_zero.ok());
  EXPECT_EQ(explicit_zero->optimizer.weight_decay, 0.0);

  auto colocated = load(FakeEnv{{"PSLD_JOB_NUM_WORKERS", "6"}}, {"--job.colocate_servers"});
  ASSERT_TRUE(colocated.ok()) << colocated.status().to_string();
  EXPECT_EQ(colocated->job.num_servers, 6);
  EXPECT_THAT(colocated->sources.at("job.num_servers"), HasSubstr("colocate_servers"));
}

// ---- launchers -----------------------------------------------------------------

TEST(Config, OpenMpi) {
  FakeEnv env{{"OMPI_COMM_WORLD_RANK", "3"},
              {"OMPI_COMM_WORLD_SIZE", "8"},
              {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}};
  auto r = load(env, {"--job.colocate_servers"});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->launcher, "openmpi");
  EXPECT_EQ(r->job.rank, 3);
  EXPECT_EQ(r->job.num_workers, 8);
  EXPECT_EQ(r->job.num_servers, 8);  // colocated: one server per process
  EXPECT_EQ(r->job.local_rank, 1);
  EXPECT_EQ(r->sources.at("job.rank"), "env OMPI_COMM_WORLD_RANK");
  EXPECT_EQ(r->sources.at("job.num_workers"), "env OMPI_COMM_WORLD_SIZE");
  EXPECT_EQ(r->job.coordinator, Config{}.job.coordinator);  // mpirun gives no address
}

TEST(Config, SlurmStep) {
  FakeEnv env{{"SLURM_PROCID", "5"},         {"SLURM_NTASKS", "16"},
              {"SLURM_STEP_NUM_TASKS", "8"}, {"SLURM_LOCALID", "2"},
              {"SLURM_STEP_ID", "0"},        {"SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"}};
  auto r = load(env);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->launcher, "slurm");
  EXPECT_EQ(r->job.rank, 5);
  EXPECT_EQ(r->job.num_workers, 8);  // the step's tasks, not the allocation's
  EXPECT_EQ(r->job.local_rank, 2);
  EXPECT_EQ(r->job.coordinator, "10.1.2.3:29600");  // port kept from the default
  EXPECT_EQ(r->sources.at("job.coordinator"), "env SLURM_LAUNCH_NODE_IPADDR");

  FakeEnv no_step_size{{"SLURM_PROCID", "1"},
                       {"SLURM_NTASKS", "4"},
                       {"SLURM_STEP_ID", "2"},
                       {"SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"}};
  TempDir dir("psld-config");
  no_step_size.set("PSLD_CONFIG", dir.write("c.toml", "[job]\ncoordinator = \"head:7000\"\n"));
  auto s = load(no_step_size);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->job.num_workers, 4);
  EXPECT_EQ(s->job.coordinator, "10.1.2.3:7000");  // host from Slurm, port from the file
}

TEST(Config, SbatchShellIsNotALaunchedStep) {
  // An sbatch script's own shell has SLURM_PROCID=0 and SLURM_NTASKS=N but
  // launched nothing: taking N as the world size would wait for N-1 ghosts.
  FakeEnv env{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "0"}};
  auto r = load(env);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->launcher, "none");
  EXPECT_EQ(r->job.num_workers, 1);
  EXPECT_EQ(r->job.rank, -1);
}

TEST(Config, Torchrun) {
  FakeEnv env{{"RANK", "2"},
              {"WORLD_SIZE", "4"},
              {"LOCAL_RANK", "0"},
              {"MASTER_ADDR", "node7"},
              {"MASTER_PORT", "29501"}};
  auto r = load(env);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->launcher, "torchrun");
  EXPECT_EQ(r->job.rank, 2);
  EXPECT_EQ(r->job.num_workers, 4);
  EXPECT_EQ(r->job.local_rank, 0);
  EXPECT_EQ(r->job.coordinator, "node7:29501");
  EXPECT_EQ(r->sources.at("job.coordinator"), "env MASTER_ADDR, MASTER_PORT");
}

TEST(Config, TorchrunIpv6MasterAddrGetsBrackets) {
  FakeEnv env{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", "fd00::7"}, {"MASTER_PORT", "9"}};
  auto r = load(env);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->job.coordinator, "[fd00::7]:9");
}

TEST(Config, InnermostLauncherWins) {
  // torchrun started by srun: RANK is the process's rank, SLURM_PROCID the node's.
  FakeEnv env{{"SLURM_PROCID", "1"},
              {"SLURM_NTASKS", "2"},
              {"SLURM_STEP_ID", "0"},
              {"RANK", "5"},
              {"WORLD_SIZE", "16"}};
  auto r = load(env);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->launcher, "torchrun");
  EXPECT_EQ(r->job.rank, 5);
  EXPECT_EQ(r->job.num_workers, 16);
}

TEST(Config, PsldVariablesWinOverTheLauncher) {
  FakeEnv env{{"OMPI_COMM_WORLD_RANK", "3"},
              {"OMPI_COMM_WORLD_SIZE", "8"},
              {"PSLD_JOB_RANK", "0"},
              {"PSLD_JOB_NUM_WORKERS", "2"}};
  auto r = load(env);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->launcher, "openmpi");
  EXPECT_EQ(r->job.rank, 0);
  EXPECT_EQ(r->sources.at("job.rank"), "env PSLD_JOB_RANK");
  EXPECT_EQ(r->job.num_workers, 2);
  // A flag wins over both.
  auto f = load(env, {"--job.rank=1"});
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->job.rank, 1);
}

TEST(Config, LauncherWinsOverTheFile) {
  TempDir dir("psld-config");
  FakeEnv env{{"PSLD_CONFIG", dir.write("c.toml", "[job]\nnum_workers = 2\nrank = 1\n")},
              {"OMPI_COMM_WORLD_RANK", "6"},
              {"OMPI_COMM_WORLD_SIZE", "8"}};
  auto r = load(env);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->job.num_workers, 8);
  EXPECT_EQ(r->job.rank, 6);
}

// BytePS: 2 worker machines of 4 GPU processes each, 3 servers; this is
// machine 1's process 2.
TEST(Config, BytepsWorker) {
  FakeEnv env{{"DMLC_ROLE", "worker"},          {"DMLC_NUM_WORKER", "2"},
              {"DMLC_NUM_SERVER", "3"},         {"DMLC_WORKER_ID", "1"},
              {"DMLC_PS_ROOT_URI", "10.0.0.9"}, {"DMLC_PS_ROOT_PORT", "9000"},
              {"BYTEPS_LOCAL_RANK", "2"},       {"BYTEPS_LOCAL_SIZE", "4"}};
  auto r = load(env);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->launcher, "dmlc");
  EXPECT_EQ(r->job.role, Role::kWorker);
  EXPECT_EQ(r->sources.at("job.role"), "env DMLC_ROLE");
  EXPECT_EQ(r->job.rank, 6);  // 1 x 4 + 2
  EXPECT_EQ(r->job.local_rank, 2);
  EXPECT_EQ(r->job.num_workers, 8);
  EXPECT_EQ(r->sources.at("job.num_workers"), "env DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE");
  EXPECT_EQ(r->job.num_servers, 3);
  EXPECT_EQ(r->job.coordinator, "10.0.0.9:9000");
  EXPECT_EQ(r->sources.at("job.coordinator"), "env DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT");
}

// ps-lite: one process per worker, the scheduler is psld's coordinator, and
// every role gets both counts.
TEST(Config, PsLiteRoles) {
  FakeEnv worker{{"DMLC_ROLE", "WORKER"},         {"DMLC_NUM_WORKER", "4"},
                 {"DMLC_NUM_SERVER", "2"},        {"DMLC_WORKER_ID", "3"},
                 {"DMLC_PS_ROOT_URI", "fd00::1"}, {"DMLC_PS_ROOT_PORT", "8000"}};
  auto w = load(worker);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  EXPECT_EQ(w->job.rank, 3);
  EXPECT_EQ(w->sources.at("job.rank"), "env DMLC_WORKER_ID");
  EXPECT_EQ(w->job.num_workers, 4);
  EXPECT_EQ(w->job.coordinator, "[fd00::1]:8000");

  FakeEnv scheduler = worker;
  scheduler.set("DMLC_ROLE", "scheduler");
  auto c = load(scheduler);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->job.role, Role::kCoordinator);
  EXPECT_EQ(c->job.rank, -1);  // a coordinator has no rank
  EXPECT_EQ(c->job.num_workers, 4);
  EXPECT_EQ(c->job.num_servers, 2);
  EXPECT_EQ(c->job.coordinator, "[fd00::1]:8000");

  FakeEnv server = worker;
  server.set("DMLC_ROLE", "server");
  auto s = load(server);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->job.role, Role::kServer);
  EXPECT_EQ(s->job.rank, -1);  // assigned by the coordinator, as ps-lite's scheduler does
  EXPECT_EQ(s->job.num_servers, 2);

  // `psld server` (--job.role=server) in a worker's environment stays a
  // server: the role from a flag or PSLD_JOB_ROLE outranks DMLC_ROLE.
  auto f = load(worker, {"--job.role=server"});
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->job.role, Role::kServer);
  EXPECT_EQ(f->job.rank, -1);
  EXPECT_EQ(f->sources.at("job.role"), "flag --job.role");
}

TEST(Config, DmlcValuesThatCannotBeReadAreRefusedByName) {
  const std::vector<std::pair<FakeEnv, std::string>> cases = {
      {FakeEnv{{"DMLC_ROLE", "joint"}},
       "env DMLC_ROLE: 'joint' is not worker, server or scheduler"},
      {FakeEnv{{"DMLC_ROLE", "worker"}, {"DMLC_NUM_WORKER", "two"}},
       "env DMLC_NUM_WORKER: 'two' is not a number"},
      {FakeEnv{{"DMLC_ROLE", "worker"}, {"BYTEPS_LOCAL_SIZE", "0"}},
       "env BYTEPS_LOCAL_SIZE: '0' is not a count of 1 or more"},
      {FakeEnv{{"DMLC_ROLE", "worker"}, {"BYTEPS_LOCAL_RANK", "1"}},
       "BYTEPS_LOCAL_RANK is set without BYTEPS_LOCAL_SIZE"},
      {FakeEnv{{"DMLC_ROLE", "worker"},
               {"DMLC_WORKER_ID", "0"},
               {"BYTEPS_LOCAL_RANK", "4"},
               {"BYTEPS_LOCAL_SIZE", "4"}},
       "env BYTEPS_LOCAL_RANK: '4' is not below BYTEPS_LOCAL_SIZE (4)"},
      {FakeEnv{{"DMLC_ROLE", "worker"}, {"DMLC_NUM_WORKER", "70000"}}, "job.num_workers"},
  };
  for (const auto& [env, want] : cases) {
    auto r = load(env);
    ASSERT_FALSE(r.ok()) << want;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << want;
    EXPECT_THAT(r.status().message(), HasSubstr(want));
  }
}

TEST(Config, MpichMvapichPmixAndKubernetes) {
  struct Case {
    FakeEnv env;
    std::string launcher;
    int rank, num_workers, local_rank;
  };
  const int unset = Config{}.job.num_workers;
  const std::vector<Case> cases = {
      // MPICH's and Intel MPI's Hydra.
      {FakeEnv{{"PMI_RANK", "5"}, {"PMI_SIZE", "6"}, {"MPI_LOCALRANKID", "1"}}, "mpich", 5, 6, 1},
      {FakeEnv{{"MV2_COMM_WORLD_RANK", "2"},
               {"MV2_COMM_WORLD_SIZE", "4"},
               {"MV2_COMM_WORLD_LOCAL_RANK", "0"},
               {"PMI_RANK", "2"},
               {"PMI_SIZE", "4"}},
       "mvapich", 2, 4, 0},
      // PMIx gives no size in the environment: the count stays the config's.
      {FakeEnv{{"PMIX_RANK", "3"}}, "pmix", 3, unset, -1},
      // OpenMPI 5 sets PMIX_RANK too, and srun --mpi=pmix does: they win.
      {FakeEnv{{"PMIX_RANK", "3"}, {"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "9"}},
       "openmpi", 3, 9, -1},
      {FakeEnv{{"PMIX_RANK", "1"},
               {"SLURM_PROCID", "1"},
               {"SLURM_NTASKS", "7"},
               {"SLURM_STEP_ID", "0"}},
       "slurm", 1, 7, -1},
      // A Kubernetes Indexed Job's pod.
      {FakeEnv{{"JOB_COMPLETION_INDEX", "4"}}, "kubernetes", 4, unset, -1},
  };
  for (const Case& c : cases) {
    auto r = load(c.env, {"--job.num_workers=" + std::to_string(std::max(unset, 10))});
    ASSERT_TRUE(r.ok()) << c.launcher << ": " << r.status().to_string();
    EXPECT_EQ(r->launcher, c.launcher);
    EXPECT_EQ(r->job.rank, c.rank) << c.launcher;
    EXPECT_EQ(r->job.local_rank, c.local_rank) << c.launcher;
    // The flag outranks a launcher's size; without it, the launcher's counts.
    auto bare = load(c.env);
    if (c.num_workers != unset) {
      ASSERT_TRUE(bare.ok()) << c.launcher << ": " << bare.status().to_string();
      EXPECT_EQ(bare->job.num_workers, c.num_workers) << c.launcher;
    }
  }
  // As a server, the size is the server count.
  auto s = load(FakeEnv{{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}}, {"--job.role=server"});
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->job.num_servers, 2);
  EXPECT_EQ(s->sources.at("job.num_servers"), "env PMI_SIZE");
}

TEST(Config, PsldLaunch) {
  FakeEnv env{{"PSLD_JOB_RANK", "1"}, {"PSLD_JOB_NUM_WORKERS", "2"}, {"PSLD_JOB_ROLE", "worker"}};
  auto r = load(env);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->launcher, "psld");
  EXPECT_EQ(r->job.rank, 1);
}

TEST(Config, ServerStepMapsWorldSizeToServers) {
  // `srun -n 2 psld server`: two servers, not two workers.
  FakeEnv env{{"SLURM_PROCID", "1"},
              {"SLURM_NTASKS", "2"},
              {"SLURM_STEP_ID", "1"},
              {"PSLD_JOB_NUM_WORKERS", "8"}};
  auto r = load(env, {"--job.role=server"});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->job.num_servers, 2);
  EXPECT_EQ(r->job.num_workers, 8);
  EXPECT_EQ(r->job.rank, 1);
}

TEST(Config, BadLauncherValuesNameTheVariable) {
  FakeEnv env{{"OMPI_COMM_WORLD_RANK", "x"}, {"OMPI_COMM_WORLD_SIZE", "8"}};
  EXPECT_THAT(error_of(load(env)),
              HasSubstr("job.rank: 'x' from env OMPI_COMM_WORLD_RANK is not an integer"));
  FakeEnv past_end{{"RANK", "4"}, {"WORLD_SIZE", "4"}};
  std::string msg = error_of(load(past_end));
  EXPECT_THAT(msg, HasSubstr("job.rank: 4 from env RANK must be -1 or below job.num_workers "
                             "(4 from env WORLD_SIZE)"));
}

// ---- validation ------------------------------------------------------------------

struct Rule {
  const char* name;
  std::function<void(Config&)> change;
  const char* key;       // the message starts "key: "
  const char* accepted;  // and says what is accepted
};

TEST(Config, EveryValidationRuleNamesItsKey) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<Rule> rules = {
      {"log", [](Config& c) { c.log = "verbose"; }, "log",
       "'verbose' is not a level (error, warn, info, debug)"},
      {"log component", [](Config& c) { c.log = "warn,ucx=loud"; }, "log", "'loud' is not a level"},
      {"role", [](Config& c) { c.job.role = static_cast<Role>(9); }, "job.role",
       "one of auto, worker, server, coordinator"},
      {"rank<-1", [](Config& c) { c.job.rank = -2; }, "job.rank", "an integer in -1..65535"},
      {"local_rank", [](Config& c) { c.job.local_rank = -5; }, "job.local_rank", "-1..65535"},
      {"workers=0", [](Config& c) { c.job.num_workers = 0; }, "job.num_workers", "1..65536"},
      {"servers=0", [](Config& c) { c.job.num_servers = 0; }, "job.num_servers", "1..65536"},
      {"standby<0", [](Config& c) { c.job.num_standby = -1; }, "job.num_standby", "0..65536"},
      {"coordinator no port", [](Config& c) { c.job.coordinator = "head"; }, "job.coordinator",
       "host:port"},
      {"coordinator port 0", [](Config& c) { c.job.coordinator = "head:0"; }, "job.coordinator",
       "1..65535"},
      {"coordinator port big", [](Config& c) { c.job.coordinator = "head:70000"; },
       "job.coordinator", "1..65535"},
      {"coordinator no host", [](Config& c) { c.job.coordinator = ":80"; }, "job.coordinator",
       "no host"},
      {"coordinator bare v6", [](Config& c) { c.job.coordinator = "fd00::1:80"; },
       "job.coordinator", "brackets"},
      {"transport", [](Config& c) { c.job.transport = "tcp"; }, "job.transport",
       "one of ucx, verbs, loopback"},
      {"listen", [](Config& c) { c.job.listen = "127.0.0.1"; }, "job.listen", "0..65535"},
      {"chunk 0", [](Config& c) { c.data.chunk_bytes = 0; }, "data.chunk_bytes",
       "a multiple of 8 in 8..1073741824"},
      {"chunk odd", [](Config& c) { c.data.chunk_bytes = 12; }, "data.chunk_bytes",
       "a multiple of 8"},
      {"chunk huge", [](Config& c) { c.data.chunk_bytes = (uint64_t{1} << 30) + 8; },
       "data.chunk_bytes", "8..1073741824"},
      {"slots 0", [](Config& c) { c.data.slots_per_worker = 0; }, "data.slots_per_worker",
       "1..4096"},
      {"slots big", [](Config& c) { c.data.slots_per_worker = 4097; }, "data.slots_per_worker",
       "1..4096"},
      {"sync", [](Config& c) { c.data.sync = static_cast<SyncMode>(7); }, "data.sync",
       "one of bsp, async, staleness"},
      {"staleness 0", [](Config& c) { c.data.staleness_rounds = 0; }, "data.staleness_rounds",
       "1..1000000"},
      {"timeout<0", [](Config& c) { c.data.request_timeout_ms = -1; }, "data.request_timeout_ms",
       "0..86400000"},
      {"mode", [](Config& c) { c.server.mode = static_cast<ServerMode>(5); }, "server.mode",
       "one of sum, optimizer"},
      {"threads", [](Config& c) { c.server.threads = 0; }, "server.threads", "1..1024"},
      {"kind", [](Config& c) { c.optimizer.kind = static_cast<OptimizerKind>(4); },
       "optimizer.kind", "one of sgd, momentum, adam, adamw"},
      {"lr<0", [](Config& c) { c.optimizer.lr = -0.1; }, "optimizer.lr", "a finite number >= 0"},
      {"lr nan", [nan](Config& c) { c.optimizer.lr = nan; }, "optimizer.lr", ">= 0"},
      {"lr inf", [inf](Config& c) { c.optimizer.lr = inf; }, "optimizer.lr", "finite"},
      {"momentum 1", [](Config& c) { c.optimizer.momentum = 1.0; }, "optimizer.momentum",
       "a number in [0, 1)"},
      {"momentum<0", [](Config& c) { c.optimizer.momentum = -0.5; }, "optimizer.momentum",
       "[0, 1)"},
      {"dampening", [](Config& c) { c.optimizer.dampening = 1.5; }, "optimizer.dampening",
       "[0, 1]"},
      {"beta1", [](Config& c) { c.optimizer.beta1 = 1.0; }, "optimizer.beta1", "[0, 1)"},
      {"beta2", [](Config& c) { c.optimizer.beta2 = -0.1; }, "optimizer.beta2", "[0, 1)"},
      {"eps", [](Config& c) { c.optimizer.eps = -1e-8; }, "optimizer.eps", ">= 0"},
      {"weight_decay", [](Config& c) { c.optimizer.weight_decay = -0.1; }, "optimizer.weight_decay",
       ">= 0"},
      {"heartbeat 0", [](Config& c) { c.liveness.heartbeat_interval_ms = 0; },
       "liveness.heartbeat_interval_ms", "1..3600000"},
      {"heartbeat timeout", [](Config& c) { c.liveness.heartbeat_timeout_ms = 1000; },
       "liveness.heartbeat_timeout_ms", "must exceed 2 x liveness.heartbeat_interval_ms (500"},
      {"connect 0", [](Config& c) { c.liveness.connect_timeout_ms = 0; },
       "liveness.connect_timeout_ms", "1..86400000"},
      {"stats 0", [](Config& c) { c.stats.interval_ms = 0; }, "stats.interval_ms", "1..3600000"},
      {"worker peers", [](Config& c) { c.stats.worker_peers = -1; }, "stats.worker_peers",
       "0..65536"},
      {"balancer 0", [](Config& c) { c.balancer.interval_ms = 0; }, "balancer.interval_ms",
       "1..86400000"},
      {"balancer<stats", [](Config& c) { c.balancer.interval_ms = 50; }, "balancer.interval_ms",
       "must be at least stats.interval_ms (100"},
      {"tls empty name", [](Config& c) { c.ucx.tls = "tcp,,sm"; }, "ucx.tls", "UCX_TLS list"},
      {"tls space", [](Config& c) { c.ucx.tls = "rc x"; }, "ucx.tls", "UCX_TLS list"},
      {"write_path", [](Config& c) { c.ucx.write_path = "rdma"; }, "ucx.write_path",
       "one of auto, put, am"},
      {"gpu_path", [](Config& c) { c.data.gpu_path = "gpudirect"; }, "data.gpu_path",
       "one of auto, direct, staged"},
      {"server device", [](Config& c) { c.server.device = "gpu"; }, "server.device",
       "one of cpu, cuda"},
      {"ring 8", [](Config& c) { c.ucx.notify_ring_slots = 8; }, "ucx.notify_ring_slots",
       "not 0 or a power of two from 16 to 65536"},
      {"ring 1000", [](Config& c) { c.ucx.notify_ring_slots = 1000; }, "ucx.notify_ring_slots",
       "not 0 or a power of two from 16 to 65536"},
      {"device", [](Config& c) { c.verbs.device = "mlx5 0"; }, "verbs.device",
       "an RDMA device name"},
      {"port 0", [](Config& c) { c.verbs.port = 0; }, "verbs.port", "1..255"},
      {"gid", [](Config& c) { c.verbs.gid_index = -2; }, "verbs.gid_index", "-1..255"},
      {"egress", [](Config& c) { c.link.egress_bytes_per_second = uint64_t{1} << 60; },
       "link.egress_bytes_per_second", "0..10000000000000"},
      {"ingress", [](Config& c) { c.link.ingress_bytes_per_second = uint64_t{1} << 50; },
       "link.ingress_bytes_per_second", "0..10000000000000"},
      {"latency", [](Config& c) { c.link.latency_us = 20000000; }, "link.latency_us",
       "0..10000000"},
      {"worker rank", [](Config& c) { c.job.rank = 1; }, "job.rank",
       "must be -1 or below job.num_workers (1"},
      {"server rank",
       [](Config& c) {
         c.job.role = Role::kServer;
         c.job.num_servers = 2;
         c.job.num_standby = 1;
         c.job.rank = 3;
       },
       "job.rank", "below job.num_servers + job.num_standby (3)"},
      {"coordinator rank",
       [](Config& c) {
         c.job.role = Role::kCoordinator;
         c.job.num_workers = 4;
         c.job.rank = 1;
       },
       "job.rank", "one coordinator"},
      {"colocate",
       [](Config& c) {
         c.job.colocate_servers = true;
         c.job.num_workers = 4;
         c.job.num_servers = 2;
       },
       "job.num_servers", "must equal job.num_workers (4"},
      {"nesterov no momentum", [](Config& c) { c.optimizer.nesterov = true; }, "optimizer.nesterov",
       "needs optimizer.momentum > 0"},
      {"nesterov dampening",
       [](Config& c) {
         c.optimizer.nesterov = true;
         c.optimizer.momentum = 0.9;
         c.optimizer.dampening = 0.1;
       },
       "optimizer.nesterov", "optimizer.dampening = 0"},
      {"straggler threshold 0", [](Config& c) { c.balancer.straggler_threshold = 0; },
       "balancer.straggler_threshold", "must be above 0"},
      {"straggler threshold big", [](Config& c) { c.balancer.straggler_threshold = 11; },
       "balancer.straggler_threshold", "[0, 10]"},
      {"straggler windows 0", [](Config& c) { c.balancer.straggler_windows = 0; },
       "balancer.straggler_windows", "1..1000000"},
      {"false alarms 5", [](Config& c) { c.balancer.false_alarm_windows = 5; },
       "balancer.false_alarm_windows", "[10, 1000000000000]"},
      {"horizon 0", [](Config& c) { c.balancer.horizon_rounds = 0.5; }, "balancer.horizon_rounds",
       "[1, 1000000000]"},
      {"step 0", [](Config& c) { c.balancer.max_step_fraction = 0; }, "balancer.max_step_fraction",
       "must be above 0"},
      {"step 2", [](Config& c) { c.balancer.max_step_fraction = 2; }, "balancer.max_step_fraction",
       "[0, 1]"},
      {"evaluation 0", [](Config& c) { c.balancer.evaluation_windows = 0; },
       "balancer.evaluation_windows", "1..1000"},
      {"rollback nan", [](Config& c) { c.balancer.rollback_tolerance = -1; },
       "balancer.rollback_tolerance", "[0, 10]"},
      {"scale out 0", [](Config& c) { c.balancer.scale_out_utilisation = 0; },
       "balancer.scale_out_utilisation", "must be above 0"},
      {"scale in >= out",
       [](Config& c) {
         c.balancer.scale_in_utilisation = 0.9;
         c.balancer.scale_out_utilisation = 0.8;
       },
       "balancer.scale_in_utilisation", "must be below balancer.scale_out_utilisation"},
      {"min active 0", [](Config& c) { c.balancer.min_active_servers = 0; },
       "balancer.min_active_servers", "1..65536"},
      {"checkpoints nowhere", [](Config& c) { c.checkpoint.every_rounds = 10; }, "checkpoint.dir",
       "checkpoint.every_rounds (10) needs it"},
      {"resume from nowhere", [](Config& c) { c.checkpoint.resume = true; }, "checkpoint.dir",
       "checkpoint.resume (true) needs it"},
      {"checkpoints async",
       [](Config& c) {
         c.checkpoint.dir = "/ckpt";
         c.checkpoint.every_rounds = 10;
         c.data.sync = SyncMode::kAsync;
       },
       "checkpoint.every_rounds", "needs data.sync = bsp"},
      {"keep 0", [](Config& c) { c.checkpoint.keep = 0; }, "checkpoint.keep", "1..1000000"},
      {"replication 0", [](Config& c) { c.replication.factor = 0; }, "replication.factor", "1..2"},
      {"replication 3", [](Config& c) { c.replication.factor = 3; }, "replication.factor", "1..2"},
      {"metrics no port", [](Config& c) { c.metrics.listen = "127.0.0.1"; }, "metrics.listen",
       "no ':port'"},
      {"trace rounds backwards", [](Config& c) { c.trace.rounds = "9:3"; }, "trace.rounds",
       "1 <= A <= B"},
      {"trace round 0", [](Config& c) { c.trace.rounds = "0:3"; }, "trace.rounds", "1 <= A <= B"},
      {"trace rounds text", [](Config& c) { c.trace.rounds = "1-3"; }, "trace.rounds",
       "1 <= A <= B"},
      {"replicated async with the balancer",
       [](Config& c) {
         c.replication.factor = 2;
         c.data.sync = SyncMode::kAsync;
         c.balancer.enabled = true;
       },
       "replication.factor", "needs balancer.enabled = false"},

      {"dir newline", [](Config& c) { c.checkpoint.dir = "/a\nb"; }, "checkpoint.dir",
       "a newline or NUL"},
  };
  for (const Rule& rule : rules) {
    SCOPED_TRACE(rule.name);
    Config c;
    rule.change(c);
    Status s = validate(c);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), StartsWith(std::string(rule.key) + ": "));
    EXPECT_THAT(s.message(), HasSubstr(rule.accepted));
  }
}

TEST(Config, EdgesOfTheRangesAreValid) {
  const std::vector<std::function<void(Config&)>> valid = {
      [](Config& c) { c.data.chunk_bytes = 8; },
      [](Config& c) { c.data.chunk_bytes = uint64_t{1} << 30; },
      [](Config& c) { c.data.slots_per_worker = 4096; },
      [](Config& c) { c.liveness.heartbeat_timeout_ms = 1001; },
      [](Config& c) { c.balancer.interval_ms = c.stats.interval_ms; },
      [](Config& c) { c.optimizer.lr = 0; },
      [](Config& c) { c.optimizer.momentum = 0.999; },
      [](Config& c) {
        c.optimizer.nesterov = true;
        c.optimizer.momentum = 0.9;
      },
      [](Config& c) { c.job.coordinator = "[::1]:1"; },
      [](Config& c) { c.job.listen = "0.0.0.0:65535"; },
      [](Config& c) { c.ucx.tls = "^ib,cuda_copy"; },
      [](Config& c) {
        c.job.role = Role::kServer;
        c.job.num_standby = 1;
        c.job.rank = 1;
      },
      [](Config& c) {
        c.job.num_workers = 4;
        c.job.rank = 3;
      },
      [](Config& c) {
        // Replicated ranges move with the balancer (docs/replication.md).
        c.replication.factor = 2;
        c.balancer.enabled = true;
      },
      [](Config& c) {
        c.replication.factor = 2;
        c.data.sync = SyncMode::kStaleness;
        c.data.staleness_rounds = 2;
      },
  };
  for (size_t i = 0; i < valid.size(); ++i) {
    Config c;
    valid[i](c);
    EXPECT_TRUE(validate(c).ok()) << i << ": " << validate(c).to_string();
  }
}

TEST(Config, ValidateNamesTheSource) {
  auto r = load(FakeEnv{{"PSLD_LIVENESS_HEARTBEAT_TIMEOUT_MS", "900"}});
  EXPECT_THAT(error_of(r), HasSubstr("liveness.heartbeat_timeout_ms: 900 from env "
                                     "PSLD_LIVENESS_HEARTBEAT_TIMEOUT_MS must exceed 2 x "
                                     "liveness.heartbeat_interval_ms (500 by default)"));
}

// ---- wrong types -----------------------------------------------------------------

TEST(Config, WrongValuesNameKeySourceAndAcceptedValues) {
  EXPECT_EQ(error_of(load(FakeEnv{}, {"--data.sync=bps"})),
            "data.sync: 'bps' from flag --data.sync is not one of bsp, async, staleness");
  EXPECT_EQ(error_of(load(FakeEnv{{"PSLD_JOB_NUM_WORKERS", "abc"}})),
            "job.num_workers: 'abc' from env PSLD_JOB_NUM_WORKERS is not an integer in 1..65536");
  EXPECT_THAT(error_of(load(FakeEnv{{"PSLD_JOB_NUM_WORKERS", "1.5"}})),
              HasSubstr("'1.5' from env PSLD_JOB_NUM_WORKERS is not an integer"));
  EXPECT_THAT(error_of(load(FakeEnv{}, {"--job.num_workers", "0"})),
              HasSubstr("job.num_workers: '0' from flag --job.num_workers is not an integer in "
                        "1..65536"));
  EXPECT_THAT(error_of(load(FakeEnv{}, {"--job.num_workers=99999999999999999999"})),
              HasSubstr("is not an integer in 1..65536"));
  EXPECT_THAT(error_of(load(FakeEnv{}, {"--optimizer.lr=fast"})),
              HasSubstr("optimizer.lr: 'fast' from flag --optimizer.lr is not a finite number"));
  EXPECT_THAT(error_of(load(FakeEnv{}, {"--optimizer.lr=nan"})), HasSubstr("optimizer.lr"));
  EXPECT_THAT(error_of(load(FakeEnv{}, {"--job.coordinator=head"})),
              HasSubstr("job.coordinator: 'head' from flag --job.coordinator is not host:port "
                        "with a port in 1..65535 (no ':port')"));

  TempDir dir("psld-config");
  std::string path = dir.write("t.toml",
                               "[job]\n"
                               "num_workers = 1.5\n"
                               "num_servers = \"2\"\n"
                               "colocate_servers = \"true\"\n"
                               "role = 3\n"
                               "[data]\n"
                               "chunk_bytes = -8\n");
  std::string msg = error_of(load(FakeEnv{{"PSLD_CONFIG", path}}));
  EXPECT_THAT(msg, HasSubstr("job.num_workers: 1.5 from file " + path +
                             ":2 is not an integer in 1..65536"));
  EXPECT_THAT(msg, HasSubstr("job.num_servers: \"2\" (a string) from file " + path + ":3"));
  EXPECT_THAT(msg, HasSubstr("job.colocate_servers: \"true\" (a string) from file " + path +
                             ":4 is not true or false"));
  EXPECT_THAT(msg, HasSubstr("job.role: 3 from file " + path + ":5 is not one of auto"));
  EXPECT_THAT(msg, HasSubstr("data.chunk_bytes: -8 from file " + path + ":7"));
}

TEST(Config, AllProblemsAreReportedAtOnce) {
  std::string msg = error_of(
      load(FakeEnv{{"PSLD_JOB_NUM_WORKERS", "x"}, {"PSLD_JOB_RANKK", "1"}}, {"--data.sync=bps"}));
  EXPECT_THAT(msg, HasSubstr("job.num_workers"));
  EXPECT_THAT(msg, HasSubstr("PSLD_JOB_RANKK"));
  EXPECT_THAT(msg, HasSubstr("data.sync"));
}

TEST(Config, ASecretOnACommandLineIsRefused) {
  std::string msg = error_of(load(FakeEnv{}, {"--job.secret=hunter2"}));
  EXPECT_THAT(msg, HasSubstr("ps"));
  EXPECT_THAT(msg, HasSubstr("PSLD_SECRET_FILE"));
  EXPECT_THAT(msg, Not(HasSubstr("hunter2")));
  // A program's own settings are no command line.
  auto r = load_in_code(FakeEnv{}, {"--job.secret=hunter2"});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->job.secret, "hunter2");
}

TEST(Config, TheSecretComesFromAFileOnlyItsOwnerCanRead) {
  TempDir dir("psld-config");
  const std::string path = dir.write("secret", "hunter2\n");
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  auto r = load(FakeEnv{{"PSLD_SECRET_FILE", path}});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->job.secret, "hunter2") << "one trailing newline is not the secret's";
  EXPECT_THAT(r->sources.at("job.secret"), HasSubstr(path));
  EXPECT_THAT(to_string(*r), Not(HasSubstr("hunter2")));

  ASSERT_EQ(chmod(path.c_str(), 0640), 0);
  std::string msg = error_of(load(FakeEnv{{"PSLD_SECRET_FILE", path}}));
  EXPECT_THAT(msg, HasSubstr("mode 0640"));
  EXPECT_THAT(msg, HasSubstr("chmod 600"));
  ASSERT_EQ(chmod(path.c_str(), 0400), 0);
  EXPECT_TRUE(load(FakeEnv{{"PSLD_SECRET_FILE", path}}).ok()) << "read-only is stricter still";

  msg = error_of(load(FakeEnv{{"PSLD_SECRET_FILE", path}, {"PSLD_JOB_SECRET", "other"}}));
  EXPECT_THAT(msg, HasSubstr("one way only"));
  EXPECT_THAT(msg, Not(HasSubstr("hunter2")));
  EXPECT_THAT(msg, Not(HasSubstr("other")));

  auto missing = load(FakeEnv{{"PSLD_SECRET_FILE", dir.write("x", "") + ".none"}});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  for (const std::string& text : {std::string("\n"), std::string(5000, 'k')}) {
    const std::string bad = dir.write("bad", text);
    ASSERT_EQ(chmod(bad.c_str(), 0600), 0);
    auto b = load(FakeEnv{{"PSLD_SECRET_FILE", bad}});
    ASSERT_FALSE(b.ok()) << text.size() << " bytes";
    EXPECT_THAT(b.status().message(), AnyOf(HasSubstr("empty"), HasSubstr("longer than")));
    EXPECT_THAT(b.status().message(), Not(HasSubstr("kkkk")));
  }
  msg = error_of(load(FakeEnv{{"PSLD_SECRET_FILE", dir.write("", "")}}));
  EXPECT_THAT(msg, HasSubstr("not a regular file"));
}

TEST(Config, SecretIsNeverEchoed) {
  TempDir dir("psld-config");
  std::string path = dir.write("s.toml", "[job]\nsecret = 12345\n");
  std::string msg = error_of(load(FakeEnv{{"PSLD_CONFIG", path}}));
  EXPECT_THAT(msg, HasSubstr("job.secret: <redacted> from file"));
  EXPECT_THAT(msg, Not(HasSubstr("12345")));
}

// ---- unknown names -------------------------------------------------------------------

TEST(Config, UnknownEnvironmentVariableSuggestsTheKey) {
  EXPECT_THAT(error_of(load(FakeEnv{{"PSLD_JOB_NUM_WORKER", "4"}})),
              HasSubstr("unknown environment variable PSLD_JOB_NUM_WORKER; did you mean "
                        "PSLD_JOB_NUM_WORKERS?"));
  // The likeliest mistake: leaving out the section.
  EXPECT_THAT(error_of(load(FakeEnv{{"PSLD_NUM_WORKERS", "4"}})),
              HasSubstr("did you mean PSLD_JOB_NUM_WORKERS?"));
  EXPECT_THAT(error_of(load(FakeEnv{{"PSLD_LR", "0.1"}})),
              HasSubstr("did you mean PSLD_OPTIMIZER_LR?"));
  EXPECT_THAT(error_of(load(FakeEnv{{"PSLD_ZZZZZZZZZZZZ", "1"}})),
              HasSubstr("docs/configuration.md"));
}

TEST(Config, OtherPsldVariablesAreNotConfigKeys) {
  FakeEnv env{{"PSLD_KERNEL_ISA", "scalar"},
              {"PSLD_JOBS", "2"},
              {"PSLD_PLACEMENT_EMIT", "/x"},
              {"PSLD_LOG", "info"}};
  auto r = load(env);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->log, "info");
}

TEST(Config, ListedButUnsetVariablesAreIgnored) {
  ConfigSources s;
  s.getenv = [](const char*) -> const char* { return nullptr; };
  s.env_names = [] { return std::vector<std::string>{"PSLD_TYPO"}; };
  EXPECT_TRUE(load_config(s).ok());
}

TEST(Config, UnknownFlagsSuggestTheKey) {
  EXPECT_THAT(error_of(load(FakeEnv{}, {"--job.num-workers=4"})),
              HasSubstr("unknown flag --job.num-workers; did you mean --job.num_workers?"));
  EXPECT_THAT(error_of(load(FakeEnv{}, {"--num_workers=4"})),
              HasSubstr("did you mean --job.num_workers?"));
  EXPECT_THAT(error_of(load(FakeEnv{}, {"--optimizer.lrr", "0.1"})),
              HasSubstr("did you mean --optimizer.lr?"));
  EXPECT_THAT(error_of(load(FakeEnv{}, {"positional"})),
              HasSubstr("unexpected argument 'positional'"));
  EXPECT_THAT(error_of(load(FakeEnv{}, {"--job.num_workers"})),
              HasSubstr("flag --job.num_workers needs a value"));
  EXPECT_THAT(error_of(load(FakeEnv{}, {"--job.num_workers", "--job.rank=0"})),
              HasSubstr("flag --job.num_workers needs a value"));
}

TEST(Config, UnknownFileKeysSuggestTheKey) {
  TempDir dir("psld-config");
  std::string path = dir.write("u.toml",
                               "[job]\n"
                               "num_workers = 2\n"
                               "num_worker = 2\n"
                               "[optimiser]\n"
                               "lr = 0.1\n"
                               "[data]\n"
                               "[data.extra]\n"
                               "x = 1\n");
  std::string msg = error_of(load(FakeEnv{{"PSLD_CONFIG", path}}));
  EXPECT_THAT(msg, HasSubstr(path + ":3: unknown key job.num_worker; did you mean "
                                    "job.num_workers?"));
  EXPECT_THAT(msg, HasSubstr(path + ":4: unknown table [optimiser]; did you mean [optimizer]?"));
  EXPECT_THAT(msg, HasSubstr(path + ":7: unknown key data.extra"));
}

// ---- the file itself -------------------------------------------------------------------

TEST(Config, MalformedTomlGivesTheLine) {
  TempDir dir("psld-config");
  std::string path = dir.write("bad.toml", "[job]\nnum_workers = 2\nrole = worker\n");
  auto r = load(FakeEnv{{"PSLD_CONFIG", path}});
  std::string msg = error_of(r);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(msg, StartsWith("config file " + path + ":3: TOML syntax error"));
  EXPECT_THAT(msg, HasSubstr("strings need quotes"));

  std::string unterminated = dir.write("u.toml", "# x\n\n[job\n");
  EXPECT_THAT(error_of(load(FakeEnv{}, {"--config=" + unterminated})),
              StartsWith("config file " + unterminated + ":3: TOML syntax error"));

  std::string twice = dir.write("t.toml", "[job]\nrank = 1\nrank = 2\n");
  EXPECT_THAT(error_of(load(FakeEnv{}, {"--config=" + twice})), HasSubstr(twice + ":3:"));
}

TEST(Config, MissingFileIsNotFound) {
  auto r = load(FakeEnv{{"PSLD_CONFIG", "/nonexistent/psld.toml"}});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("/nonexistent/psld.toml (from env PSLD_CONFIG)"));
}

// ---- printing ----------------------------------------------------------------------------

TEST(Config, PrintsOneLinePerKeyWithItsSource) {
  auto r = load(FakeEnv{{"PSLD_JOB_NUM_WORKERS", "4"}}, {"--optimizer.lr=0.5"});
  ASSERT_TRUE(r.ok());
  std::string text = to_string(*r);
  EXPECT_THAT(text, HasSubstr("launcher: none"));
  EXPECT_THAT(text, HasSubstr("\n[job]\n"));
  EXPECT_THAT(text, HasSubstr("num_workers = 4"));
  EXPECT_THAT(text, HasSubstr("# env PSLD_JOB_NUM_WORKERS\n"));
  EXPECT_THAT(text, HasSubstr("lr = 0.5"));
  EXPECT_THAT(text, HasSubstr("# flag --optimizer.lr\n"));
  EXPECT_THAT(text, HasSubstr("role = \"auto\""));
  EXPECT_THAT(text, HasSubstr("eps = 1e-8 "));
  EXPECT_THAT(text, HasSubstr("beta1 = 0.9 "));
  EXPECT_THAT(text, HasSubstr("dampening = 0.0 "));  // a float stays a float
  // Every key once, without sources too.
  std::string plain = "\n" + to_string(*r, false);
  EXPECT_THAT(plain, Not(HasSubstr("# env")));
  for (const ConfigKeyInfo& k : config_keys()) {
    std::string leaf = k.key.substr(k.key.find('.') + 1);
    EXPECT_THAT(plain, HasSubstr("\n" + (leaf == "secret" ? "# " + leaf : leaf) + " = ")) << k.key;
  }
}

Config everything_changed() {
  Config c;
  c.log = "error";
  c.job.role = Role::kWorker;
  c.job.rank = 2;
  c.job.local_rank = 1;
  c.job.num_workers = 3;
  c.job.num_servers = 3;
  c.job.num_standby = 1;
  c.job.colocate_servers = true;
  c.job.coordinator = "[fe80::1]:1234";
  c.job.transport = "verbs";
  c.job.listen = "host.example:0";
  c.data.chunk_bytes = 8192;
  c.data.slots_per_worker = 3;
  c.data.sync = SyncMode::kAsync;
  c.data.staleness_rounds = 9;
  c.data.request_timeout_ms = 123;
  c.data.gpu_path = "direct";
  c.server.mode = ServerMode::kSum;
  c.server.threads = 7;
  c.server.device = "cuda";
  c.optimizer.kind = OptimizerKind::kMomentum;
  c.optimizer.lr = 0.1;  // not exact in binary: must still round-trip
  c.optimizer.momentum = 0.95;
  c.optimizer.dampening = 0;
  c.optimizer.nesterov = true;
  c.optimizer.beta1 = 1.0 / 3;
  c.optimizer.beta2 = 0.5;
  c.optimizer.eps = 1e-300;
  c.optimizer.weight_decay = 2;
  c.liveness.heartbeat_interval_ms = 10;
  c.liveness.heartbeat_timeout_ms = 21;
  c.liveness.connect_timeout_ms = 99;
  c.stats.interval_ms = 7;
  c.stats.worker_peers = 3;
  c.balancer.enabled = false;
  c.balancer.interval_ms = 7;
  c.ucx.tls = "^ib";
  c.ucx.write_path = "put";
  c.ucx.notify_ring_slots = 0;
  c.verbs.device = "mlx5_0";
  c.verbs.port = 2;
  c.verbs.gid_index = 0;
  c.link.egress_bytes_per_second = 1;
  c.link.ingress_bytes_per_second = 10000000000000;
  c.link.latency_us = 5;
  return c;
}

TEST(Config, PrintedTextLoadsBackToTheSameConfig) {
  TempDir dir("psld-config");
  Config c = everything_changed();
  ASSERT_TRUE(validate(c).ok()) << validate(c).to_string();
  for (const ConfigKeyInfo& k : config_keys()) {
    if (k.key == "job.secret") continue;
    EXPECT_NE(to_string(c, false).find(k.key.substr(k.key.find('.') + 1) + " = "),
              std::string::npos);
  }
  for (bool with_sources : {true, false}) {
    SCOPED_TRACE(with_sources);
    std::string text = to_string(c, with_sources);
    auto r = load(FakeEnv{}, {"--config=" + dir.write("round.toml", text)});
    ASSERT_TRUE(r.ok()) << r.status().to_string() << "\n" << text;
    EXPECT_EQ(*r, c) << text << "\n---\n" << to_string(*r);
    EXPECT_EQ(to_string(*r, false), to_string(c, false));
  }
  // And a loaded config with its sources, including a string needing escapes.
  FakeEnv env{{"PSLD_UCX_TLS", "tcp"}, {"PSLD_VERBS_DEVICE", "a.b-c_d"}};
  auto loaded = load(env, {"--optimizer.kind=adamw", "--log=debug"});
  ASSERT_TRUE(loaded.ok());
  auto again = load(FakeEnv{}, {"--config=" + dir.write("again.toml", to_string(*loaded))});
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(*again, *loaded);
}

TEST(Config, SecretIsNeverPrinted) {
  const std::string secret = "hunter2-\"quoted\"-s3cret";
  auto r = load(FakeEnv{{"PSLD_JOB_SECRET", secret}});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->job.secret, secret);
  for (bool with_sources : {true, false}) {
    std::string text = to_string(*r, with_sources);
    EXPECT_THAT(text, Not(HasSubstr("hunter2")));
    EXPECT_THAT(text, HasSubstr("# secret = <set>"));
  }
  EXPECT_THAT(to_string(Config{}), HasSubstr("# secret = <unset>"));
  // The printed text loads, without the secret: it has to be given again.
  TempDir dir("psld-config");
  auto back = load(FakeEnv{}, {"--config=" + dir.write("s.toml", to_string(*r))});
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->job.secret, "");
  Config expected = *r;
  expected.job.secret.clear();
  EXPECT_EQ(*back, expected);
}

// RuntimeOptions{} (what in-process jobs, tests and benchmarks start from)
// has the defaults a user's Config{} gives.
TEST(Config, RuntimeOptionsDefaultToConfigsDefaults) {
  const RuntimeOptions want = runtime_options_from_config(Config{});
  const RuntimeOptions got;
  EXPECT_EQ(got.chunk_bytes, want.chunk_bytes);
  EXPECT_EQ(got.slots_per_worker, want.slots_per_worker);
  EXPECT_EQ(got.sync, want.sync);
  EXPECT_EQ(got.staleness, want.staleness);
  EXPECT_EQ(got.mode, want.mode);
  EXPECT_EQ(got.mode, ServerMode::kOptimizer);
  EXPECT_EQ(got.optimizer.kind, want.optimizer.kind);
  EXPECT_EQ(got.optimizer.lr, want.optimizer.lr);
  EXPECT_EQ(got.optimizer.momentum, want.optimizer.momentum);
  EXPECT_EQ(got.optimizer.dampening, want.optimizer.dampening);
  EXPECT_EQ(got.optimizer.nesterov, want.optimizer.nesterov);
  EXPECT_EQ(got.optimizer.beta1, want.optimizer.beta1);
  EXPECT_EQ(got.optimizer.beta2, want.optimizer.beta2);
  EXPECT_EQ(got.optimizer.eps, want.optimizer.eps);
  EXPECT_EQ(got.optimizer.weight_decay, want.optimizer.weight_decay);
  EXPECT_EQ(got.server_threads, want.server_threads);
  EXPECT_EQ(got.server_device, want.server_device);
  EXPECT_EQ(got.heartbeat_interval, want.heartbeat_interval);
  EXPECT_EQ(got.heartbeat_timeout, want.heartbeat_timeout);
  EXPECT_EQ(got.connect_timeout, want.connect_timeout);
  EXPECT_EQ(got.stats_interval, want.stats_interval);
  EXPECT_EQ(got.balancer_enabled, want.balancer_enabled);
  EXPECT_EQ(got.balancer_interval, want.balancer_interval);
  EXPECT_EQ(got.gpu_path, want.gpu_path);
}

// The [balancer] keys default to the balancer's own defaults and reach it.
TEST(Config, BalancerKeysDefaultToTheBalancersOptionsAndReachThem) {
  const BalancerOptions want;
  const BalancerOptions got = runtime_options_from_config(Config{}).balancer;
  EXPECT_EQ(got.straggler_threshold, want.straggler_threshold);
  EXPECT_EQ(got.straggler_windows, want.straggler_windows);
  EXPECT_EQ(got.false_alarm_windows, want.false_alarm_windows);
  EXPECT_EQ(got.horizon_rounds, want.horizon_rounds);
  EXPECT_EQ(got.max_step_fraction, want.max_step_fraction);
  EXPECT_EQ(got.evaluation_windows, want.evaluation_windows);
  EXPECT_EQ(got.rollback_tolerance, want.rollback_tolerance);
  EXPECT_EQ(got.scale_out, want.scale_out);
  EXPECT_EQ(got.scale_in, want.scale_in);
  EXPECT_EQ(got.scale_out_utilisation, want.scale_out_utilisation);
  EXPECT_EQ(got.scale_in_utilisation, want.scale_in_utilisation);
  EXPECT_EQ(got.min_active_servers, want.min_active_servers);

  auto c =
      load(FakeEnv{{"PSLD_BALANCER_SCALE_IN", "false"}, {"PSLD_BALANCER_STRAGGLER_WINDOWS", "5"}},
           {"--balancer.max_step_fraction=0.5", "--balancer.horizon_rounds", "400"});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const BalancerOptions set = runtime_options_from_config(*c).balancer;
  EXPECT_FALSE(set.scale_in);
  EXPECT_EQ(set.straggler_windows, 5u);
  EXPECT_EQ(set.max_step_fraction, 0.5);
  EXPECT_EQ(set.horizon_rounds, 400);
  EXPECT_TRUE(set.validate().ok());
}

// server.device reaches the servers' options: cpu by default.
TEST(Config, ServerDeviceDefaultsToCpuAndReachesTheServers) {
  EXPECT_EQ(runtime_options_from_config(Config{}).server_device, ServerDeviceKind::kCpu);
  auto c = load(FakeEnv{{"PSLD_SERVER_DEVICE", "cuda"}}, {});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(runtime_options_from_config(*c).server_device, ServerDeviceKind::kCuda);
  EXPECT_EQ(server_device_name(ServerDeviceKind::kCuda), "cuda");
}

TEST(Config, ConfigKeysDescribeTheDefaults) {
  std::map<std::string, ConfigKeyInfo> keys;
  for (const ConfigKeyInfo& k : config_keys())
    keys[k.key] = k;
  EXPECT_EQ(keys.at("job.num_workers").default_value, "1");
  EXPECT_EQ(keys.at("job.num_workers").accepted, "an integer in 1..65536");
  EXPECT_EQ(keys.at("data.chunk_bytes").default_value, "4194304");
  EXPECT_EQ(keys.at("data.sync").default_value, "\"bsp\"");
  EXPECT_EQ(keys.at("optimizer.lr").default_value, "0.001");
  EXPECT_EQ(keys.at("job.secret").default_value, "<unset>");
  EXPECT_EQ(keys.at("log").env, "PSLD_LOG");
}

// docs/configuration.md documents every key: its row has the key, the
// variable and the default.
TEST(Config, DocumentationListsEveryKey) {
  // __FILE__ is relative to the build directory ("../tests/config_test.cc"),
  // which is the working directory under `meson test` and the parent of this
  // binary's directory.
  std::filesystem::path relative =
      std::filesystem::path(__FILE__).parent_path() / ".." / "docs" / "configuration.md";
  std::error_code ec;
  std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  std::ifstream in(relative);
  if (!in && !ec) in.open(exe.parent_path().parent_path() / relative);
  if (!in) GTEST_SKIP() << "no " << relative << " from here or from " << exe;
  std::stringstream text;
  text << in.rdbuf();
  for (const ConfigKeyInfo& k : config_keys()) {
    std::string row =
        "| `" + k.key + "` | `" + k.env + "` | `--" + k.key + "` | `" + k.default_value + "` |";
    EXPECT_NE(text.str().find(row), std::string::npos) << "missing or stale row: " << row;
  }
}

}  // namespace
}  // namespace psld
