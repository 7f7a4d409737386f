// Replication and failover (docs/replication.md): with replication.factor 2
// a server killed in the middle of a BSP job loses nothing; every round's
// sums stay exact, and an optimizer's parameters end bit-identical to those
// of a job in which nobody died.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "tests/cluster.h"
#include "tests/eventually.h"

namespace psld {
namespace {

struct Job {
  uint32_t workers = 4;
  uint32_t servers = 3;
  uint32_t standby = 0;
  uint64_t rounds = 60;
  ServerMode mode = ServerMode::kSum;
  // Round -> what worker 0 does once it finished that round (on a thread of
  // its own), such as killing a server.
  std::map<uint64_t, std::function<void(Cluster&)>> events;
  std::vector<size_t> elems = {1, 7, 1000, 16384, 50001, 3000, 77777};
  // The tensors in Worker::allocate memory, which loopback servers map (a
  // push_pull is then read in place); and odd tensors sent as a plain push
  // followed by a pull instead of a push_pull.
  bool allocated = false;
  bool plain_pushes = false;
  // Async and staleness (sum mode): no sum is checked per round; after the
  // last, every worker pulls each tensor, which must hold the total of every
  // push of every worker.
  SyncMode sync = SyncMode::kBsp;
  // A server whose link adds `slow_latency` to everything it sends (its
  // handshakes too), and what happens once every server started, while the
  // workers may still be joining (Cluster::servers_started).
  std::optional<ServerId> slow_server;
  std::chrono::milliseconds slow_latency{0};
  std::function<void(Cluster&)> servers_started;
  std::function<void(Cluster&)> started;  // once every member started
};

// What a job's worker 0 ends with, and what the job said.
struct Outcome {
  Status status;
  std::vector<std::vector<float>> params;  // worker 0's tensors after the last round
  uint64_t failovers = 0;
  uint64_t switches = 0;
  std::optional<Placement> placement;  // the coordinator's at the end
  ServerStats servers;                 // every server's, lost ones included
};

float pushed(uint32_t rank, uint64_t r, size_t t, size_t i) {
  return static_cast<float>(rank) * 100.0f + static_cast<float>((r + i + t) % 11);
}

std::function<void(Cluster&)> kill(ServerId victim) {
  return [victim](Cluster& c) { kill_server(c, victim); };
}

// Kills `victim` once the copies of the last switch or failover are all
// made (before, a loss fails the job: docs/replication.md).
std::function<void(Cluster&)> kill_once_copied(ServerId victim) {
  return [victim](Cluster& c) {
    EXPECT_TRUE(eventually("the copies of the last switch", 20s,
                           [&] { return !c.coordinator->switching(); }));
    kill_server(c, victim);
  };
}

// The switch that gives every other arc of server `from` to server `to`
// (joining it to the ring first when it is a standby).
Result<PlacementChange> half_of(const Placement& p, ServerId from, ServerId to) {
  PlacementDelta d{p.epoch(), p.epoch() + 1, {}, {}};
  if (p.find_server(to) == nullptr) {
    PSLD_ASSIGN_OR_RETURN(PlacementChange add, p.add_server({to, 1.0}));
    d.membership = add.delta.membership;
  }
  const std::vector<Arc> arcs = p.arcs_of(from);
  for (size_t i = 0; i < arcs.size(); i += 2)
    d.assignments.push_back({arcs[i].lo, arcs[i].hi, to});
  PSLD_ASSIGN_OR_RETURN(Placement next, p.apply(d));
  return PlacementChange{std::move(next), std::move(d)};
}

// Proposes half_of(from, to), once no switch is in flight, and waits for its
// commit.
std::function<void(Cluster&)> move_half(ServerId from, ServerId to) {
  return [from, to](Cluster& c) {
    const Status st = switch_to(c, "moving half a server's arcs",
                                [&](const Placement& p) { return half_of(p, from, to); });
    ASSERT_TRUE(st.ok()) << st.to_string();
  };
}

Outcome run_job(const Job& job, const std::string& backend) {
  Outcome out;
  // Per worker, declared before the cluster: a server may still write a
  // pull into a tensor after a request failed, until the cluster stops.
  std::vector<std::vector<std::vector<float>>> tensors(job.workers);
  Cluster c(
      job.workers, job.servers,
      [&](RuntimeOptions& o) {
        o.replication_factor = 2;
        o.num_standby = job.standby;
        o.mode = job.mode;
        o.sync = job.sync;
        o.staleness = 2;
        o.optimizer.kind = OptimizerKind::kAdam;
        o.optimizer.lr = 0.01f;
        o.stats_interval = 20ms;
        o.heartbeat_timeout = 1s;
      },
      backend);
  c.server_tweak = [&job, numbered = numbered_servers(backend)](uint32_t i, RuntimeOptions& o) {
    numbered(i, o);
    if (job.slow_server == i) {
      o.net.emulate_link = true;
      o.net.link.latency = job.slow_latency;
    }
  };
  c.servers_started = job.servers_started;
  out.status = c.start();
  if (!out.status.ok()) return out;
  if (job.started) job.started(c);
  std::vector<std::thread> killers;
  std::mutex killers_mu;
  out.status = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<float*> data;
    std::vector<uint32_t> handles;
    if (job.allocated) {
      PSLD_ASSIGN_OR_RETURN(handles, register_allocated(w, job.elems, data));
    } else {
      PSLD_ASSIGN_OR_RETURN(handles, register_zeroed(w, job.elems, tensors[wi]));
      for (auto& v : tensors[wi])
        data.push_back(v.data());
    }
    PSLD_RETURN_IF_ERROR(w.barrier(10s));
    auto wait_all = [&](std::vector<std::shared_ptr<RequestState>>& reqs, uint64_t r) -> Status {
      for (auto& req : reqs) {
        Status st = req->wait(20s);
        if (!st.ok())
          return st.with_context(fmt::format("round {}: {}", r, w.describe_in_flight()));
      }
      reqs.clear();
      return Status::Ok();
    };
    const uint32_t rank = w.rank();
    for (uint64_t r = 1; r <= job.rounds; ++r) {
      std::vector<std::shared_ptr<RequestState>> reqs;
      auto plain = [&](size_t t) { return job.plain_pushes && t % 2 == 1; };
      for (size_t t = 0; t < job.elems.size(); ++t) {
        for (size_t i = 0; i < job.elems[t]; ++i)
          data[t][i] = pushed(rank, r, t, i);
        PSLD_ASSIGN_OR_RETURN(
            auto req, w.submit(handles[t], plain(t) ? RequestKind::kPush : RequestKind::kPushPull));
        reqs.push_back(req);
      }
      PSLD_RETURN_IF_ERROR(wait_all(reqs, r));
      for (size_t t = 0; t < job.elems.size(); ++t) {
        if (!plain(t)) continue;
        PSLD_ASSIGN_OR_RETURN(auto req, w.submit(handles[t], RequestKind::kPull));
        reqs.push_back(req);
      }
      PSLD_RETURN_IF_ERROR(wait_all(reqs, r));
      if (job.mode == ServerMode::kSum && job.sync == SyncMode::kBsp) {
        for (size_t t = 0; t < job.elems.size(); ++t) {
          for (size_t i = 0; i < job.elems[t]; ++i) {
            float want = 0;
            for (uint32_t k = 0; k < job.workers; ++k)
              want += pushed(k, r, t, i);
            if (data[t][i] != want) {
              return Internal(fmt::format("worker {} round {} tensor {} element {}: {} != {}", rank,
                                          r, t, i, data[t][i], want));
            }
          }
        }
      }
      if (wi == 0) {
        if (auto e = job.events.find(r); e != job.events.end()) {
          std::lock_guard<std::mutex> lock(killers_mu);
          killers.emplace_back([&c, fn = e->second] { fn(c); });
        }
      }
    }
    if (job.sync == SyncMode::kBsp) return Status::Ok();
    // Every push of every worker is in once all passed the barrier (a push
    // completes once its version is at the backup); the parameters hold
    // their total, each exactly once.
    PSLD_RETURN_IF_ERROR(w.barrier(20s).with_context("the barrier after the last push"));
    std::vector<std::shared_ptr<RequestState>> pulls;
    for (size_t t = 0; t < job.elems.size(); ++t) {
      PSLD_ASSIGN_OR_RETURN(auto req, w.submit(handles[t], RequestKind::kPull));
      pulls.push_back(req);
    }
    PSLD_RETURN_IF_ERROR(wait_all(pulls, job.rounds + 1));
    for (size_t t = 0; t < job.elems.size(); ++t) {
      for (size_t i = 0; i < job.elems[t]; ++i) {
        float want = 0;
        for (uint64_t r = 1; r <= job.rounds; ++r) {
          for (uint32_t k = 0; k < job.workers; ++k)
            want += pushed(k, r, t, i);
        }
        if (data[t][i] != want) {
          return Internal(fmt::format("worker {} tensor {} element {}: total {} != {}", rank, t, i,
                                      data[t][i], want));
        }
      }
    }
    return Status::Ok();
  });
  for (auto& k : killers)
    k.join();
  // Worker 0's tensors, wherever they live (its first tensor starts the
  // block when allocated). Not of a failed job: a server may still be
  // writing a pull into them (a data race under TSan).
  for (size_t t = 0; out.status.ok() && t < job.elems.size() && !c.workers.empty(); ++t) {
    const float* at = job.allocated ? nullptr : tensors[0][t].data();
    if (at == nullptr) continue;
    out.params.emplace_back(at, at + job.elems[t]);
  }
  out.failovers = c.coordinator->failovers();
  out.switches = c.coordinator->switches();
  out.placement = c.coordinator->placement();
  for (const auto& s : c.servers)
    out.servers += s->stats();
  return out;
}

// A job that ended well after so many switches and failovers, with a
// placement to look at (a fatal failure otherwise: ASSERT_NO_FATAL_FAILURE).
void expect_ran(const Outcome& out, uint64_t switches, uint64_t failovers) {
  if (!out.status.ok() || !out.placement) {
    GTEST_FAIL() << out.status.to_string();
  }
  EXPECT_EQ(out.switches, switches);
  EXPECT_EQ(out.failovers, failovers);
}

// Worker 0's tensors at the end of two jobs, bit for bit.
void expect_bit_identical(const Outcome& a, const Outcome& b) {
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t t = 0; t < a.params.size(); ++t) {
    ASSERT_EQ(a.params[t].size(), b.params[t].size());
    EXPECT_EQ(
        std::memcmp(a.params[t].data(), b.params[t].data(), a.params[t].size() * sizeof(float)), 0)
        << "tensor " << t;
  }
}

class Replication : public ::testing::TestWithParam<std::string> {};

// 4 workers x 3 servers, sums checked every round; server 1 is killed at
// round 10, and server 2, once its keys have copies again, at round 40:
// every range of the job ends on server 0, nothing lost.
TEST_P(Replication, TwoServersKilledOneAfterTheOtherLoseNothing) {
  Job job;
  job.events = {{10, kill(1)}, {40, kill(2)}};
  const Outcome out = run_job(job, GetParam());
  EXPECT_TRUE(out.status.ok()) << out.status.to_string();
  EXPECT_EQ(out.failovers, 2u);
  // Sums in fp32: the copies of applied rounds are written straight from
  // the parameter, without a staging copy.
  EXPECT_GT(out.servers.copies_direct, 0u);
  EXPECT_LE(out.servers.copies_direct, out.servers.copies);
}

// 3 servers and 2 standby: each failover brings a standby into the ring in
// the lost server's place. Server 1 dies (its ranges go to 2, standby 3
// joins), then 2 (its ranges go to 3, which has held their copies since it
// joined; standby 4 joins), then 0 (to 3): every range ends on a server
// that started as a standby, sums exact every round.
TEST_P(Replication, StandbyServersTakeTheLostServersPlaces) {
  Job job;
  job.standby = 2;
  job.rounds = 100;
  job.events = {{10, kill(1)}, {40, kill(2)}, {70, kill(0)}};
  const Outcome out = run_job(job, GetParam());
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  EXPECT_EQ(out.failovers, 3u);
  ASSERT_TRUE(out.placement.has_value());
  std::vector<ServerId> members;
  for (const ServerInfo& s : out.placement->servers())
    members.push_back(s.id);
  EXPECT_EQ(members, (std::vector<ServerId>{3, 4}));
  EXPECT_EQ(out.placement->owners(), (std::set<ServerId>{3}));
}

// A standby that joined in a lost server's place owns nothing yet: losing
// it too loses nothing, even before its predecessor's keys have copies at
// it, and the job goes on (on two servers, no standby being left).
TEST_P(Replication, LosingAStandbyThatOwnsNothingLosesNothing) {
  Job job;
  job.standby = 1;
  job.rounds = 50;
  job.events = {{10, [](Cluster& c) {
                   kill_server(c, 1);
                   ASSERT_TRUE(eventually("standby 3 to join the placement", 10s, [&] {
                     auto p = c.coordinator->placement();
                     return p && p->find_server(3) != nullptr;
                   }));
                   kill_server(c, 3);
                 }}};
  const Outcome out = run_job(job, GetParam());
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  EXPECT_EQ(out.failovers, 2u);
  ASSERT_TRUE(out.placement.has_value());
  EXPECT_EQ(out.placement->servers().size(), 2u);
}

// Plain pushes (each completes once its round is durable at the backup)
// followed by pulls, and push_pulls read in place from the workers' memory
// (loopback), through a failover.
TEST_P(Replication, PlainPushesAndInPlacePushPullsSurviveAFailover) {
  Job job;
  job.allocated = true;
  job.plain_pushes = true;
  job.rounds = 40;
  job.events = {{12, kill(2)}};
  const Outcome out = run_job(job, GetParam());
  EXPECT_TRUE(out.status.ok()) << out.status.to_string();
  EXPECT_EQ(out.failovers, 1u);
}

// Adam on the servers: parameters and both moments are in the copies, so a
// job with a failover ends bit-identical to one without.
TEST_P(Replication, AdamIsBitIdenticalToAJobWithoutFailures) {
  Job job;
  job.mode = ServerMode::kOptimizer;
  job.rounds = 40;
  const Outcome clean = run_job(job, GetParam());
  ASSERT_TRUE(clean.status.ok()) << clean.status.to_string();
  EXPECT_EQ(clean.failovers, 0u);
  // Three arrays a copy: every one is staged.
  EXPECT_GT(clean.servers.copies, 0u);
  EXPECT_EQ(clean.servers.copies_direct, 0u);
  job.events = {{15, kill(0)}};
  const Outcome failed_over = run_job(job, GetParam());
  ASSERT_TRUE(failed_over.status.ok()) << failed_over.status.to_string();
  EXPECT_EQ(failed_over.failovers, 1u);
  expect_bit_identical(clean, failed_over);
}

// Server 2 is killed, and server 1, whose backup that was, right after,
// before its keys have copies at its new backup: the ranges of server 1
// exist nowhere else, and the job fails saying so, naming them. (On
// loopback server 1's new copies are held up for 3 s so that it dies
// before they land; on UCX both fall silent together, and neither can copy
// anything.)
TEST_P(Replication, LosingBothCopiesOfARangeFailsTheJobNamingIt) {
  Job job;
  job.rounds = 30;
  job.events = {{5, [](Cluster& c) {
                   if (c.base.net.transport == "loopback") {
                     transport::FaultPlan slow;
                     slow.delay = 3s;
                     c.fabric->set_faults(slow, c.servers[1]->address());
                   }
                   kill_server(c, 2);
                   kill_server(c, 1);
                 }}};
  const Outcome out = run_job(job, GetParam());
  ASSERT_FALSE(out.status.ok());
  const std::string msg = out.status.to_string();
  EXPECT_NE(msg.find("exist nowhere else"), std::string::npos) << msg;
  // Whichever of the two the coordinator found first, both are named.
  EXPECT_NE(msg.find("server 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("server 2"), std::string::npos) << msg;
}

// Replicated ranges move: half of server 0's arcs go to server 1, then
// half of server 2's to server 0; each new owner copies what it gained to
// its backup before answering a pull of it. Server 1, which gained ranges,
// is killed once the copies are made: its ranges, the moved ones too, fail
// over to server 2, sums exact every round.
TEST_P(Replication, MovedRangesAreCopiedAndSurviveALossOfTheirNewOwner) {
  Job job;
  job.rounds = 50;
  job.events = {{6, move_half(0, 1)}, {14, move_half(2, 0)}, {24, kill_once_copied(1)}};
  const Outcome out = run_job(job, GetParam());
  ASSERT_NO_FATAL_FAILURE(expect_ran(out, /*switches=*/2, /*failovers=*/1));
  EXPECT_EQ(out.placement->find_server(1), nullptr);
}

// A standby joins the ring by a switch that gives it ranges: server 2's
// backup is the standby from then on, and server 2 copies every key it owns
// there (ReplicaSynced) before the next switch or a loss can come. Server 2
// is then killed: its ranges fail over to the standby. Adam: the parameters
// end bit-identical to those of a job in which nothing moved or died.
TEST_P(Replication, AStandbyJoinsByASwitchAndHoldsItsNeighboursCopies) {
  Job job;
  job.standby = 1;
  job.mode = ServerMode::kOptimizer;
  job.rounds = 40;
  const Outcome clean = run_job(job, GetParam());
  ASSERT_TRUE(clean.status.ok()) << clean.status.to_string();
  job.events = {{6, move_half(1, 3)}, {16, kill_once_copied(2)}};
  const Outcome moved = run_job(job, GetParam());
  ASSERT_NO_FATAL_FAILURE(expect_ran(moved, /*switches=*/1, /*failovers=*/1));
  EXPECT_NE(moved.placement->find_server(3), nullptr);
  EXPECT_EQ(moved.placement->find_server(2), nullptr);
  expect_bit_identical(clean, moved);
}

// A server lost while a switch's moved ranges may exist at one server only
// (from the commit until every worker finished its switch round) fails the
// job, saying so, instead of losing them. Loopback: everything to and from
// the new owner takes 400 ms, so the old owner dies inside that window.
TEST(ReplicationSwitch, ALossDuringASwitchFailsTheJobSayingSo) {
  Job job;
  job.rounds = 30;
  job.events = {{5, [](Cluster& c) {
                   transport::FaultPlan slow;
                   slow.delay = 400ms;
                   c.fabric->set_faults(slow, c.servers[2]->address());
                   move_half(0, 2)(c);
                   kill_server(c, 0);
                 }}};
  const Outcome out = run_job(job, "loopback");
  ASSERT_FALSE(out.status.ok());
  const std::string msg = out.status.to_string();
  EXPECT_NE(msg.find("does not survive a loss during a switch"), std::string::npos) << msg;
  EXPECT_NE(msg.find("server 0"), std::string::npos) << msg;
}

// A server lost while a switch is being voted on: nothing has moved yet, so
// the coordinator cancels the switch and fails the server over as at any
// other time. The switch moves half of server `from`'s arcs to server `to`,
// whose link then adds 400 ms to everything it sends: its vote is still on
// the way when the victim dies 50 ms later. Sums exact every round. When
// `to` is a member, its slow link also holds the workers before the switch
// round; when it is a standby joining the ring, the workers reach the
// switch round and `from` refuses them the moving keys until the cancel
// and the failover epoch come (the standby then takes the lost server's
// place in the ring).
struct VoteLoss {
  ServerId from, to, victim;
  const char* name;
};

class ReplicationVoteLoss : public ::testing::TestWithParam<VoteLoss> {};

TEST_P(ReplicationVoteLoss, CancelsTheSwitchAndFailsOver) {
  const VoteLoss v = GetParam();
  Job job;
  job.rounds = 30;
  job.slow_server = v.to;
  if (v.to >= job.servers) {
    // A standby joins by the switch: it serves nothing before, so its link
    // can be slow from the start without slowing a round.
    job.standby = 1;
    job.slow_latency = 400ms;
  }
  job.events = {
      {5, [v](Cluster& c) {
         transport::LinkOptions slow;
         slow.latency = 400ms;
         ASSERT_TRUE(transport::set_link(c.servers[v.to]->transport(), slow).ok());
         auto change = half_of(c.coordinator->current_placement(), v.from, v.to);
         ASSERT_TRUE(change.ok()) << change.status().to_string();
         ASSERT_TRUE(c.coordinator->propose(change->delta).ok());
         ASSERT_TRUE(c.coordinator->switching());
         // Long enough for the workers to reach the switch round (two
         // rounds ahead), well inside the 400 ms the late vote takes.
         std::this_thread::sleep_for(50ms);
         kill_server(c, v.victim);
         EXPECT_TRUE(
             eventually("the failover", 10s, [&] { return c.coordinator->failovers() == 1; }));
         if (v.victim != v.to) {
           ASSERT_TRUE(
               transport::set_link(c.servers[v.to]->transport(), transport::LinkOptions{}).ok());
         }
       }}};
  const Outcome out = run_job(job, "loopback");
  // Cancelled, never committed (a late vote changed nothing): the failover
  // took epoch 1.
  ASSERT_NO_FATAL_FAILURE(expect_ran(out, /*switches=*/0, /*failovers=*/1));
  EXPECT_EQ(out.placement->find_server(v.victim), nullptr);
  EXPECT_EQ(out.placement->epoch(), 1u);
}

// Server 0's backup is server 1, server 2's is server 0.
INSTANTIATE_TEST_SUITE_P(Cases, ReplicationVoteLoss,
                         ::testing::Values(VoteLoss{1, 2, 0, "a_bystander"},
                                           VoteLoss{0, 1, 0, "the_old_owner_whose_backup_gains"},
                                           VoteLoss{1, 2, 2, "the_new_owner_voting_late"},
                                           VoteLoss{1, 3, 0, "while_a_standby_joins"}),
                         [](const auto& info) { return std::string(info.param.name); });

class ReplicationAsync : public ::testing::TestWithParam<std::tuple<SyncMode, std::string>> {};

// Async and bounded staleness: every push is applied on arrival and copied
// to the backup, and its pull (or a plain push's completion) waits for that
// copy. Server 1 is killed at worker 0's round 15, and server 2 (its ranges'
// new owner) at round 35, once the copies were made again: the pushes the
// workers send again are taken once (each copy says which rounds of every
// worker it holds), so the parameters end holding the total of all pushes,
// exactly.
TEST_P(ReplicationAsync, EveryPushIsCountedOnceThroughTwoFailovers) {
  Job job;
  job.sync = std::get<0>(GetParam());
  job.plain_pushes = true;
  job.rounds = 50;
  job.events = {{15, kill_once_copied(1)}, {35, kill_once_copied(2)}};
  const Outcome out = run_job(job, std::get<1>(GetParam()));
  ASSERT_NO_FATAL_FAILURE(expect_ran(out, /*switches=*/0, /*failovers=*/2));
}

INSTANTIATE_TEST_SUITE_P(Modes, ReplicationAsync,
                         ::testing::Combine(::testing::Values(SyncMode::kAsync,
                                                              SyncMode::kStaleness),
                                            ::testing::Values("loopback", "ucx")),
                         [](const auto& info) {
                           return fmt::format("{}_{}", sync_mode_name(std::get<0>(info.param)),
                                              std::get<1>(info.param));
                         });

// Async and staleness, replicated: a pull of a tensor that nobody pushed or
// initialized reads its zeros at once, as without replication (it waited
// for a copy, which only a push makes, until the pull's deadline).
TEST_P(ReplicationAsync, APullOfATensorNobodyWroteReadsZerosAtOnce) {
  Cluster c(
      2, 2,
      [&](RuntimeOptions& o) {
        o.replication_factor = 2;
        o.sync = std::get<0>(GetParam());
        o.staleness = 2;
      },
      std::get<1>(GetParam()));
  c.server_tweak = numbered_servers(std::get<1>(GetParam()));
  ASSERT_TRUE(c.start().ok());
  std::vector<float> data(50001, 7.0f);  // a chunk and a part of one
  auto h = c.workers[0]->register_tensor("never_written", DType::kFloat32, data.size() * 4,
                                         data.data(), nullptr);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  auto pull = c.workers[0]->submit(*h, RequestKind::kPull);
  ASSERT_TRUE(pull.ok()) << pull.status().to_string();
  const Status st = (*pull)->wait(3s);
  ASSERT_TRUE(st.ok()) << st.to_string();
  for (size_t i = 0; i < data.size(); ++i)
    ASSERT_EQ(data[i], 0.0f) << "element " << i;
}

// A server lost while the workers join, before it granted them landing
// slots (server 2, whose answers take 500 ms each way, so the workers' joins
// wait for it) or after (server 0, while the joins wait for server 2): the
// joins go on without it once the coordinator removed it, and the job loses
// nothing (sums exact every round). On loopback the killed server's
// connections close; on UCX it falls silent, and only the failover epoch
// tells the joining workers.
class ReplicationJoin : public ::testing::TestWithParam<std::tuple<ServerId, std::string>> {};

TEST_P(ReplicationJoin, AServerLostWhileTheWorkersJoinLosesNothing) {
  Job job;
  job.rounds = 20;
  job.slow_server = 2;
  job.slow_latency = 500ms;
  const ServerId victim = std::get<0>(GetParam());
  job.servers_started = kill(victim);
  if (victim != 2) {
    // Joined: server 2 answers at full speed from then on.
    job.started = [](Cluster& c) {
      ASSERT_TRUE(transport::set_link(c.servers[2]->transport(), transport::LinkOptions{}).ok());
    };
  }
  const Outcome out = run_job(job, std::get<1>(GetParam()));
  ASSERT_NO_FATAL_FAILURE(expect_ran(out, /*switches=*/0, /*failovers=*/1));
}

INSTANTIATE_TEST_SUITE_P(Victims, ReplicationJoin,
                         ::testing::Combine(::testing::Values(ServerId{2}, ServerId{0}),
                                            ::testing::Values("loopback", "ucx")),
                         [](const auto& info) {
                           return fmt::format("server{}_{}", std::get<0>(info.param),
                                              std::get<1>(info.param));
                         });

TEST(ReplicationOptions, TwoCopiesNeedTwoServers) {
  Cluster c(1, 1, [](RuntimeOptions& o) { o.replication_factor = 2; });
  Status s = c.start();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("needs at least 2 servers"), std::string::npos) << s.to_string();
}

std::vector<std::string> backends() {
  return {"loopback", "ucx"};
}

INSTANTIATE_TEST_SUITE_P(Transports, Replication, ::testing::ValuesIn(backends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace psld
