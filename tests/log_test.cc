// base/log.h: the levels by component, the line's prefix and its file.
#include "base/log.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "tests/temp_dir.h"

namespace psld {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::StartsWith;
using testing::TempDir;

static_assert(log_component("../transports/ucx/worker.cc") == "ucx");
static_assert(log_component("/src/psld/lib/coordinator/service.cc") == "coordinator");
static_assert(log_component("base/log.cc") == "base");
static_assert(log_component("log.cc").empty());
static_assert(log_component("/log.cc").empty());

// Restores the levels a test changed.
class Log : public ::testing::Test {
 protected:
  void TearDown() override { set_log_spec(LogSpec{}); }
};

TEST_F(Log, SpecsParse) {
  LogSpec s;
  EXPECT_EQ(parse_log_spec("info", &s), "");
  EXPECT_EQ(s.level, LogLevel::kInfo);
  EXPECT_TRUE(s.components.empty());

  EXPECT_EQ(parse_log_spec("warn,ucx=debug,coordinator=error", &s), "");
  EXPECT_EQ(s.level, LogLevel::kWarn);
  ASSERT_EQ(s.components.size(), 2u);
  EXPECT_EQ(s.components[0].first, "ucx");
  EXPECT_EQ(s.components[0].second, LogLevel::kDebug);
  EXPECT_EQ(s.components[1].first, "coordinator");
  EXPECT_EQ(s.components[1].second, LogLevel::kError);

  // A component alone: the default stays warn.
  EXPECT_EQ(parse_log_spec("server=info", &s), "");
  EXPECT_EQ(s.level, LogLevel::kWarn);
  ASSERT_EQ(s.components.size(), 1u);
}

TEST_F(Log, BadSpecsSayWhatIsWrongAndChangeNothing) {
  LogSpec s;
  s.level = LogLevel::kDebug;
  const std::pair<const char*, const char*> cases[] = {
      {"", "an empty item"},
      {"verbose", "'verbose' is not a level (error, warn, info, debug)"},
      {"info,warn", "two default levels"},
      {"info,,ucx=debug", "an empty item"},
      {"info,", "an empty item"},
      {"=debug", "names no component"},
      {"UCX=debug", "'UCX' is not a component name"},
      {"ucx=loud", "'loud' is not a level"},
      {"ucx=info,ucx=debug", "component 'ucx' given twice"},
  };
  for (const auto& [text, want] : cases) {
    EXPECT_THAT(parse_log_spec(text, &s), HasSubstr(want)) << text;
    EXPECT_EQ(s.level, LogLevel::kDebug) << text;
  }
}

TEST_F(Log, AComponentHasItsOwnLevel) {
  LogSpec s;
  ASSERT_EQ(parse_log_spec("warn,ucx=debug,server=error", &s), "");
  set_log_spec(s);
  EXPECT_TRUE(log_enabled(LogLevel::kDebug, "ucx"));
  EXPECT_TRUE(log_enabled(LogLevel::kWarn, "coordinator"));
  EXPECT_FALSE(log_enabled(LogLevel::kInfo, "coordinator"));
  EXPECT_FALSE(log_enabled(LogLevel::kWarn, "server"));
  EXPECT_TRUE(log_enabled(LogLevel::kError, "server"));
  // set_log_level changes the default only.
  set_log_level(LogLevel::kInfo);
  EXPECT_TRUE(log_enabled(LogLevel::kInfo, "coordinator"));
  EXPECT_TRUE(log_enabled(LogLevel::kDebug, "ucx"));
  EXPECT_FALSE(log_enabled(LogLevel::kWarn, "server"));
  EXPECT_EQ(log_level(), LogLevel::kInfo);
}

TEST_F(Log, ALineHasTheTimeTheProcessAndItsRoleAndRank) {
  const std::string pid = std::to_string(::getpid());
  set_log_identity("worker", 3);
  const std::string line = format_log_line(LogLevel::kWarn, "slow server 2", 1764822970123);
  EXPECT_THAT(line, StartsWith("2025-12-04T04:36:10.123Z "));
  EXPECT_THAT(line, MatchesRegex("2025-12-04T04:36:10\\.123Z [^ ]+:" + pid +
                                 " worker 3 \\[psld warn\\] slow server 2"));
  set_log_identity("coordinator", -1);
  EXPECT_THAT(
      format_log_line(LogLevel::kInfo, "m", 7),
      MatchesRegex("1970-01-01T00:00:00\\.007Z [^ ]+:" + pid + " coordinator \\[psld info\\] m"));
}

TEST_F(Log, TheFilePatternNamesTheHostAndThePid) {
  std::string error;
  EXPECT_EQ(expand_log_path("/var/log/psld-%h-%p.log", "node7", 42, &error),
            "/var/log/psld-node7-42.log");
  EXPECT_EQ(expand_log_path("100%%", "h", 1, &error), "100%");
  EXPECT_EQ(expand_log_path("a-%x", "h", 1, &error), "");
  EXPECT_THAT(error, HasSubstr("'%x' is not %h (host), %p (pid) or %%"));
  EXPECT_EQ(expand_log_path("a-%", "h", 1, &error), "");

  TempDir dir("psld-log");
  // Appends `line` through a file opened from the pattern; returns the file's text.
  auto append = [&](const char* line) -> std::string {
    FILE* f = open_log_file(dir.path() + "/psld-%p.log", &error);
    if (f == nullptr) return "cannot open: " + error;
    std::fputs(line, f);
    std::fclose(f);
    std::ifstream in(dir.path() + "/psld-" + std::to_string(::getpid()) + ".log");
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  EXPECT_EQ(append("one\n"), "one\n");
  EXPECT_EQ(append("two\n"), "one\ntwo\n");  // appended to, not truncated

  EXPECT_EQ(open_log_file(dir.path() + "/no/such/dir/x.log", &error), nullptr);
  EXPECT_THAT(error, HasSubstr("cannot open"));
}

}  // namespace
}  // namespace psld
