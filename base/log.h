// Minimal logging for transports and the runtime: one line per event on
// stderr, "[psld <level>] message". PSLD_LOG=error|warn|info|debug sets the
// level (default: warn), read once.
#pragma once

#include <fmt/format.h>

#include <string_view>

namespace psld {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

LogLevel log_level();
// Overrides PSLD_LOG (the runtime calls it with the configured `log` key).
void set_log_level(LogLevel level);
// "error", "warn", "info", "debug"; false for anything else.
bool parse_log_level(std::string_view name, LogLevel* level);
void log_line(LogLevel level, std::string_view message);

template <typename... Args>
void log_at(LogLevel level, fmt::format_string<Args...> f, Args&&... args) {
  if (static_cast<int>(level) <= static_cast<int>(log_level())) {
    log_line(level, fmt::format(f, std::forward<Args>(args)...));
  }
}
#define PSLD_LOG_ERROR(...) ::psld::log_at(::psld::LogLevel::kError, __VA_ARGS__)
#define PSLD_LOG_WARN(...) ::psld::log_at(::psld::LogLevel::kWarn, __VA_ARGS__)
#define PSLD_LOG_INFO(...) ::psld::log_at(::psld::LogLevel::kInfo, __VA_ARGS__)
#define PSLD_LOG_DEBUG(...) ::psld::log_at(::psld::LogLevel::kDebug, __VA_ARGS__)

}  // namespace psld
