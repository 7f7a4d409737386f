// `psld bench stragglers` end to end, on a few rounds: every scenario runs,
// every policy gets its row, the files are written, bad flags are refused.
// It measures nothing (a benchmark is not a test): the numbers are in
// docs/stragglers.md.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_process.h"

namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

std::string psld() {
  return std::getenv("TEST_PSLD_BINARY");
}

std::string read(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// The table row of `policy`, or "".
std::string row_of(const std::string& output, const std::string& policy) {
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("| " + policy + " |", 0) == 0) return line;
  }
  return "";
}

struct TempDir {
  fs::path path;
  TempDir() {
    char tmpl[] = "/tmp/psld_stragglers_XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { fs::remove_all(path); }
};

TEST(StragglersBench, EveryPolicyOfAScenarioWithEventsGetsARowAndAPlot) {
  TempDir out;
  auto r =
      psld::testing::run_process({psld(), "bench", "stragglers", "--scenario", "S2", "--rounds",
                                  "16", "--workers", "2", "--out", out.path.string()},
                                 {}, 300s);
  ASSERT_FALSE(r.timed_out) << r.output;
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("## S2: a straggler"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("speedup vs mxnet | speedup vs byteps | speedup vs round-robin |"),
            std::string::npos)
      << r.output;
  for (const char* policy : {"mxnet", "byteps", "round-robin", "psld", "oracle"}) {
    const std::string row = row_of(r.output, policy);
    ASSERT_FALSE(row.empty()) << policy << "\n" << r.output;
    // rounds/s is a positive number.
    const double rounds_per_s = std::strtod(row.c_str() + row.find('|', 2) + 1, nullptr);
    EXPECT_GT(rounds_per_s, 0) << row;
  }
  // A baseline against itself.
  EXPECT_NE(row_of(r.output, "mxnet").find("| 1.00x |"), std::string::npos);
  // The per-round data: a header and 16 rounds, a column per policy.
  const std::string tsv = read(out.path / "S2.tsv");
  EXPECT_EQ(tsv.rfind("round\tmxnet\tbyteps\tround-robin\tpsld\toracle\n", 0), 0u) << tsv;
  EXPECT_EQ(std::count(tsv.begin(), tsv.end(), '\n'), 17);
  EXPECT_NE(read(out.path / "results.md").find("## S2"), std::string::npos);
  if (std::system("command -v gnuplot >/dev/null 2>&1") == 0) {
    EXPECT_GT(fs::file_size(out.path / "S2.png"), 1000u);
  } else {
    std::printf("gnuplot not installed: the PNG plot is not checked\n");
  }
}

TEST(StragglersBench, ComputeAndScaleOutScenariosRunOnTheLoopbackTransport) {
  auto r = psld::testing::run_process(
      {psld(), "bench", "stragglers", "--scenario", "S4,S5", "--policies", "psld,oracle",
       "--rounds", "12", "--workers", "2", "--transport", "loopback"},
      {}, 300s);
  ASSERT_FALSE(r.timed_out) << r.output;
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("## S4"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("each server's reduce; links unlimited"), std::string::npos);
  EXPECT_NE(r.output.find("## S5"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("3 servers + 1 standby"), std::string::npos);
}

TEST(StragglersBench, NoiseIsMadeOnPurposeAndSaid) {
  auto r = psld::testing::run_process(
      {psld(), "bench", "stragglers", "--scenario", "S3", "--policies", "mxnet", "--rounds", "8",
       "--workers", "2", "--transport", "loopback", "--noise", "1", "--noise-duty", "0.25"},
      {}, 300s);
  ASSERT_FALSE(r.timed_out) << r.output;
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("noise: 1 busy thread at 25% duty"), std::string::npos) << r.output;
}

TEST(StragglersBench, BadFlagsAreRefusedWithTheAcceptedValues) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--scenario", "S9"}, "--scenario 'S9': accepted values are S1, S2, S3, S4, S5, all"},
      {{"--policies", "fastest"}, "accepted values are mxnet, byteps, round-robin, psld, oracle"},
      {{"--rounds", "0"}, "--rounds 0: a whole number"},
      {{"--scale", "2"}, "--scale 2: a fraction in (0, 1]"},
      {{"--rate", "-5"}, "--rate -5: MB/s, above 0"},
      {{"--transport", "carrier-pigeon"}, "accepted values are ucx, loopback"},
      {{"--rounds"}, "--rounds needs a value"},
      {{"--noise", "-1"}, "--noise -1: busy threads, a whole number 0 to 64"},
      {{"--noise-duty", "1.5"}, "--noise-duty 1.5: a fraction in (0, 1]"},
      {{"--bogus", "1"}, "unknown flag '--bogus'"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {psld(), "bench", "stragglers"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    auto r = psld::testing::run_process(argv, {}, 30s);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << r.output;
  }
  auto r = psld::testing::run_process({psld(), "bench", "nothing"}, {}, 30s);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("the subcommands are `run`, `compare`, `merge` and `stragglers`"),
            std::string::npos)
      << r.output;
  r = psld::testing::run_process({psld(), "bench", "stragglers", "--help"}, {}, 30s);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.output.find("usage: psld bench stragglers"), std::string::npos) << r.output;
}

}  // namespace
