// `psld bench compare` (bench/compare.h) and its reports (bench/report.h):
// regressions and improvements found, noise and mismatches reported with
// clear messages, the JSON read back as written.
#include "bench/compare.h"
#include "bench/compare_cmd.h"

#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/temp_dir.h"

namespace psld::bench {
namespace {

// A report with `reps` repetitions of each named row; row i's ratio is
// level * (1 + N(0, noise)), its real_time 1000 / ratio.
Report make_report(const std::vector<std::pair<std::string, double>>& rows, int reps, double noise,
                   uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0.0, noise);
  Report r;
  r.context = {{"host_name", "ci-1"}, {"num_cpus", 2}, {"psld", {{"build_type", "release"}}}};
  for (int rep = 0; rep < reps; ++rep) {
    for (const auto& [name, level] : rows) {
      Row row;
      row.name = name;
      row.repetition = rep;
      row.repetitions = reps;
      const double ratio = level * (1 + (noise > 0 ? n(rng) : 0.0));
      row.values = {{"ratio", ratio}, {"real_time", 1000 / ratio}};
      r.rows.push_back(row);
    }
  }
  return r;
}

const RowComparison& row(const Comparison& c, const std::string& name) {
  for (const auto& r : c.rows) {
    if (r.name == name) return r;
  }
  ADD_FAILURE() << "no row " << name;
  static RowComparison none;
  return none;
}

bool has_warning(const Comparison& c, const std::string& part) {
  for (const auto& w : c.warnings) {
    if (w.find(part) != std::string::npos) return true;
  }
  return false;
}

TEST(Compare, FlagsATenPercentRegressionAndOnlyThatRow) {
  const Report base = make_report({{"kernels/a", 1.0}, {"kernels/b", 0.8}}, 9, 0.03, 1);
  const Report fresh = make_report({{"kernels/a", 0.9}, {"kernels/b", 0.8}}, 9, 0.03, 2);
  auto c = compare(base, fresh, {});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(row(*c, "kernels/a").verdict, Verdict::kRegression);
  EXPECT_LT(row(*c, "kernels/a").p, 0.05);
  EXPECT_NEAR(row(*c, "kernels/a").change, -0.10, 0.04);
  EXPECT_EQ(row(*c, "kernels/b").verdict, Verdict::kSame);
  EXPECT_EQ(c->count(Verdict::kRegression), 1U);
  EXPECT_FALSE(has_warning(*c, "repetition"));
  const std::string md = markdown(*c, {});
  EXPECT_NE(md.find("| kernels/a |"), std::string::npos);
  EXPECT_NE(md.find("**REGRESSION**"), std::string::npos);
  EXPECT_NE(md.find("1 regression,"), std::string::npos);
}

TEST(Compare, SameDistributionIsNotFlagged) {
  const Report base = make_report({{"a", 1.0}, {"b", 2.0}}, 9, 0.03, 3);
  const Report fresh = make_report({{"a", 1.0}, {"b", 2.0}}, 9, 0.03, 4);
  auto c = compare(base, fresh, {});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->count(Verdict::kRegression), 0U);
  EXPECT_EQ(c->count(Verdict::kImprovement), 0U);
}

TEST(Compare, ReportsImprovements) {
  auto c =
      compare(make_report({{"a", 1.0}}, 9, 0.02, 5), make_report({{"a", 1.2}}, 9, 0.02, 6), {});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(row(*c, "a").verdict, Verdict::kImprovement);
}

TEST(Compare, LowerIsBetterForTimes) {
  CompareOptions o;
  o.metric = "real_time";
  // ratio 0.8 is real_time 1250 against 1000: 25% slower.
  auto c = compare(make_report({{"a", 1.0}}, 9, 0.02, 7), make_report({{"a", 0.8}}, 9, 0.02, 8), o);
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->higher_is_better);
  EXPECT_EQ(row(*c, "a").verdict, Verdict::kRegression);
  EXPECT_GT(row(*c, "a").change, 0.2);
}

TEST(Compare, AChangeWithinTheThresholdIsNotARegression) {
  // A real 3% shift with little noise: significant, but inside 5%.
  auto c =
      compare(make_report({{"a", 1.0}}, 9, 0.005, 9), make_report({{"a", 0.97}}, 9, 0.005, 10), {});
  ASSERT_TRUE(c.ok());
  EXPECT_LT(row(*c, "a").p, 0.05);
  EXPECT_EQ(row(*c, "a").verdict, Verdict::kSame);
  CompareOptions tight;
  tight.threshold = 0.02;
  EXPECT_EQ(row(*compare(make_report({{"a", 1.0}}, 9, 0.005, 9),
                         make_report({{"a", 0.97}}, 9, 0.005, 10), tight),
                "a")
                .verdict,
            Verdict::kRegression);
}

TEST(Compare, OneRepetitionIsJudgedByItsChangeAndSaysSo) {
  auto c = compare(make_report({{"a", 1.0}, {"b", 1.0}}, 1, 0, 11),
                   make_report({{"a", 0.7}, {"b", 0.99}}, 1, 0, 12), {});
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(row(*c, "a").tested);
  EXPECT_EQ(row(*c, "a").verdict, Verdict::kRegression);
  EXPECT_EQ(row(*c, "b").verdict, Verdict::kSame);
  EXPECT_TRUE(has_warning(*c, "only 1 repetition on a side"));
  EXPECT_TRUE(has_warning(*c, "no p-value can reach alpha"));
  EXPECT_NE(markdown(*c, {}).find("(untested)"), std::string::npos);
}

TEST(Compare, TiesEverywhere) {
  // Every repetition the same value on each side: the ties leave a variance,
  // and 9 against 9 all apart is significant.
  auto c = compare(make_report({{"a", 1.0}, {"b", 1.0}}, 9, 0, 13),
                   make_report({{"a", 0.7}, {"b", 1.0}}, 9, 0, 14), {});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(row(*c, "a").verdict, Verdict::kRegression);
  EXPECT_TRUE(row(*c, "a").tested);
  EXPECT_EQ(row(*c, "b").verdict, Verdict::kSame);
  EXPECT_EQ(row(*c, "b").p, 1.0);
}

TEST(Compare, MismatchedNamesAreListed) {
  auto c = compare(make_report({{"a", 1.0}, {"gone", 1.0}}, 3, 0.01, 15),
                   make_report({{"a", 1.0}, {"new", 1.0}}, 3, 0.01, 16), {});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->rows.size(), 1U);
  EXPECT_EQ(c->only_in_base, std::vector<std::string>{"gone"});
  EXPECT_EQ(c->only_in_new, std::vector<std::string>{"new"});
  const std::string md = markdown(*c, {});
  EXPECT_NE(md.find("Only in BASE (1): gone"), std::string::npos);
  EXPECT_NE(md.find("Only in NEW (1): new"), std::string::npos);

  auto none = compare(make_report({{"x", 1.0}}, 3, 0, 1), make_report({{"y", 1.0}}, 3, 0, 1), {});
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("no row in common"), std::string::npos);
}

TEST(Compare, YardsticksAreNotListedAsLackingARatio) {
  Report base = make_report({{"k/row", 1.0}}, 3, 0, 1);
  for (int rep = 0; rep < 3; ++rep) {
    Row y;
    y.name = "k/yard";
    y.repetition = rep;
    y.values = {{"real_time", 100.0}};
    base.rows.push_back(y);
    Row odd = y;
    odd.name = "k/other";  // no ratio, and nobody's yardstick
    base.rows.push_back(odd);
  }
  for (Row& r : base.rows) {
    if (r.name == "k/row") r.yardstick = "k/yard";
  }
  auto c = compare(base, base, {});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->without_metric, std::vector<std::string>{"k/other"});
  EXPECT_NE(markdown(*c, {}).find("1 row compared on ratio (higher is better): 0 regressions"),
            std::string::npos);
}

TEST(Compare, MetricsItDoesNotKnowNeedADirection) {
  Report base = make_report({{"a", 1.0}}, 3, 0, 1), fresh = base;
  CompareOptions o;
  o.metric = "moves";
  auto c = compare(base, fresh, o);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("--higher-is-better"), std::string::npos);
  // A known direction but a metric the rows lack.
  o.metric = "items_per_second";
  c = compare(base, fresh, o);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("1 without the metric"), std::string::npos);
  o.metric = "ratio";
  o.alpha = 0;
  EXPECT_FALSE(compare(base, fresh, o).ok());
  o.alpha = 0.05;
  o.threshold = -0.1;
  EXPECT_FALSE(compare(base, fresh, o).ok());
}

TEST(Compare, WarnsAboutLoadHostsAndNoisyYardsticks) {
  Report base = make_report({{"k/row", 1.0}}, 9, 0.01, 17);
  Report fresh = make_report({{"k/row", 1.0}}, 9, 0.01, 18);
  fresh.context["host_name"] = "laptop";
  fresh.context["psld"]["load_avg_start"] = {3.5, 1.0, 0.5};
  // A yardstick whose time swings by 2x within NEW.
  for (int rep = 0; rep < 9; ++rep) {
    Row y;
    y.name = "k/yard";
    y.repetition = rep;
    y.values = {{"real_time", rep % 2 == 0 ? 100.0 : 200.0}};
    fresh.rows.push_back(y);
  }
  for (Row& r : fresh.rows) {
    if (r.name == "k/row") r.yardstick = "k/yard";
  }
  auto c = compare(base, fresh, {});
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(has_warning(*c, "different hosts: ci-1 and laptop"));
  EXPECT_TRUE(has_warning(*c, "NEW ran on a loaded machine: load average 3.50 at its start"));
  EXPECT_TRUE(has_warning(*c, "NEW: the yardstick k/yard varied by"));
  EXPECT_FALSE(has_warning(*c, "BASE ran on a loaded"));

  // As psld bench run records it: one number.
  base.context["psld"]["load_avg_end"] = 2.5;
  c = compare(base, fresh, {});
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(has_warning(*c, "BASE ran on a loaded machine: load average 2.50 at its end"));
}

TEST(Report, RoundTripsThroughGoogleBenchmarkJson) {
  Report r = make_report({{"kernels/BM_reduce_fp32/4096", 0.9}, {"kernels/BM_memcpy/4096", 1}}, 3,
                         0.01, 19);
  r.rows[0].yardstick = "kernels/BM_memcpy/4096";
  r.rows[0].label = "avx2";
  const std::string text = format_report(r);
  // Google Benchmark's shape: iteration rows and a median aggregate per name.
  EXPECT_NE(text.find("\"run_type\": \"aggregate\""), std::string::npos);
  EXPECT_NE(text.find("\"aggregate_name\": \"median\""), std::string::npos);
  EXPECT_NE(text.find("\"time_unit\": \"ns\""), std::string::npos);
  auto back = parse_report(text, "the round trip");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  ASSERT_EQ(back->rows.size(), r.rows.size());  // the aggregates are not samples
  EXPECT_EQ(back->rows[0].yardstick, "kernels/BM_memcpy/4096");
  EXPECT_EQ(back->rows[0].label, "avx2");
  EXPECT_EQ(samples_of(*back, "kernels/BM_reduce_fp32/4096", "ratio"),
            samples_of(r, "kernels/BM_reduce_fp32/4096", "ratio"));
  EXPECT_EQ(back->context["host_name"], "ci-1");
}

TEST(Report, ReadsGoogleBenchmarkOutputAndConvertsTimes) {
  const char* text = R"({"context": {"num_cpus": 2},
    "benchmarks": [
      {"name": "BM_x/8", "run_type": "iteration", "real_time": 2.5, "cpu_time": 2.0,
       "time_unit": "ms", "iterations": 100, "bytes_per_second": 1e9},
      {"name": "BM_x/8", "run_type": "iteration", "real_time": 3.0, "cpu_time": 2.0,
       "time_unit": "us", "iterations": 100},
      {"name": "BM_x/8_mean", "run_type": "aggregate", "real_time": 9, "time_unit": "ms"}]})";
  auto r = parse_report(text, "gb.json");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(samples_of(*r, "BM_x/8", "real_time"), (std::vector<double>{2.5e6, 3e3}));
  EXPECT_EQ(samples_of(*r, "BM_x/8", "bytes_per_second"), (std::vector<double>{1e9}));
}

TEST(Report, BadDocumentsGetClearErrors) {
  struct Case {
    const char* text;
    const char* says;
  };
  const Case cases[] = {
      {"not json", "is not a JSON object"},
      {"[1, 2]", "is not a JSON object"},
      {R"({"context": {}})", "has no \"benchmarks\" array"},
      {R"({"benchmarks": []})", "holds no measured rows"},
      {R"({"benchmarks": [{"name": "a_mean", "run_type": "aggregate", "real_time": 1}]})",
       "holds no measured rows"},
      {R"({"benchmarks": [{"real_time": 1}]})", "row 1 has no name"},
      {R"({"benchmarks": [3]})", "row 1 is not an object"},
      {R"({"benchmarks": [{"name": "a", "cpu_time": 1}]})", "row 'a' has no real_time"},
      {R"({"benchmarks": [{"name": "a", "real_time": "fast"}]})", "row 'a' has no real_time"},
      {R"({"benchmarks": [{"name": "a", "real_time": 1, "error_occurred": true,
          "error_message": "no GPU"}]})",
       "row 'a' failed: no GPU"},
  };
  for (const Case& c : cases) {
    auto r = parse_report(c.text, "x.json");
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_NE(r.status().message().find(c.says), std::string::npos) << r.status().message();
    EXPECT_EQ(r.status().message().rfind("x.json", 0), 0U) << r.status().message();
  }
  EXPECT_EQ(read_report("/nonexistent/psld-bench.json").status().code(), StatusCode::kNotFound);
}

// --rerun runs BASE's programs only from a build directory of BASE's
// revision: what vcs_tag wrote into its build_info.cc.
TEST(BenchRerun, ReadsTheRevisionABenchDirectoryWasBuiltFrom) {
  psld::testing::TempDir dir("psld-bench-revision");
  ASSERT_FALSE(dir.path().empty());
  EXPECT_EQ(revision_at(dir.path()), "") << "no build_info.cc: not a build";
  std::ofstream(dir.path() + "/build_info.cc")
      << "// Generated by bench/meson.build from bench/build_info.cc.in.\n"
      << "namespace psld::bench {\n"
      << "const char* const kGitDescribe = \"74f7601ab2c3-dirty\";\n"
      << "const char* const kBuildType = PSLD_BUILD_TYPE;\n}\n";
  EXPECT_EQ(revision_at(dir.path()), "74f7601ab2c3-dirty");
  EXPECT_EQ(revision_at(dir.path() + "/nonexistent"), "");
}

}  // namespace
}  // namespace psld::bench
