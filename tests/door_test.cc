// The door of a running job, with real processes under `psld launch` over
// UCX (TCP on loopback): its secret (random per job, never on a command
// line), an intruder without it (refused, logged once), and garbage at every
// port the job listens on (random bytes, frames announcing huge lengths,
// truncated frames, a connect-and-close storm, 500 idle connections): no
// crash, no hang, file descriptors back to where they were, and the job's
// sums exact to its last round (docs/reliability.md, "The door").
//
// Traffic goes to 127.0.0.1 only, to ports this test's own job listens on.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_process.h"

namespace {

using namespace std::chrono_literals;
using psld::testing::Background;
using psld::testing::listening_sockets;
using psld::testing::proc_children;
using psld::testing::proc_file;
using psld::testing::run_process;
using psld::testing::sockets_of;

using psld::testing::kLaunchedJobEnv;
using psld::testing::last_round;
using psld::testing::psld;
using psld::testing::trainer;

const std::vector<std::string>& kEnv = kLaunchedJobEnv;

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/psld-door-XXXXXX";
    path = mkdtemp(tmpl) != nullptr ? tmpl : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

// A job that runs until the test writes its last round into `stop_file`.
std::vector<std::string> open_job(const std::string& stop_file) {
  return {
      psld(),    "launch",        "-w", "3",           "-s",     "2", "--", trainer(), "--rounds",
      "1000000", "--print-every", "20", "--stop-file", stop_file};
}

// Ends the job cleanly 60 rounds after the last one it printed, and expects
// every worker to say its sums were exact up to that round.
void finish(Background& launch, const std::string& stop_file, int workers) {
  const int stop = last_round(launch.output()) + 60;
  std::ofstream(stop_file) << stop << "\n";
  auto code = launch.wait(120s);
  ASSERT_TRUE(code) << "the job did not end 120 s after its last round was set\n"
                    << launch.output();
  EXPECT_EQ(*code, 0) << launch.output();
  for (int w = 0; w < workers; ++w) {
    const std::string want =
        "worker " + std::to_string(w) + ": " + std::to_string(stop) + " rounds exact";
    EXPECT_NE(launch.output().find(want), std::string::npos) << want << "\n" << launch.output();
  }
}

std::vector<pid_t> job_pids(const Background& launch) {
  std::vector<pid_t> pids = proc_children(launch.pid());
  pids.push_back(launch.pid());
  return pids;
}

size_t open_fds(pid_t pid) {
  size_t n = 0;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    ++n;
  return n;
}

std::string env_of(pid_t pid, const std::string& name) {
  std::stringstream env(proc_file(pid, "environ"));
  for (std::string kv; std::getline(env, kv, '\0');) {
    if (kv.rfind(name + "=", 0) == 0) return kv.substr(name.size() + 1);
  }
  return "";
}

// A TCP connection to 127.0.0.1:port (non-blocking sends), or -1.
int dial(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

void send_and_close(int port, const std::vector<uint8_t>& bytes) {
  const int fd = dial(port);
  if (fd < 0) return;
  (void)send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  close(fd);
}

TEST(Door, EachJobHasItsOwnSecretAndItIsOnNoCommandLine) {
  TempDir dir;
  std::string secrets[2];
  for (std::string& secret : secrets) {
    const std::string stop = dir.path + "/stop";
    std::filesystem::remove(stop);
    Background launch(open_job(stop), kEnv);
    ASSERT_TRUE(launch.wait_for_output("worker 2: round 20", 60s)) << launch.output();
    const auto children = proc_children(launch.pid());
    ASSERT_EQ(children.size(), 5u);
    secret = env_of(children[0], "PSLD_JOB_SECRET");
    EXPECT_EQ(secret.size(), 64u) << "32 random bytes in hex";
    for (pid_t c : children) {
      EXPECT_EQ(env_of(c, "PSLD_JOB_SECRET"), secret) << "one secret per job";
      EXPECT_EQ(proc_file(c, "cmdline").find(secret), std::string::npos);
    }
    EXPECT_EQ(proc_file(launch.pid(), "cmdline").find(secret), std::string::npos);
    EXPECT_EQ(launch.output().find(secret), std::string::npos) << "never printed";

    // An intruder without the secret is refused at once (not redialled
    // until its connect timeout); the coordinator says so once per host
    // however many times it tries.
    const std::string coordinator = env_of(children[0], "PSLD_JOB_COORDINATOR");
    for (int attempt = 0; attempt < 2; ++attempt) {
      auto r = run_process({psld(), "server"},
                           {"PSLD_JOB_COORDINATOR=" + coordinator, "PSLD_JOB_SECRET=guess",
                            "PSLD_UCX_TLS=tcp", "UCX_WARN_UNUSED_ENV_VARS=n"},
                           30s);
      EXPECT_FALSE(r.timed_out) << r.output;
      EXPECT_NE(r.exit_code, 0) << r.output;
      // Refused by the coordinator's UCX bootstrap, before any endpoint.
      EXPECT_NE(r.output.find("refused the connection: wrong job secret"), std::string::npos)
          << r.output;
    }
    finish(launch, stop, 3);
    const std::string out = launch.output();
    size_t told = 0;
    for (size_t at = out.find("refused a connection from"); at != std::string::npos;
         at = out.find("refused a connection from", at + 1))
      ++told;
    EXPECT_EQ(told, 1u) << out;
  }
  EXPECT_NE(secrets[0], secrets[1]) << "a new secret for every job";
}

// A running job, the TCP ports it listens on (all on 127.0.0.1) and how
// many descriptors each of its processes holds.
struct RunningJob {
  TempDir dir;
  std::string stop = dir.path + "/stop";
  Background launch{open_job(stop), kEnv};
  std::vector<pid_t> pids;
  std::vector<int> ports;
  std::vector<size_t> fds_before;

  void start() {
    ASSERT_TRUE(launch.wait_for_output("worker 2: round 40", 60s)) << launch.output();
    pids = job_pids(launch);
    ASSERT_EQ(pids.size(), 6u);
    std::set<std::string> sockets;
    for (pid_t p : pids) {
      for (const auto& s : sockets_of(p))
        sockets.insert(s);
    }
    for (const auto& l : listening_sockets(sockets)) {
      ASSERT_EQ(l.address, "0100007F") << "the job listens off loopback";
      ports.push_back(l.port);
    }
    ASSERT_GE(ports.size(), 3u);
    for (pid_t p : pids)
      fds_before.push_back(open_fds(p));
  }

  // Every process alive, and the job still making progress.
  void expect_alive_and_going() {
    const int round_then = last_round(launch.output());
    for (pid_t p : pids)
      EXPECT_EQ(kill(p, 0), 0) << "process " << p << " of the job died\n" << launch.output();
    EXPECT_TRUE(launch.wait_for_output("worker 0: round " + std::to_string(round_then + 20), 30s))
        << "the job stopped making progress under the garbage\n"
        << launch.output();
  }

  // Descriptors come back: no connection the garbage made is kept.
  void expect_descriptors_back(size_t garbage) {
    for (size_t i = 0; i < pids.size(); ++i) {
      const auto deadline = std::chrono::steady_clock::now() + 20s;
      while (open_fds(pids[i]) > fds_before[i] + 8 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(100ms);
      EXPECT_LE(open_fds(pids[i]), fds_before[i] + 8)
          << "process " << pids[i] << " held " << fds_before[i] << " descriptors before " << garbage
          << " garbage connections";
    }
  }
};

std::vector<uint8_t> random_bytes(std::mt19937& rng, size_t n) {
  std::vector<uint8_t> b(n);
  for (auto& x : b)
    x = static_cast<uint8_t>(rng());
  return b;
}

// Garbage at every listening port of a running job, bounded: random bytes,
// truncated frames and a connect-and-close storm at each port, then 500
// idle connections held past the handshake deadline. The job keeps going,
// its sums stay exact, and once the garbage is gone its processes hold no
// more descriptors than before it.
TEST(Door, GarbageAtEveryPortLeavesTheJobAndItsSumsAlone) {
  RunningJob job;
  job.start();
  if (::testing::Test::HasFatalFailure()) return;
  std::mt19937 rng(20261202);
  size_t sent = 0;
  for (int port : job.ports) {
    for (int i = 0; i < 8; ++i, ++sent)
      send_and_close(port, random_bytes(rng, 64 << 10));
    for (size_t n = 1; n < 8; ++n, ++sent)
      send_and_close(port, random_bytes(rng, n));  // truncated
    for (int i = 0; i < 100; ++i, ++sent) {
      const int fd = dial(port);  // connect and close at once
      if (fd >= 0) close(fd);
    }
  }
  std::vector<int> idle;
  for (size_t i = 0; i < 500; ++i) {
    const int fd = dial(job.ports[i % job.ports.size()]);
    if (fd >= 0) idle.push_back(fd);
  }
  EXPECT_GE(idle.size(), 450u) << "the job's ports stopped accepting";
  std::this_thread::sleep_for(4s);  // the 3 s handshake deadline, and a margin
  job.expect_alive_and_going();
  for (int fd : idle)
    close(fd);
  job.expect_descriptors_back(sent + idle.size());
  finish(job.launch, job.stop, 3);
}

// Frames whose header announces a huge length, and zero-filled ones, at
// every port. UCX before 1.22 aborts the process whose UCX listener (the
// coordinator's, a server's) reads one: its tcp_sockcm asserts
// "cep->comm_ctx.offset <= cep->comm_ctx.length" (docs/reliability.md,
// "Known: UCX 1.13's listener"). psld cannot catch that before its own
// handshake, because UCX parses the connection request first.
TEST(Door, FramesAnnouncingHugeLengthsAtEveryPortLeaveTheJobAlone) {
  // The job's ports are psld's bootstrap sockets and UCX's own TCP
  // transport; no UCX listener (UCX 1.13's aborted on these frames).
  RunningJob job;
  job.start();
  if (::testing::Test::HasFatalFailure()) return;
  std::mt19937 rng(20261203);
  size_t sent = 0;
  for (int port : job.ports) {
    for (const std::vector<uint8_t>& head :
         {std::vector<uint8_t>(8, 0xff), std::vector<uint8_t>{0xff, 0xff, 0xff, 0x7f},
          std::vector<uint8_t>{0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff},
          std::vector<uint8_t>{1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff}, std::vector<uint8_t>(8, 0)}) {
      std::vector<uint8_t> frame = head;
      const auto tail = random_bytes(rng, 512);
      frame.insert(frame.end(), tail.begin(), tail.end());
      send_and_close(port, frame);
      send_and_close(port, std::vector<uint8_t>(520, 0));
      sent += 2;
    }
  }
  std::this_thread::sleep_for(1s);
  job.expect_alive_and_going();
  job.expect_descriptors_back(sent);
  finish(job.launch, job.stop, 3);
}

}  // namespace
