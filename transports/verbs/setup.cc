// Setup of the verbs backend: device open, GID choice, PD/CQs/SRQ, buffer pools, epoll, listening.
#include "transports/verbs/core.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "base/log.h"

namespace psld::transport {
namespace verbs {

namespace {

bool set_nonblocking(int fd) {
  const int flags = fcntl(fd, F_GETFL);
  return flags >= 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

const char* mtu_name(int mtu) {
  switch (mtu) {
    case IBV_MTU_256:
      return "256";
    case IBV_MTU_512:
      return "512";
    case IBV_MTU_1024:
      return "1024";
    case IBV_MTU_2048:
      return "2048";
    case IBV_MTU_4096:
      return "4096";
  }
  return "?";
}

}  // namespace

// ---------------------------------------------------------------------------
// Setup

Status Core::init() {
  port_ = opts_.verbs.port;
  PSLD_RETURN_IF_ERROR(open_device());
  PSLD_RETURN_IF_ERROR(select_gid());
  PSLD_RETURN_IF_ERROR(create_queues());
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epfd_ < 0 || wake_fd_ < 0) return device_error("epoll_create1/eventfd", errno);
  PSLD_RETURN_IF_ERROR(epoll_add(wake_fd_, kTagWake, EPOLLIN));
  PSLD_RETURN_IF_ERROR(epoll_add(channel_->fd, kTagChannel, EPOLLIN));
  PSLD_RETURN_IF_ERROR(epoll_add(ctx_->async_fd, kTagAsync, EPOLLIN));
  PSLD_RETURN_IF_ERROR(start_listening());
  detect_cuda_support();
  PSLD_LOG_INFO("verbs: {} port {} ({}, {}), path MTU {}, {} send WRs per QP, SRQ of {}",
                device_name_, port_, link_ == LinkLayer::kEthernet ? "RoCE" : "InfiniBand",
                use_grh_ ? fmt::format("GID index {} {}", gid_index_, gid_.to_string())
                         : fmt::format("LID {:#x}", port_attr_.lid),
                mtu_name(port_attr_.active_mtu), sq_depth_, recv_pool_.count);
  return Status::Ok();
}

Status Core::open_device() {
  int num = 0;
  errno = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr) {
    return Unavailable(fmt::format(
        "no RDMA device: ibv_get_device_list failed: {} (no RDMA support in this kernel?)",
        errno_text(errno)));
  }
  std::unique_ptr<ibv_device*, void (*)(ibv_device**)> guard(list, ibv_free_device_list);
  if (num == 0) {
    return Unavailable(
        "no RDMA device: libibverbs found none (no RDMA NIC, no Soft-RoCE/rxe link, or no "
        "provider library for it)");
  }
  std::vector<std::string> names, rejected;
  for (int i = 0; i < num && ctx_ == nullptr; ++i) {
    const std::string name = ibv_get_device_name(list[i]);
    names.push_back(name);
    if (!opts_.verbs.device.empty() && name != opts_.verbs.device) continue;
    if (list[i]->transport_type != IBV_TRANSPORT_IB) {
      // iWARP RC queue pairs can only be connected through rdmacm.
      rejected.push_back(name + " (not InfiniBand/RoCE)");
      continue;
    }
    ibv_context* ctx = ibv_open_device(list[i]);
    if (ctx == nullptr) {
      rejected.push_back(fmt::format("{} (cannot open: {})", name, errno_text(errno)));
      continue;
    }
    ibv_device_attr dattr{};
    ibv_port_attr pattr{};
    std::string why;
    if (ibv_query_device(ctx, &dattr) != 0) {
      why = "ibv_query_device failed";
    } else if (port_ > dattr.phys_port_cnt) {
      why = fmt::format("has {} port(s), not port {}", dattr.phys_port_cnt, port_);
    } else if (ibv_query_port(ctx, port_, &pattr) != 0) {
      why = "ibv_query_port failed";
    } else if (pattr.state != IBV_PORT_ACTIVE) {
      why = fmt::format("port {} is {}", port_, ibv_port_state_str(pattr.state));
    } else if (pattr.link_layer != IBV_LINK_LAYER_ETHERNET && pattr.lid == 0) {
      why = fmt::format("port {} has no LID (is a subnet manager running?)", port_);
    }
    if (!why.empty()) {
      rejected.push_back(fmt::format("{} ({})", name, why));
      ibv_close_device(ctx);
      continue;
    }
    ctx_ = ctx;
    dev_attr_ = dattr;
    port_attr_ = pattr;
    device_name_ = name;
  }
  if (ctx_ != nullptr) return Status::Ok();
  if (!opts_.verbs.device.empty() && rejected.empty()) {
    return Unavailable(fmt::format("no RDMA device named '{}' (verbs.device); present: {}",
                                   opts_.verbs.device, fmt::join(names, ", ")));
  }
  return Unavailable(
      fmt::format("no RDMA device with an active port {}: {}", port_, fmt::join(rejected, "; ")));
}

// RoCE needs a GID (and a GRH on every packet); InfiniBand inside a subnet
// routes by LID and uses a GRH only when verbs.gid_index asks for one.
//
// gid_index -1 on RoCE picks, among the port's RoCE v2 GIDs, an IPv4-mapped
// one (::ffff:a.b.c.d: routable over IP, what RoCE clusters configure), else
// a global IPv6 one, else a link-local one, lowest index first. RoCE v1 GIDs
// are never picked automatically (not routable across subnets); name one with
// verbs.gid_index if the fabric is v1-only. The GID type comes from
// ibv_query_gid_ex (rdma-core >= 32).
Status Core::select_gid() {
  link_ = port_attr_.link_layer == IBV_LINK_LAYER_ETHERNET ? LinkLayer::kEthernet
                                                           : LinkLayer::kInfiniBand;
  const int wanted = opts_.verbs.gid_index;
  if (wanted >= 0) {
    if (wanted >= port_attr_.gid_tbl_len) {
      return InvalidArgument(
          fmt::format("verbs.gid_index {} is past the GID table of {} port {} "
                      "({} entries; see show_gids)",
                      wanted, device_name_, port_, port_attr_.gid_tbl_len));
    }
    ibv_gid g{};
    if (ibv_query_gid(ctx_, port_, wanted, &g) != 0) {
      return device_error(
          fmt::format("ibv_query_gid({} port {} index {})", device_name_, port_, wanted), errno);
    }
    std::memcpy(gid_.raw.data(), g.raw, 16);
    if (gid_.is_zero()) {
      return InvalidArgument(fmt::format("verbs.gid_index {}: that entry of {} port {} is empty",
                                         wanted, device_name_, port_));
    }
    gid_index_ = wanted;
    use_grh_ = true;
    return Status::Ok();
  }
  if (link_ == LinkLayer::kInfiniBand) {
    ibv_gid g{};
    if (ibv_query_gid(ctx_, port_, 0, &g) == 0) std::memcpy(gid_.raw.data(), g.raw, 16);
    gid_index_ = 0;
    use_grh_ = false;
    return Status::Ok();
  }
  int best = -1, best_rank = 0;
  for (int i = 0; i < port_attr_.gid_tbl_len; ++i) {
    ibv_gid_entry e{};
    if (ibv_query_gid_ex(ctx_, port_, static_cast<uint32_t>(i), &e, 0) != 0) continue;
    if (e.gid_type != IBV_GID_TYPE_ROCE_V2) continue;
    Gid g;
    std::memcpy(g.raw.data(), e.gid.raw, 16);
    if (g.is_zero()) continue;
    const bool link_local = g.raw[0] == 0xfe && (g.raw[1] & 0xc0) == 0x80;
    const int rank = g.is_ipv4_mapped() ? 3 : link_local ? 1 : 2;
    if (rank > best_rank) {
      best = i;
      best_rank = rank;
      gid_ = g;
    }
  }
  if (best < 0) {
    return Unavailable(fmt::format(
        "no RDMA device with a RoCE v2 GID: {} port {} has none (does its netdev have an IP "
        "address?); set verbs.gid_index to use another GID",
        device_name_, port_));
  }
  gid_index_ = best;
  use_grh_ = true;
  return Status::Ok();
}

Status Core::make_pool(BufferPool& pool, uint32_t count, uint32_t bytes, int access) {
  const size_t size = (static_cast<size_t>(count) * bytes + 4095) / 4096 * 4096;
  pool.mem = static_cast<uint8_t*>(std::aligned_alloc(4096, size));
  if (pool.mem == nullptr) return ResourceExhausted(fmt::format("cannot allocate {} bytes", size));
  std::memset(pool.mem, 0, size);
  pool.count = count;
  pool.bytes = bytes;
  pool.mr = ibv_reg_mr(pd_, pool.mem, size, access);
  if (pool.mr == nullptr) {
    return ResourceExhausted(fmt::format(
        "ibv_reg_mr of a {}-byte buffer pool: {} (raise ulimit -l)", size, errno_text(errno)));
  }
  pool.free.clear();
  for (uint32_t i = count; i > 0; --i) {
    pool.free.push_back(static_cast<int>(i - 1));
  }
  return Status::Ok();
}

Status Core::create_queues() {
  pd_ = ibv_alloc_pd(ctx_);
  if (pd_ == nullptr) return device_error("ibv_alloc_pd", errno);
  channel_ = ibv_create_comp_channel(ctx_);
  if (channel_ == nullptr) return device_error("ibv_create_comp_channel", errno);
  // Both fds are read inside progress(), which must never block.
  if (!set_nonblocking(channel_->fd) || !set_nonblocking(ctx_->async_fd)) {
    return device_error("making the completion channel non-blocking", errno);
  }
  if (dev_attr_.max_srq == 0 || dev_attr_.max_srq_wr == 0) {
    return Unimplemented(fmt::format("{} has no shared receive queues", device_name_));
  }
  const uint32_t srq_depth = std::min<uint32_t>(kSrqDepth, dev_attr_.max_srq_wr);
  const int max_cqe = std::max(dev_attr_.max_cqe, 1);
  send_cq_ = ibv_create_cq(ctx_, std::min(kSendCqDepth, max_cqe), nullptr, channel_, 0);
  // With an SRQ a receive completion needs a posted receive, so the SRQ
  // depth bounds what the receive CQ can hold; twice that is slack.
  recv_cq_ =
      ibv_create_cq(ctx_, std::min(static_cast<int>(2 * srq_depth), max_cqe), nullptr, channel_, 0);
  if (send_cq_ == nullptr || recv_cq_ == nullptr) return device_error("ibv_create_cq", errno);
  const auto cq_slots = static_cast<uint32_t>(send_cq_->cqe);
  ibv_srq_init_attr sa{};
  sa.attr.max_wr = srq_depth;
  sa.attr.max_sge = 1;
  srq_ = ibv_create_srq(pd_, &sa);
  if (srq_ == nullptr) return device_error("ibv_create_srq", errno);

  PSLD_RETURN_IF_ERROR(make_pool(recv_pool_, srq_depth, kMaxMessageBytes, IBV_ACCESS_LOCAL_WRITE));
  // Send buffers are only read by the NIC; LOCAL_WRITE is harmless and some
  // providers want it for any MR used in a gather list.
  PSLD_RETURN_IF_ERROR(
      make_pool(send_pool_, kSendBuffers, kMaxMessageBytes, IBV_ACCESS_LOCAL_WRITE));
  std::vector<uint32_t> all;
  for (uint32_t i = 0; i < recv_pool_.count; ++i) {
    all.push_back(i);
  }
  recv_pool_.free.clear();  // the receive pool is "free" when posted
  {
    MutexLock lock(mu_);
    cq_budget_ = SlotBudget(cq_slots);
    post_receives_locked(all);
  }
  sq_depth_ = std::min<uint32_t>(opts_.verbs.max_inflight,
                                 static_cast<uint32_t>(std::max(dev_attr_.max_qp_wr, 1)));
  sq_depth_ = std::min(sq_depth_, cq_slots);
  // wc.byte_len is 32 bits; a port reporting 0 gets the common 1 GiB.
  max_write_bytes_ = port_attr_.max_msg_sz != 0 ? port_attr_.max_msg_sz : (1u << 30);
  max_rd_atomic_ = static_cast<uint8_t>(std::min(1, dev_attr_.max_qp_init_rd_atom));
  max_dest_rd_atomic_ = static_cast<uint8_t>(std::min(1, dev_attr_.max_qp_rd_atom));
  return Status::Ok();
}

Status Core::epoll_add(int fd, uint64_t tag, uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = tag;
  if (epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) != 0) return device_error("epoll_ctl(ADD)", errno);
  return Status::Ok();
}

void Core::epoll_del(int fd) {
  if (epfd_ >= 0 && fd >= 0) epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
}

Status Core::start_listening() {
  if (opts_.common.listen_address.empty()) return Status::Ok();
  PSLD_ASSIGN_OR_RETURN(HostPort where, parse_host_port(opts_.common.listen_address, false));
  auto fd = tcp_listen(where);
  // Not Unavailable: a port in use is a configuration problem here.
  if (!fd.ok()) return FailedPrecondition(fd.status().message());
  listen_fd_ = *fd;
  PSLD_ASSIGN_OR_RETURN(HostPort bound, socket_address(listen_fd_, /*peer=*/false));
  address_ = format_host_port(bound);
  return epoll_add(listen_fd_, kTagListen, EPOLLIN);
}

Core::~Core() {
  teardown();
  if (wake_fd_ >= 0) ::close(wake_fd_);
  if (epfd_ >= 0) ::close(epfd_);
}

}  // namespace verbs
}  // namespace psld::transport
