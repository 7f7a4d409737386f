#include "lib/worker/service.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "base/block_pool.h"
#include "base/log.h"
#include "base/secret.h"
#include "gpu/cuda_copy_engine.h"
#include "kernels/dispatch.h"

namespace psld {

using transport::Clock;
using transport::ConnectionPtr;

// ---- RequestState

void RequestState::complete_part(const Status& status) {
  {
    MutexLock lock(mu_);
    if (done_.load(std::memory_order_relaxed)) return;
    if (!status.ok() && status_.ok()) status_ = status;
    if (--remaining_ != 0 && status.ok()) return;  // waiters wait for done_ only: no wake-up
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

Status RequestState::wait(std::chrono::milliseconds timeout) {
  // Most requests of a round are done by the time they are waited for.
  if (done_.load(std::memory_order_acquire)) return final_status();
  UniqueLock lock(mu_);
  if (!cv_.wait_for(lock.native(), timeout,
                    [&] { return done_.load(std::memory_order_relaxed); })) {
    return Timeout(fmt::format("request not complete after {} ms ({} chunk operations pending)",
                               timeout.count(), remaining_));
  }
  return status_;
}

bool RequestState::test() const {
  return done_.load(std::memory_order_acquire);
}

Status RequestState::status() const {
  if (done_.load(std::memory_order_acquire)) return final_status();
  MutexLock lock(mu_);
  return status_;
}

// status_ once done_ was seen set: written before done_ and never after.
Status RequestState::final_status() const NO_THREAD_SAFETY_ANALYSIS {
  return status_;
}

// ---- WorkerService

Result<std::unique_ptr<WorkerService>> WorkerService::start(const RuntimeOptions& options) {
  std::unique_ptr<WorkerService> w(new WorkerService(options));
  PSLD_ASSIGN_OR_RETURN(w->load_, LoadRecorder::make(Role::kWorker));
  NetOptions ep = options.net;
  ep.options.common.listen_address.clear();  // workers only dial
  PSLD_RETURN_IF_ERROR(w->ProcessRuntime::start(ep, options.secret));
  w->session_.on_epoch([wk = w.get()](const protocol::EpochChange& e) { wk->on_epoch_change(e); });
  w->session_.on_tick([wk = w.get()] { wk->on_tick(); });
  PSLD_RETURN_IF_ERROR(w->session_.join({}));
  w->trace_ = TraceRecorder::make(options.trace, "worker", w->rank());
  std::vector<protocol::EpochChange> early;
  {
    MutexLock lock(w->mu_);
    w->epochs_.emplace(w->session_.placement());
    early.swap(w->early_epochs_);
  }
  for (const auto& e : early)
    w->on_epoch_change(e);
  PSLD_RETURN_IF_ERROR(w->connect_servers());
  if (options.batch_chunk_bytes > 0) {
    // As many batches in flight as slots a server grants each worker.
    const uint64_t buffer = std::min(options.batch_bytes, options.chunk_bytes);
    auto pool =
        w->transport().allocate_memory(options.slots_per_worker * buffer, MemoryKind::kHost);
    if (!pool.ok()) return pool.status().with_context("allocating the buffers of push batches");
    w->batch_pool_ = *pool;
    w->batch_buffer_bytes_ = buffer;
    {
      MutexLock lock(w->mu_);
      for (uint32_t i = options.slots_per_worker; i > 0; --i)
        w->free_batch_buffers_.push_back(i - 1);
    }
    PSLD_RETURN_IF_ERROR(w->grant_answer_slots());
  }
  {
    MutexLock lock(w->mu_);
    w->load_->set_peer_limit(
        worker_peer_limit(options.worker_peers, w->num_workers(), w->servers_.size()));
  }
  Status reports =
      w->session_.start_reports(options.stats_interval, [wk = w.get()](uint64_t window_ns) {
        std::vector<protocol::Message> out;
        uint64_t epoch = 0;
        {
          MutexLock lock(wk->mu_);
          epoch = wk->epochs_->latest().epoch();
        }
        for (auto& r : wk->load_->close_window(wk->rank(), epoch, window_ns)) {
          r.rounds = wk->max_round_.load();  // workers: the highest round pushed
          out.emplace_back(std::move(r));
        }
        out.emplace_back(wk->progress());
        return out;
      });
  PSLD_RETURN_IF_ERROR(reports);
  w->gpu_path_text_ = describe_gpu_path(options.gpu_path, w->transport());
  size_t num_servers = 0;
  {
    MutexLock lock(w->mu_);
    num_servers = w->servers_.size();
  }
  PSLD_LOG_INFO("worker {} of {} joined; {} servers; CUDA tensors: {}", w->rank(), w->num_workers(),
                num_servers, w->gpu_path_text_);
  return w;
}

WorkerService::WorkerService(const RuntimeOptions& options)
    : options_(options), session_(*this, Role::kWorker, options) {}

WorkerService::~WorkerService() {
  (void)shutdown();
}

Status WorkerService::connect_servers() {
  const uint32_t rank = session_.welcome().rank;
  for (const auto& entry : session_.servers()) {
    std::string address(entry.address.begin(), entry.address.end());
    {
      MutexLock lock(mu_);
      if (removed_servers_.count(entry.rank)) {
        // Lost before this worker dialed it: the epoch that removed it
        // routes nothing to it.
        ServerConn& s = servers_[entry.rank];
        s.rank = entry.rank;
        s.lost = true;
        s.lost_why = Unavailable(fmt::format("server {} was removed from the job", entry.rank));
        continue;
      }
    }
    auto conn = connect_text(transport(), address);
    protocol::PeerHello hello;
    {
      MutexLock lock(mu_);
      ServerConn& s = servers_[entry.rank];
      s.rank = entry.rank;
      if (!conn.ok()) {
        // A server that died while this worker joined is lost like one that
        // dies later: the coordinator removes it (replication) or fails the
        // job; the wait below sees which.
        server_lost(s, conn.status().with_context(
                           fmt::format("connecting to server {} at {}", entry.rank, address)));
        continue;
      }
      s.conn = *conn;
      s.dial.emplace(Role::kWorker, rank);
      hello = s.dial->hello;
    }
    if (Status sent = send(*conn, hello); !sent.ok()) {
      MutexLock lock(mu_);
      server_lost(servers_[entry.rank],
                  sent.with_context(fmt::format("greeting server {} at {}", entry.rank, address)));
    }
  }
  flush();
  // Every server grants landing slots, refuses this worker, or is lost and
  // removed from the job by the coordinator.
  UniqueLock lock(mu_);
  const bool ok = cv_.wait_for(lock.native(), options_.connect_timeout, [&]() REQUIRES(mu_) {
    if (!session_.health().ok()) return true;
    for (const auto& [r, s] : servers_) {
      if (!s.granted && s.refused.ok() && !removed_servers_.count(r)) return false;
    }
    return true;
  });
  PSLD_RETURN_IF_ERROR(session_.health());
  for (const auto& [r, s] : servers_) {
    if (!s.refused.ok() && !removed_servers_.count(r)) {
      return s.refused.with_context(fmt::format("server {} at {}", r, s.conn->peer()));
    }
  }
  if (!ok) {
    for (const auto& [r, s] : servers_) {
      if (s.granted || removed_servers_.count(r) || !s.lost) continue;
      return Unavailable(fmt::format(
          "{}; the coordinator neither removed the server nor ended the job within {} ms",
          s.lost_why.message(), options_.connect_timeout.count()));
    }
    return Timeout("not every server granted landing slots in time");
  }
  return Status::Ok();
}

WorkerService::ServerConn* WorkerService::server_of(const ConnectionPtr& conn) {
  for (auto& [rank, s] : servers_) {
    if (s.conn && s.conn->id() == conn->id()) return &s;
  }
  return nullptr;
}

// The data handshake's dialing end (protocol.h): answer the server's
// challenge, then take its grant once it proved it knows the secret.
void WorkerService::handshake(ServerConn& s, protocol::Message& message) {
  if (auto* c = std::get_if<protocol::Challenge>(&message)) {
    if (auto answer = s.dial->answer(options_.secret, *c)) {
      outbox_.push_back([this, conn = s.conn, p = *answer] { (void)send(conn, p); });
    }
    return;
  }
  if (auto* e = std::get_if<protocol::Error>(&message)) {
    s.refused = FailedPrecondition(e->message);
    return;
  }
  auto* g = std::get_if<protocol::Grant>(&message);
  if (g == nullptr) {
    PSLD_LOG_WARN("worker: {} from server {} before its grant; ignored",
                  protocol::message_name(message), s.rank);
    return;
  }
  if (!s.dial->proves(options_.secret, *g)) {
    s.refused = FailedPrecondition(fmt::format(
        "the server did not prove it knows the job secret ({})", kSameSecretEverywhere));
    return;
  }
  if (g->num_slots == 0) {
    s.refused = DataLoss("the server granted no landing slots");
    return;
  }
  auto slots = s.conn->import_region(g->slots_key);
  if (!slots.ok()) {
    s.refused = slots.status().with_context("the server's grant does not import");
    return;
  }
  s.slots = *slots;
  s.slot_bytes = g->slot_bytes;
  for (uint32_t i = 0; i < g->num_slots; ++i)
    s.free_slots.push_back(i);
  s.granted = true;
}

void WorkerService::on_control(const ConnectionPtr& conn, protocol::Message&& message) {
  if (session_.handle(conn, message)) {
    // A failed job fails every outstanding request at once.
    Status h = session_.health();
    if (!h.ok()) {
      MutexLock lock(mu_);
      fail_everything(h);
      cv_.notify_all();
    }
    return;
  }
  {
    MutexLock lock(mu_);
    ServerConn* s = server_of(conn);
    if (s == nullptr) return;
    if (!s->granted) {
      handshake(*s, message);
      cv_.notify_all();
    } else if (std::holds_alternative<protocol::Grant>(message)) {
      PSLD_LOG_WARN("worker: a second grant from server {}; ignored", s->rank);
    } else if (auto* c = std::get_if<protocol::Credit>(&message)) {
      for (uint32_t tag : c->accepted)
        finish_tag(tag, Status::Ok());
      for (uint32_t slot : c->slots)
        s->free_slots.push_back(slot);
      pump(*s);
    } else if (auto* a = std::get_if<protocol::Ack>(&message)) {
      auto it = acks_wanted_.find(a->request);
      if (it != acks_wanted_.end()) {
        it->second.erase(s->rank);
        auto t = ack_tensor_.find(a->request);
        if ((a->flags & protocol::kAckMapped) && t != ack_tensor_.end())
          s->mapped.insert(t->second);
      }
      cv_.notify_all();
    } else if (auto* e = std::get_if<protocol::Error>(&message)) {
      Status st(static_cast<StatusCode>(e->code),
                fmt::format("server {}: {}", s->rank, e->message));
      if (e->tag != 0 && pending_.contains(e->tag)) {
        finish_tag(e->tag, st);
      } else {
        PSLD_LOG_ERROR("{}", st.to_string());
      }
    } else if (auto* m = std::get_if<protocol::Moved>(&message)) {
      on_moved(*s, *m);
    } else {
      PSLD_LOG_WARN("worker: unexpected {} from server {}", protocol::message_name(message),
                    s->rank);
    }
  }
  flush();
}

Status WorkerService::grant_answer_slots() {
  // By default enough for a server to have a batch in flight while the last
  // one is copied out; a server that finds none free writes its answers one
  // by one.
  const uint32_t answer_slots = options_.answer_slots;
  if (answer_slots == 0) return Status::Ok();
  const uint64_t slot_bytes =
      std::max<uint64_t>(batch_buffer_bytes_, 2 * protocol::kAnswerDataOffset);
  std::vector<uint32_t> ranks;
  {
    MutexLock lock(mu_);
    for (const auto& [r, s] : servers_) {
      if (!s.lost) ranks.push_back(r);
    }
  }
  // Allocated outside mu_: the transport's handlers take mu_.
  std::vector<std::shared_ptr<transport::MemoryRegion>> regions;
  for (uint32_t r : ranks) {
    auto region = transport().allocate_memory(answer_slots * slot_bytes, MemoryKind::kHost);
    if (!region.ok()) {
      return region.status().with_context(fmt::format("allocating answer slots for server {}", r));
    }
    regions.push_back(*region);
  }
  std::vector<std::pair<ConnectionPtr, protocol::AnswerSlots>> grants;
  {
    MutexLock lock(mu_);
    for (size_t i = 0; i < ranks.size(); ++i) {
      ServerConn& s = servers_[ranks[i]];
      s.answers = regions[i];
      s.answer_slot_bytes = slot_bytes;
      s.answer_slots = answer_slots;
      grants.emplace_back(
          s.conn, protocol::AnswerSlots{answer_slots, slot_bytes,
                                        std::vector<uint8_t>(s.answers->remote_key().begin(),
                                                             s.answers->remote_key().end())});
    }
  }
  for (auto& [conn, grant] : grants) {
    // A server lost since is the coordinator's to remove (or to end the job
    // for); the grant matters no more.
    if (Status sent = send(conn, grant); !sent.ok() && conn->is_open()) return sent;
  }
  return Status::Ok();
}

void WorkerService::take_answers(ServerConn& s, uint32_t slot, uint64_t length) {
  // A server of this job wrote it, and still nothing in it is trusted: a
  // malformed batch is logged and dropped (its pulls time out).
  auto malformed = [&](std::string_view why) REQUIRES(mu_) {
    PSLD_LOG_ERROR("worker {}: a batch of answers from server {} in slot {}: {}; dropped", rank(),
                   s.rank, slot, why);
  };
  if (!s.answers || slot >= s.answer_slots) return malformed("no such slot");
  if (length < sizeof(protocol::AnswerHeader) || length > s.answer_slot_bytes) {
    return malformed("a write of the wrong length");
  }
  const uint8_t* base = s.answers->data() + uint64_t{slot} * s.answer_slot_bytes;
  protocol::AnswerHeader header;
  std::memcpy(&header, base, sizeof(header));
  if (header.magic != protocol::kAnswerMagic || header.count == 0 ||
      header.count > protocol::kMaxAnswerEntries ||
      sizeof(header) + header.count * sizeof(protocol::AnswerEntry) > protocol::kAnswerDataOffset) {
    return malformed("not a table of answers");
  }
  for (uint32_t i = 0; i < header.count; ++i) {
    protocol::AnswerEntry e;
    std::memcpy(&e, base + sizeof(header) + i * sizeof(e), sizeof(e));
    const Pending* pending = pending_.find(e.tag);
    if (pending == nullptr) continue;  // failed meanwhile (or sent elsewhere), as on_write
    if (!pending->lands || pending->server != s.rank) {
      malformed(fmt::format("tag {} is no pull of this server's", e.tag));
      continue;
    }
    const Tensor& t = tensors_[pending->op.tensor];
    const ChunkSpan span = t.layout->chunk(pending->op.chunk);
    if (e.bytes != span.bytes || e.offset < protocol::kAnswerDataOffset || e.offset > length ||
        e.bytes > length - e.offset || t.region->kind() != MemoryKind::kHost) {
      malformed(fmt::format("the answer to tag {} does not fit its chunk or the write", e.tag));
      continue;
    }
    std::memcpy(t.region->data() + t.region_offset + span.offset, base + e.offset, e.bytes);
    finish_tag(e.tag, Status::Ok());
  }
  // Copied out: the slot goes back.
  outbox_.push_back([this, conn = s.conn, slot] {
    (void)send(conn, protocol::Credit{{slot}, {}});
  });
}

void WorkerService::on_write(const ConnectionPtr& conn, uint32_t tag, uint64_t length) {
  {
    MutexLock lock(mu_);
    if ((tag & protocol::kAnswerBatch) == 0) {
      finish_tag(tag, Status::Ok());
      return;
    }
    ServerConn* s = server_of(conn);
    if (s == nullptr) return;
    take_answers(*s, tag & ~protocol::kAnswerBatch, length);
  }
  flush();
}

void WorkerService::on_disconnect(const ConnectionPtr& conn, const Status& why) {
  if (session_.on_disconnect(conn, why)) {
    MutexLock lock(mu_);
    if (!stopped_) fail_everything(session_.health());
    cv_.notify_all();
    return;
  }
  {
    MutexLock lock(mu_);
    ServerConn* s = server_of(conn);
    if (s == nullptr || stopped_) return;
    // Not a failure yet, also during the handshake: a server that held
    // nothing but keys in transfer, or whose ranges have copies, can be lost
    // without losing anything; the coordinator decides.
    server_lost(*s,
                Unavailable(fmt::format("lost server {}{}: {}", s->rank,
                                        s->granted ? "" : " during the handshake", why.message())));
    cv_.notify_all();
  }
  flush();
}

void WorkerService::server_lost(ServerConn& s, const Status& why) {
  if (s.lost) return;
  s.lost = true;
  s.lost_why = why;
  const auto deadline = Clock::now() + orphan_grace();
  PSLD_LOG_WARN(
      "worker {}: {}; what it did not answer goes where the coordinator says (at most {} ms "
      "from now)",
      session_.welcome().rank, why.message(), orphan_grace().count());
  // The worker still holds everything the server did not answer: a plain
  // push completes only once accepted, a push_pull once its pull landed,
  // and a server gaining keys accepts and answers nothing of them before
  // the transfer is final.
  // In tag order, the order they were issued in: each key's rounds stay in
  // order on their way to the new owner.
  for (uint32_t tag : pending_.tags()) {
    const Pending* found = pending_.find(tag);
    if (found == nullptr || found->server != s.rank) continue;  // gone: a push_pull's other half
    Pending p = std::move(*take_operation(tag));
    orphans_.push_back({std::move(p.op), s.rank, deadline, why});
  }
  for (auto& op : s.backlog)
    orphans_.push_back({std::move(op), s.rank, deadline, why});
  s.backlog.clear();
  s.free_slots.clear();
  for (auto& [request, want] : acks_wanted_)
    want.erase(s.rank);
  // Dropped for good, also when it was only silent: whatever it sends later
  // is not listened to.
  if (ConnectionPtr conn = s.conn) outbox_.push_back([conn] { conn->close(); });
  cv_.notify_all();
}

void WorkerService::op_failed(uint32_t rank, const ConnectionPtr& conn, uint32_t tag,
                              const Status& why) {
  auto it = servers_.find(rank);
  if (it == servers_.end() || it->second.conn != conn) return finish_tag(tag, why);
  if (!conn->is_open()) {
    server_lost(it->second, Unavailable(fmt::format("lost server {}: {}", rank, why.message())));
    return;
  }
  // A server that is going away may refuse before its connection says so
  // (a dying loopback peer deregisters its memory first): such an operation
  // did not reach it and waits for the coordinator like a lost server's.
  // Anything else fails at once, a timeout above all: the write may have
  // landed, and sending it again could count it twice.
  const StatusCode code = why.code();
  if (code != StatusCode::kNotFound && code != StatusCode::kUnavailable &&
      code != StatusCode::kAborted) {
    return finish_tag(tag, why);
  }
  std::optional<Pending> taken = take_operation(tag);
  if (!taken) return;
  Pending op = std::move(*taken);
  orphans_.push_back({std::move(op.op), rank, Clock::now() + orphan_grace(),
                      Unavailable(fmt::format("server {}: {}", rank, why.message()))});
}

void WorkerService::on_tick() {
  // The session found the coordinator silent (or the job failed) without a
  // message that says so, as when the coordinator's host stops: what waits
  // on servers that nobody will declare dead fails now.
  const Status health = session_.health();
  MutexLock lock(mu_);
  if (stopped_) return;
  if (!health.ok()) {
    fail_everything(health);
    cv_.notify_all();
    return;
  }
  if (orphans_.empty()) return;
  const auto now = Clock::now();
  std::vector<Orphan> still;
  for (auto& o : orphans_) {
    if (now < o.deadline) {
      still.push_back(std::move(o));
      continue;
    }
    o.op.request->complete_part(Unavailable(fmt::format(
        "{}, and within {} ms the coordinator neither moved its keys nor failed the job "
        "(tensor {} chunk {} round {})",
        o.why.message(), orphan_grace().count(), tensors_[o.op.tensor].name, o.op.chunk,
        o.op.round)));
  }
  orphans_.swap(still);
}

void WorkerService::fail_everything(const Status& why) {
  Status st = why.ok() ? Aborted("the worker stopped") : why;
  for (auto& [tag, p] : pending_.take_all())
    p.op.request->complete_part(st);
  for (auto& [rank, s] : servers_) {
    for (auto& op : s.backlog)
      op.request->complete_part(st);
    s.backlog.clear();
  }
  for (auto& m : moved_)
    m.op.request->complete_part(st);
  moved_.clear();
  for (auto& o : orphans_)
    o.op.request->complete_part(st);
  orphans_.clear();
}

void WorkerService::finish_tag(uint32_t tag, const Status& status) {
  std::optional<Pending> taken = take_operation(tag);
  if (!taken) return;
  Pending p = std::move(*taken);
  const auto answered = Clock::now();
  if (status.ok()) {
    ServerLoadStats& load = loads_[p.server];
    const auto ns = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(answered - p.issued).count());
    ++load.answers;
    load.answer_latency_ns += ns;
    load_->record(p.server, LoadMetric::kAnswerNs, static_cast<double>(ns));
  }
  const Tensor& t = tensors_[p.op.tensor];
  if (status.ok() && p.lands && t.shadow) {
    // The chunk is in the shadow; the request completes once it is on the GPU.
    const ChunkSpan span = t.layout->chunk(p.op.chunk);
    // Its trace span ends when it is on the GPU: the copy is the pull.
    std::shared_ptr<TraceRecorder> trace = trace_ && trace_->wants(p.op.round) ? trace_ : nullptr;
    copier_->copy(
        DeviceCopier::Direction::kToDevice, t.data + span.offset, t.shadow.get() + span.offset,
        span.bytes, [trace, p, answered, name = t.name, bytes = span.bytes](const Status& s) {
          // Recorded before the completion: a later round that the
          // completion lets start may write the file.
          if (trace) trace_chunk(*trace, p, name, bytes, answered, Clock::now(), s);
          p.op.request->complete_part(
              s.ok() ? s : s.with_context(fmt::format("tensor '{}' chunk {}", name, p.op.chunk)));
        });
    return;
  }
  if (trace_ && trace_->wants(p.op.round)) {
    trace_chunk(*trace_, p, t.name, t.layout->chunk(p.op.chunk).bytes, answered, Clock::now(),
                status);
  }
  p.op.request->complete_part(status);
}

void WorkerService::trace_chunk(TraceRecorder& trace, const Pending& p, const std::string& tensor,
                                uint64_t bytes, Clock::time_point answered, Clock::time_point done,
                                const Status& status) {
  // One id per chunk of a round: tensor, chunk and round share 64 bits.
  const uint64_t id = (uint64_t{p.op.tensor} << 44) ^ (uint64_t{p.op.chunk} << 24) ^ p.op.round;
  const std::string_view kind = p.op.kind == RequestKind::kPull   ? "pull"
                                : p.op.kind == RequestKind::kPush ? "push"
                                                                  : "push_pull";
  const auto submitted = p.op.submitted == Clock::time_point{} ? p.issued : p.op.submitted;
  const std::string name = fmt::format("{} {}[{}]", kind, tensor, p.op.chunk);
  trace.async_begin(
      name, "chunk", id, submitted,
      fmt::format(R"("tensor":{},"chunk":{},"round":{},"server":{},"bytes":{},"status":{})",
                  json_string(tensor), p.op.chunk, p.op.round, p.server, bytes,
                  json_string(status.ok() ? "ok" : status.to_string())));
  // push: waiting for the server's credit and writing; wait: the server
  // reducing, updating and answering; pull: the answer into the tensor
  // (the copy to the GPU for a tensor in GPU memory).
  trace.async_begin("push", "chunk", id, submitted);
  trace.async_end("push", "chunk", id, p.issued);
  trace.async_begin("wait", "chunk", id, p.issued);
  trace.async_end("wait", "chunk", id, answered);
  trace.async_begin("pull", "chunk", id, answered);
  trace.async_end("pull", "chunk", id, done);
  trace.async_end(name, "chunk", id, done);
}

std::vector<ServerLoadStats> WorkerService::server_loads() {
  MutexLock lock(mu_);
  std::vector<ServerLoadStats> out;
  for (const auto& [rank, s] : servers_) {
    ServerLoadStats l = loads_[rank];
    l.server = rank;
    out.push_back(l);
  }
  return out;
}

void WorkerService::flush() {
  std::vector<std::function<void()>> out;
  {
    MutexLock lock(mu_);
    out.swap(outbox_);
  }
  for (auto& fn : out)
    fn();
}

Result<uint32_t> WorkerService::register_tensor(const std::string& name, DType dtype,
                                                uint64_t bytes, void* data, const void* init) {
  PSLD_RETURN_IF_ERROR(session_.health());
  if (name.empty() || name.size() > protocol::kMaxNameBytes) {
    return InvalidArgument("a tensor name must have 1 to 256 bytes");
  }
  if (bytes > 0 && data == nullptr) {
    return InvalidArgument(fmt::format("tensor '{}': data is null", name));
  }
  if (bytes % protocol::dtype_bytes(dtype) != 0) {
    return InvalidArgument(fmt::format("tensor '{}': {} bytes is not a whole number of {} elements",
                                       name, bytes, protocol::dtype_name(dtype)));
  }
  {
    MutexLock lock(mu_);
    auto it = tensor_by_name_.find(name);
    if (it != tensor_by_name_.end()) {
      const Tensor& t = tensors_[it->second];
      if (t.bytes == bytes && t.dtype == dtype && t.data == data) return it->second;
      return AlreadyExists(fmt::format(
          "tensor '{}' is already registered here as {} bytes of {}; registering it again as {} "
          "bytes of {} is not allowed",
          name, t.bytes, protocol::dtype_name(t.dtype), bytes, protocol::dtype_name(dtype)));
    }
  }
  // Where the memory is decides how it travels: prepared here, before the
  // coordinator hears of the tensor, so that a failure leaves nothing behind.
  Tensor t;
  t.name = name;
  t.dtype = dtype;
  t.bytes = bytes;
  t.data = static_cast<uint8_t*>(data);
  if (bytes > 0) {
    t.kind = options_.memory_kind_of
                 ? options_.memory_kind_of(data)
                 : (kernels::memory_kind_of(data) == MemoryKind::kCuda ? MemoryKind::kCuda
                                                                       : MemoryKind::kHost);
  }
  if (t.kind == MemoryKind::kCuda) {
    const GpuPathChoice path = choose_gpu_path(options_.gpu_path, transport());
    if (!path.possible) {
      return FailedPrecondition(fmt::format("tensor '{}' is in CUDA memory: {}", name, path.text));
    }
    if (path.direct) {
      PSLD_ASSIGN_OR_RETURN(t.region, transport().register_memory(data, bytes, MemoryKind::kCuda));
    } else {
      PSLD_RETURN_IF_ERROR(
          stage_tensor(t).with_context(fmt::format("tensor '{}' is in CUDA memory", name)));
    }
    PSLD_LOG_INFO("worker {}: tensor '{}' ({} bytes of CUDA memory) goes {}", rank(), name, bytes,
                  path.text);
  } else if (bytes > 0) {
    // Inside a block from allocate(): that block's region, already mappable
    // by local servers. Anything else is registered as it is.
    {
      MutexLock lock(mu_);
      auto it = allocations_.upper_bound(t.data);
      if (it != allocations_.begin()) {
        --it;
        const uint64_t offset = static_cast<uint64_t>(t.data - it->first);
        if (offset < it->second->length() && bytes <= it->second->length() - offset) {
          t.region = it->second;
          t.region_offset = offset;
        }
      }
    }
    if (!t.region) {
      PSLD_ASSIGN_OR_RETURN(t.region, transport().register_memory(data, bytes, MemoryKind::kHost));
    }
  }
  protocol::RegisterTensor reg;
  reg.name = name;
  reg.dtype = dtype;
  reg.bytes = bytes;
  reg.has_init = init != nullptr;
  PSLD_ASSIGN_OR_RETURN(protocol::TensorInfo info,
                        session_.register_tensor(reg, options_.connect_timeout));
  PSLD_ASSIGN_OR_RETURN(ChunkLayout layout, ChunkLayout::make(info.id, bytes, info.chunk_bytes,
                                                              protocol::dtype_bytes(dtype)));
  t.id = info.id;
  t.layout = layout;
  t.push_round = info.round;  // a resumed job goes on from its checkpoint
  if (bytes > 0) {
    // Every server learns where this tensor's pulls land, and confirms.
    std::vector<ConnectionPtr> conns;
    uint64_t request = 0;
    {
      MutexLock lock(mu_);
      request = next_request_++;
      ack_tensor_[request] = t.id;
      auto& want = acks_wanted_[request];
      for (auto& [r, s] : servers_) {
        if (s.lost) continue;
        want.insert(r);
        conns.push_back(s.conn);
      }
    }
    // In host memory (the tensor's own, or a staged tensor's pinned copy),
    // answers to its small pulls may come in batches that on_write copies out.
    const uint8_t flags = batch_pool_ && t.region->kind() == MemoryKind::kHost
                              ? protocol::kTensorAnswersBatched
                              : uint8_t{0};
    protocol::TensorKey key{
        request, t.id,
        std::vector<uint8_t>(t.region->remote_key().begin(), t.region->remote_key().end()),
        t.region_offset, flags};
    for (auto& c : conns)
      PSLD_RETURN_IF_ERROR(send(c, key));
    UniqueLock lock(mu_);
    const bool acked = cv_.wait_for(lock.native(), options_.connect_timeout, [&]() REQUIRES(mu_) {
      return acks_wanted_[request].empty() || !session_.health().ok();
    });
    acks_wanted_.erase(request);
    ack_tensor_.erase(request);
    PSLD_RETURN_IF_ERROR(session_.health());
    if (!acked) return Timeout(fmt::format("tensor '{}': not every server confirmed it", name));
  }
  uint32_t handle = 0;
  // Read before t moves into tensors_, which other threads may grow meanwhile.
  const bool on_device = t.kind == MemoryKind::kCuda;
  {
    MutexLock lock(mu_);
    handle = static_cast<uint32_t>(tensors_.size());
    tensors_.push_back(std::move(t));
    tensor_by_name_[name] = handle;
  }
  if (info.round > 0) {
    // Resumed from a checkpoint: the servers hold the parameters of that
    // round, and every worker's memory gets them now (no initial value).
    if (bytes == 0) return handle;
    PSLD_ASSIGN_OR_RETURN(auto req, submit(handle, RequestKind::kPull));
    PSLD_RETURN_IF_ERROR(req->wait(options_.connect_timeout)
                             .with_context(fmt::format("tensor '{}' from the checkpoint of "
                                                       "round {}",
                                                       name, info.round)));
    return handle;
  }
  // Worker 0 sets the initial value; the others get it with their first pull.
  if (init != nullptr && rank() == 0 && bytes > 0) {
    if (init != data && on_device) {
      PSLD_ASSIGN_OR_RETURN(DeviceCopier * c, copier());
      PSLD_RETURN_IF_ERROR(c->copy_and_wait(DeviceCopier::Direction::kToDevice, data, init, bytes)
                               .with_context("initial value of '" + name + "'"));
    } else if (init != data) {
      std::memmove(data, init, bytes);
    }
    PSLD_ASSIGN_OR_RETURN(auto req, submit(handle, RequestKind::kInit));
    PSLD_RETURN_IF_ERROR(
        req->wait(options_.connect_timeout).with_context("initial value of '" + name + "'"));
  }
  return handle;
}

Result<uint64_t> WorkerService::tensor_round(uint32_t handle) const {
  MutexLock lock(mu_);
  if (handle >= tensors_.size()) return InvalidArgument("unknown tensor handle");
  return tensors_[handle].push_round;
}

Result<std::shared_ptr<RequestState>> WorkerService::submit(uint32_t handle, RequestKind kind) {
  PSLD_ASSIGN_OR_RETURN(auto reqs, submit_many({&handle, 1}, kind));
  return std::move(reqs.front());
}

namespace {
// The blocks of every worker's requests, for the life of the process: a
// user may keep a request past its worker (base/block_pool.h).
BlockPool& request_pool() {
  static BlockPool* const pool = new BlockPool(4096);  // NOLINT(cppcoreguidelines-owning-memory)
  return *pool;
}
}  // namespace

Result<std::vector<std::shared_ptr<RequestState>>> WorkerService::submit_many(
    std::span<const uint32_t> handles, RequestKind kind) {
  std::vector<std::shared_ptr<RequestState>> reqs;
  reqs.reserve(handles.size());
  std::vector<std::function<void()>> copy_out;
  const auto now = Clock::now();
  {
    MutexLock lock(mu_);
    if (stopped_) return FailedPrecondition("the worker was shut down");
    // Under mu_: a job that fails sets the session's health, then fails
    // everything in flight under mu_. A request that sees the failure here
    // fails what is in flight itself (the control thread may not have got
    // to it yet); one that does not is in flight when that happens.
    if (Status h = session_.health(); !h.ok()) {
      fail_everything(h);
      cv_.notify_all();
      return h;
    }
    for (uint32_t handle : handles) {
      if (handle >= tensors_.size()) return InvalidArgument("unknown tensor handle");
    }
    for (uint32_t handle : handles) {
      Tensor& t = tensors_[handle];
      const uint64_t chunks = t.layout->num_chunks();
      auto req =
          std::allocate_shared<RequestState>(PoolAllocator<RequestState>(&request_pool()), chunks);
      uint64_t round = t.push_round;
      if (kind == RequestKind::kPush || kind == RequestKind::kPushPull) round = ++t.push_round;
      if (round > max_round_.load()) max_round_.store(round);
      // A staged tensor's push leaves chunk by chunk as each is copied out of
      // the GPU (on_staged); everything else is routed now.
      const bool stage_out = t.shadow != nullptr && kind != RequestKind::kPull;
      for (uint64_t c = 0; c < chunks; ++c) {
        ChunkOp op{kind, handle, static_cast<uint32_t>(c), round, req, lr_, now};
        if (!stage_out) {
          route(std::move(op));
          continue;
        }
        const ChunkSpan span = t.layout->chunk(op.chunk);
        ++staging_[{handle, round}];
        copy_out.push_back([this, op, span, dst = t.shadow.get() + span.offset,
                            src = t.data + span.offset]() mutable {
          copier_->copy(DeviceCopier::Direction::kToHost, dst, src, span.bytes,
                        [this, op](const Status& s) { on_staged(op, s); });
        });
      }
      reqs.push_back(std::move(req));
    }
    // Once every chunk is queued: small pushes to one server leave together.
    for (auto& [r, s] : servers_)
      pump(s);
  }
  // Queued outside mu_: a stopped copier answers at once, and on_staged takes mu_.
  for (auto& fn : copy_out)
    fn();
  flush();
  return reqs;
}

Result<void*> WorkerService::allocate(size_t bytes) {
  if (bytes == 0) return InvalidArgument("allocate: 0 bytes");
  PSLD_ASSIGN_OR_RETURN(auto region, transport().allocate_memory(bytes, MemoryKind::kHost));
  MutexLock lock(mu_);
  if (stopped_) return FailedPrecondition("the worker was shut down");
  allocations_[region->data()] = region;
  return static_cast<void*>(region->data());
}

Result<DeviceCopier*> WorkerService::copier() {
  MutexLock lock(device_mu_);
  if (copier_) return copier_.get();
  auto engine = options_.copy_engine ? options_.copy_engine() : create_cuda_copy_engine(2);
  if (!engine.ok()) return engine.status().with_context("starting the CUDA copy engine");
  PSLD_ASSIGN_OR_RETURN(copier_, DeviceCopier::start(std::move(engine).value()));
  return copier_.get();
}

Status WorkerService::stage_tensor(Tensor& t) {
  PSLD_ASSIGN_OR_RETURN(DeviceCopier * c, copier());
  void* host = nullptr;
  PSLD_ASSIGN_OR_RETURN(host, c->allocate_host(t.bytes));
  // The registration is dropped (its cache entry too) before the memory goes.
  t.shadow =
      std::shared_ptr<uint8_t>(static_cast<uint8_t*>(host), [this, c, bytes = t.bytes](uint8_t* p) {
        (void)transport().invalidate(p, bytes);
        c->free_host(p);
      });
  auto region = transport().register_memory(host, t.bytes, MemoryKind::kHost);
  if (!region.ok()) {
    return region.status().with_context(
        fmt::format("tensor '{}': registering its pinned staging memory", t.name));
  }
  t.region = std::move(region).value();
  return Status::Ok();
}

void WorkerService::on_staged(ChunkOp op, const Status& copied) {
  {
    MutexLock lock(mu_);
    auto it = staging_.find({op.tensor, op.round});
    if (it != staging_.end() && --it->second == 0) staging_.erase(it);
    Status fail = copied.with_context(
        fmt::format("tensor '{}' chunk {}", tensors_[op.tensor].name, op.chunk));
    if (stopped_) fail = Aborted("the worker was shut down");
    if (fail.ok()) fail = session_.health();
    if (!fail.ok()) {
      op.request->complete_part(fail);
      return;
    }
    route(std::move(op));
    for (auto& [r, s] : servers_)
      pump(s);
  }
  flush();
}

uint64_t WorkerService::staged_bytes_to_host() {
  MutexLock lock(device_mu_);
  return copier_ ? copier_->bytes_to_host() : 0;
}

uint64_t WorkerService::staged_bytes_to_device() {
  MutexLock lock(device_mu_);
  return copier_ ? copier_->bytes_to_device() : 0;
}

std::string WorkerService::describe_in_flight() {
  MutexLock lock(mu_);
  std::string out = fmt::format("worker {} (epoch {}):", rank(), epochs_->latest().epoch());
  for (const auto& [r, s] : servers_) {
    out += fmt::format(" server {}: {} free slots, {} waiting for credit;", r, s.free_slots.size(),
                       s.backlog.size());
  }
  for (uint32_t tag : pending_.tags()) {
    if (const Pending* p = pending_.find(tag)) {
      out += fmt::format(" tag {} -> server {} (tensor {} chunk {} round {});", tag, p->server,
                         p->op.tensor, p->op.chunk, p->op.round);
    }
  }
  uint64_t staging = 0;
  for (const auto& [tensor_round, n] : staging_)
    staging += n;
  out += fmt::format(
      " {} waiting for an epoch, {} for a lost server's keys to move, {} for a copy off the GPU",
      moved_.size(), orphans_.size(), staging);
  return out;
}

size_t WorkerService::operations_in_flight() {
  MutexLock lock(mu_);
  size_t n = moved_.size() + orphans_.size();
  for (const auto& [tensor_round, chunks] : staging_)
    n += chunks;
  pending_.for_each([&](uint32_t tag, const Pending& p) {
    n += p.other_tag == 0 || tag < p.other_tag;  // a push_pull's two tags are one operation
  });
  for (const auto& [r, s] : servers_)
    n += s.backlog.size();
  return n;
}

Status WorkerService::shutdown() {
  session_.on_tick(nullptr);  // the tick reads what is torn down below
  {
    MutexLock lock(mu_);
    if (stopped_) return Status::Ok();
    stopped_ = true;
  }
  session_.stop_reports();  // the last window goes before the goodbye
  session_.goodbye();
  stop();  // closing flushes: the goodbye reaches the coordinator first
  {
    MutexLock lock(mu_);
    fail_everything(Aborted("the worker was shut down"));
  }
  // The copies still running finish (the GPU may be writing a shadow), then
  // the shadows go: nothing reads or writes them any more.
  {
    MutexLock lock(device_mu_);
    if (copier_) copier_->stop();
  }
  MutexLock lock(mu_);
  for (Tensor& t : tensors_) {
    if (!t.shadow) continue;
    t.region.reset();
    t.shadow.reset();
  }
  return Status::Ok();
}

}  // namespace psld
