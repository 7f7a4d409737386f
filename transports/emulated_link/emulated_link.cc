#include "transports/emulated_link/emulated_link.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "transports/common/forwarding_transport.h"

namespace psld::transport {
namespace {

// A token bucket expressed as "when is the link free again": an operation of
// n bytes occupies the link for n / rate seconds after the later of (the link
// being free) and (now minus one burst's worth of idle credit). It is released
// when its last byte would have left, so release times are monotonic and
// operations keep their order.
class Shaper {
 public:
  void configure(double rate, uint64_t burst) {
    rate_ = rate;
    burst_ = burst;
  }
  Clock::time_point release(uint64_t bytes, Clock::time_point now) {
    if (rate_ <= 0) return std::max(now, last_release_);
    const auto credit = seconds(static_cast<double>(burst_) / rate_);
    const auto start = std::max(now - credit, next_free_);
    next_free_ = start + seconds(static_cast<double>(bytes) / rate_);
    last_release_ = std::max({now, next_free_, last_release_});
    return last_release_;
  }
  // When the link can start the next operation (an unlimited one: always).
  Clock::time_point free_at() const { return rate_ <= 0 ? Clock::time_point::min() : next_free_; }

 private:
  static Clock::duration seconds(double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  }
  double rate_ = 0;
  uint64_t burst_ = 0;
  Clock::time_point next_free_{};
  Clock::time_point last_release_{};
};

class LinkTransport;

// Transport::backend() of the emulated link: how set_link tells its own.
const char kLinkTransportTag = 'T';

// Both shaped operations keep their completion in a shared slot: it is
// called exactly once, by the inner transport once issued, or with Aborted if
// the transport shuts down while the shaper still holds the operation.
struct HeldCompletion {
  std::mutex mu;
  Completion done;
  Completion take() {
    std::lock_guard<std::mutex> lock(mu);
    return std::move(done);
  }
};

class LinkConnection final : public Connection {
 public:
  // The regions it writes are the inner transport's, with their tags.
  LinkConnection(LinkTransport* owner, ConnectionPtr inner)
      : Connection(inner->region_tag(), inner->remote_tag()),
        owner_(owner),
        inner_(std::move(inner)) {}

  uint64_t id() const override { return inner_->id(); }
  std::string peer() const override { return inner_->peer(); }
  std::string write_path() const override { return inner_->write_path() + "+link"; }
  bool is_open() const override { return inner_->is_open(); }
  Result<std::shared_ptr<RemoteRegion>> import_region(std::span<const uint8_t> key) override {
    return inner_->import_region(key);
  }
  Status send(std::span<const uint8_t> message, Completion done) override;
  void close() override { inner_->close(); }

  const ConnectionPtr& inner() const { return inner_; }

 protected:
  Status check_backend(const WriteRequest& req) const override { return inner_->check_write(req); }
  Status start_write(const WriteRequest& req, Completion done) override;

 private:
  LinkTransport* owner_;
  ConnectionPtr inner_;
};

class LinkTransport final : public ForwardingTransport<std::unique_ptr<Transport>>, public Handler {
 public:
  LinkTransport(const LinkOptions& link, Handler* user, TimeSource time)
      : ForwardingTransport(&kLinkTransportTag, nullptr), user_(user), time_(time) {
    configure(link);
  }
  ~LinkTransport() override { shutdown(); }

  Status init(std::string_view inner, const TransportOptions& options) {
    PSLD_ASSIGN_OR_RETURN(inner_, create_transport(inner, options, this));
    name_ = std::string(inner_->name()) + "+link";
    return Status::Ok();
  }

  void configure(const LinkOptions& link) {
    std::lock_guard<std::mutex> lock(mu_);
    link_ = link;
    egress_.shaper.configure(link.egress_bytes_per_second, link.burst_bytes);
    egress_.latency = std::chrono::duration_cast<Clock::duration>(link.latency);
    ingress_.shaper.configure(link.ingress_bytes_per_second, link.burst_bytes);
  }
  LinkOptions link() const {
    std::lock_guard<std::mutex> lock(mu_);
    return link_;
  }

  std::string_view name() const override { return name_; }

  Result<ConnectionPtr> connect(std::span<const uint8_t> peer_address) override {
    PSLD_ASSIGN_OR_RETURN(ConnectionPtr inner, inner_->connect(peer_address));
    return ConnectionPtr(wrap(inner));
  }

  size_t progress() override {
    size_t n = inner_->progress();
    std::vector<std::function<void()>> due;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto now = time_.now();
      serve(egress_, now);
      serve(ingress_, now);
      while (!queue_.empty() && queue_.begin()->first.first <= now) {
        due.push_back(std::move(queue_.begin()->second.fn));
        queue_.erase(queue_.begin());
      }
    }
    for (auto& fn : due)
      fn();
    return n + due.size();
  }

  void wait(std::chrono::milliseconds timeout) override {
    auto limit = timeout;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto next = queue_.empty() ? Clock::time_point::max() : queue_.begin()->first.first;
      for (const Direction* d : {&egress_, &ingress_}) {
        if (!d->flows.empty()) next = std::min(next, d->shaper.free_at());
      }
      if (next != Clock::time_point::max()) {
        const auto until = next - time_.now();
        if (until <= Clock::duration::zero()) return;
        limit =
            std::min(limit, std::chrono::ceil<std::chrono::milliseconds>(time_.real_delay(until)));
      }
    }
    inner_->wait(limit);
  }

  void shutdown() override {
    if (shut_.exchange(true)) return;
    // Egress operations still held by the shaper never reached the inner
    // transport: fail them here, exactly once.
    std::vector<Action> held;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [when, action] : queue_)
        held.push_back(std::move(action));
      queue_.clear();
      for (auto& [conn, ops] : egress_.flows) {
        for (auto& op : ops)
          held.push_back(std::move(op.action));
      }
      egress_.flows.clear();
      ingress_.flows.clear();
    }
    if (inner_) inner_->shutdown();
    for (auto& action : held) {
      if (!action.held) continue;
      if (Completion done = action.held->take()) {
        done(Aborted("transport shut down before the emulated link sent this operation"));
      }
    }
  }

  // Schedules an egress operation of `bytes` on connection `conn`; `issue`
  // runs at its release.
  void egress(uint64_t conn, uint64_t bytes, std::function<void()> issue,
              std::shared_ptr<HeldCompletion> held) {
    std::lock_guard<std::mutex> lock(mu_);
    enqueue(egress_, conn, bytes + link_.per_op_overhead_bytes,
            Action{std::move(issue), std::move(held)});
  }

  // ---- Handler for the inner transport: ingress is shaped here.
  void on_accept(const ConnectionPtr& conn) override { user_->on_accept(wrap(conn)); }
  void on_write(const ConnectionPtr& conn, uint32_t notify, uint64_t length) override {
    auto wrapper = find(conn);
    if (!wrapper) return;
    ingress(conn->id(), length,
            [this, wrapper, notify, length] { user_->on_write(wrapper, notify, length); });
  }
  void on_message(const ConnectionPtr& conn, std::span<const uint8_t> message) override {
    auto wrapper = find(conn);
    if (!wrapper) return;
    auto copy = std::make_shared<std::vector<uint8_t>>(message.begin(), message.end());
    ingress(conn->id(), copy->size(), [this, wrapper, copy] { user_->on_message(wrapper, *copy); });
  }
  void on_disconnect(const ConnectionPtr& conn, const Status& why) override {
    auto wrapper = find(conn);
    if (!wrapper) return;
    // After the data that arrived before it, never before.
    std::lock_guard<std::mutex> lock(mu_);
    enqueue(ingress_, conn->id(), 0,
            Action{[this, wrapper, why, conn] {
                     user_->on_disconnect(wrapper, why);
                     std::lock_guard<std::mutex> l(mu_);
                     conns_.erase(conn->id());
                   },
                   nullptr});
  }

 private:
  struct Action {
    std::function<void()> fn;
    std::shared_ptr<HeldCompletion> held;  // egress only
  };
  // One direction of the link. Operations wait in per-connection FIFOs and
  // the link shares itself among the connections by bytes, as fair queuing
  // does (self-clocked: each operation is tagged with its connection's
  // finish time in bytes, counted from the tag of the one in service when
  // it arrived, and the smallest tag goes next); within a connection order
  // is kept. So a heartbeat on the coordinator's connection waits for at
  // most about one operation of each busy connection, and a connection that
  // sends many small messages gets its share of the bytes rather than one
  // message per turn: served one operation each, the coordinator's messages
  // (four a second) queued behind 4 MiB writes at 0.4 s each, without
  // bound, until a slow server's coordinator fell silent for seconds.
  struct Pending {
    uint64_t bytes;
    Clock::time_point queued;
    uint64_t tag;  // its connection's finish time, in bytes
    uint64_t seq;  // ties go to the one queued first
    Action action;
  };
  struct Direction {
    Shaper shaper;
    Clock::duration latency{0};
    // By connection id; only those with something waiting.
    std::map<uint64_t, std::deque<Pending>> flows;
    uint64_t virtual_bytes = 0;  // the tag of the operation served last
  };

  void ingress(uint64_t conn, uint64_t bytes, std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(mu_);
    enqueue(ingress_, conn, bytes + link_.per_op_overhead_bytes, Action{std::move(fn), nullptr});
  }

  // Called with mu_ held.
  void enqueue(Direction& d, uint64_t conn, uint64_t bytes, Action action) {
    const auto now = time_.now();
    std::deque<Pending>& flow = d.flows[conn];
    // After the connection's last waiting operation; a connection with none
    // waiting starts from the link's present, not from its own past (which
    // would let it catch up a burst). Waiting tags are never below
    // virtual_bytes: the smallest is served first.
    const uint64_t tag = (flow.empty() ? d.virtual_bytes : flow.back().tag) + bytes;
    flow.push_back(Pending{bytes, now, tag, seq_++, std::move(action)});
    serve(d, now);
  }

  // Hands the link, while it is free by `now`, to the waiting operation with
  // the smallest tag: it is released when its last byte would have left,
  // counted from when it was queued (a progress() call that comes late
  // changes nothing). A connection leaves `flows` when its queue empties.
  // Called with mu_ held.
  void serve(Direction& d, Clock::time_point now) {
    while (!d.flows.empty() && d.shaper.free_at() <= now) {
      auto next = d.flows.begin();
      for (auto it = std::next(next); it != d.flows.end(); ++it) {
        const Pending& a = it->second.front();
        const Pending& b = next->second.front();
        if (a.tag < b.tag || (a.tag == b.tag && a.seq < b.seq)) next = it;
      }
      Pending op = std::move(next->second.front());
      next->second.pop_front();
      if (next->second.empty()) d.flows.erase(next);
      d.virtual_bytes = std::max(d.virtual_bytes, op.tag);
      const auto at = d.shaper.release(op.bytes, op.queued) + d.latency;
      queue_.emplace(std::make_pair(at, seq_++), std::move(op.action));
    }
  }

  std::shared_ptr<LinkConnection> wrap(const ConnectionPtr& inner) {
    auto wrapper = std::make_shared<LinkConnection>(this, inner);
    std::lock_guard<std::mutex> lock(mu_);
    conns_[inner->id()] = wrapper;
    return wrapper;
  }
  std::shared_ptr<LinkConnection> find(const ConnectionPtr& inner) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = conns_.find(inner->id());
    return it == conns_.end() ? nullptr : it->second;
  }

  Handler* user_;
  const TimeSource time_;
  // The wrapped transport (ForwardingTransport's target), set by init().
  std::unique_ptr<Transport>& inner_ = target_;
  std::string name_;
  std::atomic<bool> shut_{false};

  mutable std::mutex mu_;
  LinkOptions link_;
  Direction egress_;
  Direction ingress_;
  uint64_t seq_ = 0;  // orders operations queued or released at the same moment
  // Operations the link has served, by release time.
  std::map<std::pair<Clock::time_point, uint64_t>, Action> queue_;
  std::map<uint64_t, std::shared_ptr<LinkConnection>> conns_;
};

Status LinkConnection::start_write(const WriteRequest& req, Completion done) {
  PSLD_RETURN_IF_ERROR(check_backend(req));
  auto held = std::make_shared<HeldCompletion>();
  held->done = std::move(done);
  ConnectionPtr inner = inner_;
  owner_->egress(
      id(), req.length,
      [inner, req, held] {
        Completion done = held->take();
        Status s = inner->write(req, done);
        if (!s.ok() && done) done(s);
      },
      held);
  return Status::Ok();
}

Status LinkConnection::send(std::span<const uint8_t> message, Completion done) {
  if (message.size() > kMaxMessageBytes) {
    return InvalidArgument(fmt::format("message of {} bytes exceeds the {}-byte limit",
                                       message.size(), kMaxMessageBytes));
  }
  if (!is_open()) return Unavailable("connection to " + peer() + " is closed");
  auto copy = std::make_shared<std::vector<uint8_t>>(message.begin(), message.end());
  auto held = std::make_shared<HeldCompletion>();
  held->done = std::move(done);
  ConnectionPtr inner = inner_;
  owner_->egress(
      id(), copy->size(),
      [inner, copy, held] {
        Completion done = held->take();
        Status s = inner->send(*copy, done);
        if (!s.ok() && done) done(s);
      },
      held);
  return Status::Ok();
}

}  // namespace

Status validate_link_options(const LinkOptions& link) {
  if (!(link.egress_bytes_per_second >= 0) || !std::isfinite(link.egress_bytes_per_second)) {
    return InvalidArgument(
        "link.egress_bytes_per_second must be a finite value >= 0 (0: unlimited)");
  }
  if (!(link.ingress_bytes_per_second >= 0) || !std::isfinite(link.ingress_bytes_per_second)) {
    return InvalidArgument(
        "link.ingress_bytes_per_second must be a finite value >= 0 (0: unlimited)");
  }
  if (link.latency.count() < 0) return InvalidArgument("link.latency must be >= 0");
  if (link.burst_bytes == 0) return InvalidArgument("link.burst_bytes must be at least 1");
  return Status::Ok();
}

Result<std::unique_ptr<Transport>> create_emulated_link(std::string_view inner,
                                                        const TransportOptions& options,
                                                        const LinkOptions& link, Handler* handler,
                                                        TimeSource time) {
  if (handler == nullptr) return InvalidArgument("create_emulated_link needs a Handler");
  PSLD_RETURN_IF_ERROR(validate_link_options(link));
  auto t = std::make_unique<LinkTransport>(link, handler, time);
  PSLD_RETURN_IF_ERROR(t->init(inner, options));
  return std::unique_ptr<Transport>(std::move(t));
}

Status set_link(Transport& transport, const LinkOptions& link) {
  if (transport.backend() != &kLinkTransportTag) {
    return InvalidArgument(fmt::format("transport '{}' is not an emulated link", transport.name()));
  }
  PSLD_RETURN_IF_ERROR(validate_link_options(link));
  static_cast<LinkTransport&>(transport).configure(link);
  return Status::Ok();
}

LinkOptions get_link(const Transport& transport) {
  if (transport.backend() != &kLinkTransportTag) return LinkOptions{};
  return static_cast<const LinkTransport&>(transport).link();
}

}  // namespace psld::transport
