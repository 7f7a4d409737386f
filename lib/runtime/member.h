// MemberSession: a worker's or server's conversation with the coordinator —
// admission (Challenge / Hello / Welcome), the job state it hands out (server
// list, placement), tensor registration, barriers, heartbeats in both
// directions, and the job's end (Shutdown, or JobFailed with the reason).
//
// The owning ProcessRuntime forwards the coordinator connection's messages and
// disconnect to handle() / on_disconnect(); blocking calls wait on a
// condition variable and give up with a clear error when the job fails, the
// coordinator goes silent, or their timeout passes.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "base/mutex.h"
#include "lib/config/runtime_options.h"
#include "lib/placement/placement.h"
#include "lib/protocol/protocol.h"
#include "lib/runtime/runtime.h"

namespace psld {

class MemberSession {
 public:
  MemberSession(ProcessRuntime& runtime, Role role, const RuntimeOptions& options);
  ~MemberSession();

  // Connects, proves the secret, and waits for Welcome and the job state
  // (server list and placement) until connect_timeout. Starts heartbeats.
  Status join(std::vector<uint8_t> listen_address);

  // Returns true when `conn` is the coordinator's connection and the message
  // was consumed.
  bool handle(const transport::ConnectionPtr& conn, protocol::Message& message);
  bool on_disconnect(const transport::ConnectionPtr& conn, const Status& why);

  // Ok while the job runs; the reason once it failed or the coordinator is lost.
  Status health() const;
  bool shutdown_requested() const;
  // Waits until the coordinator says the job is over (servers) or it fails.
  Status wait_for_shutdown(std::chrono::milliseconds timeout);

  const protocol::Welcome& welcome() const { return welcome_; }
  std::vector<protocol::ServerEntry> servers() const;
  std::shared_ptr<const Placement> placement() const;

  Result<protocol::TensorInfo> register_tensor(const protocol::RegisterTensor& request,
                                               std::chrono::milliseconds timeout);
  Status barrier(std::chrono::milliseconds timeout);
  // Tells the coordinator this member is done (workers) and stops heartbeats.
  void goodbye();
  // Reports a local fatal error to the coordinator, which fails the job.
  void report_failure(const std::string& reason);

  // Load reports: every `interval` (nothing when it is zero) a thread calls
  // make(the window's length in ns) and sends what it returns to the
  // coordinator. stop_reports() sends one last window and joins the thread;
  // the owner calls it before tearing down what `make` reads.
  using ReportFn = std::function<std::vector<protocol::Message>(uint64_t window_ns)>;
  // Placement epoch changes from the coordinator go to `fn` (on the
  // transport's thread). Set before join().
  using EpochFn = std::function<void(const protocol::EpochChange&)>;
  void on_epoch(EpochFn fn) {
    MutexLock lock(mu_);
    on_epoch_ = std::move(fn);
  }
  // The end of a transfer (EpochFinal, servers) goes to `fn`, like on_epoch.
  using FinalFn = std::function<void(const protocol::EpochFinal&)>;
  void on_final(FinalFn fn) {
    MutexLock lock(mu_);
    on_final_ = std::move(fn);
  }
  // A LowWatermark from the coordinator (servers) goes to `fn`, like on_epoch.
  using WatermarkFn = std::function<void(const protocol::LowWatermark&)>;
  void on_watermark(WatermarkFn fn) {
    MutexLock lock(mu_);
    on_watermark_ = std::move(fn);
  }
  // A CheckpointSeal from the coordinator (servers) goes to `fn`, like on_epoch.
  using SealFn = std::function<void(const protocol::CheckpointSeal&)>;
  void on_seal(SealFn fn) {
    MutexLock lock(mu_);
    on_seal_ = std::move(fn);
  }
  // `fn` runs on the heartbeat thread once per heartbeat interval, from
  // join() until it is replaced: the owner's clock for deadlines that no
  // message may ever come to check (a transfer's fallback, a lost server's
  // grace period). Replacing it (with nullptr before the owner goes away)
  // waits for a call in progress; `fn` must not call on_tick itself.
  using TickFn = std::function<void()>;
  void on_tick(TickFn fn);
  // Sends a message to the coordinator (Unavailable when not connected).
  Status send_to_coordinator(const protocol::Message& message);
  Status start_reports(std::chrono::milliseconds interval, ReportFn make);
  void stop_reports();

 private:
  void heartbeat_loop();
  void report_loop(std::chrono::milliseconds interval, const ReportFn& make);
  void fail(const std::string& reason) REQUIRES(mu_);

  ProcessRuntime& runtime_;
  const Role role_;
  const RuntimeOptions options_;
  transport::ConnectionPtr coordinator_;
  bool joining_ GUARDED_BY(mu_) = false;
  bool heard_ GUARDED_BY(mu_) = false;   // the coordinator said something
  Status dial_failure_ GUARDED_BY(mu_);  // the connection failed before that
  std::vector<protocol::Message> early_ GUARDED_BY(mu_);

  mutable Mutex mu_;
  std::condition_variable cv_;
  bool welcomed_ GUARDED_BY(mu_) = false;
  std::string rejected_ GUARDED_BY(mu_);
  // Whom the job waited for, as the coordinator last said (before the start).
  std::optional<protocol::JoinWaiting> waiting_ GUARDED_BY(mu_);
  protocol::Welcome welcome_ GUARDED_BY(mu_);
  // The coordinator's challenge and our answer, which its Welcome must prove.
  std::optional<protocol::Nonce> challenge_ GUARDED_BY(mu_);
  protocol::Hello hello_ GUARDED_BY(mu_);
  std::vector<uint8_t> listen_address_ GUARDED_BY(mu_);
  std::vector<protocol::ServerEntry> servers_ GUARDED_BY(mu_);
  bool have_servers_ GUARDED_BY(mu_) = false;
  std::map<uint32_t, std::vector<uint8_t>> placement_pieces_ GUARDED_BY(mu_);
  uint32_t placement_count_ GUARDED_BY(mu_) = 0;
  std::shared_ptr<const Placement> placement_ GUARDED_BY(mu_);
  std::map<uint64_t, Result<protocol::TensorInfo>> registrations_ GUARDED_BY(mu_);
  uint64_t next_request_ GUARDED_BY(mu_) = 1;
  std::set<uint64_t> released_barriers_ GUARDED_BY(mu_);
  uint64_t next_barrier_ GUARDED_BY(mu_) = 1;
  Status health_ GUARDED_BY(mu_);
  bool shutdown_ GUARDED_BY(mu_) = false;
  bool goodbye_ GUARDED_BY(mu_) = false;
  transport::Clock::time_point last_heard_ GUARDED_BY(mu_);
  std::thread heartbeat_;
  std::thread reporter_;
  EpochFn on_epoch_ GUARDED_BY(mu_);
  FinalFn on_final_ GUARDED_BY(mu_);
  WatermarkFn on_watermark_ GUARDED_BY(mu_);
  SealFn on_seal_ GUARDED_BY(mu_);
  Mutex tick_mu_;  // held while tick_ runs
  TickFn tick_ GUARDED_BY(tick_mu_);
  bool reports_stop_ GUARDED_BY(mu_) = false;
};

}  // namespace psld
