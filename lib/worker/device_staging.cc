#include "lib/worker/device_staging.h"

#include <fmt/format.h>

#include <chrono>
#include <future>
#include <utility>
#include <vector>

#include "base/thread.h"
#include "kernels/dispatch.h"
#include "transports/loopback/loopback.h"

namespace psld {

GpuPathChoice choose_gpu_path(GpuPath requested, const transport::Transport& transport) {
  const transport::MemorySupport support = transport.memory_support(MemoryKind::kCuda);
  GpuPathChoice c;
  switch (requested) {
    case GpuPath::kDirect:
      c.possible = support.supported;
      c.direct = support.supported;
      c.text = support.supported
                   ? fmt::format("direct (data.gpu_path = direct): {}", support.detail)
                   : fmt::format(
                         "data.gpu_path = direct, but the {} transport cannot register CUDA "
                         "memory: {}",
                         transport.name(), support.detail);
      break;
    case GpuPath::kStaged:
      c.possible = true;
      c.text = "staged through pinned host memory (data.gpu_path = staged)";
      break;
    case GpuPath::kAuto:
      c.possible = true;
      c.direct = support.supported;
      c.text = support.supported
                   ? fmt::format("direct: {}", support.detail)
                   : fmt::format("staged through pinned host memory: {}", support.detail);
      break;
  }
  return c;
}

std::string describe_gpu_path(GpuPath requested, const transport::Transport& transport) {
  const GpuPathChoice c = choose_gpu_path(requested, transport);
  const Status device = kernels::cuda_device_status();
  if (device.ok()) return c.text;
  // A tensor is only ever staged or direct where its memory is CUDA memory.
  return fmt::format("none here ({}); a CUDA tensor would go {}", device.message(), c.text);
}

std::string describe_gpu_path(const RuntimeOptions& options) {
  struct Ignore final : transport::Handler {
    void on_write(const transport::ConnectionPtr&, uint32_t, uint64_t) override {}
    void on_message(const transport::ConnectionPtr&, std::span<const uint8_t>) override {}
  } handler;
  transport::TransportOptions o = options.net.options;
  o.common.listen_address.clear();
  if (options.net.transport == "loopback" && !o.loopback.fabric) {
    o.loopback.fabric = std::make_shared<transport::LoopbackFabric>();
  }
  auto t = transport::create_transport(options.net.transport, o, &handler);
  if (!t.ok()) {
    return fmt::format("unknown: the {} transport does not start here ({})", options.net.transport,
                       t.status().message());
  }
  std::string out = describe_gpu_path(options.gpu_path, **t);
  (*t)->shutdown();
  return out;
}

// ---- DeviceCopier

Result<std::unique_ptr<DeviceCopier>> DeviceCopier::start(std::unique_ptr<CopyEngine> engine) {
  if (!engine) return InvalidArgument("device copier: no copy engine");
  if (engine->lanes() < 2) {
    return InvalidArgument(
        fmt::format("device copier: the copy engine has {} lanes; it needs 2", engine->lanes()));
  }
  std::unique_ptr<DeviceCopier> c(new DeviceCopier(std::move(engine)));
  PSLD_RETURN_IF_ERROR(start_thread(c->thread_, "device copier", [p = c.get()] { p->run(); }));
  return c;
}

DeviceCopier::DeviceCopier(std::unique_ptr<CopyEngine> engine) : engine_(std::move(engine)) {}

DeviceCopier::~DeviceCopier() {
  stop();
}

void DeviceCopier::copy(Direction direction, void* dst, const void* src, size_t bytes, Done done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      lanes_[static_cast<size_t>(direction)].queue.push_back({dst, src, bytes, std::move(done)});
      cv_.notify_one();
      return;
    }
  }
  done(Aborted("the device copier stopped"));
}

Status DeviceCopier::copy_and_wait(Direction direction, void* dst, const void* src, size_t bytes) {
  auto result = std::make_shared<std::promise<Status>>();
  std::future<Status> f = result->get_future();
  copy(direction, dst, src, bytes, [result](Status s) { result->set_value(std::move(s)); });
  return f.get();
}

void DeviceCopier::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

uint64_t DeviceCopier::bytes_to_host() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lanes_[static_cast<size_t>(Direction::kToHost)].bytes;
}

uint64_t DeviceCopier::bytes_to_device() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lanes_[static_cast<size_t>(Direction::kToDevice)].bytes;
}

void DeviceCopier::run() {
  // Only this thread starts copies and reads lanes' running/current, so the
  // engine is called without mu_: enqueuers (the worker, under its own lock)
  // never wait for a copy to be queued or polled.
  using Clock = std::chrono::steady_clock;
  Clock::time_point waiting_since{};
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    bool progressed = false;
    for (size_t l = 0; l < 2; ++l) {
      Lane& lane = lanes_[l];
      if (lane.running || lane.queue.empty() || stopping_) continue;
      lane.current = std::move(lane.queue.front());
      lane.queue.pop_front();
      lane.running = true;
      const Job& j = lane.current;
      lock.unlock();
      Status s = engine_->copy_async(j.dst, j.src, j.bytes, l);
      lock.lock();
      if (!s.ok()) {
        lane.running = false;
        Done done = std::move(lane.current.done);
        lock.unlock();
        done(s.with_context(
            fmt::format("copying {} bytes {}", j.bytes, l == 0 ? "from the GPU" : "to the GPU")));
        lock.lock();
      }
      progressed = true;
    }
    if (!lanes_[0].running && !lanes_[1].running) {
      if (stopping_) break;
      if (!progressed) {
        cv_.wait(lock,
                 [&] { return stopping_ || !lanes_[0].queue.empty() || !lanes_[1].queue.empty(); });
      }
      continue;
    }
    for (size_t l = 0; l < 2; ++l) {
      Lane& lane = lanes_[l];
      if (!lane.running) continue;
      lock.unlock();
      Result<bool> idle = engine_->lane_idle(l);
      lock.lock();
      if (idle.ok() && !*idle) continue;
      lane.running = false;
      Status s =
          idle.ok()
              ? Status::Ok()
              : idle.status().with_context(fmt::format("copying {} bytes {}", lane.current.bytes,
                                                       l == 0 ? "from the GPU" : "to the GPU"));
      if (s.ok()) lane.bytes += lane.current.bytes;
      Done done = std::move(lane.current.done);
      lock.unlock();
      done(std::move(s));
      lock.lock();
      progressed = true;
    }
    if (progressed) {
      waiting_since = {};
      continue;
    }
    // A copy runs: a 4 MiB chunk takes ~100-300 us over PCIe. Yield for the
    // first 100 us so a short copy is seen at once, then poll every 50 us
    // rather than keep a core busy for a long one.
    const auto now = Clock::now();
    if (waiting_since == Clock::time_point{}) waiting_since = now;
    lock.unlock();
    if (now - waiting_since < std::chrono::microseconds(100)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    lock.lock();
  }
  // Stopping, nothing running: what never started fails.
  std::vector<Done> aborted;
  for (Lane& lane : lanes_) {
    for (Job& j : lane.queue)
      aborted.push_back(std::move(j.done));
    lane.queue.clear();
  }
  lock.unlock();
  for (Done& d : aborted)
    d(Aborted("the device copier stopped before this copy started"));
}

}  // namespace psld
