#include "lib/stats/trace.h"

#include <fmt/format.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/log.h"

namespace psld {

namespace {

double micros(TraceRecorder::Clock::time_point t) {
  return static_cast<double>(
             std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count()) /
         1000.0;
}

long thread_id() {
  thread_local const long tid = syscall(SYS_gettid);
  return tid;
}

std::string args_of(const std::string& args) {
  return args.empty() ? "" : ",\"args\":{" + args + "}";
}

}  // namespace

std::string json_string(std::string_view s) {
  // Bytes that are not UTF-8 (a tensor name is any bytes) become U+FFFD.
  return nlohmann::json(std::string(s))
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::unique_ptr<TraceRecorder> TraceRecorder::make(const Options& options, std::string_view role,
                                                   int64_t rank) {
  if (options.dir.empty()) return nullptr;
  return std::unique_ptr<TraceRecorder>(new TraceRecorder(options, role, rank));
}

TraceRecorder::~TraceRecorder() {
  if (Status s = write(); !s.ok()) PSLD_LOG_WARN("trace: {}", s.to_string());
}

bool TraceRecorder::wants(uint64_t round) {
  if (done_.load(std::memory_order_relaxed)) return false;
  if (round > options_.last_round) {
    if (Status s = write(); !s.ok()) PSLD_LOG_WARN("trace: {}", s.to_string());
    return false;
  }
  return round >= options_.first_round;
}

void TraceRecorder::add(std::string event) {
  if (done_.load(std::memory_order_relaxed)) return;
  MutexLock lock(mu_);
  if (events_.size() >= options_.max_events) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  events_.push_back(std::move(event));
}

void TraceRecorder::complete(std::string_view name, std::string_view cat, Clock::time_point start,
                             Clock::time_point end, const std::string& args) {
  add(fmt::format(R"({{"name":{},"cat":{},"ph":"X","ts":{:.3f},"dur":{:.3f},"pid":{},"tid":{}{}}})",
                  json_string(name), json_string(cat), micros(start),
                  std::max(0.0, micros(end) - micros(start)), getpid(), thread_id(),
                  args_of(args)));
}

void TraceRecorder::async_begin(std::string_view name, std::string_view cat, uint64_t id,
                                Clock::time_point at, const std::string& args) {
  add(fmt::format(R"({{"name":{},"cat":{},"ph":"b","id":"{:#x}","ts":{:.3f},"pid":{},"tid":{}{}}})",
                  json_string(name), json_string(cat), id, micros(at), getpid(), thread_id(),
                  args_of(args)));
}

void TraceRecorder::async_end(std::string_view name, std::string_view cat, uint64_t id,
                              Clock::time_point at) {
  add(fmt::format(R"({{"name":{},"cat":{},"ph":"e","id":"{:#x}","ts":{:.3f},"pid":{},"tid":{}}})",
                  json_string(name), json_string(cat), id, micros(at), getpid(), thread_id()));
}

void TraceRecorder::instant(std::string_view name, std::string_view cat, Clock::time_point at,
                            const std::string& args) {
  add(fmt::format(R"({{"name":{},"cat":{},"ph":"i","s":"p","ts":{:.3f},"pid":{},"tid":{}{}}})",
                  json_string(name), json_string(cat), micros(at), getpid(), thread_id(),
                  args_of(args)));
}

std::string TraceRecorder::path() const {
  MutexLock lock(mu_);
  return path_;
}

Status TraceRecorder::write() {
  if (done_.exchange(true)) return Status::Ok();
  MutexLock lock(mu_);
  std::error_code ec;
  std::filesystem::create_directories(options_.dir, ec);
  if (ec)
    return Unavailable(fmt::format("cannot make trace.dir {}: {}", options_.dir, ec.message()));
  const std::string who = rank_ >= 0 ? fmt::format("{}{}", role_, rank_) : role_;
  const std::string path = fmt::format("{}/psld-{}-{}.json", options_.dir, who, getpid());
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) {
    return Unavailable(fmt::format("cannot write {}: {}", tmp, std::strerror(errno)));
  }
  const std::string name = rank_ >= 0 ? fmt::format("{} {}", role_, rank_) : role_;
  std::fprintf(f,
               "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"rounds\":\"%llu:%llu\","
               "\"dropped_events\":%llu},\n\"traceEvents\":[\n"
               "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":%s}}",
               static_cast<unsigned long long>(options_.first_round),
               static_cast<unsigned long long>(options_.last_round),
               static_cast<unsigned long long>(dropped_.load()), getpid(),
               json_string(name).c_str());
  for (const auto& e : events_) {
    std::fputs(",\n", f);
    std::fputs(e.c_str(), f);
  }
  std::fputs("\n]}\n", f);
  const bool ok = std::fflush(f) == 0 && std::ferror(f) == 0;
  std::fclose(f);
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return Unavailable(fmt::format("cannot write {}: {}", path, std::strerror(errno)));
  }
  PSLD_LOG_INFO("trace: {} events of rounds {}..{} in {}{}", events_.size(), options_.first_round,
                options_.last_round, path,
                dropped_.load() > 0 ? fmt::format(" ({} dropped)", dropped_.load()) : "");
  path_ = path;
  events_.clear();
  events_.shrink_to_fit();
  return Status::Ok();
}

}  // namespace psld
