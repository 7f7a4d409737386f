// An in-process job for tests: a coordinator, servers and workers on one
// transport (the loopback fabric by default), started side by side and
// stopped in order by the destructor.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "lib/coordinator/service.h"
#include "lib/server/service.h"
#include "lib/worker/service.h"
#include "tests/eventually.h"
#include "transports/loopback/loopback.h"

namespace psld {

using namespace std::chrono_literals;

struct Cluster {
  std::shared_ptr<transport::LoopbackFabric> fabric = std::make_shared<transport::LoopbackFabric>();
  RuntimeOptions base;
  std::unique_ptr<CoordinatorService> coordinator;
  std::vector<std::unique_ptr<ServerService>> servers;
  std::vector<std::unique_ptr<WorkerService>> workers;
  // Changes the options of the i-th server started (servers[i]), e.g. to
  // put one behind a slow emulated link.
  std::function<void(uint32_t, RuntimeOptions&)> server_tweak;
  // Runs once every server started (and so the job did), while the workers
  // may still be connecting to the servers: to kill one during their join.
  std::function<void(Cluster&)> servers_started;

  explicit Cluster(uint32_t num_workers, uint32_t num_servers,
                   const std::function<void(RuntimeOptions&)>& tweak = nullptr,
                   const std::string& transport = "loopback") {
    base.net.transport = transport;
    base.net.options.loopback.fabric = fabric;
    base.net.options.ucx.tls = "tcp";
    base.net.options.common.op_timeout = 5s;
    base.num_workers = num_workers;
    base.num_servers = num_servers;
    // The tests check integer sums: the summation service, said here since
    // the library's default (Config's) is server.mode = optimizer.
    base.mode = ServerMode::kSum;
    base.chunk_bytes = 64 * 1024;
    base.slots_per_worker = 4;
    base.heartbeat_interval = 50ms;
    base.heartbeat_timeout = 2s;
    base.connect_timeout = 5s;
    if (tweak) tweak(base);
  }

  Status start() {
    auto c = CoordinatorService::start(base);
    if (!c.ok()) return c.status();
    coordinator = std::move(c).value();
    base.coordinator_address = coordinator->address();
    return start_members();
  }

  // The servers and workers, against the coordinator already started.
  Status start_members() {
    std::vector<std::future<Result<std::unique_ptr<ServerService>>>> sf;
    for (uint32_t i = 0; i < base.num_servers + base.num_standby; ++i) {
      RuntimeOptions o = base;
      if (server_tweak) server_tweak(i, o);
      sf.push_back(std::async(std::launch::async, [o] { return ServerService::start(o); }));
    }
    std::vector<std::future<Result<std::unique_ptr<WorkerService>>>> wf;
    for (uint32_t i = 0; i < base.num_workers; ++i) {
      RuntimeOptions o = base;
      o.rank = static_cast<int32_t>(i);
      wf.push_back(std::async(std::launch::async, [o] { return WorkerService::start(o); }));
    }
    Status first;
    for (auto& f : sf) {
      auto s = f.get();
      if (s.ok())
        servers.push_back(std::move(s).value());
      else if (first.ok())
        first = s.status();
    }
    if (servers_started && first.ok()) servers_started(*this);
    for (auto& f : wf) {
      auto w = f.get();
      if (w.ok())
        workers.push_back(std::move(w).value());
      else if (first.ok())
        first = w.status();
    }
    return first;
  }

  ~Cluster() {
    for (auto& w : workers)
      (void)w->shutdown();
    if (coordinator) (void)coordinator->wait(2s);
    for (auto& s : servers)
      s->shutdown();
    if (coordinator) coordinator->shutdown();
  }
};

// servers[i] is server i; on UCX each sits behind an emulated link (of
// unlimited capacity) that kill_server() can cut.
inline std::function<void(uint32_t, RuntimeOptions&)> numbered_servers(const std::string& backend) {
  return [backend](uint32_t i, RuntimeOptions& o) {
    o.rank = static_cast<int32_t>(i);
    if (backend != "loopback") o.net.emulate_link = true;
  };
}

// Waits up to 20 s until no switch is in flight, proposes the change
// make(committed placement) returns, and waits up to 10 s for its commit.
template <typename Make>
Status switch_to(Cluster& c, const char* what, Make&& make) {
  if (!eventually("no switch in flight", 20s, [&] { return !c.coordinator->switching(); })) {
    return Timeout(std::string(what) + ": a switch was still in flight after 20 s");
  }
  auto change = make(c.coordinator->current_placement());
  if (!change.ok()) return change.status().with_context(what);
  const uint64_t before = c.coordinator->switches();
  PSLD_RETURN_IF_ERROR(c.coordinator->propose(change->delta).with_context(what));
  if (!eventually(what, 10s, [&] { return c.coordinator->switches() != before; })) {
    return Timeout(std::string(what) + " did not commit within 10 s");
  }
  return Status::Ok();
}

// How a test kills a server. On loopback its transport shuts down without a
// goodbye: every connection closes at once, as a crashed process's would.
// On UCX it falls silent behind its link (a hung or cut-off server, found by
// the coordinator's heartbeats): shutting a UCX transport down in-process
// while its peers are busy can crash inside UCX's connection manager
// (uct_tcp_sockcm_ep_recv, on UCX's async thread), which is not what a
// crashed process does to the survivors.
inline void kill_server(Cluster& c, ServerId victim) {
  if (c.base.net.transport == "loopback") {
    c.servers[victim]->shutdown();
    return;
  }
  transport::LinkOptions cut;
  cut.egress_bytes_per_second = 1;
  cut.ingress_bytes_per_second = 1;
  cut.burst_bytes = 1;
  ASSERT_TRUE(transport::set_link(c.servers[victim]->transport(), cut).ok());
}

// Runs fn(worker index) on every worker concurrently and returns the first error.
inline Status on_all(Cluster& c, const std::function<Status(size_t)>& fn) {
  std::vector<std::future<Status>> fs;
  for (size_t i = 0; i < c.workers.size(); ++i) {
    fs.push_back(std::async(std::launch::async, [&, i] { return fn(i); }));
  }
  Status first;
  for (auto& f : fs) {
    Status s = f.get();
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

// Makes data[t] a zeroed fp32 tensor of elems[t] elements and registers it
// on w as "t<t>", in order (so every worker's tensor t gets the same id);
// returns the handles.
inline Result<std::vector<uint32_t>> register_zeroed(WorkerService& w,
                                                     const std::vector<size_t>& elems,
                                                     std::vector<std::vector<float>>& data) {
  data.resize(elems.size());
  std::vector<uint32_t> handles;
  for (size_t t = 0; t < elems.size(); ++t) {
    data[t].assign(elems[t], 0.0f);
    PSLD_ASSIGN_OR_RETURN(uint32_t h, w.register_tensor("t" + std::to_string(t), DType::kFloat32,
                                                        elems[t] * 4, data[t].data(), nullptr));
    handles.push_back(h);
  }
  return handles;
}

// Like register_zeroed, with the tensors carved one after another from one
// Worker::allocate block (zero-filled), which servers that map it read
// push_pulls from in place; data[t] points at tensor t.
inline Result<std::vector<uint32_t>> register_allocated(WorkerService& w,
                                                        const std::vector<size_t>& elems,
                                                        std::vector<float*>& data) {
  size_t total = 0;
  for (size_t n : elems)
    total += n;
  PSLD_ASSIGN_OR_RETURN(void* block, w.allocate(total * 4));
  float* at = static_cast<float*>(block);
  data.clear();
  std::vector<uint32_t> handles;
  for (size_t t = 0; t < elems.size(); ++t) {
    data.push_back(at);
    PSLD_ASSIGN_OR_RETURN(uint32_t h, w.register_tensor("t" + std::to_string(t), DType::kFloat32,
                                                        elems[t] * 4, at, nullptr));
    handles.push_back(h);
    at += elems[t];
  }
  return handles;
}

// `rounds` BSP push_pull rounds over every tensor (data[t]: elems[t] fp32
// elements): each element i of round r is pushed as value(r, i) and must come
// back exactly as want(r, i). The first wrong element is the error.
// `together`: each round's requests are submitted at once (submit_many), so
// small chunks travel in batches; else one submit per tensor.
inline Status exact_push_pull_rounds(WorkerService& w, const std::vector<uint32_t>& handles,
                                     const std::vector<float*>& data,
                                     const std::vector<size_t>& elems, int rounds,
                                     const std::function<float(int, size_t)>& value,
                                     const std::function<float(int, size_t)>& want,
                                     bool together = false) {
  for (int r = 1; r <= rounds; ++r) {
    std::vector<std::shared_ptr<RequestState>> reqs;
    for (size_t t = 0; t < elems.size(); ++t) {
      for (size_t i = 0; i < elems[t]; ++i)
        data[t][i] = value(r, i);
      if (together) continue;
      PSLD_ASSIGN_OR_RETURN(auto req, w.submit(handles[t], RequestKind::kPushPull));
      reqs.push_back(req);
    }
    if (together) {
      PSLD_ASSIGN_OR_RETURN(reqs, w.submit_many(handles, RequestKind::kPushPull));
    }
    for (auto& req : reqs)
      PSLD_RETURN_IF_ERROR(req->wait(std::chrono::seconds(10)));
    for (size_t t = 0; t < elems.size(); ++t) {
      for (size_t i = 0; i < elems[t]; ++i) {
        if (data[t][i] != want(r, i)) {
          return Internal("round " + std::to_string(r) + " tensor " + std::to_string(t) +
                          " element " + std::to_string(i) + ": " + std::to_string(data[t][i]) +
                          " != " + std::to_string(want(r, i)));
        }
      }
    }
  }
  return Status::Ok();
}

// register_zeroed on every worker of `c`, worker w's tensors in storage_of[w]
// (resized to the workers); its handles in the result's [w].
inline Result<std::vector<std::vector<uint32_t>>> register_zeroed_on_all(
    Cluster& c, const std::vector<size_t>& elems,
    std::vector<std::vector<std::vector<float>>>& storage_of) {
  storage_of.resize(c.workers.size());
  std::vector<std::vector<uint32_t>> handles;
  for (size_t w = 0; w < c.workers.size(); ++w) {
    PSLD_ASSIGN_OR_RETURN(auto h, register_zeroed(*c.workers[w], elems, storage_of[w]));
    handles.push_back(std::move(h));
  }
  return handles;
}

// On every worker at once: zeroed tensors of `elems` (in storage_of[w]),
// then `rounds` rounds of exact_push_pull_rounds with each round's tensors
// submitted together; value(rank, r, i) is what a worker of that rank
// pushes, want(r, i) the sum it must pull.
inline Status exact_rounds_together_on_all(Cluster& c,
                                           std::vector<std::vector<std::vector<float>>>& storage_of,
                                           const std::vector<size_t>& elems, int rounds,
                                           const std::function<float(float, int, size_t)>& value,
                                           const std::function<float(int, size_t)>& want) {
  storage_of.resize(c.workers.size());
  return on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    PSLD_ASSIGN_OR_RETURN(std::vector<uint32_t> handles, register_zeroed(w, elems, storage_of[wi]));
    std::vector<float*> data;
    for (auto& v : storage_of[wi])
      data.push_back(v.data());
    const float rank = static_cast<float>(w.rank());
    return exact_push_pull_rounds(
        w, handles, data, elems, rounds, [&](int r, size_t i) { return value(rank, r, i); }, want,
        /*together=*/true);
  });
}

// Two runs' tensors hold the very same floats, bit for bit; the first
// difference fails the test.
inline void expect_bit_identical(const std::vector<std::vector<float>>& a,
                                 const std::vector<std::vector<float>>& b) {
  ASSERT_EQ(a.size(), b.size());
  ASSERT_FALSE(a.empty());
  for (size_t t = 0; t < a.size(); ++t) {
    ASSERT_EQ(a[t].size(), b[t].size());
    for (size_t i = 0; i < a[t].size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(a[t][i]), std::bit_cast<uint32_t>(b[t][i]))
          << "tensor " << t << " element " << i << ": " << a[t][i] << " vs " << b[t][i];
    }
  }
}

// The transports a runtime test runs on: the loopback fabric, and UCX where
// this build has it.
inline std::vector<std::string> test_backends() {
  std::vector<std::string> out{"loopback"};
  for (const auto& t : transport::available_transports()) {
    if (t == "ucx") out.push_back("ucx");
  }
  return out;
}

}  // namespace psld
