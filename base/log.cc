#include "base/log.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "base/mutex.h"

namespace psld {

namespace {

constexpr const char* kLevelNames[] = {"error", "warn", "info", "debug"};

// The levels. `most` is the highest level anything logs at, so that a line
// below every level costs one atomic load; the rest is read under mu.
struct Levels {
  Mutex mu;
  LogSpec spec GUARDED_BY(mu);
  std::atomic<int> most{static_cast<int>(LogLevel::kWarn)};

  void set(LogSpec s) {
    int m = static_cast<int>(s.level);
    for (const auto& [name, level] : s.components)
      m = std::max(m, static_cast<int>(level));
    MutexLock lock(mu);
    spec = std::move(s);
    most.store(m, std::memory_order_relaxed);
  }
};

Levels& levels() {
  static Levels* l = [] {
    auto* out = new Levels;  // never destroyed: threads may log during exit
    LogSpec spec;
    const char* v = std::getenv("PSLD_LOG");
    if (v != nullptr && parse_log_spec(v, &spec).empty()) out->set(std::move(spec));
    return out;
  }();
  return *l;
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

// host:pid (`process`, fixed) and, once set, " role rank" (`text`).
struct Identity {
  const std::string process = fmt::format("{}:{}", host_name(), static_cast<int64_t>(::getpid()));
  Mutex mu;
  std::string text GUARDED_BY(mu) = process;
};

Identity& identity() {
  static Identity* id = new Identity;  // never destroyed: threads may log during exit
  return *id;
}

// stderr, or PSLD_LOG_FILE's file (opened once, appended to).
FILE* sink() {
  static FILE* out = [] {
    const char* pattern = std::getenv("PSLD_LOG_FILE");
    if (pattern == nullptr || *pattern == '\0') return stderr;
    std::string error;
    FILE* f = open_log_file(pattern, &error);
    if (f == nullptr) {
      std::fputs(
          fmt::format("[psld warn] PSLD_LOG_FILE={}: {}; logging to stderr\n", pattern, error)
              .c_str(),
          stderr);
      return stderr;
    }
    return f;
  }();
  return out;
}

}  // namespace

bool parse_log_level(std::string_view name, LogLevel* level) {
  for (int i = 0; i < 4; ++i) {
    if (name == kLevelNames[i]) {
      *level = static_cast<LogLevel>(i);
      return true;
    }
  }
  return false;
}

std::string parse_log_spec(std::string_view text, LogSpec* spec) {
  LogSpec out;
  bool have_default = false;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string_view item = text.substr(start, comma - start);
    start = comma + 1;
    if (item.empty()) return "an empty item (two commas, or a comma at an end)";
    const size_t eq = item.find('=');
    LogLevel level;
    if (eq == std::string_view::npos) {
      if (have_default) return fmt::format("two default levels ('{}')", item);
      if (!parse_log_level(item, &level)) {
        return fmt::format("'{}' is not a level (error, warn, info, debug)", item);
      }
      out.level = level;
      have_default = true;
      continue;
    }
    const std::string_view name = item.substr(0, eq);
    if (name.empty()) return fmt::format("'{}' names no component", item);
    for (char c : name) {
      if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) {
        return fmt::format(
            "'{}' is not a component name (a source directory: ucx, "
            "coordinator, server, ...)",
            name);
      }
    }
    if (!parse_log_level(item.substr(eq + 1), &level)) {
      return fmt::format("'{}' is not a level (error, warn, info, debug)", item.substr(eq + 1));
    }
    for (const auto& [seen, l] : out.components) {
      if (seen == name) return fmt::format("component '{}' given twice", name);
    }
    out.components.emplace_back(std::string(name), level);
  }
  *spec = std::move(out);
  return "";
}

LogLevel log_level() {
  Levels& l = levels();
  MutexLock lock(l.mu);
  return l.spec.level;
}

void set_log_level(LogLevel level) {
  Levels& l = levels();
  LogSpec spec;
  {
    MutexLock lock(l.mu);
    spec = l.spec;
  }
  spec.level = level;
  l.set(std::move(spec));
}

void set_log_spec(const LogSpec& spec) {
  levels().set(spec);
}

bool log_enabled(LogLevel level, std::string_view component) {
  Levels& l = levels();
  if (static_cast<int>(level) > l.most.load(std::memory_order_relaxed)) return false;
  MutexLock lock(l.mu);
  LogLevel limit = l.spec.level;
  for (const auto& [name, at] : l.spec.components) {
    if (name == component) limit = at;
  }
  return static_cast<int>(level) <= static_cast<int>(limit);
}

void set_log_identity(std::string_view role, int64_t rank) {
  Identity& id = identity();
  std::string text = fmt::format("{} {}", id.process, role);
  if (rank >= 0) text += fmt::format(" {}", rank);
  MutexLock lock(id.mu);
  id.text = std::move(text);
}

std::string expand_log_path(std::string_view pattern, std::string_view host, int64_t pid,
                            std::string* error) {
  std::string out;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '%') {
      out += pattern[i];
      continue;
    }
    const char next = i + 1 < pattern.size() ? pattern[i + 1] : '\0';
    if (next == 'h') {
      out += host;
    } else if (next == 'p') {
      out += std::to_string(pid);
    } else if (next == '%') {
      out += '%';
    } else {
      *error = fmt::format("'%{}' is not %h (host), %p (pid) or %%",
                           next == '\0' ? std::string() : std::string(1, next));
      return "";
    }
    ++i;
  }
  return out;
}

FILE* open_log_file(std::string_view pattern, std::string* error) {
  const std::string path =
      expand_log_path(pattern, host_name(), static_cast<int64_t>(::getpid()), error);
  if (path.empty()) {
    if (error->empty()) *error = "an empty path";
    return nullptr;
  }
  FILE* f = std::fopen(path.c_str(), "ae");
  if (f == nullptr) {
    *error = fmt::format("cannot open {}: {}", path, std::strerror(errno));
    return nullptr;
  }
  std::setvbuf(f, nullptr, _IOLBF, 0);
  return f;
}

std::string format_log_line(LogLevel level, std::string_view message, int64_t unix_ms) {
  const std::time_t seconds = static_cast<std::time_t>(unix_ms / 1000);
  std::tm utc{};
  ::gmtime_r(&seconds, &utc);
  std::string who;
  {
    Identity& id = identity();
    MutexLock lock(id.mu);
    who = id.text;
  }
  return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z {} [psld {}] {}",
                     utc.tm_year + 1900, utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min,
                     utc.tm_sec, unix_ms % 1000, who, kLevelNames[static_cast<int>(level)],
                     message);
}

void log_line(LogLevel level, std::string_view message) {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  std::string line = format_log_line(
      level, message, std::chrono::duration_cast<std::chrono::milliseconds>(now).count());
  line += '\n';
  // One write per line so lines from several threads do not interleave.
  std::fputs(line.c_str(), sink());
}

}  // namespace psld
