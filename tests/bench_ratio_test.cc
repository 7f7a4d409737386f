// psld bench run's ratios (bench/run_cmd.h add_ratios): every row against its
// yardstick of the same repetition, in the direction of its speed.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "bench/run_cmd.h"

namespace psld::bench {
namespace {

Row row(const std::string& name, std::map<std::string, double> values) {
  Row r;
  r.name = name;
  r.values = std::move(values);
  return r;
}

std::string memcpy_of(const std::string& name) {
  const size_t slash = name.find('/');
  return name.rfind("BM_memcpy", 0) == 0 ? "" : "BM_memcpy" + name.substr(slash);
}

std::string sort_of(const std::string& name) {
  return name == "BM_sort" ? "" : "BM_sort";
}

TEST(Ratios, AgainstTheYardstickOfTheSameRun) {
  std::vector<Row> rows = {row("BM_memcpy/4096", {{"bytes_per_second", 10e9}}),
                           row("BM_reduce/4096", {{"bytes_per_second", 8e9}}),
                           row("BM_reduce/8192", {{"bytes_per_second", 8e9}})};
  add_ratios(rows, "kernels", memcpy_of, Speed::kBytesPerSecond);
  EXPECT_EQ(rows[0].name, "kernels/BM_memcpy/4096");
  EXPECT_TRUE(rows[0].yardstick.empty());
  EXPECT_EQ(rows[0].values.count("ratio"), 0U);
  EXPECT_EQ(rows[1].name, "kernels/BM_reduce/4096");
  EXPECT_EQ(rows[1].yardstick, "kernels/BM_memcpy/4096");
  EXPECT_DOUBLE_EQ(rows[1].values.at("ratio"), 0.8);
  // Its yardstick is not in the run: no ratio rather than a wrong one.
  EXPECT_TRUE(rows[2].yardstick.empty());
  EXPECT_EQ(rows[2].values.count("ratio"), 0U);
}

TEST(Ratios, TimesAreInvertedSoThatHigherIsBetter) {
  std::vector<Row> rows = {row("BM_sort", {{"real_time", 2e6}}),
                           row("BM_decide", {{"real_time", 4e6}}),
                           row("BM_broken", {{"real_time", 0}})};
  add_ratios(rows, "balancer", sort_of, Speed::kInverseTime);
  EXPECT_DOUBLE_EQ(rows[1].values.at("ratio"), 0.5);  // twice the sort's time
  EXPECT_EQ(rows[2].values.count("ratio"), 0U);       // a zero time has no ratio
}

TEST(Ratios, ItemsPerSecond) {
  std::vector<Row> rows = {row("BM_sort", {{"items_per_second", 1e6}}),
                           row("BM_lookup", {{"items_per_second", 3e6}})};
  add_ratios(rows, "placement", sort_of, Speed::kItemsPerSecond);
  EXPECT_DOUBLE_EQ(rows[1].values.at("ratio"), 3.0);
  EXPECT_EQ(rows[1].yardstick, "placement/BM_sort");
}

}  // namespace
}  // namespace psld::bench
