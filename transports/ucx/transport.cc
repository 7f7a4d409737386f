// UCX transport: shutdown, the Connection and Transport objects, the factory.
#include "transports/ucx/core.h"

#include <fmt/format.h>

#include <thread>

#include "transports/common/forwarding_transport.h"

namespace psld::transport {

namespace ucx_detail {

std::atomic<uint64_t> g_next_connection_id{1};

}  // namespace ucx_detail

// ---------------------------------------------------------------------------
// Shutdown

void UcxCore::shutdown() {
  std::vector<Event> events;
  {
    MutexLock lock(mu_);
    shut_ = true;
    if (worker_ != nullptr) {
      // No new connections: the listener and every bootstrap go first.
      if (listen_fd_ >= 0) {
        ::close(listen_fd_);
        listen_fd_ = -1;
      }
      std::vector<int> boots;
      for (auto& [fd, b] : boots_)
        boots.push_back(fd);
      for (int fd : boots) {
        if (auto it = boots_.find(fd); it != boots_.end()) {
          fail_boot(*it->second, Aborted("transport shut down"));
        }
      }
      std::vector<ConnPtr> conns;
      for (auto& [id, conn] : conns_)
        conns.push_back(conn);
      for (auto& conn : conns)
        close_locked(*conn, Aborted("transport shut down"), true);
      run_deferred();
      // Give the byes a moment to leave (they do not need the peer to
      // progress on tcp or shared memory); then close whatever is left.
      const auto give_up = Clock::now() + std::min<Clock::duration>(options_.common.op_timeout,
                                                                    std::chrono::milliseconds(200));
      for (;;) {
        bool waiting = false;
        for (auto& [id, conn] : conns_)
          waiting |= conn->bye_in_flight_;
        if (!waiting || Clock::now() > give_up) break;
        ucp_worker_progress(worker_);
        run_deferred();
      }
      for (auto& [id, conn] : conns_)
        to_close_.push_back(conn);
      run_deferred();
      // Then the endpoints to the peers.
      for (auto& [ep, instance] : ep_peers_)
        dead_eps_.push_back(ep);
      run_deferred();
      // Force-closing completes every request UCX still holds; wait (briefly)
      // for the close requests themselves.
      const auto close_by = Clock::now() + std::chrono::seconds(1);
      while (live_count_ > 0 && Clock::now() < close_by) {
        ucp_worker_progress(worker_);
        run_deferred();
      }
      {
        // Waits for copies into mapped memory still running in write().
        WriterLock map(mapping_mu_);
        MutexLock rlock(rkey_mu_);
        for (UcxRemoteRegion* remote : live_remotes_) {
          if (remote->rkey_ != nullptr) ucp_rkey_destroy(remote->rkey_);
          remote->rkey_ = nullptr;
          remote->mapped_base_ = nullptr;
        }
        live_remotes_.clear();
      }
      drain_graveyard();
      ucp_worker_destroy(worker_);
      worker_ = nullptr;
      // Requests UCX never called back for are gone with the worker.
      while (live_ops_ != nullptr)
        unlink_op(live_ops_);
      for (OpCtx* op : free_ops_)
        delete op;
      free_ops_.clear();
      by_token_.clear();
      peer_eps_.clear();
      ep_peers_.clear();
      dead_eps_.clear();
      conns_.clear();
      flushed_.clear();
      acks_.clear();
      ready_.clear();
      failed_.clear();
      to_close_.clear();
      rx_conns_.clear();
      dead_rings_.clear();
    }
    events.swap(events_);
  }
  // Wake threads in wait(); they find the worker gone.
  wake();
  for (int i = 0; i < 1000 && sleepers_.load() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Completions still owed are delivered here, exactly once; handler calls
  // are dropped (after shutdown no handler runs).
  for (Event& e : events) {
    if (e.kind == Event::kCompletion) e.ready.run();
  }
  for (auto& r : pending_.fail_all(Aborted("transport shut down")))
    r.run();
  cache_.clear();
  MutexLock lock(export_mu_);
  exported_.clear();
  unexported_.fetch_add(1, std::memory_order_release);
}

// ---------------------------------------------------------------------------
// Connection methods: thin wrappers that find the core.

Result<std::shared_ptr<RemoteRegion>> UcxConnection::import_region(std::span<const uint8_t> key) {
  auto core = core_.lock();
  if (!core) return Unavailable("UCX transport is gone");
  return core->import_region(*this, key);
}

Status UcxConnection::check_backend(const WriteRequest& request) const {
  auto core = core_.lock();
  if (!core) return Unavailable("UCX transport is gone");
  return core->check_backend(*this, request);
}

Status UcxConnection::start_write(const WriteRequest& request, Completion done) {
  if (!done && request.length <= kRingCopyMax && tx_ring_mapped_.load(std::memory_order_acquire)) {
    Status status;
    if (UcxCore::write_through_ring(*this, request, &status)) return status;
  }
  auto core = core_.lock();
  if (!core) return Unavailable("UCX transport is gone");
  return core->write(*this, request, std::move(done));
}

Status UcxConnection::send(std::span<const uint8_t> message, Completion done) {
  auto core = core_.lock();
  if (!core) return Unavailable("UCX transport is gone");
  return core->send(*this, message, std::move(done));
}

void UcxConnection::close() {
  if (auto core = core_.lock()) {
    core->close_connection(*this);
  } else {
    open_ = false;
  }
}

// ---------------------------------------------------------------------------

class UcxTransport final : public ForwardingTransport<std::shared_ptr<UcxCore>> {
 public:
  explicit UcxTransport(std::shared_ptr<UcxCore> core)
      : ForwardingTransport(&kUcxTransportTag, std::move(core)) {}
  ~UcxTransport() override { shutdown(); }

  std::string_view name() const override { return "ucx"; }
  const uint8_t* local_view(const RemoteRegion& remote) const override {
    // Host memory the peer allocated and this process mapped (shared memory
    // on one host); device memory is never read by this process's CPU.
    if (remote.backend() != &kUcxRemoteRegionTag) return nullptr;
    const auto& r = static_cast<const UcxRemoteRegion&>(remote);
    if (!r.mapped() || r.kind() != MemoryKind::kHost) return nullptr;
    return r.mapped_base();
  }

  const UcxCore& core() const { return *target_; }
};

Result<std::unique_ptr<Transport>> create_ucx_transport(const TransportOptions& options,
                                                        Handler* handler) {
  if (handler == nullptr) return InvalidArgument("create_ucx_transport needs a Handler");
  WritePath forced;
  if (options.ucx.write_path == "auto") {
    forced = WritePath::kAuto;
  } else if (options.ucx.write_path == "put") {
    forced = WritePath::kPut;
  } else if (options.ucx.write_path == "am") {
    forced = WritePath::kAm;
  } else {
    return InvalidArgument(
        fmt::format("ucx.write_path '{}' is not valid; accepted values: auto, "
                    "put, am",
                    options.ucx.write_path));
  }
  if (options.common.op_timeout.count() <= 0) {
    return InvalidArgument("common.op_timeout must be positive");
  }
  const uint32_t slots = options.ucx.notify_ring_slots;
  if (slots != 0 &&
      (slots < kMinRingSlots || slots > kMaxRingSlots || (slots & (slots - 1)) != 0)) {
    return InvalidArgument(
        fmt::format("ucx.notify_ring_slots {} is not valid; use a power of two from {} to {}, or "
                    "0 for no notification ring",
                    slots, kMinRingSlots, kMaxRingSlots));
  }
  sockaddr_storage listen{};
  socklen_t listen_len = 0;
  const bool listening = !options.common.listen_address.empty();
  if (listening) {
    PSLD_RETURN_IF_ERROR(
        parse_socket_address(options.common.listen_address, true, &listen, &listen_len)
            .with_context("common.listen_address"));
  }
  auto core = std::make_shared<UcxCore>(options, handler, forced);
  Status s = core->init(listening ? &listen : nullptr, listen_len);
  if (!s.ok()) {
    core->shutdown();
    return s;
  }
  return std::unique_ptr<Transport>(new UcxTransport(std::move(core)));
}

Result<UcxCounters> ucx_counters(const Transport& transport) {
  if (transport.backend() != &kUcxTransportTag) return InvalidArgument("not a UCX transport");
  return static_cast<const UcxTransport&>(transport).core().counters();
}

}  // namespace psld::transport
