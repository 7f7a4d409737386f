// Operating a running job from outside (docs/operations.md): `psld launch`
// with metrics.listen and the balancer on, one server behind a slow link;
// its /metrics scraped with curl and every line parsed; `psld top --once
// --json` read; `psld top` driven live in tmux (the view refreshes in place,
// q quits); the job ends cleanly and psld top then says the coordinator is
// gone. Real processes over UCX (TCP on loopback). Skips without curl or
// tmux (tools/dev deps installs both).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "tests/prometheus_parse.h"
#include "tests/temp_dir.h"
#include "tests/test_process.h"

namespace {

using namespace std::chrono_literals;
using psld::testing::Background;
using psld::testing::parse_prometheus;
using psld::testing::PromScrape;
using psld::testing::psld;
using psld::testing::run_process;
using psld::testing::RunResult;
using psld::testing::trainer;

const char* kCurl = "/usr/bin/curl";
const char* kTmux = "/usr/bin/tmux";

bool poll_until(std::chrono::seconds timeout, const std::function<bool()>& done) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return done();
    std::this_thread::sleep_for(200ms);
  }
  return true;
}

std::string scrape_text(const std::string& address, const std::string& path = "/metrics") {
  RunResult r =
      run_process({kCurl, "-sS", "--fail", "--max-time", "5", "http://" + address + path}, {}, 20s);
  return r.exit_code == 0 ? r.output : "";
}

// A tmux server of this test's own, killed with everything in it at the end.
class Tmux {
 public:
  Tmux() : socket_("psld-top-test-" + std::to_string(getpid())) {}
  ~Tmux() { run({"kill-server"}); }
  Tmux(const Tmux&) = delete;
  Tmux& operator=(const Tmux&) = delete;
  RunResult run(std::vector<std::string> args) const {
    std::vector<std::string> argv = {kTmux, "-L", socket_};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_process(argv, {"TERM=xterm-256color"}, 20s);
  }
  std::string capture(const std::string& session) const {
    return run({"capture-pane", "-p", "-t", session}).output;
  }

 private:
  std::string socket_;
};

TEST(Top, MetricsAndTopFollowARunningJobWithAStraggler) {
  if (access(kCurl, X_OK) != 0 || access(kTmux, X_OK) != 0) {
    GTEST_SKIP() << "needs curl and tmux (tools/dev deps installs them)";
  }
  psld::testing::TempDir dir;
  const std::string stop_file = dir.path() + "/stop";
  std::vector<std::string> env = psld::testing::kLaunchedJobEnv;
  env.insert(env.end(), {"PSLD_METRICS_LISTEN=127.0.0.1:0", "PSLD_BALANCER_ENABLED=true",
                         "PSLD_LIVENESS_HEARTBEAT_TIMEOUT_MS=10000"});
  // Server 2 at 20 MB/s each way: a bandwidth straggler the balancer sees.
  Background launch(
      {psld(), "launch", "-w", "2", "-s", "3", "--slow-server", "2:20M", "--", trainer(),
       "--rounds", "100000000", "--print-every", "100", "--stop-file", stop_file},
      env);
  ASSERT_TRUE(launch.started());
  ASSERT_TRUE(launch.wait_for_output("metrics at http://", 30s)) << launch.output();
  std::smatch m;
  const std::string out = launch.output();
  ASSERT_TRUE(std::regex_search(out, m, std::regex("metrics at http://([0-9.]+:[0-9]+)/metrics")))
      << out;
  const std::string address = m[1];

  // Scraped until the balancer has committed a switch: every line parses.
  PromScrape scrape;
  std::string text;
  const bool switched = poll_until(90s, [&] {
    text = scrape_text(address);
    scrape = parse_prometheus(text);
    auto sw = scrape.value("psld_placement_switches_total");
    return !text.empty() && scrape.error.empty() && sw && *sw >= 1;
  });
  ASSERT_EQ(scrape.error, "") << text;
  ASSERT_TRUE(switched) << "no epoch switch within 90 s\n" << text << launch.output();
  EXPECT_EQ(*scrape.value("psld_job_state", {{"state", "running"}}), 1);
  for (int w = 0; w < 2; ++w) {
    EXPECT_EQ(*scrape.value("psld_member_up", {{"role", "worker"}, {"rank", std::to_string(w)}}),
              1);
    const std::string rank = std::to_string(w);
    const double count = *scrape.value("psld_worker_round_seconds_count", {{"worker", rank}});
    EXPECT_GT(count, 0);
    EXPECT_EQ(*scrape.value("psld_worker_round_seconds_bucket", {{"worker", rank}, {"le", "+Inf"}}),
              count);
  }
  double share = 0;
  double bytes = 0;
  for (int s = 0; s < 3; ++s) {
    const std::string rank = std::to_string(s);
    EXPECT_EQ(*scrape.value("psld_member_up", {{"role", "server"}, {"rank", rank}}), 1);
    share += *scrape.value("psld_server_share", {{"server", rank}});
    bytes += *scrape.value("psld_server_bytes_total", {{"server", rank}, {"direction", "in"}});
  }
  EXPECT_NEAR(share, 1, 1e-9);
  EXPECT_GT(bytes, 0);
  EXPECT_GE(*scrape.value("psld_placement_epoch"), 1);
  EXPECT_GT(*scrape.value("psld_migrated_bytes_total"), 0);
  double steps = 0;
  for (const auto& s : scrape.find("psld_balancer_decisions_total")) {
    if (s.labels.at("kind") != "none") steps += s.value;
  }
  EXPECT_GE(steps, 1);

  // psld top --once --json: the same job, as a script reads it.
  RunResult once = run_process({psld(), "top", address, "--once", "--json"}, {}, 20s);
  ASSERT_EQ(once.exit_code, 0) << once.output;
  auto j = nlohmann::json::parse(once.output, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << once.output;
  EXPECT_EQ(j["state"], "running");
  EXPECT_EQ(j["servers"].size(), 3U);
  EXPECT_EQ(j["members"].size(), 5U);
  ASSERT_FALSE(j["decisions"].empty()) << once.output;
  EXPECT_NE(j["decisions"].back()["reason"].get<std::string>(), "");

  // psld top live in tmux: the table, refreshed in place, and q quits.
  Tmux tmux;
  RunResult started = tmux.run({"new-session", "-d", "-s", "top", "-x", "160", "-y", "50",
                                psld() + " top " + address + " --interval 0.3"});
  ASSERT_EQ(started.exit_code, 0) << started.output;
  std::string screen;
  const std::regex server_row(R"(\n +2 +(active|draining) +[0-9.]+%)");
  ASSERT_TRUE(poll_until(20s, [&] {
    screen = tmux.capture("top");
    return screen.find("SERVER") != std::string::npos &&
           screen.find("MEMBERS") != std::string::npos && std::regex_search(screen, server_row);
  })) << screen;
  EXPECT_NE(screen.find("job running"), std::string::npos) << screen;
  EXPECT_NE(screen.find("worker 1 up"), std::string::npos) << screen;
  EXPECT_NE(screen.find("DECISIONS"), std::string::npos) << screen;
  // In place: one screen, not a scroll of views; and its round moves on.
  EXPECT_EQ(screen.find("psld top", 1), std::string::npos) << screen;
  std::smatch r1;
  ASSERT_TRUE(std::regex_search(screen, r1, std::regex("round ([0-9]+)"))) << screen;
  const long first_round = std::stol(r1[1]);
  std::string later;
  EXPECT_TRUE(poll_until(20s, [&] {
    later = tmux.capture("top");
    std::smatch r2;
    return std::regex_search(later, r2, std::regex("round ([0-9]+)")) &&
           std::stol(r2[1]) > first_round;
  })) << later;
  ASSERT_EQ(tmux.run({"send-keys", "-t", "top", "q"}).exit_code, 0);
  EXPECT_TRUE(poll_until(10s,
                         [&] {
                           return tmux.run({"has-session", "-t", "top"}).exit_code != 0;
                         }))
      << "psld top did not quit on q\n"
      << tmux.capture("top");

  // The job ends cleanly, every worker at the same round: one about 3 s of
  // their pace ahead (over 1,000 rounds/s once the load is off the slow
  // server; a fixed 50 rounds ahead was passed before the workers read it).
  auto round_now = [&] { return parse_prometheus(scrape_text(address)).value("psld_round"); };
  const auto before = round_now();
  std::this_thread::sleep_for(1s);
  const auto now_round = round_now();
  ASSERT_TRUE(before.has_value() && now_round.has_value());
  const auto pace = static_cast<long>(*now_round - *before);  // rounds a second
  std::ofstream(stop_file) << static_cast<long>(*now_round) + std::max(50L, 3 * pace) << "\n";
  auto code = launch.wait(60s);
  ASSERT_TRUE(code.has_value()) << "the job did not end at the stop round\n" << launch.output();
  EXPECT_EQ(*code, 0) << launch.output();

  RunResult gone = run_process({psld(), "top", address, "--once"}, {}, 20s);
  EXPECT_EQ(gone.exit_code, 1) << gone.output;
  EXPECT_NE(gone.output.find("cannot connect"), std::string::npos) << gone.output;
}

TEST(Top, BadUsageIsExplained) {
  RunResult r = run_process({psld(), "top"}, {"PSLD_METRICS_LISTEN="}, 20s);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("PSLD_METRICS_LISTEN"), std::string::npos) << r.output;
  r = run_process({psld(), "top", "127.0.0.1:1", "--once"}, {}, 20s);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("cannot connect to 127.0.0.1:1"), std::string::npos) << r.output;
  r = run_process({psld(), "top", "127.0.0.1:1", "--interval", "0"}, {}, 20s);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("--interval"), std::string::npos) << r.output;
  r = run_process({psld(), "top", "--bogus"}, {}, 20s);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("usage: psld top"), std::string::npos) << r.output;
}

}  // namespace
