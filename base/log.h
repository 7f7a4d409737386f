// Logging for transports and the runtime: one line per event,
//
//   2026-12-04T04:16:10.123Z node7:4242 worker 3 [psld warn] message
//
// (UTC time, host:pid, the process's role and rank once it has them, the
// level). PSLD_LOG sets the levels, read once: a default level and levels by
// component, "info" or "warn,ucx=debug,coordinator=info". A component is the
// directory of the source file that logs ("ucx" for transports/ucx/*.cc,
// "coordinator" for lib/coordinator/*.cc). Lines go to stderr, or to the file
// PSLD_LOG_FILE names (%h: the host name, %p: the pid), appended to.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace psld {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

// The default level (components without a level of their own).
LogLevel log_level();
// Sets the default level; components keep theirs.
void set_log_level(LogLevel level);
// "error", "warn", "info", "debug"; false for anything else.
bool parse_log_level(std::string_view name, LogLevel* level);

// A PSLD_LOG value: the default level and levels by component.
struct LogSpec {
  LogLevel level = LogLevel::kWarn;
  std::vector<std::pair<std::string, LogLevel>> components;
};
// "info", "warn,ucx=debug", "ucx=debug" (the default stays warn); "" when it
// parses, else what is wrong with it.
std::string parse_log_spec(std::string_view text, LogSpec* spec);
// Replaces the levels (the runtime calls it with the configured `log` key).
void set_log_spec(const LogSpec& spec);

// The component of a source file: the name of its directory.
constexpr std::string_view log_component(std::string_view file) {
  const size_t slash = file.find_last_of('/');
  if (slash == std::string_view::npos || slash == 0) return {};
  const std::string_view dir = file.substr(0, slash);
  const size_t parent = dir.find_last_of('/');
  return parent == std::string_view::npos ? dir : dir.substr(parent + 1);
}
bool log_enabled(LogLevel level, std::string_view component);

// The role and rank every line names from now on ("worker", 3); rank -1:
// none (the coordinator).
void set_log_identity(std::string_view role, int64_t rank);
// PSLD_LOG_FILE's pattern with %h (host), %p (pid) and %% (a percent sign)
// replaced; "" with *error set for another % sequence.
std::string expand_log_path(std::string_view pattern, std::string_view host, int64_t pid,
                            std::string* error);
// The file of the expanded pattern, opened to append, line-buffered;
// nullptr with *error set when it cannot be.
FILE* open_log_file(std::string_view pattern, std::string* error);
// One line as log_line writes it, without its newline.
std::string format_log_line(LogLevel level, std::string_view message, int64_t unix_milliseconds);

void log_line(LogLevel level, std::string_view message);

template <typename... Args>
void log_at(LogLevel level, std::string_view component, fmt::format_string<Args...> f,
            Args&&... args) {
  if (log_enabled(level, component)) {
    log_line(level, fmt::format(f, std::forward<Args>(args)...));
  }
}
#define PSLD_LOG_AT_(level, ...) ::psld::log_at(level, ::psld::log_component(__FILE__), __VA_ARGS__)
#define PSLD_LOG_ERROR(...) PSLD_LOG_AT_(::psld::LogLevel::kError, __VA_ARGS__)
#define PSLD_LOG_WARN(...) PSLD_LOG_AT_(::psld::LogLevel::kWarn, __VA_ARGS__)
#define PSLD_LOG_INFO(...) PSLD_LOG_AT_(::psld::LogLevel::kInfo, __VA_ARGS__)
#define PSLD_LOG_DEBUG(...) PSLD_LOG_AT_(::psld::LogLevel::kDebug, __VA_ARGS__)

}  // namespace psld
