// The fake RDMA device of tests/fake_verbs.h. Test code only: it is linked
// into test binaries, never into libpsld.
#include "tests/fake_verbs.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>

namespace psld::transport::fake_verbs {
namespace {

// Each fake object is the libibverbs struct followed by a pointer to its
// state; both structs are standard-layout, so the library's pointer converts
// back to ours.
struct CtxState {
  std::deque<ibv_async_event> async;
  int unacked_async = 0;
};
struct CtxImpl {
  ibv_context ctx;
  CtxState* s;
};
struct PdState {
  int users = 0;
};
struct PdImpl {
  ibv_pd pd;
  PdState* s;
};
struct MrImpl {
  ibv_mr mr;
  int access;
};
struct ChanState {
  std::deque<ibv_cq*> events;
  int cqs = 0;
};
struct ChanImpl {
  ibv_comp_channel ch;
  ChanState* s;
};
struct CqState {
  struct Entry {
    ibv_wc wc;
    bool send;
  };
  std::deque<Entry> q;
  bool armed = false;
  uint32_t delivered = 0, acked = 0;
  int users = 0;
};
struct CqImpl {
  ibv_cq cq;
  CqState* s;
};
struct SrqState {
  struct Wqe {
    uint64_t wr_id;
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
  };
  std::deque<Wqe> wqes;
  uint32_t max_wr = 0;
  std::deque<uint32_t> waiters;  // QPs whose head WR waits for a receive
  int qps = 0;
};
struct SrqImpl {
  ibv_srq srq;
  SrqState* s;
};
struct WrCopy {
  uint64_t wr_id = 0;
  ibv_wr_opcode opcode = IBV_WR_SEND;
  bool signaled = false;
  bool is_inline = false;
  std::vector<uint8_t> inline_data;
  std::vector<ibv_sge> sges;
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint32_t imm = 0;  // network order, as posted
};
struct QpState {
  uint32_t max_send_wr = 0;
  uint32_t max_inline = 0;
  uint32_t outstanding = 0;  // posted, completion not yet polled
  std::deque<WrCopy> sq;     // posted, not yet executed (RNR wait)
  uint32_t dest = 0;
  int access = 0;
  bool was_rtr = false;
};
struct QpImpl {
  ibv_qp qp;
  QpState* s;
};

constexpr uint32_t kMaxInline = 256;
constexpr int kGidTableLen = 4;

std::mutex g_mu;
std::atomic<bool> g_enabled{false};
bool g_roce = true;
bool g_dmabuf = true;
Stats g_stats;
std::map<uint32_t, QpImpl*> g_qps;
std::map<uint32_t, MrImpl*> g_mrs;  // lkey == rkey
uint32_t g_next_qpn = 0x100;
uint32_t g_next_key = 0x1000;
uint32_t g_next_handle = 1;

ibv_device make_device() {
  ibv_device d{};
  d.node_type = IBV_NODE_CA;
  d.transport_type = IBV_TRANSPORT_IB;
  std::snprintf(d.name, sizeof(d.name), "fakeverbs0");
  std::snprintf(d.dev_name, sizeof(d.dev_name), "uverbs_fake0");
  return d;
}
ibv_device g_device = make_device();

bool is_fake(const ibv_context* c) {
  return c != nullptr && c->device == &g_device;
}
CtxImpl* ctx_of(ibv_context* c) {
  return reinterpret_cast<CtxImpl*>(c);
}
PdImpl* pd_of(ibv_pd* p) {
  return reinterpret_cast<PdImpl*>(p);
}
CqImpl* cq_of(ibv_cq* c) {
  return reinterpret_cast<CqImpl*>(c);
}
SrqImpl* srq_of(ibv_srq* s) {
  return reinterpret_cast<SrqImpl*>(s);
}
QpImpl* qp_of(ibv_qp* q) {
  return reinterpret_cast<QpImpl*>(q);
}
ChanImpl* chan_of(ibv_comp_channel* c) {
  return reinterpret_cast<ChanImpl*>(c);
}

void violation(std::string what) {
  std::fprintf(stderr, "[fake_verbs] violation: %s\n", what.c_str());
  g_stats.violations.push_back(std::move(what));
}

void* real_symbol(const char* name) {
  void* p = dlsym(RTLD_NEXT, name);
  if (p == nullptr) {
    std::fprintf(stderr, "[fake_verbs] no real %s to forward to\n", name);
    std::abort();
  }
  return p;
}
// Calls the real libibverbs function `name` (parenthesised: several names
// are also function-like macros in verbs.h).
#define FORWARD(name, ...)                                                         \
  do {                                                                             \
    static auto real_fn = reinterpret_cast<decltype(&(name))>(real_symbol(#name)); \
    return real_fn(__VA_ARGS__);                                                   \
  } while (false)

// The port's GID table on RoCE: what a ConnectX port with one IPv4 address
// shows (v1 and v2 of the link-local address, then of the IPv4 address).
ibv_gid_entry gid_entry(int index) {
  ibv_gid_entry e{};
  e.gid_index = static_cast<uint32_t>(index);
  e.port_num = 1;
  e.gid_type = (index % 2 == 0) ? IBV_GID_TYPE_ROCE_V1 : IBV_GID_TYPE_ROCE_V2;
  if (index < 2) {
    e.gid.raw[0] = 0xfe;
    e.gid.raw[1] = 0x80;
    e.gid.raw[15] = 1;
  } else {
    e.gid.raw[10] = 0xff;
    e.gid.raw[11] = 0xff;
    e.gid.raw[12] = 10;
    e.gid.raw[15] = 1;
  }
  if (!g_roce) e.gid_type = IBV_GID_TYPE_IB;
  return e;
}

void signal_fd(int fd) {
  const uint64_t one = 1;
  (void)!::write(fd, &one, sizeof(one));
}

void push_async(ibv_context* c, ibv_event_type type, ibv_qp* qp) {
  ibv_async_event ev{};
  ev.event_type = type;
  ev.element.qp = qp;
  ctx_of(c)->s->async.push_back(ev);
  signal_fd(c->async_fd);
}

void push_cqe(ibv_cq* cq, const ibv_wc& wc, bool send) {
  CqState* s = cq_of(cq)->s;
  if (s->q.size() >= static_cast<size_t>(cq->cqe)) {
    violation(fmt::format("CQ overrun ({} entries)", cq->cqe));
    return;
  }
  s->q.push_back({wc, send});
  if (s->armed && cq->channel != nullptr) {
    s->armed = false;
    chan_of(cq->channel)->s->events.push_back(cq);
    signal_fd(cq->channel->fd);
  }
}

void complete_send(QpImpl* q, const WrCopy& w, ibv_wc_status status, uint32_t len) {
  if (!w.signaled && status == IBV_WC_SUCCESS) {
    --q->s->outstanding;
    return;
  }
  ibv_wc wc{};
  wc.wr_id = w.wr_id;
  wc.status = status;
  wc.opcode = w.opcode == IBV_WR_SEND ? IBV_WC_SEND : IBV_WC_RDMA_WRITE;
  wc.byte_len = len;
  wc.qp_num = q->qp.qp_num;
  push_cqe(q->qp.send_cq, wc, /*send=*/true);
}

void remove_waiter(QpImpl* q) {
  if (q->qp.srq == nullptr) return;
  auto& w = srq_of(q->qp.srq)->s->waiters;
  w.erase(std::remove(w.begin(), w.end(), q->qp.qp_num), w.end());
}

// Moves a QP to ERR: what is queued completes with WR_FLUSH_ERR, and a QP on
// an SRQ reports that it will consume no more receives.
void to_error(QpImpl* q, ibv_event_type async = IBV_EVENT_QP_LAST_WQE_REACHED) {
  const bool was_error = q->qp.state == IBV_QPS_ERR;
  q->qp.state = IBV_QPS_ERR;
  for (const WrCopy& w : q->s->sq) {
    ibv_wc wc{};
    wc.wr_id = w.wr_id;
    wc.status = IBV_WC_WR_FLUSH_ERR;
    wc.qp_num = q->qp.qp_num;
    push_cqe(q->qp.send_cq, wc, true);  // flushed WRs always complete
  }
  q->s->sq.clear();
  remove_waiter(q);
  if (!was_error) {
    if (async != IBV_EVENT_QP_LAST_WQE_REACHED) push_async(q->qp.context, async, &q->qp);
    if (q->qp.srq != nullptr && q->s->was_rtr) {
      push_async(q->qp.context, IBV_EVENT_QP_LAST_WQE_REACHED, &q->qp);
    }
  }
}

MrImpl* find_mr(uint32_t key) {
  auto it = g_mrs.find(key);
  return it == g_mrs.end() ? nullptr : it->second;
}

bool mr_covers(const MrImpl* mr, ibv_pd* pd, uint64_t addr, uint64_t len) {
  const auto base = reinterpret_cast<uint64_t>(mr->mr.addr);
  return mr->mr.pd == pd && addr >= base && len <= mr->mr.length &&
         addr - base <= mr->mr.length - len;
}

// Executes the QP's posted work requests in order until one must wait for a
// receive at the target (RNR) or the QP fails.
void execute(QpImpl* q) {
  while (!q->s->sq.empty() && q->qp.state == IBV_QPS_RTS) {
    WrCopy& w = q->s->sq.front();
    auto dit = g_qps.find(q->s->dest);
    QpImpl* d = dit == g_qps.end() ? nullptr : dit->second;
    if (d == nullptr || (d->qp.state != IBV_QPS_RTR && d->qp.state != IBV_QPS_RTS)) {
      // Nobody answers: the requester's retries run out.
      WrCopy failed = std::move(w);
      q->s->sq.pop_front();
      complete_send(q, failed, IBV_WC_RETRY_EXC_ERR, 0);
      to_error(q);
      return;
    }
    std::vector<uint8_t> bytes;
    if (w.is_inline) {
      bytes = w.inline_data;
    } else {
      for (const ibv_sge& sge : w.sges) {
        MrImpl* mr = find_mr(sge.lkey);
        if (mr == nullptr || !mr_covers(mr, q->qp.pd, sge.addr, sge.length)) {
          WrCopy failed = std::move(w);
          q->s->sq.pop_front();
          complete_send(q, failed, IBV_WC_LOC_PROT_ERR, 0);
          to_error(q);
          return;
        }
        const auto* p = reinterpret_cast<const uint8_t*>(sge.addr);
        bytes.insert(bytes.end(), p, p + sge.length);
      }
    }
    SrqState* srq = d->qp.srq != nullptr ? srq_of(d->qp.srq)->s : nullptr;
    if (srq == nullptr) {
      violation("target QP has no SRQ");
      return;
    }
    if (srq->wqes.empty()) {
      ++g_stats.rnr_waits;
      if (std::find(srq->waiters.begin(), srq->waiters.end(), q->qp.qp_num) == srq->waiters.end()) {
        srq->waiters.push_back(q->qp.qp_num);
      }
      return;
    }
    ibv_wc rwc{};
    rwc.status = IBV_WC_SUCCESS;
    rwc.qp_num = d->qp.qp_num;
    rwc.src_qp = q->qp.qp_num;
    rwc.byte_len = static_cast<uint32_t>(bytes.size());
    if (w.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
      MrImpl* mr = find_mr(w.rkey);
      if (mr == nullptr || (mr->access & IBV_ACCESS_REMOTE_WRITE) == 0 ||
          (d->s->access & IBV_ACCESS_REMOTE_WRITE) == 0 ||
          !mr_covers(mr, d->qp.pd, w.remote_addr, bytes.size())) {
        WrCopy failed = std::move(w);
        q->s->sq.pop_front();
        complete_send(q, failed, IBV_WC_REM_ACCESS_ERR, 0);
        to_error(q);
        to_error(d, IBV_EVENT_QP_ACCESS_ERR);
        return;
      }
      if (!bytes.empty())
        std::memcpy(reinterpret_cast<void*>(w.remote_addr), bytes.data(), bytes.size());
      const SrqState::Wqe wqe = srq->wqes.front();
      srq->wqes.pop_front();
      rwc.wr_id = wqe.wr_id;
      rwc.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
      rwc.wc_flags = IBV_WC_WITH_IMM;
      rwc.imm_data = w.imm;
    } else {
      const SrqState::Wqe wqe = srq->wqes.front();
      MrImpl* mr = find_mr(wqe.lkey);
      if (bytes.size() > wqe.length || mr == nullptr ||
          !mr_covers(mr, d->qp.pd, wqe.addr, bytes.size())) {
        srq->wqes.pop_front();
        rwc.wr_id = wqe.wr_id;
        rwc.status = IBV_WC_LOC_LEN_ERR;
        push_cqe(d->qp.recv_cq, rwc, false);
        to_error(d);
        WrCopy failed = std::move(w);
        q->s->sq.pop_front();
        complete_send(q, failed, IBV_WC_REM_INV_REQ_ERR, 0);
        to_error(q);
        return;
      }
      srq->wqes.pop_front();
      if (!bytes.empty())
        std::memcpy(reinterpret_cast<void*>(wqe.addr), bytes.data(), bytes.size());
      rwc.wr_id = wqe.wr_id;
      rwc.opcode = IBV_WC_RECV;
    }
    push_cqe(d->qp.recv_cq, rwc, false);
    WrCopy done = std::move(w);
    q->s->sq.pop_front();
    complete_send(q, done, IBV_WC_SUCCESS, static_cast<uint32_t>(bytes.size()));
  }
}

// --- ops reached through the context (inline functions in verbs.h) ---------

int fake_poll_cq(ibv_cq* cq, int n, ibv_wc* wc) {
  std::lock_guard<std::mutex> lock(g_mu);
  CqState* s = cq_of(cq)->s;
  int k = 0;
  while (k < n && !s->q.empty()) {
    const CqState::Entry e = s->q.front();
    s->q.pop_front();
    if (e.send) {
      auto it = g_qps.find(e.wc.qp_num);
      if (it != g_qps.end() && it->second->s->outstanding > 0) --it->second->s->outstanding;
    }
    wc[k++] = e.wc;
  }
  return k;
}

int fake_req_notify_cq(ibv_cq* cq, int /*solicited_only*/) {
  std::lock_guard<std::mutex> lock(g_mu);
  // Like the hardware: only completions added after arming raise an event.
  cq_of(cq)->s->armed = true;
  return 0;
}

int fake_post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  std::lock_guard<std::mutex> lock(g_mu);
  QpImpl* q = qp_of(qp);
  for (ibv_send_wr* w = wr; w != nullptr; w = w->next) {
    if (qp->state != IBV_QPS_RTS && qp->state != IBV_QPS_ERR) {
      violation(fmt::format("post_send on QP {:#x} in state {}", qp->qp_num,
                            static_cast<int>(qp->state)));
      *bad = w;
      return EINVAL;
    }
    if (q->s->outstanding >= q->s->max_send_wr) {
      violation(fmt::format("post_send beyond the send queue of QP {:#x} ({} WRs)", qp->qp_num,
                            q->s->max_send_wr));
      *bad = w;
      return ENOMEM;
    }
    if (w->opcode != IBV_WR_SEND && w->opcode != IBV_WR_RDMA_WRITE_WITH_IMM) {
      *bad = w;
      return EINVAL;
    }
    WrCopy c;
    c.wr_id = w->wr_id;
    c.opcode = w->opcode;
    c.signaled = (w->send_flags & IBV_SEND_SIGNALED) != 0;
    c.is_inline = (w->send_flags & IBV_SEND_INLINE) != 0;
    c.remote_addr = w->wr.rdma.remote_addr;
    c.rkey = w->wr.rdma.rkey;
    c.imm = w->imm_data;
    size_t total = 0;
    for (int i = 0; i < w->num_sge; ++i) {
      total += w->sg_list[i].length;
      if (c.is_inline) {
        const auto* p = reinterpret_cast<const uint8_t*>(w->sg_list[i].addr);
        c.inline_data.insert(c.inline_data.end(), p, p + w->sg_list[i].length);
      } else {
        c.sges.push_back(w->sg_list[i]);
      }
    }
    if (c.is_inline && total > q->s->max_inline) {
      *bad = w;
      return EINVAL;
    }
    ++q->s->outstanding;
    if (qp->state == IBV_QPS_ERR) {
      ibv_wc wc{};
      wc.wr_id = c.wr_id;
      wc.status = IBV_WC_WR_FLUSH_ERR;
      wc.qp_num = qp->qp_num;
      push_cqe(qp->send_cq, wc, true);
    } else {
      q->s->sq.push_back(std::move(c));
    }
  }
  execute(q);
  return 0;
}

int fake_post_recv(ibv_qp*, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  *bad = wr;
  return EINVAL;  // every fake QP uses an SRQ
}

int fake_post_srq_recv(ibv_srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  std::lock_guard<std::mutex> lock(g_mu);
  SrqState* s = srq_of(srq)->s;
  for (ibv_recv_wr* w = wr; w != nullptr; w = w->next) {
    if (s->wqes.size() >= s->max_wr || w->num_sge != 1) {
      if (s->wqes.size() >= s->max_wr) violation("post_srq_recv beyond the SRQ size");
      *bad = w;
      return ENOMEM;
    }
    s->wqes.push_back({w->wr_id, w->sg_list[0].addr, w->sg_list[0].length, w->sg_list[0].lkey});
  }
  // Senders waiting in RNR retry go on, in the order they started waiting.
  std::deque<uint32_t> waiters;
  waiters.swap(s->waiters);
  for (uint32_t qpn : waiters) {
    auto it = g_qps.find(qpn);
    if (it != g_qps.end()) execute(it->second);
  }
  return 0;
}

ibv_mr* fake_reg_mr(ibv_pd* pd, void* addr, size_t length, int access) {
  std::lock_guard<std::mutex> lock(g_mu);
  ++g_stats.reg_mr_calls;
  if ((access & IBV_ACCESS_REMOTE_WRITE) != 0 && (access & IBV_ACCESS_LOCAL_WRITE) == 0) {
    errno = EINVAL;  // the verbs rule: remote write needs local write
    return nullptr;
  }
  auto* m = new MrImpl{};
  m->access = access;
  m->mr.context = pd->context;
  m->mr.pd = pd;
  m->mr.addr = addr;
  m->mr.length = length;
  m->mr.handle = g_next_handle++;
  m->mr.lkey = m->mr.rkey = g_next_key++;
  g_mrs[m->mr.lkey] = m;
  ++pd_of(pd)->s->users;
  ++g_stats.live_objects;
  return &m->mr;
}

}  // namespace

void enable(bool on) {
  g_enabled = on;
}
bool enabled() {
  return g_enabled.load();
}
void set_roce(bool roce) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_roce = roce;
}
void set_dmabuf_supported(bool supported) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_dmabuf = supported;
}
Stats stats() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_stats;
}
void reset_stats() {
  std::lock_guard<std::mutex> lock(g_mu);
  const size_t live = g_stats.live_objects;
  g_stats = Stats{};
  g_stats.live_objects = live;
}

#if PSLD_FAKE_VERBS_ENABLED_BY_DEFAULT
// The conformance binary built against the fake runs with it from the start,
// and fails if the transport misused the verbs API or leaked a verbs object.
class FakeVerbsEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { enable(true); }
  void TearDown() override {
    const Stats st = stats();
    EXPECT_EQ(st.live_objects, 0u) << "verbs objects outlived every transport";
    for (const std::string& v : st.violations)
      ADD_FAILURE() << "verbs API misuse: " << v;
  }
};
[[maybe_unused]] ::testing::Environment* const g_environment =
    ::testing::AddGlobalTestEnvironment(new FakeVerbsEnvironment);
#endif

}  // namespace psld::transport::fake_verbs

// --- exported libibverbs entry points -------------------------------------

using namespace psld::transport::fake_verbs;

extern "C" {

ibv_device**(ibv_get_device_list)(int* num) {
  if (!g_enabled.load()) FORWARD(ibv_get_device_list, num);
  auto** list = static_cast<ibv_device**>(std::calloc(2, sizeof(ibv_device*)));
  list[0] = &g_device;
  if (num != nullptr) *num = 1;
  return list;
}

void ibv_free_device_list(ibv_device** list) {
  if (list != nullptr && list[0] == &g_device) {
    std::free(list);
    return;
  }
  FORWARD(ibv_free_device_list, list);
}

ibv_context* ibv_open_device(ibv_device* device) {
  if (device != &g_device) FORWARD(ibv_open_device, device);
  std::lock_guard<std::mutex> lock(g_mu);
  auto* c = new CtxImpl{};
  c->s = new CtxState;
  c->ctx.device = device;
  c->ctx.ops.poll_cq = fake_poll_cq;
  c->ctx.ops.req_notify_cq = fake_req_notify_cq;
  c->ctx.ops.post_send = fake_post_send;
  c->ctx.ops.post_recv = fake_post_recv;
  c->ctx.ops.post_srq_recv = fake_post_srq_recv;
  c->ctx.cmd_fd = -1;
  c->ctx.async_fd = eventfd(0, EFD_CLOEXEC);
  c->ctx.num_comp_vectors = 1;
  pthread_mutex_init(&c->ctx.mutex, nullptr);
  c->ctx.abi_compat = nullptr;  // not extended: query_port takes the exported path
  ++g_stats.live_objects;
  return &c->ctx;
}

int ibv_close_device(ibv_context* context) {
  if (!is_fake(context)) FORWARD(ibv_close_device, context);
  std::lock_guard<std::mutex> lock(g_mu);
  CtxImpl* c = ctx_of(context);
  if (c->s->unacked_async != 0) violation("device closed with unacknowledged async events");
  ::close(context->async_fd);
  pthread_mutex_destroy(&context->mutex);
  delete c->s;
  delete c;
  --g_stats.live_objects;
  return 0;
}

int ibv_query_device(ibv_context* context, ibv_device_attr* a) {
  if (!is_fake(context)) FORWARD(ibv_query_device, context, a);
  std::memset(a, 0, sizeof(*a));
  std::snprintf(a->fw_ver, sizeof(a->fw_ver), "fake");
  a->max_mr_size = UINT64_MAX;
  a->max_qp = 1 << 16;
  a->max_qp_wr = 32768;
  a->max_sge = 30;
  a->max_cq = 1 << 16;
  a->max_cqe = 4194303;
  a->max_mr = 1 << 20;
  a->max_pd = 1 << 16;
  a->max_qp_rd_atom = 16;
  a->max_qp_init_rd_atom = 16;
  a->max_srq = 1 << 16;
  a->max_srq_wr = 32767;
  a->max_srq_sge = 31;
  a->phys_port_cnt = 1;
  return 0;
}

int(ibv_query_port)(ibv_context* context, uint8_t port, _compat_ibv_port_attr* compat) {
  if (!is_fake(context)) FORWARD(ibv_query_port, context, port, compat);
  if (port != 1) return EINVAL;
  // The inline wrapper passes a whole ibv_port_attr.
  auto* a = reinterpret_cast<ibv_port_attr*>(compat);
  std::lock_guard<std::mutex> lock(g_mu);
  a->state = IBV_PORT_ACTIVE;
  a->max_mtu = IBV_MTU_4096;
  a->active_mtu = IBV_MTU_1024;
  a->gid_tbl_len = kGidTableLen;
  a->max_msg_sz = 1u << 30;
  a->pkey_tbl_len = 1;
  a->lid = g_roce ? 0 : 0x11;
  a->link_layer = g_roce ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_INFINIBAND;
  a->phys_state = 5;
  return 0;
}

int ibv_query_gid(ibv_context* context, uint8_t port, int index, ibv_gid* gid) {
  if (!is_fake(context)) FORWARD(ibv_query_gid, context, port, index, gid);
  if (port != 1 || index < 0 || index >= kGidTableLen) return -1;
  std::lock_guard<std::mutex> lock(g_mu);
  *gid = gid_entry(index).gid;
  return 0;
}

int _ibv_query_gid_ex(ibv_context* context, uint32_t port, uint32_t index, ibv_gid_entry* entry,
                      uint32_t flags, size_t entry_size) {
  if (!is_fake(context)) FORWARD(_ibv_query_gid_ex, context, port, index, entry, flags, entry_size);
  if (port != 1 || index >= static_cast<uint32_t>(kGidTableLen)) return ENODATA;
  std::lock_guard<std::mutex> lock(g_mu);
  *entry = gid_entry(static_cast<int>(index));
  return 0;
}

ibv_pd* ibv_alloc_pd(ibv_context* context) {
  if (!is_fake(context)) FORWARD(ibv_alloc_pd, context);
  std::lock_guard<std::mutex> lock(g_mu);
  auto* p = new PdImpl{};
  p->s = new PdState;
  p->pd.context = context;
  p->pd.handle = g_next_handle++;
  ++g_stats.live_objects;
  return &p->pd;
}

int ibv_dealloc_pd(ibv_pd* pd) {
  if (!is_fake(pd->context)) FORWARD(ibv_dealloc_pd, pd);
  std::lock_guard<std::mutex> lock(g_mu);
  PdImpl* p = pd_of(pd);
  if (p->s->users != 0) {
    violation(fmt::format("PD freed while {} MRs/QPs/SRQs use it", p->s->users));
    return EBUSY;
  }
  delete p->s;
  delete p;
  --g_stats.live_objects;
  return 0;
}

ibv_mr*(ibv_reg_mr)(ibv_pd* pd, void* addr, size_t length, int access) {
  if (!is_fake(pd->context)) FORWARD(ibv_reg_mr, pd, addr, length, access);
  return fake_reg_mr(pd, addr, length, access);
}

ibv_mr* ibv_reg_mr_iova2(ibv_pd* pd, void* addr, size_t length, uint64_t iova,
                         unsigned int access) {
  if (!is_fake(pd->context)) FORWARD(ibv_reg_mr_iova2, pd, addr, length, iova, access);
  return fake_reg_mr(pd, addr, length, static_cast<int>(access));
}

// The fake has no device memory: the tests' fake CUDA driver hands out host
// memory as "device" memory, so the MR addresses it by its iova, which the
// transport sets to the pointer itself.
ibv_mr* ibv_reg_dmabuf_mr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                          int access) {
  if (!is_fake(pd->context)) FORWARD(ibv_reg_dmabuf_mr, pd, offset, length, iova, fd, access);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_stats.dmabuf_calls.push_back({offset, length, iova, fd >= 0 && fcntl(fd, F_GETFD) != -1});
    if (!g_dmabuf) {
      errno = EOPNOTSUPP;
      return nullptr;
    }
  }
  ibv_mr* mr =
      fake_reg_mr(pd, reinterpret_cast<void*>(static_cast<uintptr_t>(iova)), length, access);
  if (mr != nullptr) {
    std::lock_guard<std::mutex> lock(g_mu);
    --g_stats.reg_mr_calls;  // counted as a dma-buf registration only
  }
  return mr;
}

int ibv_dereg_mr(ibv_mr* mr) {
  if (!is_fake(mr->context)) FORWARD(ibv_dereg_mr, mr);
  std::lock_guard<std::mutex> lock(g_mu);
  auto* m = reinterpret_cast<MrImpl*>(mr);
  g_mrs.erase(mr->lkey);
  --pd_of(mr->pd)->s->users;
  delete m;
  --g_stats.live_objects;
  return 0;
}

ibv_comp_channel* ibv_create_comp_channel(ibv_context* context) {
  if (!is_fake(context)) FORWARD(ibv_create_comp_channel, context);
  std::lock_guard<std::mutex> lock(g_mu);
  auto* c = new ChanImpl{};
  c->s = new ChanState;
  c->ch.context = context;
  c->ch.fd = eventfd(0, EFD_CLOEXEC);
  ++g_stats.live_objects;
  return &c->ch;
}

int ibv_destroy_comp_channel(ibv_comp_channel* channel) {
  if (!is_fake(channel->context)) FORWARD(ibv_destroy_comp_channel, channel);
  std::lock_guard<std::mutex> lock(g_mu);
  ChanImpl* c = chan_of(channel);
  if (c->s->cqs != 0) {
    violation("completion channel destroyed while CQs use it");
    return EBUSY;
  }
  ::close(channel->fd);
  delete c->s;
  delete c;
  --g_stats.live_objects;
  return 0;
}

ibv_cq* ibv_create_cq(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel,
                      int comp_vector) {
  if (!is_fake(context)) FORWARD(ibv_create_cq, context, cqe, cq_context, channel, comp_vector);
  std::lock_guard<std::mutex> lock(g_mu);
  auto* c = new CqImpl{};
  c->s = new CqState;
  c->cq.context = context;
  c->cq.channel = channel;
  c->cq.cq_context = cq_context;
  c->cq.handle = g_next_handle++;
  c->cq.cqe = cqe;
  if (channel != nullptr) ++chan_of(channel)->s->cqs;
  ++g_stats.live_objects;
  return &c->cq;
}

int ibv_destroy_cq(ibv_cq* cq) {
  if (!is_fake(cq->context)) FORWARD(ibv_destroy_cq, cq);
  std::lock_guard<std::mutex> lock(g_mu);
  CqImpl* c = cq_of(cq);
  if (c->s->users != 0) {
    violation("CQ destroyed while QPs use it");
    return EBUSY;
  }
  if (c->s->delivered != c->s->acked) {
    violation("CQ destroyed with unacknowledged completion events");
    return EBUSY;
  }
  if (cq->channel != nullptr) {
    auto& events = chan_of(cq->channel)->s->events;
    events.erase(std::remove(events.begin(), events.end(), cq), events.end());
    --chan_of(cq->channel)->s->cqs;
  }
  delete c->s;
  delete c;
  --g_stats.live_objects;
  return 0;
}

int ibv_get_cq_event(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) {
  if (!is_fake(channel->context)) FORWARD(ibv_get_cq_event, channel, cq, cq_context);
  std::lock_guard<std::mutex> lock(g_mu);
  auto& events = chan_of(channel)->s->events;
  if (events.empty()) {
    errno = EAGAIN;  // the transport made the fd non-blocking
    return -1;
  }
  *cq = events.front();
  events.pop_front();
  *cq_context = (*cq)->cq_context;
  ++cq_of(*cq)->s->delivered;
  if (events.empty()) {
    uint64_t v = 0;
    (void)!::read(channel->fd, &v, sizeof(v));
  }
  return 0;
}

void ibv_ack_cq_events(ibv_cq* cq, unsigned int nevents) {
  if (!is_fake(cq->context)) FORWARD(ibv_ack_cq_events, cq, nevents);
  std::lock_guard<std::mutex> lock(g_mu);
  cq_of(cq)->s->acked += nevents;
}

ibv_srq* ibv_create_srq(ibv_pd* pd, ibv_srq_init_attr* init) {
  if (!is_fake(pd->context)) FORWARD(ibv_create_srq, pd, init);
  std::lock_guard<std::mutex> lock(g_mu);
  if (init->attr.max_wr == 0 || init->attr.max_wr > 32767 || init->attr.max_sge == 0) {
    errno = EINVAL;
    return nullptr;
  }
  auto* s = new SrqImpl{};
  s->s = new SrqState;
  s->s->max_wr = init->attr.max_wr;
  s->srq.context = pd->context;
  s->srq.srq_context = init->srq_context;
  s->srq.pd = pd;
  s->srq.handle = g_next_handle++;
  ++pd_of(pd)->s->users;
  ++g_stats.live_objects;
  return &s->srq;
}

int ibv_destroy_srq(ibv_srq* srq) {
  if (!is_fake(srq->context)) FORWARD(ibv_destroy_srq, srq);
  std::lock_guard<std::mutex> lock(g_mu);
  SrqImpl* s = srq_of(srq);
  if (s->s->qps != 0) {
    violation("SRQ destroyed while QPs use it");
    return EBUSY;
  }
  --pd_of(srq->pd)->s->users;
  delete s->s;
  delete s;
  --g_stats.live_objects;
  return 0;
}

ibv_qp* ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* init) {
  if (!is_fake(pd->context)) FORWARD(ibv_create_qp, pd, init);
  std::lock_guard<std::mutex> lock(g_mu);
  if (init->qp_type != IBV_QPT_RC || init->srq == nullptr || init->send_cq == nullptr ||
      init->recv_cq == nullptr || init->cap.max_send_wr == 0 || init->cap.max_send_wr > 32768 ||
      init->cap.max_inline_data > kMaxInline) {
    errno = EINVAL;
    return nullptr;
  }
  auto* q = new QpImpl{};
  q->s = new QpState;
  q->s->max_send_wr = init->cap.max_send_wr;
  q->s->max_inline = init->cap.max_inline_data;
  q->qp.context = pd->context;
  q->qp.qp_context = init->qp_context;
  q->qp.pd = pd;
  q->qp.send_cq = init->send_cq;
  q->qp.recv_cq = init->recv_cq;
  q->qp.srq = init->srq;
  q->qp.handle = g_next_handle++;
  q->qp.qp_num = g_next_qpn++;
  q->qp.state = IBV_QPS_RESET;
  q->qp.qp_type = IBV_QPT_RC;
  ++pd_of(pd)->s->users;
  ++cq_of(init->send_cq)->s->users;
  ++cq_of(init->recv_cq)->s->users;
  ++srq_of(init->srq)->s->qps;
  g_qps[q->qp.qp_num] = q;
  ++g_stats.live_objects;
  return &q->qp;
}

int ibv_modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int mask) {
  if (!is_fake(qp->context)) FORWARD(ibv_modify_qp, qp, attr, mask);
  std::lock_guard<std::mutex> lock(g_mu);
  QpImpl* q = qp_of(qp);
  if ((mask & IBV_QP_STATE) == 0) return EINVAL;
  const ibv_qp_state from = qp->state, to = attr->qp_state;
  auto need = [&](int bits) { return (mask & bits) == bits; };
  if (to == IBV_QPS_ERR) {
    to_error(q);
    return 0;
  }
  if (from == IBV_QPS_RESET && to == IBV_QPS_INIT) {
    if (!need(IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) || attr->port_num != 1) {
      return EINVAL;
    }
    q->s->access = attr->qp_access_flags;
  } else if (from == IBV_QPS_INIT && to == IBV_QPS_RTR) {
    if (!need(IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
              IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) ||
        attr->path_mtu > IBV_MTU_1024 || attr->path_mtu < IBV_MTU_256 ||
        attr->ah_attr.port_num != 1 || attr->dest_qp_num == 0 || attr->dest_qp_num > 0xffffff ||
        attr->rq_psn > 0xffffff || attr->max_dest_rd_atomic > 16) {
      return EINVAL;
    }
    const ibv_ah_attr& ah = attr->ah_attr;
    if (g_roce && !ah.is_global) {
      violation("RoCE QP moved to RTR without a GRH");
      return EINVAL;
    }
    if (!g_roce && ah.dlid == 0) return EINVAL;
    if (ah.is_global) {
      const int sgid = ah.grh.sgid_index;
      bool zero = true;
      for (uint8_t b : ah.grh.dgid.raw)
        zero = zero && b == 0;
      if (sgid >= kGidTableLen || zero) return EINVAL;
    }
    g_stats.last_used_grh = ah.is_global != 0;
    g_stats.last_sgid_index = ah.is_global ? ah.grh.sgid_index : -1;
    q->s->dest = attr->dest_qp_num;
    q->s->was_rtr = true;
  } else if (from == IBV_QPS_RTR && to == IBV_QPS_RTS) {
    if (!need(IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
              IBV_QP_MAX_QP_RD_ATOMIC) ||
        attr->sq_psn > 0xffffff || attr->retry_cnt > 7 || attr->rnr_retry > 7 ||
        attr->timeout > 31 || attr->max_rd_atomic > 16) {
      return EINVAL;
    }
  } else {
    return EINVAL;
  }
  qp->state = to;
  return 0;
}

int ibv_destroy_qp(ibv_qp* qp) {
  if (!is_fake(qp->context)) FORWARD(ibv_destroy_qp, qp);
  std::lock_guard<std::mutex> lock(g_mu);
  QpImpl* q = qp_of(qp);
  // Events not yet read are dropped, as the kernel does; read ones must have
  // been acknowledged (checked when the device closes).
  auto& async = ctx_of(qp->context)->s->async;
  async.erase(std::remove_if(async.begin(), async.end(),
                             [&](const ibv_async_event& ev) { return ev.element.qp == qp; }),
              async.end());
  remove_waiter(q);
  // Like providers do, completions of a destroyed QP leave its CQs.
  for (ibv_cq* cq : {qp->send_cq, qp->recv_cq}) {
    auto& entries = cq_of(cq)->s->q;
    entries.erase(
        std::remove_if(entries.begin(), entries.end(),
                       [&](const CqState::Entry& e) { return e.wc.qp_num == qp->qp_num; }),
        entries.end());
  }
  --pd_of(qp->pd)->s->users;
  --cq_of(qp->send_cq)->s->users;
  --cq_of(qp->recv_cq)->s->users;
  --srq_of(qp->srq)->s->qps;
  g_qps.erase(qp->qp_num);
  delete q->s;
  delete q;
  --g_stats.live_objects;
  return 0;
}

int ibv_get_async_event(ibv_context* context, ibv_async_event* event) {
  if (!is_fake(context)) FORWARD(ibv_get_async_event, context, event);
  std::lock_guard<std::mutex> lock(g_mu);
  CtxImpl* c = ctx_of(context);
  if (c->s->async.empty()) {
    uint64_t v = 0;
    (void)!::read(context->async_fd, &v, sizeof(v));
    errno = EAGAIN;
    return -1;
  }
  *event = c->s->async.front();
  c->s->async.pop_front();
  ++c->s->unacked_async;
  return 0;
}

void ibv_ack_async_event(ibv_async_event* event) {
  // The fake raises QP events only.
  const bool qp_event = event->event_type == IBV_EVENT_QP_LAST_WQE_REACHED ||
                        event->event_type == IBV_EVENT_QP_ACCESS_ERR ||
                        event->event_type == IBV_EVENT_QP_FATAL;
  if (!qp_event || event->element.qp == nullptr || !is_fake(event->element.qp->context)) {
    FORWARD(ibv_ack_async_event, event);
  }
  std::lock_guard<std::mutex> lock(g_mu);
  --ctx_of(event->element.qp->context)->s->unacked_async;
}

}  // extern "C"
