// Chrome traces (trace.dir, trace.rounds; docs/operations.md, "Traces"): an
// in-process job of 2 workers and 2 servers runs 14 rounds while one key is
// moved to the other server; every process's file is valid JSON in the
// trace-event format, holds only the traced rounds, every chunk of them
// with its push, wait and pull nested in order inside it, every reduce and
// update of the servers, and the epoch switch on the coordinator and the
// servers.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "lib/stats/trace.h"
#include "tests/cluster.h"
#include "tests/eventually.h"
#include "tests/temp_dir.h"

namespace psld {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

std::map<std::string, json> read_traces(const std::string& dir) {
  std::map<std::string, json> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(e.path());
    std::stringstream text;
    text << in.rdbuf();
    out[e.path().filename().string()] = json::parse(text.str(), nullptr, false);
  }
  return out;
}

std::string process_name(const json& trace) {
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") return e["args"]["name"];
  }
  return "";
}

TEST(Trace, JsonEscapesWhatAStringHolds) {
  EXPECT_EQ(json_string("a\"b\\c\nd\x01"), "\"a\\\"b\\\\c\\nd\\u0001\"");
  EXPECT_EQ(json::parse(json_string("tab\there\r")), "tab\there\r");
}

TEST(Trace, NoDirectoryTracesNothing) {
  EXPECT_EQ(TraceRecorder::make({}, "worker", 0), nullptr);
}

TEST(Trace, AJobWritesNestedSpansOfItsRoundsPerProcess) {
  testing::TempDir dir;
  constexpr uint64_t kFirst = 3;
  constexpr uint64_t kLast = 12;
  constexpr int kRounds = 14;
  {
    Cluster c(2, 2, [&](RuntimeOptions& o) { o.trace = {dir.path(), kFirst, kLast}; });
    c.server_tweak = numbered_servers("loopback");
    ASSERT_TRUE(c.start().ok());
    const std::vector<size_t> elems = {1000, 40000, 3};
    std::vector<std::vector<std::vector<float>>> data;
    auto registered = register_zeroed_on_all(c, elems, data);
    ASSERT_TRUE(registered.ok()) << registered.status().to_string();
    const std::vector<std::vector<uint32_t>>& handles = *registered;
    // Tensor 1's first chunk moves to the other server once round 4 is
    // reached.
    std::thread mover([&] {
      if (!eventually("round 4", 20s, [&] { return c.coordinator->view().round >= 4; })) return;
      const Placement p = c.coordinator->current_placement();
      const Key key = make_key(2, 0);
      const ServerId to = p.owner_of_key(key) == 0 ? 1 : 0;
      auto change = p.move_arc(p.arc_index_of_hash(hash_key(key)), to);
      ASSERT_TRUE(change.ok()) << change.status().to_string();
      ASSERT_TRUE(c.coordinator->propose(change->delta).ok());
    });
    Status st = on_all(c, [&](size_t w) -> Status {
      for (int r = 1; r <= kRounds; ++r) {
        PSLD_ASSIGN_OR_RETURN(auto reqs,
                              c.workers[w]->submit_many(handles[w], RequestKind::kPushPull));
        for (auto& req : reqs)
          PSLD_RETURN_IF_ERROR(req->wait(10s));
        // Slow enough that the switch, a few rounds ahead, lands in range.
        std::this_thread::sleep_for(20ms);
      }
      return Status::Ok();
    });
    mover.join();
    ASSERT_TRUE(st.ok()) << st.to_string();
    ASSERT_GE(c.coordinator->switches(), 1U);
    ASSERT_LE(c.coordinator->last_switch_round(), kLast);
  }  // every process's recorder writes its file as it stops (or once past kLast)

  auto traces = read_traces(dir.path());
  std::map<std::string, const json*> by_process;
  for (const auto& [file, trace] : traces) {
    ASSERT_FALSE(trace.is_discarded()) << file << " is not JSON";
    ASSERT_TRUE(trace.contains("traceEvents")) << file;
    EXPECT_EQ(trace["otherData"]["rounds"], "3:12") << file;
    EXPECT_EQ(trace["otherData"]["dropped_events"], 0) << file;
    by_process[process_name(trace)] = &trace;
  }
  for (const std::string p : {"worker 0", "worker 1", "server 0", "server 1", "coordinator"}) {
    ASSERT_TRUE(by_process.count(p)) << "no trace of " << p << " in " << dir.path();
  }
  // Chunks per round: 1 + 1 + 1 (64 KiB chunks: 4000 and 160000 bytes, 12).
  const size_t chunks_per_round = 1 + 3 + 1;
  for (const std::string w : {"worker 0", "worker 1"}) {
    // (cat, id, name) -> the begin's timestamp; a span per chunk of a round.
    std::map<std::tuple<std::string, std::string, std::string>, double> open;
    struct Span {
      double begin = 0, end = 0;
    };
    std::map<std::string, std::map<std::string, Span>> by_id;  // id -> name -> span
    std::set<std::pair<uint64_t, std::pair<std::string, uint64_t>>> chunks;
    for (const auto& e : (*by_process[w])["traceEvents"]) {
      const std::string ph = e["ph"];
      if (ph == "M") continue;
      ASSERT_TRUE(ph == "b" || ph == "e") << e.dump();
      EXPECT_EQ(e["cat"], "chunk") << e.dump();
      const auto key = std::make_tuple(e["cat"].get<std::string>(), e["id"].get<std::string>(),
                                       e["name"].get<std::string>());
      if (ph == "b") {
        ASSERT_FALSE(open.count(key)) << "a span begun twice: " << e.dump();
        open[key] = e["ts"].get<double>();
        if (e.contains("args")) {
          const uint64_t round = e["args"]["round"];
          EXPECT_GE(round, kFirst) << e.dump();
          EXPECT_LE(round, kLast) << e.dump();
          EXPECT_EQ(e["args"]["status"], "ok") << e.dump();
          chunks.insert({round, {e["args"]["tensor"].get<std::string>(), e["args"]["chunk"]}});
        }
      } else {
        ASSERT_TRUE(open.count(key)) << "an end without a begin: " << e.dump();
        by_id[std::get<1>(key)][std::get<2>(key)] = {open[key], e["ts"].get<double>()};
        open.erase(key);
      }
    }
    EXPECT_TRUE(open.empty()) << w << ": spans never ended";
    EXPECT_EQ(chunks.size(), (kLast - kFirst + 1) * chunks_per_round) << w;
    for (const auto& [id, spans] : by_id) {
      ASSERT_EQ(spans.size(), 4U) << w << " id " << id;
      const Span& push = spans.at("push");
      const Span& wait = spans.at("wait");
      const Span& pull = spans.at("pull");
      Span chunk;
      for (const auto& [name, s] : spans) {
        if (name.rfind("push_pull ", 0) == 0) chunk = s;
      }
      EXPECT_LE(chunk.begin, push.begin) << id;
      EXPECT_LE(push.begin, push.end) << id;
      EXPECT_LE(push.end, wait.begin) << id;
      EXPECT_LE(wait.end, pull.begin) << id;
      EXPECT_LE(pull.end, chunk.end) << id;
    }
  }
  // Servers: every reduce (2 workers) and update of every key of the traced
  // rounds, complete spans that never cross on a thread.
  size_t reduces = 0;
  size_t updates = 0;
  size_t commits = 0;
  for (const std::string s : {"server 0", "server 1"}) {
    std::map<long, std::vector<std::pair<double, double>>> per_thread;
    for (const auto& e : (*by_process[s])["traceEvents"]) {
      if (e["ph"] == "i" && e["name"] == "epoch commit") ++commits;
      if (e["ph"] != "X") continue;
      const uint64_t round = e["args"]["round"];
      EXPECT_GE(round, kFirst) << e.dump();
      EXPECT_LE(round, kLast) << e.dump();
      if (e["name"] == "reduce") ++reduces;
      if (e["name"] == "update") ++updates;
      per_thread[e["tid"].get<long>()].push_back(
          {e["ts"], e["ts"].get<double>() + e["dur"].get<double>()});
    }
    for (auto& [tid, spans] : per_thread) {
      std::sort(spans.begin(), spans.end());
      for (size_t i = 1; i < spans.size(); ++i) {
        EXPECT_GE(spans[i].first, spans[i - 1].second - 0.002) << s << " thread " << tid;
      }
    }
  }
  const size_t rounds = kLast - kFirst + 1;
  EXPECT_EQ(reduces, rounds * chunks_per_round * 2);
  EXPECT_EQ(updates, rounds * chunks_per_round);
  EXPECT_EQ(commits, 2U) << "each server applies the switch once";
  size_t coordinator_commits = 0;
  for (const auto& e : (*by_process["coordinator"])["traceEvents"]) {
    if (e["ph"] == "i" && e["name"] == "epoch commit") ++coordinator_commits;
  }
  EXPECT_EQ(coordinator_commits, 1U);
}

}  // namespace
}  // namespace psld
