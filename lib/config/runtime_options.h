// RuntimeOptions: what the coordinator, servers and workers need, resolved
// from a psld::Config (see runtime_options_from_config) or built directly by
// tests, which also put several roles on one in-process loopback fabric.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "gpu/copy_engine.h"
#include "kernels/cpu/cpu_kernels.h"
#include "lib/balancer/balancer.h"
#include "lib/placement/placement.h"
#include "lib/runtime/runtime.h"
#include "lib/server/aggregator.h"
#include "lib/server/server_device.h"
#include "lib/stats/trace.h"
#include "psld/config.h"
#include "psld/keys.h"

namespace psld {

// How a worker moves tensors in CUDA memory (docs/gpu.md; config
// data.gpu_path).
enum class GpuPath : uint8_t {
  kAuto,    // direct where the transport can register device memory, else staged
  kDirect,  // the transport reads and writes device memory; an error where it cannot
  kStaged,  // through pinned host memory, copied by CUDA streams
};
std::string_view gpu_path_name(GpuPath path);

// Where a server keeps its keys and runs its kernels (docs/gpu.md, "GPU
// servers"; config server.device).
enum class ServerDeviceKind : uint8_t {
  kCpu,   // host memory, the CPU kernels
  kCuda,  // GPU memory, the CUDA kernels (lib/server/server_device.h)
};
std::string_view server_device_name(ServerDeviceKind kind);

// What a process of a job runs with. Every field that has a Config key
// defaults to that key's default (Config{}), so in-process jobs (tests,
// benchmarks) run with what users get unless they say otherwise.
struct RuntimeOptions {
  NetOptions net;                   // transport name and options (listen address, ...)
  std::string coordinator_address;  // text form of the coordinator's transport address
  std::string secret;
  uint32_t num_workers = 1;
  uint32_t num_servers = 1;
  uint32_t num_standby = 0;
  int32_t rank = -1;  // -1: assigned by the coordinator
  uint64_t chunk_bytes = DataConfig{}.chunk_bytes;
  uint32_t slots_per_worker = DataConfig{}.slots_per_worker;
  uint64_t batch_chunk_bytes = DataConfig{}.batch_chunk_bytes;  // 0: no batches
  uint64_t batch_bytes = DataConfig{}.batch_bytes;
  // Slots a worker gives each server for batches of answers to its small
  // pulls (protocol::AnswerSlots); 0: none, every pull is its own write.
  // Not a config key: tests set it to exercise a server that finds none free.
  uint32_t answer_slots = 4;
  SyncMode sync = DataConfig{}.sync;
  uint32_t staleness = DataConfig{}.staleness_rounds;
  ServerMode mode = ServerConfig{}.mode;
  OptimizerOptions optimizer;
  uint32_t server_threads = static_cast<uint32_t>(ServerConfig{}.threads);
  ServerDeviceKind server_device = ServerDeviceKind::kCpu;
  std::chrono::milliseconds heartbeat_interval{LivenessConfig{}.heartbeat_interval_ms};
  std::chrono::milliseconds heartbeat_timeout{LivenessConfig{}.heartbeat_timeout_ms};
  std::chrono::milliseconds connect_timeout{LivenessConfig{}.connect_timeout_ms};
  // How often servers and workers send a LoadReport; 0: never.
  std::chrono::milliseconds stats_interval{StatsConfig{}.interval_ms};
  // Servers a worker's LoadReport names each window (stats.worker_peers;
  // 0: auto, worker_peer_limit()).
  uint32_t worker_peers = 0;
  // The coordinator's balancer (lib/balancer/balancer.h): plans every interval.
  bool balancer_enabled = BalancerConfig{}.enabled;
  std::chrono::milliseconds balancer_interval{BalancerConfig{}.interval_ms};
  BalancerOptions balancer;
  GpuPath gpu_path = GpuPath::kAuto;
  // Consistent checkpoints and resuming from them (docs/checkpoint.md).
  CheckpointConfig checkpoint;
  // Copies of every key range (replication.factor, docs/replication.md).
  uint32_t replication_factor = 1;
  // Coordinator: where it serves /metrics and /status.json ("": nowhere).
  std::string metrics_listen;
  // Chrome traces (trace.dir, trace.rounds): an empty dir traces nothing.
  TraceRecorder::Options trace;

  // In-process jobs only (benchmarks, tests), never from a Config:
  // The coordinator's epoch 0 instead of Placement::initial over servers
  // 0..num_servers-1 (a static placement to compare against). It must be
  // epoch 0 and its members exactly those servers.
  std::shared_ptr<const Placement> initial_placement;
  // A server's emulated compute capacity: its reduce runs no faster than
  // this many bytes/s (0: unlimited). It makes one server a compute
  // straggler on a machine whose cores all run at the same speed; the
  // server's set_compute_rate() changes it while the job runs.
  double compute_bytes_per_second = 0;
  // Where a registered tensor's memory is (default: the CUDA driver's
  // answer, kernels::memory_kind_of) and the copy engine that stages CUDA
  // tensors (default: create_cuda_copy_engine). Tests replace
  // both to run the staged path on host memory posing as device memory.
  std::function<MemoryKind(const void*)> memory_kind_of;
  std::function<Result<std::unique_ptr<CopyEngine>>()> copy_engine;
  // The device of a server with server_device = kCuda (default:
  // create_cuda_server_device with one lane per server thread). Tests
  // replace it with a fake GPU.
  std::function<Result<std::unique_ptr<ServerDevice>>(size_t lanes)> server_device_factory;
};

// Resolves a validated Config into the runtime's options.
RuntimeOptions runtime_options_from_config(const Config& config);

}  // namespace psld
