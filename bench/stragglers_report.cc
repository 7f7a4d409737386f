#include "bench/stragglers_report.h"

#include <fmt/format.h>

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>

namespace psld::bench {

uint64_t chunk_bytes_for(Policy policy, double scale) {
  double bytes = static_cast<double>(kBytePsPartitionBytes) * scale;
  if (policy == Policy::kMxnet) bytes /= 4;
  return std::max<uint64_t>(4, static_cast<uint64_t>(bytes / 4) * 4);
}

namespace {

// Servers whose shares a table row lists one by one; beyond, their spread.
constexpr size_t kListedShares = 16;

struct TableRow {
  Policy policy;
  double rounds_per_s = 0;
  double mean_ms = 0;
  std::string settle;
  std::string migration;
  uint64_t switches = 0;
  std::string shares;
};

TableRow summarise(const Scenario& sc, const RunResult& r) {
  TableRow row;
  row.policy = r.policy;
  row.rounds_per_s = static_cast<double>(r.round_ms.size()) / r.seconds;
  row.mean_ms = std::accumulate(r.round_ms.begin(), r.round_ms.end(), 0.0) /
                static_cast<double>(std::max<size_t>(1, r.round_ms.size()));
  const auto starts = phase_starts(sc);
  for (size_t p = 0; p < starts.size(); ++p) {
    const size_t from = starts[p] - 1;
    const size_t to = p + 1 < starts.size() ? starts[p + 1] - 1 : r.round_ms.size();
    const auto settle = rounds_to_settle(r.round_ms, from, to);
    if (!row.settle.empty()) row.settle += ", ";
    row.settle += settle ? std::to_string(*settle) : "?";
  }
  std::vector<double> during;
  for (size_t i = 0; i < r.round_ms.size(); ++i) {
    if (r.migrating[i]) during.push_back(r.round_ms[i]);
  }
  row.migration = during.empty() ? "-"
                                 : fmt::format("{:.1f} ({} rounds)",
                                               std::accumulate(during.begin(), during.end(), 0.0) /
                                                   static_cast<double>(during.size()),
                                               during.size());
  row.switches = r.switches;
  if (r.final_shares.size() > kListedShares) {
    // Too many servers to list: the spread, in % of the model.
    std::vector<double> s = r.final_shares;
    std::sort(s.begin(), s.end());
    const size_t empty = static_cast<size_t>(std::count(s.begin(), s.end(), 0.0));
    row.shares =
        fmt::format("{} servers: max {:.2f}, median {:.2f}, min {:.2f}; {} hold nothing", s.size(),
                    100 * s.back(), 100 * s[s.size() / 2], 100 * s.front(), empty);
    return row;
  }
  for (size_t s = 0; s < r.final_shares.size(); ++s) {
    if (!row.shares.empty()) row.shares += " ";
    row.shares += fmt::format("{:.0f}", 100 * r.final_shares[s]);
  }
  return row;
}

bool have_program(const char* name) {
  const std::string cmd = fmt::format("command -v {} >/dev/null 2>&1", name);
  return std::system(cmd.c_str()) == 0;
}

}  // namespace

std::vector<uint64_t> phase_starts(const Scenario& sc) {
  std::vector<uint64_t> starts{1};
  for (const CapacityEvent& e : sc.events) {
    if (e.round > 1 && e.round <= sc.rounds && e.round != starts.back()) starts.push_back(e.round);
  }
  return starts;
}

std::string table(const Scenario& sc, const std::vector<RunResult>& results) {
  std::vector<TableRow> rows;
  rows.reserve(results.size());
  for (const RunResult& r : results)
    rows.push_back(summarise(sc, r));
  std::string out =
      "| policy | rounds/s | mean round ms | rounds to settle | round ms while migrating | "
      "epoch switches | model % per server at the end |";
  std::vector<const TableRow*> baselines;
  for (Policy b : kBaselines) {
    for (const TableRow& row : rows) {
      if (row.policy == b) baselines.push_back(&row);
    }
  }
  for (const TableRow* b : baselines)
    out += fmt::format(" speedup vs {} |", policy_name(b->policy));
  out += "\n|---|---:|---:|---:|---:|---:|---|";
  for (size_t i = 0; i < baselines.size(); ++i)
    out += "---:|";
  out += "\n";
  for (const TableRow& row : rows) {
    out += fmt::format("| {} | {:.2f} | {:.1f} | {} | {} | {} | {} |", policy_name(row.policy),
                       row.rounds_per_s, row.mean_ms, row.settle, row.migration, row.switches,
                       row.shares);
    for (const TableRow* b : baselines)
      out += fmt::format(" {:.2f}x |", row.rounds_per_s / b->rounds_per_s);
    out += "\n";
  }
  return out;
}

Status write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::trunc);
  f << text;
  f.close();
  if (!f) return Unavailable(fmt::format("cannot write {}", path));
  return Status::Ok();
}

Status write_plot(const std::string& out_dir, const Scenario& sc,
                  const std::vector<RunResult>& results, std::string* note) {
  const std::string tsv = out_dir + "/" + sc.id + ".tsv";
  std::string text = "round";
  for (const RunResult& r : results)
    text += fmt::format("\t{}", policy_name(r.policy));
  text += "\n";
  for (size_t i = 0; i < sc.rounds; ++i) {
    text += std::to_string(i + 1);
    for (const RunResult& r : results)
      text += i < r.round_ms.size() ? fmt::format("\t{:.2f}", r.round_ms[i]) : "\t";
    text += "\n";
  }
  PSLD_RETURN_IF_ERROR(write_file(tsv, text));
  if (!have_program("gnuplot")) {
    *note = "gnuplot not found, PNG plots skipped (apt-get install gnuplot-nox)";
    return Status::Ok();
  }
  std::string script = fmt::format(
      "set terminal png size 1000,520 font ',10'\n"
      "set output '{}/{}.png'\n"
      "set title \"{}: {}\" noenhanced\n"
      "set xlabel 'round'\nset ylabel 'round time (ms)'\n"
      "set key outside right top\nset grid\nset yrange [0:*]\n"
      "set datafile separator '\\t'\nset datafile missing ''\n",
      out_dir, sc.id, sc.id, sc.title);
  for (uint64_t start : phase_starts(sc)) {
    if (start > 1)
      script += fmt::format("set arrow from {0},graph 0 to {0},graph 1 nohead dt 2\n", start);
  }
  script += "plot ";
  for (size_t i = 0; i < results.size(); ++i) {
    script += fmt::format("{}'{}' using 1:{} with lines lw 1.5 title '{}'", i ? ", " : "", tsv,
                          i + 2, policy_name(results[i].policy));
  }
  script += "\n";
  const std::string script_path = out_dir + "/." + sc.id + ".gnuplot";
  PSLD_RETURN_IF_ERROR(write_file(script_path, script));
  const std::string cmd = fmt::format("gnuplot '{}'", script_path);
  const int rc = std::system(cmd.c_str());
  std::remove(script_path.c_str());
  if (rc != 0) return Internal(fmt::format("gnuplot failed on {}", script_path));
  return Status::Ok();
}

void add_rows(const Scenario& sc, const std::vector<RunResult>& results, bench::Report& report) {
  const std::string prefix = "BM_stragglers/" + sc.id + "/";
  const RunResult* psld = nullptr;
  for (const RunResult& r : results) {
    if (r.policy == Policy::kPsld) psld = &r;
  }
  auto add = [&](const std::string& name, const std::vector<double>& round_ms,
                 const std::string& yardstick, double yard_median_ms) {
    for (size_t i = 0; i < round_ms.size(); ++i) {
      bench::Row row;
      row.name = name;
      row.repetition = static_cast<int>(i);
      row.repetitions = static_cast<int>(round_ms.size());
      row.values["real_time"] = round_ms[i] * 1e6;
      row.values["cpu_time"] = round_ms[i] * 1e6;
      row.values["iterations"] = 1;
      if (!yardstick.empty() && round_ms[i] > 0) {
        row.yardstick = yardstick;
        row.values["ratio"] = yard_median_ms / round_ms[i];
      }
      report.rows.push_back(std::move(row));
    }
  };
  for (const RunResult& r : results)
    add(prefix + std::string(policy_name(r.policy)), r.round_ms, "", 0);
  if (psld == nullptr) return;
  for (const RunResult& r : results) {
    if (r.policy != Policy::kMxnet && r.policy != Policy::kOracle) continue;
    const std::string name(policy_name(r.policy));
    add(prefix + "psld_vs_" + name, psld->round_ms, prefix + name, median(r.round_ms));
  }
}

namespace {

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = std::min(s.find(',', start), s.size());
    if (comma > start) out.push_back(s.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

}  // namespace

Result<std::vector<Scenario>> parse_scenarios(const std::string& list,
                                              std::optional<uint64_t> rounds,
                                              std::optional<double> scale) {
  std::vector<Scenario> out;
  const auto all = default_scenarios();
  for (const std::string& name : split_list(list)) {
    bool found = false;
    for (const Scenario& s : all) {
      if (name == "all" || name == s.id) {
        out.push_back(rounds ? with_rounds(s, *rounds) : s);
        if (scale) out.back().scale = *scale;
        found = true;
      }
    }
    if (!found) {
      return InvalidArgument(
          fmt::format("--scenario '{}': accepted values are S1, S2, S3, S4, S5, all", name));
    }
  }
  if (out.empty()) return InvalidArgument("nothing to run: give at least one scenario");
  return out;
}

Result<std::vector<Policy>> parse_policies(const std::string& list) {
  std::vector<Policy> out;
  for (const std::string& name : split_list(list)) {
    if (name == "all") {
      out.insert(out.end(), std::begin(kAllPolicies), std::end(kAllPolicies));
      continue;
    }
    auto p = parse_policy(name);
    if (!p) {
      return InvalidArgument(fmt::format(
          "--policies '{}': accepted values are mxnet, byteps, round-robin, psld, oracle, all",
          name));
    }
    out.push_back(*p);
  }
  if (out.empty()) return InvalidArgument("nothing to run: give at least one policy");
  return out;
}

Status ScenarioReport::open() const {
  if (!out_dir_.empty() && ::mkdir(out_dir_.c_str(), 0755) != 0 && errno != EEXIST) {
    return Unavailable(fmt::format("cannot create {}", out_dir_));
  }
  return Status::Ok();
}

Status ScenarioReport::add(const Scenario& sc, const std::string& description,
                           const std::vector<RunResult>& results, const std::string& extra) {
  add_rows(sc, results, report_);
  const std::string section =
      fmt::format("## {}: {}\n\n{}\n\n{}{}", sc.id, sc.title, description, table(sc, results),
                  extra.empty() ? "" : "\n" + extra + "\n");
  std::printf("%s\n", section.c_str());
  std::fflush(stdout);
  markdown_ += section;
  if (!out_dir_.empty()) {
    std::string note;
    PSLD_RETURN_IF_ERROR(write_plot(out_dir_, sc, results, &note));
    if (!note.empty()) {
      notes_ = note;
    } else {
      markdown_ += fmt::format("\n![{} round time per policy]({}.png)\n", sc.id, sc.id);
    }
  }
  markdown_ += "\n";
  return Status::Ok();
}

Status ScenarioReport::finish(const std::map<std::string, std::string>& context) {
  if (!out_dir_.empty()) {
    PSLD_RETURN_IF_ERROR(write_file(out_dir_ + "/results.md", markdown_));
    if (!notes_.empty()) std::fprintf(stderr, "%s: %s\n", program_.c_str(), notes_.c_str());
  }
  if (json_.empty()) return Status::Ok();
  report_.context["executable"] = program_;
  for (const auto& [key, value] : context)
    report_.context[key] = value;
  return write_report(json_, report_);
}

}  // namespace psld::bench
