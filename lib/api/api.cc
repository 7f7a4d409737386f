// The public classes of include/psld/ over the services in lib/.
#include <cmath>
#include <future>

#include "base/log.h"
#include "lib/config/interface.h"
#include "lib/config/runtime_options.h"
#include "lib/coordinator/service.h"
#include "lib/server/service.h"
#include "lib/worker/service.h"
#include "psld/coordinator.h"
#include "psld/server.h"
#include "psld/version.h"
#include "psld/worker.h"

namespace psld {

const char* version() {
  return PSLD_VERSION_STRING;
}

namespace {
// Checks the config and applies its `log` levels; every log line names
// `role` (and the rank, once known) from now on.
Status check_config(const Config& config, std::string_view role) {
  PSLD_RETURN_IF_ERROR(validate(config).with_context("invalid configuration"));
  LogSpec spec;
  if (parse_log_spec(config.log, &spec).empty()) set_log_spec(spec);
  set_log_identity(role, role == "coordinator" ? -1 : config.job.rank);
  return Status::Ok();
}

// The runtime's options, job.interface resolved.
Result<RuntimeOptions> options_for(const Config& config) {
  RuntimeOptions o = runtime_options_from_config(config);
  PSLD_RETURN_IF_ERROR(apply_interface(config, o));
  return o;
}
}  // namespace

// ---- Request

Status Request::wait(std::chrono::milliseconds timeout) const {
  return state_ ? state_->wait(timeout) : Status::Ok();
}

bool Request::test() const {
  return state_ ? state_->test() : true;
}

// ---- Worker

Result<std::unique_ptr<Worker>> Worker::join(const Config& config) {
  PSLD_RETURN_IF_ERROR(check_config(config, "worker"));
  PSLD_ASSIGN_OR_RETURN(const RuntimeOptions options, options_for(config));
  std::unique_ptr<Worker> w(new Worker());
  if (!config.job.colocate_servers) {
    PSLD_ASSIGN_OR_RETURN(w->impl_, WorkerService::start(options));
    set_log_identity("worker", w->impl_->rank());
    return w;
  }
  if (options.rank < 0) {
    return InvalidArgument(
        "job.colocate_servers needs this worker's rank at start: run it under a launcher "
        "(mpirun, srun, torchrun) or set job.rank");
  }
  if (options.rank == 0) {
    RuntimeOptions c = options;
    c.net.options.common.listen_address = config.job.coordinator;
    auto coordinator = CoordinatorService::start(c);
    if (!coordinator.ok()) {
      return coordinator.status().with_context("worker 0 runs the coordinator of a colocated job");
    }
    w->coordinator_ = std::move(coordinator).value();
  }
  // Both block until the whole job joined, so they start side by side.
  auto server =
      std::async(std::launch::async, [&options] { return ServerService::start(options); });
  auto worker = WorkerService::start(options);
  auto started = server.get();
  if (!started.ok()) {
    return started.status().with_context("the server colocated with worker " +
                                         std::to_string(options.rank));
  }
  w->server_ = std::move(started).value();
  if (!worker.ok()) return worker.status();
  w->impl_ = std::move(worker).value();
  PSLD_LOG_INFO("worker {} runs server {}{}", w->impl_->rank(), w->server_->rank(),
                w->coordinator_ ? " and the coordinator" : "");
  return w;
}

Worker::~Worker() {
  if (!server_ && !coordinator_) {
    (void)shutdown();
    return;
  }
  // A colocated worker destroyed without shutdown() is leaving abnormally (an
  // error return, an exception): waiting for the job to end would hold this
  // process while the others wait for it. It leaves as a crash would, without
  // a goodbye, so the job fails at once naming this worker.
  if (impl_) impl_->stop();
  if (server_) server_->shutdown();
  if (coordinator_) coordinator_->shutdown();
}

uint32_t Worker::rank() const {
  return impl_->rank();
}
uint32_t Worker::num_workers() const {
  return impl_->num_workers();
}

Result<TensorHandle> Worker::register_tensor(std::string_view name, DType dtype, size_t bytes,
                                             void* data, const void* init) {
  if (dtype != DType::kFloat32 && dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    return InvalidArgument("dtype must be kFloat32, kFloat16 or kBFloat16");
  }
  PSLD_ASSIGN_OR_RETURN(uint32_t index,
                        impl_->register_tensor(std::string(name), dtype, bytes, data, init));
  return TensorHandle{index};
}

Result<Request> Worker::push(TensorHandle t) {
  PSLD_ASSIGN_OR_RETURN(auto state, impl_->submit(t.index, RequestKind::kPush));
  return Request(std::move(state));
}

Result<Request> Worker::pull(TensorHandle t) {
  PSLD_ASSIGN_OR_RETURN(auto state, impl_->submit(t.index, RequestKind::kPull));
  return Request(std::move(state));
}

Result<Request> Worker::push_pull(TensorHandle t) {
  PSLD_ASSIGN_OR_RETURN(auto state, impl_->submit(t.index, RequestKind::kPushPull));
  return Request(std::move(state));
}

Result<std::vector<Request>> Worker::submit_all(std::span<const TensorHandle> tensors, int kind) {
  std::vector<uint32_t> handles;
  handles.reserve(tensors.size());
  for (TensorHandle t : tensors)
    handles.push_back(t.index);
  PSLD_ASSIGN_OR_RETURN(auto states, impl_->submit_many(handles, static_cast<RequestKind>(kind)));
  std::vector<Request> out;
  out.reserve(states.size());
  for (auto& s : states)
    out.push_back(Request(std::move(s)));
  return out;
}

Result<std::vector<Request>> Worker::push(std::span<const TensorHandle> tensors) {
  return submit_all(tensors, static_cast<int>(RequestKind::kPush));
}

Result<std::vector<Request>> Worker::pull(std::span<const TensorHandle> tensors) {
  return submit_all(tensors, static_cast<int>(RequestKind::kPull));
}

Result<std::vector<Request>> Worker::push_pull(std::span<const TensorHandle> tensors) {
  return submit_all(tensors, static_cast<int>(RequestKind::kPushPull));
}

Result<uint64_t> Worker::round(TensorHandle t) const {
  return impl_->tensor_round(t.index);
}

Status Worker::barrier(std::chrono::milliseconds timeout) {
  return impl_->barrier(timeout);
}
Status Worker::set_learning_rate(double lr) {
  if (!std::isfinite(lr) || lr < 0) {
    return InvalidArgument(fmt::format(
        "learning rate {}: expected a finite number >= 0 (0: the servers' optimizer.lr)", lr));
  }
  impl_->set_learning_rate(lr);
  return Status::Ok();
}
Status Worker::health() const {
  return impl_->health();
}

Result<void*> Worker::allocate(size_t bytes) {
  return impl_->allocate(bytes);
}

std::string Worker::gpu_path() const {
  return impl_->gpu_path();
}

std::vector<ServerLoad> Worker::server_loads() const {
  std::vector<ServerLoad> out;
  for (const auto& l : impl_->server_loads()) {
    ServerLoad s;
    s.server = l.server;
    s.bytes_pushed = l.bytes_pushed;
    s.answers = l.answers;
    s.mean_answer_us = l.answers ? static_cast<double>(l.answer_latency_ns) / l.answers / 1e3 : 0;
    out.push_back(s);
  }
  return out;
}
Status Worker::shutdown() {
  Status status = impl_ ? impl_->shutdown() : Status::Ok();
  // The coordinator ends the job once every worker finished and then tells
  // the servers to stop; until then this process's server still serves the
  // other workers. A failed job ends both waits too.
  if (coordinator_) {
    Status job = coordinator_->wait(std::chrono::hours(24 * 365));
    if (status.ok()) status = job;
  }
  if (server_) {
    Status served = server_->wait(std::chrono::hours(24 * 365));
    if (status.ok()) status = served;
    server_->shutdown();
    server_.reset();
  }
  if (coordinator_) {
    coordinator_->shutdown();
    coordinator_.reset();
  }
  return status;
}

// ---- Server

Result<std::unique_ptr<Server>> Server::start(const Config& config) {
  PSLD_RETURN_IF_ERROR(check_config(config, "server"));
  PSLD_ASSIGN_OR_RETURN(const RuntimeOptions options, options_for(config));
  PSLD_ASSIGN_OR_RETURN(auto impl, ServerService::start(options));
  set_log_identity("server", impl->rank());
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Server::Server(std::unique_ptr<ServerService> impl) : impl_(std::move(impl)) {}
Server::~Server() {
  shutdown();
}
uint32_t Server::rank() const {
  return impl_->rank();
}
std::string Server::address() const {
  return impl_->address();
}
Status Server::wait(std::chrono::milliseconds timeout) {
  return impl_->wait(timeout);
}
void Server::shutdown() {
  if (impl_) impl_->shutdown();
}

// ---- Coordinator

Result<std::unique_ptr<Coordinator>> Coordinator::start(const Config& config) {
  PSLD_RETURN_IF_ERROR(check_config(config, "coordinator"));
  PSLD_ASSIGN_OR_RETURN(RuntimeOptions o, options_for(config));
  o.net.options.common.listen_address = config.job.coordinator;
  PSLD_ASSIGN_OR_RETURN(auto impl, CoordinatorService::start(o));
  return std::unique_ptr<Coordinator>(new Coordinator(std::move(impl)));
}

Coordinator::Coordinator(std::unique_ptr<CoordinatorService> impl) : impl_(std::move(impl)) {}
Coordinator::~Coordinator() {
  shutdown();
}
std::string Coordinator::address() const {
  return impl_->address();
}

std::string Coordinator::metrics_address() const {
  return impl_->metrics_address();
}
Status Coordinator::wait(std::chrono::milliseconds timeout) {
  return impl_->wait(timeout);
}
void Coordinator::shutdown() {
  if (impl_) impl_->shutdown();
}

}  // namespace psld
