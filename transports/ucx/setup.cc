// UCX setup: the context, the worker, the bootstrap's listener and the callbacks UCX calls.
#include "transports/ucx/core.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "base/log.h"

namespace psld::transport {

namespace ucx_detail {

void send_cb(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<OpCtx*>(user_data);
  op->request = nullptr;
  op->core->on_request_done(op, status);
  ucp_request_free(request);
}

void recv_am_cb(void* request, ucs_status_t status, size_t /*length*/, void* user_data) {
  auto* op = static_cast<OpCtx*>(user_data);
  op->request = nullptr;
  op->core->on_request_done(op, status);
  ucp_request_free(request);
}

void ep_error_cb(void* arg, ucp_ep_h ep, ucs_status_t status) {
  static_cast<UcxCore*>(arg)->on_ep_error(ep, status);
}

}  // namespace ucx_detail

namespace {

template <unsigned Id>
ucs_status_t am_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                   const ucp_am_recv_param_t* param) {
  return static_cast<UcxCore*>(arg)->on_am(Id, header, header_length, data, length, param);
}

bool is_loopback(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(a);
    return (ntohl(in.sin_addr.s_addr) >> 24) == 127;
  }
  if (a.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(a);
    return IN6_IS_ADDR_LOOPBACK(&in6.sin6_addr);
  }
  return false;
}

// "127.0.0.1:29600", "localhost:1", "[::1]:5"
bool is_loopback_host_port(const std::string& host_port) {
  const std::string host = host_port.substr(0, host_port.rfind(':'));
  return host.rfind("127.", 0) == 0 || host == "localhost" || host == "[::1]";
}

}  // namespace

// ---------------------------------------------------------------------------
// Setup

Status UcxCore::init(const sockaddr_storage* listen, socklen_t listen_len) {
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return ucs_to_status(st, "UCX cannot read its configuration (UCX_* variables)");
  auto release = [&] { ucp_config_release(config); };
  const UcxOptions& ucx = options_.ucx;
  if (!ucx.tls.empty()) {
    st = ucp_config_modify(config, "TLS", ucx.tls.c_str());
    if (st != UCS_OK) {
      release();
      return InvalidArgument(
          fmt::format("ucx.tls '{}' was rejected by UCX ({}); use a UCX_TLS "
                      "value such as tcp, sm,tcp or rc,sm,tcp",
                      ucx.tls, ucs_status_string(st)));
    }
  }
  // UCX 1.13 leaves the shared-memory transports out of any endpoint that asks
  // for peer error handling unless MM_ERROR_HANDLING=y: with "sm,tcp" a
  // connection to a local peer then ran entirely over tcp (4.8 us one way
  // instead of 0.7 us here). With it, sysv/posix carry the active messages
  // and the RMA, and a dead peer is found by keep-alive. The environment
  // still wins.
  if (std::getenv("UCX_MM_ERROR_HANDLING") == nullptr && tls_may_use_shared_memory(ucx.tls)) {
    st = ucp_config_modify(config, "MM_ERROR_HANDLING", "y");
    if (st != UCS_OK) PSLD_LOG_DEBUG("ucx: MM_ERROR_HANDLING not set: {}", ucs_status_string(st));
  }
  // Keep-alive finds a peer that died without closing its sockets (shared
  // memory lanes have none). UCX's default of 20 s is longer than a typical
  // op_timeout; probe four times per op_timeout, at most every 100 ms.
  if (std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) {
    const auto interval = std::clamp<int64_t>(options_.common.op_timeout.count() / 4, 100, 20000);
    st = ucp_config_modify(config, "KEEPALIVE_INTERVAL", fmt::format("{}ms", interval).c_str());
    if (st != UCS_OK) PSLD_LOG_DEBUG("ucx: KEEPALIVE_INTERVAL not set: {}", ucs_status_string(st));
  }

  // A process that listens on loopback, or whose coordinator is on
  // loopback, is in a job on this host: UCX's own
  // TCP transport then listens on loopback too (it listened on every
  // interface's address, reachable from the network by anyone), and RDMA
  // loopback gives nothing shared memory does not. The environment still
  // wins; a multi-host job names its interfaces in UCX_NET_DEVICES
  // (docs/reliability.md, "The ports a job opens").
  const bool on_this_host = (listen != nullptr && is_loopback(*listen)) ||
                            is_loopback_host_port(options_.common.job_address);
  //
  // job.interface (common.interface) holds UCX to that interface when
  // ucx.tls leaves no RDMA transport out by it (UCX_NET_DEVICES names RDMA
  // devices and interfaces alike); else UCX_NET_DEVICES decides.
  const std::string& iface = options_.common.interface;
  const bool net_devices_set = std::getenv("UCX_NET_DEVICES") != nullptr;
  const char* devices = nullptr;
  if (net_devices_set) {
    // The environment wins.
  } else if (on_this_host) {
    devices = "lo";
  } else if (!iface.empty() && tls_without_network_rdma(ucx.tls)) {
    devices = iface.c_str();
  } else if (!iface.empty()) {
    PSLD_LOG_INFO(
        "ucx: job.interface = {} gives the listen address; UCX's devices are left to "
        "UCX_NET_DEVICES (e.g. {},mlx5_0:1): holding UCX to {} alone would leave RDMA out",
        iface, iface, iface);
  }
  if (devices != nullptr) {
    st = ucp_config_modify(config, "NET_DEVICES", devices);
    if (st != UCS_OK) PSLD_LOG_DEBUG("ucx: NET_DEVICES not set: {}", ucs_status_string(st));
  }

  ucp_params_t params{};
  params.field_mask =
      UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  // Regions are mapped and unmapped from any thread (a MemoryRegion dies
  // wherever its last holder lets go), outside the worker lock: the context
  // must lock itself.
  params.mt_workers_shared = 1;
  params.name = "psld";
  context_ = std::make_shared<UcxContext>();
  st = ucp_init(&params, config, &context_->handle);
  release();
  if (st != UCS_OK) {
    context_->handle = nullptr;
    return Unavailable(
        fmt::format("UCX could not start (ucp_init: {}) with UCX_TLS '{}'; `ucx_info -d` lists the "
                    "transports this machine has",
                    ucs_status_string(st), ucx.tls.empty() ? "(default)" : ucx.tls));
  }
  detect_cuda_support();

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // mu_ serializes every call
  st = ucp_worker_create(context_->handle, &wp, &worker_);
  if (st != UCS_OK) {
    worker_ = nullptr;
    return ucs_to_status(st, "UCX could not create a worker");
  }
  st = ucp_worker_get_efd(worker_, &efd_);
  if (st != UCS_OK) return ucs_to_status(st, "UCX worker has no event fd");
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return Unavailable(fmt::format("eventfd: {}", std::strerror(errno)));

  // Part of init, so without the analysis too.
  auto set_handler = [&](unsigned id, ucp_am_recv_callback_t cb) NO_THREAD_SAFETY_ANALYSIS {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = id;
    hp.cb = cb;
    hp.arg = this;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    return ucp_worker_set_am_recv_handler(worker_, &hp);
  };
  for (auto [id, cb] :
       {std::pair{kAmHello, &am_cb<kAmHello>}, std::pair{kAmHelloAck, &am_cb<kAmHelloAck>},
        std::pair{kAmMessage, &am_cb<kAmMessage>}, std::pair{kAmWrite, &am_cb<kAmWrite>},
        std::pair{kAmNotify, &am_cb<kAmNotify>}, std::pair{kAmBye, &am_cb<kAmBye>},
        std::pair{kAmWake, &am_cb<kAmWake>}}) {
    st = set_handler(id, cb);
    if (st != UCS_OK) return ucs_to_status(st, "UCX refused an active-message handler");
  }

  // What the bootstrap hands a peer that proved it knows the secret.
  ucp_address_t* worker_address = nullptr;
  size_t worker_address_len = 0;
  st = ucp_worker_get_address(worker_, &worker_address, &worker_address_len);
  if (st != UCS_OK) return ucs_to_status(st, "UCX cannot tell the worker's address");
  const auto* wa = reinterpret_cast<const uint8_t*>(worker_address);
  worker_address_.assign(wa, wa + worker_address_len);
  ucp_worker_release_address(worker_, worker_address);
  if (worker_address_.size() > kMaxWorkerAddress) {
    return Unimplemented(fmt::format(
        "UCX's worker address is {} bytes, more than the bootstrap carries ({}); limit UCX to the "
        "job's devices with UCX_NET_DEVICES",
        worker_address_.size(), kMaxWorkerAddress));
  }
  boot_epfd_ = epoll_create1(EPOLL_CLOEXEC);
  if (boot_epfd_ < 0) return Unavailable(fmt::format("epoll_create1: {}", std::strerror(errno)));

  if (listen != nullptr) {
    // psld's own socket, not a UCX listener: nothing of UCX is reachable
    // before a peer proved it knows the job's secret (bootstrap.cc).
    PSLD_RETURN_IF_ERROR(start_listening(*listen, listen_len));
    PSLD_LOG_INFO("ucx: listening on {} (psld bootstrap; UCX_TLS {})", listen_text_,
                  ucx.tls.empty() ? std::string("from the environment") : ucx.tls);
  }
  return Status::Ok();
}

// Whether UCX handles CUDA memory here. ucp_context_query's memory_types
// holds a type when one of the context's memory domains with transport
// resources can detect it: for CUDA that is cuda_copy, which exists only in a
// UCX built --with-cuda (Debian's and Ubuntu's packages are not) and is left
// out when UCX_TLS excludes it (e.g. "tcp"). With cuda_copy UCX moves device
// memory correctly on every lane: zero-copy where the NIC can reach GPU
// memory (GPUDirect RDMA: the ib transports with nvidia-peermem or dma-buf),
// else pipelined through its own host buffers.
void UcxCore::detect_cuda_support() {
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  const ucs_status_t st = ucp_context_query(context_->handle, &attr);
  if (st != UCS_OK) {
    cuda_supported_ = false;
    cuda_detail_ = fmt::format(
        "ucp_context_query failed ({}); psld stages device tensors "
        "through host memory",
        ucs_status_string(st));
  } else if ((attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) == 0) {
    cuda_supported_ = false;
    cuda_detail_ =
        options_.ucx.tls.empty()
            ? "this UCX build has no CUDA support (Debian's UCX does not); psld stages device "
              "tensors through host memory"
            : fmt::format(
                  "this UCX build has no CUDA support (Debian's UCX does not), or "
                  "ucx.tls '{}' leaves out cuda_copy; psld stages device tensors "
                  "through host memory",
                  options_.ucx.tls);
  } else {
    cuda_supported_ = true;
    cuda_detail_ =
        "UCX memory type cuda (ucp_mem_map with UCS_MEMORY_TYPE_CUDA; zero-copy where the "
        "NIC reaches GPU memory, else UCX pipelines through host buffers)";
  }
  PSLD_LOG_INFO("ucx: CUDA memory {}: {}", cuda_supported_ ? "supported" : "not supported",
                cuda_detail_);
}

}  // namespace psld::transport
