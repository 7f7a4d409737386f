// The operator's view of a job: the Prometheus text writer, the job view's
// Prometheus and JSON forms, the metrics endpoint's HTTP handling (bad
// requests, floods, slow clients), and an in-process job whose coordinator
// serves what its members report.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "lib/coordinator/job_view.h"
#include "lib/coordinator/metrics_endpoint.h"
#include "lib/stats/prometheus.h"
#include "tests/cluster.h"
#include "tests/eventually.h"
#include "tests/prometheus_parse.h"

namespace psld {
namespace {

using namespace std::chrono_literals;
using testing::parse_prometheus;

// ---- The text writer.

TEST(PrometheusWriter, EscapesLabelValuesAndHelpAndSpellsSpecialValues) {
  prometheus::Writer w;
  w.family("psld_thing", prometheus::Type::kGauge, "a help with \\ and a\nnewline and \"quotes\"");
  w.sample({{"host", "a\"b\\c\nd"}}, 1);
  w.sample({{"v", "nan"}}, std::nan(""));
  w.sample({{"v", "inf"}}, HUGE_VAL);
  w.sample({{"v", "-inf"}}, -HUGE_VAL);
  w.sample({{"v", "big"}}, 9007199254740992.0);
  w.sample({{"v", "half"}}, 0.5);
  w.sample({{"v", "tiny"}}, 1e-300);
  const std::string& t = w.text();
  EXPECT_NE(t.find("# HELP psld_thing a help with \\\\ and a\\nnewline and \"quotes\"\n"),
            std::string::npos)
      << t;
  EXPECT_NE(t.find("psld_thing{host=\"a\\\"b\\\\c\\nd\"} 1\n"), std::string::npos) << t;
  EXPECT_NE(t.find("{v=\"nan\"} NaN\n"), std::string::npos) << t;
  EXPECT_NE(t.find("{v=\"inf\"} +Inf\n"), std::string::npos) << t;
  EXPECT_NE(t.find("{v=\"-inf\"} -Inf\n"), std::string::npos) << t;
  EXPECT_NE(t.find("{v=\"big\"} 9007199254740992\n"), std::string::npos) << t;
  EXPECT_NE(t.find("{v=\"half\"} 0.5\n"), std::string::npos) << t;
  auto scrape = parse_prometheus(t);
  ASSERT_EQ(scrape.error, "") << t;
  EXPECT_EQ(scrape.find("psld_thing", {{"host", "a\"b\\c\nd"}}).size(), 1U);
  EXPECT_EQ(*scrape.value("psld_thing", {{"v", "tiny"}}), 1e-300);
  EXPECT_TRUE(std::isnan(*scrape.value("psld_thing", {{"v", "nan"}})));
}

TEST(PrometheusWriter, AFamilyIsAnnouncedOnceAndBadNamesAreMadeValid) {
  prometheus::Writer w;
  w.family("psld_a", prometheus::Type::kCounter, "a");
  w.sample({}, 1);
  w.family("psld_a", prometheus::Type::kCounter, "a");
  w.sample({{"x", "2"}}, 2);
  w.family("psld-bad name", prometheus::Type::kGauge, "b");
  w.sample({{"bad-label", "v"}}, 3);
  auto scrape = parse_prometheus(w.text());
  ASSERT_EQ(scrape.error, "") << w.text();
  EXPECT_EQ(scrape.types.size(), 2U);
  EXPECT_EQ(*scrape.value("psld_bad_name", {{"bad_label", "v"}}), 3);
  EXPECT_FALSE(prometheus::valid_metric_name("1abc"));
  EXPECT_TRUE(prometheus::valid_metric_name("a:b_c1"));
  EXPECT_FALSE(prometheus::valid_label_name("a:b"));
}

TEST(PrometheusWriter, HistogramsAreCumulativeWithInfSumAndCount) {
  prometheus::Writer w;
  w.family("psld_h_seconds", prometheus::Type::kHistogram, "h");
  const std::vector<double> bounds = {0.1, 1};
  const std::vector<uint64_t> cumulative = {3, 5};
  w.histogram({{"worker", "0"}}, bounds, cumulative, 7, 12.5);
  auto scrape = parse_prometheus(w.text());
  ASSERT_EQ(scrape.error, "") << w.text();
  EXPECT_EQ(*scrape.value("psld_h_seconds_bucket", {{"le", "0.1"}}), 3);
  EXPECT_EQ(*scrape.value("psld_h_seconds_bucket", {{"le", "1"}}), 5);
  EXPECT_EQ(*scrape.value("psld_h_seconds_bucket", {{"le", "+Inf"}}), 7);
  EXPECT_EQ(*scrape.value("psld_h_seconds_sum"), 12.5);
  EXPECT_EQ(*scrape.value("psld_h_seconds_count"), 7);
}

TEST(PrometheusParser, RefusesWhatIsNotTheFormat) {
  EXPECT_NE(parse_prometheus("x 1\n").error, "");  // no TYPE
  EXPECT_NE(parse_prometheus("# HELP x h\n# TYPE x gauge\nx{a=\"b} 1\n").error, "");
  EXPECT_NE(parse_prometheus("# HELP x h\n# TYPE x gauge\nx one\n").error, "");
  EXPECT_NE(parse_prometheus("# HELP x h\n# TYPE x gauge\nx 1 1700000000\n").error, "");
  EXPECT_NE(parse_prometheus("# HELP x h\n# TYPE x gauge\ny 1\n").error, "");
  EXPECT_NE(parse_prometheus("# HELP x h\n# TYPE x gauge\nx 1").error, "");
  EXPECT_EQ(parse_prometheus("# HELP x h\n# TYPE x gauge\nx{a=\"\\\"\"} 1\n").error, "");
}

// ---- The job view.

JobView sample_view() {
  JobView v;
  v.time_s = 12.5;
  v.state = "running";
  v.num_workers = 2;
  v.num_servers = 2;
  v.epoch = 3;
  v.round = 140;
  v.switches = 3;
  v.model_bytes = 1000;
  v.tensors = 4;
  v.migrated_bytes = 250;
  v.balancer = true;
  v.balancer_decisions = 9;
  v.steps = {{"rebalance", 2}, {"rollback", 1}};
  v.members = {{"worker", 0, "host\"a", 11, "up", 0.1},
               {"worker", 1, "b", 12, "finished", 0},
               {"server", 0, "c", 13, "up", 0.2},
               {"server", 1, "d", 14, "lost", 0}};
  JobView::Server s0;
  s0.rank = 0;
  s0.share = 0.75;
  s0.owned_bytes = 750;
  s0.bytes_in = 5000;
  s0.bytes_out = 4000;
  s0.in_bytes_per_s = 1.5e6;
  s0.predicted_rate = 2e6;
  s0.straggler = true;
  s0.answer_mean_s = 0.001;
  s0.answer_p99_s = 0.002;
  s0.answer_workers = 1;
  JobView::Server s1;
  s1.rank = 1;
  s1.state = "lost";
  v.servers = {s0, s1};
  JobView::Worker w;
  w.rank = 0;
  w.round = 140;
  w.round_s = 0.004;
  w.buckets.fill(0);
  for (size_t i = 2; i < w.buckets.size(); ++i)
    w.buckets[i] = 140;
  w.rounds = 140;
  w.rounds_sum_s = 0.56;
  w.answers = {{0, 70, 0.001, 0.002}};
  v.workers = {w};
  v.decisions = {{4, 3.5, 2, "rebalance", "moved 25% off server 1\nbecause"}};
  return v;
}

TEST(JobView, PrometheusTextParsesAndSaysWhatTheViewHolds) {
  const JobView v = sample_view();
  const std::string text = to_prometheus(v);
  auto scrape = parse_prometheus(text);
  ASSERT_EQ(scrape.error, "") << text;
  EXPECT_EQ(*scrape.value("psld_job_state", {{"state", "running"}}), 1);
  EXPECT_EQ(*scrape.value("psld_job_state", {{"state", "failed"}}), 0);
  EXPECT_EQ(*scrape.value("psld_member_up", {{"role", "worker"}, {"rank", "0"}}), 1);
  EXPECT_EQ(*scrape.value("psld_member_up", {{"host", "host\"a"}}), 1);
  EXPECT_EQ(*scrape.value("psld_member_up", {{"role", "server"}, {"rank", "1"}}), 0);
  EXPECT_EQ(*scrape.value("psld_server_bytes_total", {{"server", "0"}, {"direction", "in"}}), 5000);
  EXPECT_EQ(*scrape.value("psld_server_bytes_total", {{"server", "0"}, {"direction", "out"}}),
            4000);
  EXPECT_EQ(*scrape.value("psld_server_state", {{"server", "1"}, {"state", "lost"}}), 1);
  EXPECT_EQ(*scrape.value("psld_server_straggler", {{"server", "0"}}), 1);
  EXPECT_EQ(*scrape.value("psld_server_share", {{"server", "0"}}), 0.75);
  EXPECT_EQ(*scrape.value("psld_placement_epoch"), 3);
  EXPECT_EQ(*scrape.value("psld_balancer_decisions_total", {{"kind", "rebalance"}}), 2);
  EXPECT_EQ(*scrape.value("psld_balancer_decisions_total", {{"kind", "none"}}), 6);
  EXPECT_EQ(*scrape.value("psld_migrated_bytes_total"), 250);
  EXPECT_EQ(*scrape.value("psld_worker_round_seconds_bucket", {{"worker", "0"}, {"le", "0.001"}}),
            0);
  EXPECT_EQ(*scrape.value("psld_worker_round_seconds_bucket", {{"worker", "0"}, {"le", "0.005"}}),
            140);
  EXPECT_EQ(*scrape.value("psld_worker_round_seconds_count", {{"worker", "0"}}), 140);
  EXPECT_EQ(*scrape.value("psld_worker_answer_p99_seconds", {{"worker", "0"}, {"server", "0"}}),
            0.002);
  EXPECT_EQ(*scrape.value("psld_server_answer_seconds", {{"server", "0"}, {"stat", "p99"}}), 0.002);
  EXPECT_EQ(*scrape.value("psld_server_answer_workers", {{"server", "0"}}), 1);
  EXPECT_EQ(*scrape.value("psld_server_answer_workers", {{"server", "1"}}), 0);
  EXPECT_FALSE(scrape.value("psld_server_answer_seconds", {{"server", "1"}, {"stat", "mean"}}));
  EXPECT_EQ(scrape.types["psld_worker_round_seconds"], "histogram");
  EXPECT_EQ(scrape.types["psld_server_bytes_total"], "counter");
}

TEST(JobView, JsonReadsBackAsTheSameView) {
  const JobView v = sample_view();
  auto back = job_view_from_json(to_json(v));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(to_json(*back), to_json(v));
  EXPECT_EQ(back->decisions.at(0).reason, "moved 25% off server 1\nbecause");
  EXPECT_EQ(back->members.at(0).host, "host\"a");
  EXPECT_TRUE(back->servers.at(0).straggler);
}

TEST(JobView, ADocumentThatIsNotOneIsAClearError) {
  for (const std::string bad : {"", "garbage", "[1,2]", "{}", R"({"time_s":"x"})",
                                R"({"time_s":1,"state":"running","num_workers":-1})"}) {
    auto v = job_view_from_json(bad);
    EXPECT_EQ(v.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(v.status().message().find("not a psld job status"), std::string::npos);
  }
}

// ---- The endpoint.

int dial(const std::string& address) {
  const size_t colon = address.rfind(':');
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &a.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Everything the peer sends until it closes (or `timeout`).
std::string read_all(int fd, std::chrono::milliseconds timeout = 5s) {
  std::string out;
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) != 1) break;
    char buf[65536];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

std::string ask(const std::string& address, const std::string& request) {
  const int fd = dial(address);
  if (fd < 0) return "(cannot connect)";
  (void)!send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string out = read_all(fd);
  close(fd);
  return out;
}

std::string body_of(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  return at == std::string::npos ? "" : response.substr(at + 4);
}

std::unique_ptr<MetricsEndpoint> start_endpoint(std::atomic<int>* calls = nullptr) {
  auto e = MetricsEndpoint::start("127.0.0.1:0", {"/", "/metrics"}, [calls](const std::string& p) {
    if (calls) ++*calls;
    return MetricsEndpoint::Page{"text/plain", "page " + p + "\n"};
  });
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return e.ok() ? std::move(e).value() : nullptr;
}

TEST(MetricsEndpoint, AnswersKnownPagesAndRefusesTheRestClearly) {
  auto e = start_endpoint();
  ASSERT_TRUE(e);
  const std::string& at = e->address();
  std::string r = ask(at, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 200 OK\r\n", 0), 0U) << r;
  EXPECT_NE(r.find("Content-Length: 14\r\n"), std::string::npos) << r;
  EXPECT_EQ(body_of(r), "page /metrics\n");
  EXPECT_EQ(body_of(ask(at, "GET /metrics?x=1 HTTP/1.0\r\n\r\n")), "page /metrics\n");
  r = ask(at, "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 200 OK\r\n", 0), 0U) << r;
  EXPECT_EQ(body_of(r), "");
  r = ask(at, "GET /secret HTTP/1.1\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 404 ", 0), 0U) << r;
  EXPECT_NE(r.find("/metrics"), std::string::npos) << r;  // says what there is
  EXPECT_EQ(ask(at, "POST /metrics HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 405 ", 0), 0U);
  EXPECT_EQ(ask(at, "\x16\x03\x01 garbage\r\n\r\n").rfind("HTTP/1.1 400 ", 0), 0U);
  EXPECT_EQ(ask(at, "GET / HTTP/1.1\r\nX: " + std::string(9000, 'a')).rfind("HTTP/1.1 431 ", 0),
            0U);
  EXPECT_EQ(e->served(), 3U);
}

TEST(MetricsEndpoint, AFloodOfIdleConnectionsIsCappedAndTimedOut) {
  std::atomic<int> calls{0};
  auto e = start_endpoint(&calls);
  ASSERT_TRUE(e);
  std::vector<int> idle;
  for (size_t i = 0; i < MetricsEndpoint::kMaxConnections; ++i) {
    idle.push_back(dial(e->address()));
    ASSERT_GE(idle.back(), 0);
  }
  // Every slot is held by a peer that says nothing: one more is closed at once.
  ASSERT_TRUE(eventually("a connection over the cap closed", 5s, [&] {
    const int fd = dial(e->address());
    const std::string got = read_all(fd, 500ms);
    close(fd);
    return e->refused() > 0 && got.empty();
  }));
  // The silent ones are closed at the deadline, and the endpoint serves again.
  for (int fd : idle) {
    EXPECT_EQ(read_all(fd, 5s), "");
    close(fd);
  }
  EXPECT_EQ(body_of(ask(e->address(), "GET / HTTP/1.1\r\n\r\n")), "page /\n");
  EXPECT_EQ(calls.load(), 1);
}

TEST(MetricsEndpoint, ABadOrTakenAddressIsAClearError) {
  auto e = start_endpoint();
  ASSERT_TRUE(e);
  auto again = MetricsEndpoint::start(e->address(), {"/"}, nullptr);
  EXPECT_EQ(again.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(again.status().message().find("cannot listen"), std::string::npos);
  auto bad = MetricsEndpoint::start("no-port", {"/"}, nullptr);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("metrics.listen"), std::string::npos);
}

// ---- A job's coordinator serving what its members report.

TEST(CoordinatorMetrics, AJobShowsItsMembersTrafficAndPace) {
  Cluster c(2, 2, [](RuntimeOptions& o) {
    o.metrics_listen = "127.0.0.1:0";
    o.stats_interval = 20ms;
  });
  ASSERT_TRUE(c.start().ok());
  const std::string at = c.coordinator->metrics_address();
  ASSERT_NE(at, "");
  const std::vector<size_t> elems = {1000, 30000, 7};
  std::vector<std::vector<std::vector<float>>> data;
  auto registered = register_zeroed_on_all(c, elems, data);
  ASSERT_TRUE(registered.ok()) << registered.status().to_string();
  const std::vector<std::vector<uint32_t>>& handles = *registered;
  // The same rounds on both workers (BSP: one that stopped early would
  // leave the other waiting), then until the coordinator has heard of them.
  // At least kRounds, and on (both workers the same rounds: BSP) until the
  // coordinator has summarised per server what both workers saw of it: a
  // newest window with answers needs rounds running.
  constexpr int kRounds = 300;
  std::atomic<int> stop_at{20 * kRounds};
  std::array<std::atomic<int>, 2> done{};
  auto job = std::async(std::launch::async, [&] {
    return on_all(c, [&](size_t w) -> Status {
      for (int r = 0; r < stop_at; ++r) {
        PSLD_ASSIGN_OR_RETURN(auto reqs,
                              c.workers[w]->submit_many(handles[w], RequestKind::kPushPull));
        for (auto& req : reqs)
          PSLD_RETURN_IF_ERROR(req->wait(10s));
        done[w] = r + 1;
      }
      return Status::Ok();
    });
  });
  EXPECT_TRUE(eventually("every server summarised from both workers' reports", 20s, [&] {
    JobView v = c.coordinator->view();
    bool all = v.servers.size() == 2;
    for (const auto& s : v.servers)
      all =
          all && s.answer_workers == 2 && s.answer_mean_s > 0 && s.answer_p99_s >= s.answer_mean_s;
    return all;
  }));
  // A round both workers are still before (they are within one of each
  // other), and at least kRounds.
  stop_at = std::max(kRounds, std::max(done[0].load(), done[1].load()) + 4);
  const int rounds = stop_at;
  Status st = job.get();
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_TRUE(eventually("both workers' last rounds in the coordinator's view", 10s, [&] {
    JobView v = c.coordinator->view();
    bool paced = v.workers.size() == 2;
    for (const auto& wk : v.workers)
      paced = paced && wk.round == static_cast<uint64_t>(rounds) && wk.rounds >= 20;
    return paced;
  }));

  const std::string response = ask(at, "GET /metrics HTTP/1.1\r\n\r\n");
  ASSERT_EQ(response.rfind("HTTP/1.1 200 OK\r\n", 0), 0U) << response;
  EXPECT_NE(response.find("Content-Type: text/plain; version=0.0.4"), std::string::npos);
  auto scrape = parse_prometheus(body_of(response));
  ASSERT_EQ(scrape.error, "") << body_of(response);
  EXPECT_EQ(*scrape.value("psld_job_state", {{"state", "running"}}), 1);
  for (const std::string role : {"worker", "server"}) {
    for (const std::string rank : {"0", "1"}) {
      EXPECT_EQ(*scrape.value("psld_member_up", {{"role", role}, {"rank", rank}}), 1)
          << role << " " << rank;
    }
  }
  EXPECT_EQ(*scrape.value("psld_tensors"), 3);
  EXPECT_EQ(*scrape.value("psld_model_bytes"), (1000 + 30000 + 7) * 4);
  double share = 0;
  double bytes_in = 0;
  for (const std::string s : {"0", "1"}) {
    share += *scrape.value("psld_server_share", {{"server", s}});
    bytes_in += *scrape.value("psld_server_bytes_total", {{"server", s}, {"direction", "in"}});
  }
  EXPECT_NEAR(share, 1.0, 1e-9);
  EXPECT_GT(bytes_in, 20.0 * (1000 + 30000 + 7) * 4);  // 2 workers x >= 20 rounds... at least
  for (const std::string w : {"0", "1"}) {
    const double count = *scrape.value("psld_worker_round_seconds_count", {{"worker", w}});
    EXPECT_GE(count, 20) << w;
    EXPECT_EQ(*scrape.value("psld_worker_round_seconds_bucket", {{"worker", w}, {"le", "+Inf"}}),
              count);
    double last = 0;
    for (const auto& b : scrape.find("psld_worker_round_seconds_bucket", {{"worker", w}})) {
      EXPECT_GE(b.value, last) << "buckets are cumulative";
      last = b.value;
    }
    EXPECT_GT(*scrape.value("psld_worker_round", {{"worker", w}}), 20);
  }
  // The same job as JSON.
  auto view = job_view_from_json(body_of(ask(at, "GET /status.json HTTP/1.1\r\n\r\n")));
  ASSERT_TRUE(view.ok()) << view.status().to_string();
  EXPECT_EQ(view->state, "running");
  EXPECT_EQ(view->members.size(), 4U);
  EXPECT_EQ(view->servers.size(), 2U);
  EXPECT_EQ(view->epoch, c.coordinator->epoch());
}

TEST(CoordinatorMetrics, NoListenAddressServesNothing) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.start().ok());
  EXPECT_EQ(c.coordinator->metrics_address(), "");
}

}  // namespace
}  // namespace psld
