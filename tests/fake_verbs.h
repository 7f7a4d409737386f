// A fake RDMA device for tests, so the verbs transport's logic (handshake,
// queueing, completion routing, flow control, teardown) runs on machines
// without RDMA hardware.
//
// tests/fake_verbs.cc defines the libibverbs entry points the transport uses
// (ibv_open_device, ibv_create_qp, ibv_modify_qp, ...) in the test binary,
// which interposes them over libibverbs; the data-path calls (ibv_post_send,
// ibv_poll_cq, ...) reach it through the fake context's ops table. While the
// fake is disabled, ibv_get_device_list and every call on a real object go
// to the real libibverbs, so a binary with the fake still tests real devices.
//
// The fake is an in-process RC fabric: WRITE_WITH_IMM and SEND are executed
// in order per QP when posted, consume a receive from the target's SRQ and
// produce real-looking completions; an empty SRQ makes the sender wait as RNR
// retry would (rnr_retry 7); a bad rkey is REM_ACCESS_ERR and moves both QPs
// to ERR; a QP moved to ERR flushes its send queue and raises
// IBV_EVENT_QP_LAST_WQE_REACHED. It is strict where the hardware is:
// posting beyond the send queue, overrunning a CQ, posting to a QP not in
// RTS, destroying objects still in use or with unacknowledged events, and a
// RoCE QP without a GRH are recorded as violations.
//
// What it cannot show: timing, real PCIe ordering, packet loss and retry
// timers, or a provider's quirks. Those need a device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace psld::transport::fake_verbs {

// While enabled, ibv_get_device_list() returns one fake device "fakeverbs0".
void enable(bool on);
bool enabled();
// The fake port's link layer: RoCE (default, GID table with RoCE v1/v2
// entries) or InfiniBand (LID 0x11).
void set_roce(bool roce);

// Whether ibv_reg_dmabuf_mr succeeds (default) or fails with EOPNOTSUPP, as
// on a kernel or NIC driver without dma-buf support.
void set_dmabuf_supported(bool supported);

// One ibv_reg_dmabuf_mr call as the fake saw it.
struct DmabufRegistration {
  uint64_t offset = 0;
  size_t length = 0;
  uint64_t iova = 0;
  bool fd_was_open = false;  // the fd was a live descriptor during the call
};

struct Stats {
  size_t live_objects = 0;   // contexts, PDs, MRs, channels, CQs, SRQs, QPs
  int last_sgid_index = -1;  // of the last QP moved to RTR with a GRH (-1: none)
  bool last_used_grh = false;
  size_t rnr_waits = 0;                          // sends that found the target SRQ empty
  size_t reg_mr_calls = 0;                       // ibv_reg_mr / ibv_reg_mr_iova2 on the fake device
  std::vector<DmabufRegistration> dmabuf_calls;  // ibv_reg_dmabuf_mr, failed ones included
  std::vector<std::string> violations;
};
Stats stats();
void reset_stats();

}  // namespace psld::transport::fake_verbs
