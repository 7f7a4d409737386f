#include "lib/config/runtime_options.h"

#include "lib/config/fields.h"

namespace psld {

std::string_view gpu_path_name(GpuPath path) {
  switch (path) {
    case GpuPath::kAuto:
      return "auto";
    case GpuPath::kDirect:
      return "direct";
    case GpuPath::kStaged:
      return "staged";
  }
  return "unknown";
}

std::string_view server_device_name(ServerDeviceKind kind) {
  switch (kind) {
    case ServerDeviceKind::kCpu:
      return "cpu";
    case ServerDeviceKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

RuntimeOptions runtime_options_from_config(const Config& c) {
  RuntimeOptions o;
  o.net.transport = c.job.transport;
  o.net.options.common.listen_address = c.job.listen;
  o.net.options.common.job_address = c.job.coordinator;
  if (c.data.request_timeout_ms > 0) {
    o.net.options.common.op_timeout = std::chrono::milliseconds(c.data.request_timeout_ms);
  }
  o.net.options.ucx.tls = c.ucx.tls;
  o.net.options.ucx.write_path = c.ucx.write_path;
  o.net.options.ucx.notify_ring_slots = c.ucx.notify_ring_slots;
  o.net.options.verbs.device = c.verbs.device;
  o.net.options.verbs.port = static_cast<uint8_t>(c.verbs.port);
  o.net.options.verbs.gid_index = c.verbs.gid_index;
  if (c.link.egress_bytes_per_second || c.link.ingress_bytes_per_second || c.link.latency_us) {
    o.net.emulate_link = true;
    o.net.link.egress_bytes_per_second = static_cast<double>(c.link.egress_bytes_per_second);
    o.net.link.ingress_bytes_per_second = static_cast<double>(c.link.ingress_bytes_per_second);
    o.net.link.latency = std::chrono::microseconds(c.link.latency_us);
  }
  o.coordinator_address = c.job.coordinator;
  o.secret = c.job.secret;
  o.num_workers = static_cast<uint32_t>(c.job.num_workers);
  o.num_servers = static_cast<uint32_t>(c.job.num_servers);
  o.num_standby = static_cast<uint32_t>(c.job.num_standby);
  o.rank = c.job.rank;
  o.chunk_bytes = c.data.chunk_bytes;
  o.slots_per_worker = c.data.slots_per_worker;
  o.batch_chunk_bytes = c.data.batch_chunk_bytes;
  o.batch_bytes = c.data.batch_bytes;
  o.sync = c.data.sync;
  if (c.data.gpu_path == "direct") {
    o.gpu_path = GpuPath::kDirect;
  } else if (c.data.gpu_path == "staged") {
    o.gpu_path = GpuPath::kStaged;
  }
  o.staleness = c.data.staleness_rounds;
  o.mode = c.server.mode;
  o.optimizer.kind = c.optimizer.kind;
  o.optimizer.lr = static_cast<float>(c.optimizer.lr);
  o.optimizer.momentum = static_cast<float>(c.optimizer.momentum);
  o.optimizer.dampening = static_cast<float>(c.optimizer.dampening);
  o.optimizer.nesterov = c.optimizer.nesterov;
  o.optimizer.beta1 = static_cast<float>(c.optimizer.beta1);
  o.optimizer.beta2 = static_cast<float>(c.optimizer.beta2);
  o.optimizer.eps = static_cast<float>(c.optimizer.eps);
  o.optimizer.weight_decay = static_cast<float>(c.optimizer.weight_decay);
  o.server_threads = static_cast<uint32_t>(c.server.threads);
  o.server_device = c.server.device == "cuda" ? ServerDeviceKind::kCuda : ServerDeviceKind::kCpu;
  o.heartbeat_interval = std::chrono::milliseconds(c.liveness.heartbeat_interval_ms);
  o.heartbeat_timeout = std::chrono::milliseconds(c.liveness.heartbeat_timeout_ms);
  o.connect_timeout = std::chrono::milliseconds(c.liveness.connect_timeout_ms);
  o.stats_interval = std::chrono::milliseconds(c.stats.interval_ms);
  o.worker_peers = static_cast<uint32_t>(c.stats.worker_peers);
  o.balancer_enabled = c.balancer.enabled;
  o.balancer_interval = std::chrono::milliseconds(c.balancer.interval_ms);
  const BalancerConfig& b = c.balancer;
  o.balancer.straggler_threshold = b.straggler_threshold;
  o.balancer.straggler_windows = b.straggler_windows;
  o.balancer.false_alarm_windows = b.false_alarm_windows;
  o.balancer.horizon_rounds = b.horizon_rounds;
  o.balancer.max_step_fraction = b.max_step_fraction;
  o.balancer.evaluation_windows = b.evaluation_windows;
  o.balancer.rollback_tolerance = b.rollback_tolerance;
  o.balancer.scale_out = b.scale_out;
  o.balancer.scale_in = b.scale_in;
  o.balancer.scale_out_utilisation = b.scale_out_utilisation;
  o.balancer.scale_in_utilisation = b.scale_in_utilisation;
  o.balancer.min_active_servers = b.min_active_servers;
  o.checkpoint = c.checkpoint;
  o.replication_factor = c.replication.factor;
  o.metrics_listen = c.metrics.listen;
  o.trace.dir = c.trace.dir;
  config_detail::parse_round_range(c.trace.rounds, &o.trace.first_round, &o.trace.last_round);
  return o;
}

}  // namespace psld
