// The verbs Transport: shutdown and teardown, connection methods, the factory.
#include "transports/verbs/verbs_transport.h"

#include <unistd.h>

#include <cstdlib>
#include <thread>

#include "base/log.h"
#include "transports/common/forwarding_transport.h"
#include "transports/verbs/core.h"

namespace psld::transport {
namespace verbs {

// ---------------------------------------------------------------------------
// shutdown and teardown

void Core::shutdown() {
  Events failed;
  {
    MutexLock lock(mu_);
    if (shut_.exchange(true)) return;
    if (listen_fd_ >= 0) {
      epoll_del(listen_fd_);
      ::close(listen_fd_);
      listen_fd_ = -1;
    }
    std::vector<ConnPtr> all;
    for (auto& [id, c] : conns_) {
      all.push_back(c);
    }
    Events events;
    for (auto& c : all) {
      break_locked(c, Aborted("transport shut down"), true, events);
    }
    for (Event& e : deferred_) {
      events.push_back(std::move(e));
    }
    deferred_.clear();
    // Completions still owed run below, exactly once; handler events are
    // dropped (after shutdown no handler runs).
    for (Event& e : events) {
      if (e.kind == Event::Kind::kCompletion) failed.push_back(std::move(e));
    }
  }
  for (auto& r : pending_.fail_all(Aborted("transport shut down"))) {
    push_ready(failed, std::move(r));
  }
  for (Event& e : failed) {
    e.ready.run();
  }
  failed.clear();
  if (progress_owner_.load() == std::this_thread::get_id()) {
    teardown_deferred_ = true;  // a handler inside progress(): it tears down on return
  } else {
    MutexLock progress_lock(progress_mu_);
    teardown();
  }
  wake();
}

// Releases the device in dependency order: QPs (flushed), SRQ, CQs,
// completion channel, MRs, PD, device context. Idempotent; the destructor
// calls it too (after a failed init, with whatever init created).
void Core::teardown() {
  // Regions released here must not be destroyed under pd_mu_ (their
  // destructor takes it shared): they die with this vector, after the locks.
  std::vector<std::shared_ptr<const VerbsRegion>> released;
  MutexLock lock(mu_);
  if (torn_down_) return;
  torn_down_ = true;
  shut_ = true;

  // Collect the flushed completions of posted sends (every QP is in ERR
  // already), so bounce buffers and source regions are released in order.
  const auto deadline = Clock::now() + kTeardownDrain;
  auto busy = [&]() REQUIRES(mu_) {
    for (auto& [id, c] : conns_) {
      if (!c->inflight_.empty()) return true;
    }
    return false;
  };
  while (send_cq_ != nullptr && busy() && Clock::now() < deadline) {
    ibv_wc wcs[kPollBatch];
    const int n = ibv_poll_cq(send_cq_, kPollBatch, wcs);
    if (n < 0) break;
    for (int i = 0; i < n; ++i) {
      ConnPtr c = find_qp_locked(wcs[i].qp_num);
      if (!c) continue;
      auto it = c->inflight_.find(wcs[i].wr_id);
      if (it == c->inflight_.end()) continue;
      if (it->second.bounce >= 0) send_pool_.free.push_back(it->second.bounce);
      released.push_back(std::move(it->second.src));
      c->inflight_.erase(it);
      c->sq_.complete();
    }
    if (n == 0) std::this_thread::sleep_for(100us);
  }
  for (auto& [id, c] : conns_) {
    for (auto& [wr_id, rec] : c->inflight_) {
      released.push_back(std::move(rec.src));
    }
    destroy_qp_locked(*c);
  }
  conns_.clear();
  by_qp_.clear();
  send_stash_.clear();
  recv_stash_.clear();
  deferred_.clear();

  if (srq_ != nullptr) {
    if (const int rc = ibv_destroy_srq(srq_); rc != 0) {
      PSLD_LOG_WARN("verbs: ibv_destroy_srq: {}", errno_text(rc));
    }
    srq_ = nullptr;
  }
  drain_cq_events_locked();  // every CQ event must be acked before the CQ goes
  for (ibv_cq** cq : {&send_cq_, &recv_cq_}) {
    if (*cq != nullptr) {
      if (const int rc = ibv_destroy_cq(*cq); rc != 0) {
        PSLD_LOG_WARN("verbs: ibv_destroy_cq: {}", errno_text(rc));
      }
      *cq = nullptr;
    }
  }
  if (channel_ != nullptr) {
    epoll_del(channel_->fd);
    if (const int rc = ibv_destroy_comp_channel(channel_); rc != 0) {
      PSLD_LOG_WARN("verbs: ibv_destroy_comp_channel: {}", errno_text(rc));
    }
    channel_ = nullptr;
  }
  {
    WriterLock pd_lock(pd_mu_);
    for (BufferPool* pool : {&recv_pool_, &send_pool_}) {
      if (pool->mr != nullptr) ibv_dereg_mr(pool->mr);
      pool->mr = nullptr;
      std::free(pool->mem);
      pool->mem = nullptr;
      pool->free.clear();
    }
    {
      MutexLock regions_lock(regions_mu_);
      for (auto& [id, mr] : mrs_) {
        if (const int rc = ibv_dereg_mr(mr); rc != 0) {
          PSLD_LOG_WARN("verbs: ibv_dereg_mr of region {}: {}", id, errno_text(rc));
        }
      }
      mrs_.clear();
    }
    if (pd_ != nullptr) {
      if (const int rc = ibv_dealloc_pd(pd_); rc != 0) {
        PSLD_LOG_WARN("verbs: ibv_dealloc_pd: {}", errno_text(rc));
      }
      pd_ = nullptr;
    }
  }
  if (ctx_ != nullptr) {
    epoll_del(ctx_->async_fd);
    ibv_close_device(ctx_);
    ctx_ = nullptr;
  }
  if (listen_fd_ >= 0) {
    epoll_del(listen_fd_);
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
  cache_.clear();
}

// ---------------------------------------------------------------------------
// Connection methods: forward to the core, or fail once it is gone.

Result<std::shared_ptr<RemoteRegion>> VerbsConnection::import_region(std::span<const uint8_t> key) {
  auto core = core_.lock();
  if (!core) return Unavailable("verbs transport is gone");
  return core->import_region(*this, key);
}

Status VerbsConnection::check_backend(const WriteRequest& request) const {
  auto core = core_.lock();
  if (!core) return Unavailable("verbs transport is gone");
  return core->check_backend(*this, request);
}

Status VerbsConnection::start_write(const WriteRequest& request, Completion done) {
  auto core = core_.lock();
  if (!core) return Unavailable("verbs transport is gone");
  return core->write(*this, request, std::move(done));
}

Status VerbsConnection::send(std::span<const uint8_t> message, Completion done) {
  auto core = core_.lock();
  if (!core) return Unavailable("verbs transport is gone");
  return core->send(*this, message, std::move(done));
}

void VerbsConnection::close() {
  if (auto core = core_.lock()) core->close(*this);
  open_ = false;
}

// ---------------------------------------------------------------------------

class VerbsTransport final : public ForwardingTransport<std::shared_ptr<Core>> {
 public:
  explicit VerbsTransport(std::shared_ptr<Core> core)
      : ForwardingTransport(nullptr, std::move(core)) {}
  ~VerbsTransport() override { shutdown(); }

  std::string_view name() const override { return "verbs"; }
};

}  // namespace verbs

Result<std::unique_ptr<Transport>> create_verbs_transport(const TransportOptions& options,
                                                          Handler* handler) {
  if (handler == nullptr) return InvalidArgument("create_verbs_transport needs a Handler");
  PSLD_RETURN_IF_ERROR(verbs::validate_verbs_options(options));
  auto core = std::make_shared<verbs::Core>(options, handler);
  PSLD_RETURN_IF_ERROR(core->init());
  return std::unique_ptr<Transport>(new verbs::VerbsTransport(std::move(core)));
}

}  // namespace psld::transport
