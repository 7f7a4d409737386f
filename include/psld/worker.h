// psld/worker.h — what a trainer embeds.
//
//   auto cfg = psld::load_config({argv_rest});  // file, PSLD_* env, flags, launcher env
//   auto worker = psld::Worker::join(*cfg);     // blocks until the job starts
//   auto w = worker->register_tensor("fc1.weight", psld::DType::kFloat32,
//                                    bytes, grad_and_param, initial_value);
//   for (...) {
//     // compute gradients into grad_and_param, then
//     auto req = worker->push_pull(*w);  // zero-copy: reads and writes your memory
//     req->wait();                       // now it holds the new parameters
//   }
//   worker->shutdown();
//
// Zero-copy contract: the library reads pushes from, and writes pulls into,
// the memory passed to register_tensor. It must stay valid, and must not be
// written by the caller while a request on it is in flight, until shutdown().
//
// The memory may be host memory or CUDA device memory (cudaMalloc, managed);
// register_tensor tells which. A CUDA tensor goes "direct" where the
// transport can register device memory (GPUDirect RDMA), else "staged":
// chunk by chunk through a pinned host copy, the copies overlapping the
// transfers. gpu_path() says which, and why (config data.gpu_path forces
// one; docs/gpu.md).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "psld/config.h"
#include "psld/status.h"

namespace psld {

class CoordinatorService;
class RequestState;
class ServerService;
class WorkerService;

enum class DType : uint8_t {
  kFloat32 = 1,
  kFloat16 = 2,   // IEEE binary16; servers accumulate in fp32
  kBFloat16 = 3,  // bfloat16; servers accumulate in fp32
};

// What this worker sent to one server and how fast that server answered:
// the per-server load as a worker sees it (cumulative since join).
struct ServerLoad {
  uint32_t server = 0;
  uint64_t bytes_pushed = 0;
  uint64_t answers = 0;       // pull and push_pull chunks answered
  double mean_answer_us = 0;  // mean time from sending a chunk to its answer
};

// A registered tensor.
struct TensorHandle {
  uint32_t index = 0;
};

// A push, pull or push_pull in flight. Cheap to copy; all copies see the same
// request. An empty Request is complete and Ok.
class Request {
 public:
  Request() = default;
  // Waits until every chunk of the request completed or one failed; returns
  // Ok or the first error (Timeout when `timeout` passed first, leaving the
  // request in flight).
  Status wait(std::chrono::milliseconds timeout = std::chrono::hours(24)) const;
  // True once the request is complete (successfully or not).
  bool test() const;

 private:
  friend class Worker;
  explicit Request(std::shared_ptr<RequestState> state) : state_(std::move(state)) {}
  std::shared_ptr<RequestState> state_;
};

class Worker {
 public:
  // Joins the job described by `config` (role worker): contacts the
  // coordinator, waits until every worker and server joined (up to
  // liveness.connect_timeout_ms), and connects to the servers.
  //
  // With job.colocate_servers (a plain `mpirun -np N trainer` or `srun -n N`
  // job) this process also runs server `rank`, and worker 0 also runs the
  // coordinator on job.coordinator: the job needs no other process. The rank
  // must then be known at start (from the launcher or job.rank).
  static Result<std::unique_ptr<Worker>> join(const Config& config);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  uint32_t rank() const;
  uint32_t num_workers() const;

  // `bytes` of zero-filled host memory from the transport, for tensors:
  // register tensors anywhere inside it. Servers on the same host reach it
  // directly (UCX over shared memory: a pull is one memcpy into it), where
  // a pull into malloc'd memory takes the transport's rendezvous path (with
  // UCX 1.13, over tcp). Elsewhere it is ordinary registered memory. Valid
  // until the Worker is destroyed.
  Result<void*> allocate(size_t bytes);

  // Registers `bytes` of memory at `data` (host or CUDA) as the tensor
  // `name`. Every worker registers the same names with the same dtype and
  // size (else an error naming the tensor). With `init` (host or CUDA
  // memory), worker 0 sets the initial value (copied into `data` first);
  // call barrier() before other workers pull it.
  Result<TensorHandle> register_tensor(std::string_view name, DType dtype, size_t bytes, void* data,
                                       const void* init = nullptr);

  // Sends the tensor's contents (a gradient) for the next round. Complete
  // when the server took it (it may have to be sent again after a placement
  // change, so the memory must stay untouched until then).
  Result<Request> push(TensorHandle tensor);
  // Fetches the parameters of the round this worker last pushed (BSP: waits
  // until every worker pushed it) into the tensor's memory.
  Result<Request> pull(TensorHandle tensor);
  // push, then the result of that round written back into the same memory.
  Result<Request> push_pull(TensorHandle tensor);
  // The same, for many tensors at once (a request each, in order). Submitted
  // together, the small chunks among them that go to one server leave as
  // one batch (data.batch_chunk_bytes; docs/runtime.md, "Batches"): what a
  // model of many small tensors should use each round. An unknown handle
  // submits nothing.
  Result<std::vector<Request>> push(std::span<const TensorHandle> tensors);
  Result<std::vector<Request>> pull(std::span<const TensorHandle> tensors);
  Result<std::vector<Request>> push_pull(std::span<const TensorHandle> tensors);

  // Rounds of the tensor pushed so far: its next push is of round + 1. In a
  // job resumed from a checkpoint (checkpoint.resume) every tensor starts at
  // the checkpoint's round, and register_tensor has pulled the parameters
  // of that round into the tensor's memory: a trainer skips its data ahead
  // to there (docs/checkpoint.md).
  Result<uint64_t> round(TensorHandle tensor) const;
  // server.mode=optimizer: the learning rate of the updates that the pushes
  // submitted from now on are part of, instead of the servers' optimizer.lr
  // (0 goes back to it): what an LR schedule changes between steps. Each
  // update uses the rate its round's pushes carry, so every worker should set
  // the same rate before the same round (schedulers stepped in lockstep do);
  // where they differ, the lowest worker rank's wins. No effect with
  // server.mode=sum. InvalidArgument unless finite and >= 0.
  Status set_learning_rate(double lr);

  // Returns once every worker called barrier() the same number of times.
  Status barrier(std::chrono::milliseconds timeout = std::chrono::minutes(10));

  // Ok while the job runs; the reason (naming the failed process) otherwise.
  Status health() const;

  // How tensors in CUDA memory travel in this process, e.g. "staged through
  // pinned host memory: this UCX build has no CUDA memory support", or
  // "none here (no CUDA device ...)". Printed in the join line at log level info.
  std::string gpu_path() const;

  // One entry per server.
  std::vector<ServerLoad> server_loads() const;

  // Tells the coordinator this worker is done and disconnects. Requests still
  // in flight fail with Aborted. Idempotent; the destructor calls it.
  // A colocated server keeps serving the other workers until the job ends
  // (every worker finished, or the job failed), so with job.colocate_servers
  // this returns only then; destroying a colocated Worker without calling
  // shutdown() leaves at once and fails the job, as a crash would.
  Status shutdown();

 private:
  Worker() = default;
  // The span overloads: `kind` is the internal request kind.
  Result<std::vector<Request>> submit_all(std::span<const TensorHandle> tensors, int kind);
  // Declared first: destroyed last, after the worker and server that dial it.
  std::unique_ptr<CoordinatorService> coordinator_;
  std::unique_ptr<ServerService> server_;
  std::unique_ptr<WorkerService> impl_;
};

}  // namespace psld
