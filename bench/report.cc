#include "bench/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "bench/stats.h"

namespace psld::bench {

using nlohmann::json;

namespace {

double ns_per(const std::string& unit) {
  if (unit == "s") return 1e9;
  if (unit == "ms") return 1e6;
  if (unit == "us") return 1e3;
  return 1;  // "ns", or absent as in Google Benchmark's own default
}

// Google Benchmark's row keys that are not numbers of the measurement.
bool descriptive(const std::string& key) {
  static const std::set<std::string> kKeys = {"name",
                                              "run_name",
                                              "run_type",
                                              "repetitions",
                                              "repetition_index",
                                              "threads",
                                              "time_unit",
                                              "aggregate_name",
                                              "label",
                                              "yardstick",
                                              "error_occurred",
                                              "error_message",
                                              "family_index",
                                              "per_family_instance_index",
                                              "aggregate_unit"};
  return kKeys.count(key) != 0;
}

// Typed reads that never throw: a value of the wrong type is the fallback.
std::string string_at(const json& j, const char* key, std::string fallback = {}) {
  auto it = j.find(key);
  if (it != j.end() && it->is_string()) return it->get<std::string>();
  return fallback;
}
int int_at(const json& j, const char* key, int fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_number_integer() ? it->get<int>() : fallback;
}

}  // namespace

Result<Report> parse_report(const std::string& text, const std::string& what) {
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) {
    return InvalidArgument(
        fmt::format("{} is not a JSON object (a Google Benchmark report)", what));
  }
  auto benchmarks = doc.find("benchmarks");
  if (benchmarks == doc.end() || !benchmarks->is_array()) {
    return InvalidArgument(fmt::format("{} has no \"benchmarks\" array", what));
  }
  Report report;
  if (auto c = doc.find("context"); c != doc.end() && c->is_object()) report.context = *c;
  std::map<std::string, int> seen;
  size_t index = 0;
  for (const json& b : *benchmarks) {
    ++index;
    if (!b.is_object())
      return InvalidArgument(fmt::format("{}: row {} is not an object", what, index));
    auto name = b.find("name");
    if (name == b.end() || !name->is_string() || name->get<std::string>().empty()) {
      return InvalidArgument(fmt::format("{}: row {} has no name", what, index));
    }
    if (string_at(b, "run_type") == "aggregate") continue;
    if (auto e = b.find("error_occurred"); e != b.end() && e->is_boolean() && e->get<bool>()) {
      return InvalidArgument(fmt::format("{}: row '{}' failed: {}", what, name->get<std::string>(),
                                         string_at(b, "error_message", "(no message)")));
    }
    Row row;
    row.name = name->get<std::string>();
    const auto real = b.find("real_time");
    if (real == b.end() || !real->is_number()) {
      return InvalidArgument(fmt::format("{}: row '{}' has no real_time", what, row.name));
    }
    const double unit = ns_per(string_at(b, "time_unit", "ns"));
    for (auto it = b.begin(); it != b.end(); ++it) {
      if (descriptive(it.key()) || !it->is_number()) continue;
      double v = it->get<double>();
      if (it.key() == "real_time" || it.key() == "cpu_time") v *= unit;
      row.values[it.key()] = v;
    }
    row.label = string_at(b, "label");
    row.yardstick = string_at(b, "yardstick");
    row.repetitions = int_at(b, "repetitions", 1);
    // Google Benchmark numbers repetitions; a hand-made file may not.
    row.repetition = int_at(b, "repetition_index", seen[row.name]);
    ++seen[row.name];
    report.rows.push_back(std::move(row));
  }
  if (report.rows.empty()) {
    return InvalidArgument(
        fmt::format("{} holds no measured rows (only aggregates or none)", what));
  }
  return report;
}

Result<Report> read_report(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound(fmt::format("cannot read {}: {}", path, std::strerror(errno)));
  std::stringstream text;
  text << in.rdbuf();
  return parse_report(text.str(), path);
}

const json* find_path(const json& context, std::initializer_list<const char*> path) {
  const json* at = &context;
  for (const char* key : path) {
    if (!at->is_object()) return nullptr;
    auto it = at->find(key);
    if (it == at->end()) return nullptr;
    at = &*it;
  }
  return at;
}

std::string string_in(const json& context, std::initializer_list<const char*> path) {
  const json* v = find_path(context, path);
  if (v == nullptr) return {};
  if (v->is_string()) return v->get<std::string>();
  if (v->is_number()) return v->dump();
  return {};
}

std::vector<double> samples_of(const Report& report, const std::string& name,
                               const std::string& metric) {
  std::vector<std::pair<int, double>> v;
  for (const Row& r : report.rows) {
    if (r.name != name) continue;
    auto it = r.values.find(metric);
    if (it != r.values.end()) v.emplace_back(r.repetition, it->second);
  }
  std::stable_sort(v.begin(), v.end(), [](auto& a, auto& b) { return a.first < b.first; });
  std::vector<double> out;
  out.reserve(v.size());
  for (auto& [rep, x] : v)
    out.push_back(x);
  return out;
}

namespace {

json row_json(const Row& r, const std::string& name, const std::map<std::string, double>& values) {
  json j = json::object();
  j["name"] = name;
  j["run_name"] = r.name;
  j["repetitions"] = r.repetitions;
  j["threads"] = 1;
  for (const auto& [k, v] : values)
    j[k] = v;
  j["time_unit"] = "ns";
  if (!r.label.empty()) j["label"] = r.label;
  if (!r.yardstick.empty()) j["yardstick"] = r.yardstick;
  return j;
}

}  // namespace

std::string format_report(const Report& report) {
  json doc = json::object();
  doc["context"] = report.context;
  json rows = json::array();
  std::vector<std::string> order;
  std::map<std::string, const Row*> first;
  for (const Row& r : report.rows) {
    json j = row_json(r, r.name, r.values);
    j["run_type"] = "iteration";
    j["repetition_index"] = r.repetition;
    rows.push_back(std::move(j));
    if (first.emplace(r.name, &r).second) order.push_back(r.name);
  }
  for (const std::string& name : order) {
    const Row& r = *first[name];
    std::map<std::string, double> medians;
    for (const auto& [metric, unused] : r.values) {
      const std::vector<double> s = samples_of(report, name, metric);
      medians[metric] = median(s);
    }
    json j = row_json(r, name + "_median", medians);
    j["run_type"] = "aggregate";
    j["aggregate_name"] = "median";
    rows.push_back(std::move(j));
  }
  doc["benchmarks"] = std::move(rows);
  return doc.dump(2) + "\n";
}

Status write_report(const std::string& path, const Report& report) {
  // Written beside and renamed, so that a reader never sees half a file.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return Unavailable(fmt::format("cannot write {}: {}", tmp, std::strerror(errno)));
    out << format_report(report);
    out.flush();
    if (!out) return Unavailable(fmt::format("cannot write {}: {}", tmp, std::strerror(errno)));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return Unavailable(fmt::format("cannot rename {} to {}: {}", tmp, path, std::strerror(errno)));
  }
  return Status::Ok();
}

}  // namespace psld::bench
