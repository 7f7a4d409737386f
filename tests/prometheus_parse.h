// A strict reader of the Prometheus text format (0.0.4) for tests: every
// line must be a HELP or TYPE comment, a blank, or a sample whose family was
// announced by a TYPE line before it; label values must be properly quoted
// and escaped; values must be numbers, NaN or +-Inf. What the format allows
// and psld never writes (timestamps, untyped samples, families split in two)
// is refused too, so the test catches psld writing something else.
#pragma once

#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace psld::testing {

struct PromSample {
  std::string name;  // as written, with _bucket / _sum / _count
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct PromScrape {
  std::map<std::string, std::string> types;  // family -> counter, gauge, histogram
  std::map<std::string, std::string> help;
  std::vector<PromSample> samples;
  std::string error;  // the first line that does not parse, and why

  // The samples of `name` whose labels include all of `want`.
  std::vector<PromSample> find(const std::string& name,
                               const std::map<std::string, std::string>& want = {}) const {
    std::vector<PromSample> out;
    for (const auto& s : samples) {
      if (s.name != name) continue;
      bool ok = true;
      for (const auto& [k, v] : want) {
        auto it = s.labels.find(k);
        ok = ok && it != s.labels.end() && it->second == v;
      }
      if (ok) out.push_back(s);
    }
    return out;
  }
  // The value of the one sample that matches, or nullopt (none, or several).
  std::optional<double> value(const std::string& name,
                              const std::map<std::string, std::string>& want = {}) const {
    auto found = find(name, want);
    if (found.size() != 1) return std::nullopt;
    return found[0].value;
  }
};

inline bool prom_name_char(char c, bool first) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
         (!first && c >= '0' && c <= '9');
}

inline PromScrape parse_prometheus(const std::string& text) {
  PromScrape out;
  std::istringstream in(text);
  std::string line;
  std::string family;  // the family whose samples may follow
  std::set<std::string> done;
  size_t n = 0;
  auto fail = [&](const std::string& why) {
    if (out.error.empty()) out.error = "line " + std::to_string(n) + " '" + line + "': " + why;
  };
  if (!text.empty() && text.back() != '\n') {
    out.error = "the text does not end with a newline";
    return out;
  }
  while (std::getline(in, line) && out.error.empty()) {
    ++n;
    if (line.empty()) continue;
    if (line[0] == '#') {
      std::istringstream w(line);
      std::string hash, kind, name;
      w >> hash >> kind >> name;
      if (hash != "#" || (kind != "HELP" && kind != "TYPE") || name.empty()) {
        fail("a comment that is neither HELP nor TYPE");
        continue;
      }
      if (kind == "HELP") {
        if (out.help.count(name)) fail("a second HELP");
        const size_t at = line.find(name) + name.size();
        out.help[name] = at < line.size() ? line.substr(at + 1) : "";
        continue;
      }
      std::string type;
      w >> type;
      if (type != "counter" && type != "gauge" && type != "histogram") fail("type " + type);
      if (out.types.count(name)) fail("a second TYPE for " + name);
      if (!out.help.count(name)) fail("TYPE without HELP before it");
      if (!family.empty()) done.insert(family);
      family = name;
      out.types[name] = type;
      continue;
    }
    PromSample s;
    size_t i = 0;
    while (i < line.size() && prom_name_char(line[i], i == 0))
      ++i;
    s.name = line.substr(0, i);
    if (s.name.empty()) {
      fail("no metric name");
      continue;
    }
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        size_t k = i;
        while (k < line.size() && line[k] != '=' && prom_name_char(line[k], k == i) &&
               line[k] != ':')
          ++k;
        const std::string key = line.substr(i, k - i);
        if (key.empty() || k + 1 >= line.size() || line[k] != '=' || line[k + 1] != '"') {
          fail("a label that is not name=\"value\"");
          break;
        }
        std::string value;
        size_t j = k + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\') {
            ++j;
            if (j >= line.size()) break;
            if (line[j] == 'n') {
              value += '\n';
            } else if (line[j] == '\\' || line[j] == '"') {
              value += line[j];
            } else {
              fail("an escape other than \\\\, \\\" or \\n");
            }
          } else {
            value += line[j];
          }
        }
        if (j >= line.size()) {
          fail("an unterminated label value");
          break;
        }
        if (s.labels.count(key)) fail("label " + key + " twice");
        s.labels[key] = value;
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      if (i >= line.size() || line[i] != '}') {
        fail("no closing brace");
        continue;
      }
      ++i;
    }
    if (i >= line.size() || line[i] != ' ') {
      fail("no space before the value");
      continue;
    }
    const std::string v = line.substr(i + 1);
    if (v == "NaN") {
      s.value = std::nan("");
    } else if (v == "+Inf") {
      s.value = HUGE_VAL;
    } else if (v == "-Inf") {
      s.value = -HUGE_VAL;
    } else {
      char* end = nullptr;
      s.value = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || v.find(' ') != std::string::npos) {
        fail("a value that is not a number (or has a timestamp)");
        continue;
      }
    }
    // The sample must belong to the family announced last.
    std::string base = s.name;
    const auto type = out.types.find(family);
    if (type != out.types.end() && type->second == "histogram") {
      for (const char* suffix : {"_bucket", "_sum", "_count"}) {
        const std::string suf = suffix;
        if (base.size() > suf.size() &&
            base.compare(base.size() - suf.size(), suf.size(), suf) == 0 &&
            base.substr(0, base.size() - suf.size()) == family) {
          base = family;
        }
      }
      if (s.name == family + "_bucket" && !s.labels.count("le")) fail("a bucket without le");
    }
    if (base != family) fail("a sample outside its family (" + family + ")");
    out.samples.push_back(std::move(s));
  }
  return out;
}

}  // namespace psld::testing
