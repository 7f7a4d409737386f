#include "base/log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace psld {

namespace {
std::atomic<int>& level_slot() {
  static std::atomic<int> level = [] {
    LogLevel l = LogLevel::kWarn;
    const char* v = std::getenv("PSLD_LOG");
    if (v != nullptr) parse_log_level(v, &l);
    return static_cast<int>(l);
  }();
  return level;
}
}  // namespace

bool parse_log_level(std::string_view name, LogLevel* level) {
  if (name == "error")
    *level = LogLevel::kError;
  else if (name == "warn")
    *level = LogLevel::kWarn;
  else if (name == "info")
    *level = LogLevel::kInfo;
  else if (name == "debug")
    *level = LogLevel::kDebug;
  else
    return false;
  return true;
}

LogLevel log_level() {
  return static_cast<LogLevel>(level_slot().load(std::memory_order_relaxed));
}

void set_log_level(LogLevel level) {
  level_slot().store(static_cast<int>(level));
}

void log_line(LogLevel level, std::string_view message) {
  static constexpr const char* kNames[] = {"error", "warn", "info", "debug"};
  // One fprintf per line so lines from several threads do not interleave.
  std::string line = "[psld ";
  line += kNames[static_cast<int>(level)];
  line += "] ";
  line += message;
  line += '\n';
  std::fputs(line.c_str(), stderr);
}

}  // namespace psld
