// lib/config/file.cc — the config file: TOML read with cpptoml, each value checked against its key.
// cpptoml 0.1.1 trips -Wnull-dereference inside its own parser at -O2 (a
// false positive from inlining); the pragma keeps our build warning-free
// without silencing the warning for our code.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference"
#include <cpptoml.h>
#pragma GCC diagnostic pop

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>

#include "lib/config/sources.h"

namespace psld::config_detail {
namespace {

// Line of each key and table header in a TOML text ("job.rank" -> 7), for
// messages: cpptoml keeps no positions. A simple scan that skips comments and
// multi-line strings; a key it cannot place gets no line number.
std::map<std::string, int> toml_lines(const std::string& text) {
  std::map<std::string, int> lines;
  std::istringstream in(text);
  std::string line;
  std::string table;
  std::string_view open_quote;  // inside a multi-line string: its delimiter
  int n = 0;
  auto normalize = [](std::string_view s) {
    std::string out;
    for (char c : s) {
      if (!is_space(c) && c != '"' && c != '\'') out += c;
    }
    return out;
  };
  auto count = [](std::string_view s, std::string_view what) {
    size_t k = 0;
    for (size_t at = s.find(what); at != std::string_view::npos; at = s.find(what, at + 3))
      ++k;
    return k;
  };
  while (std::getline(in, line)) {
    ++n;
    std::string_view s = trim(line);
    if (!open_quote.empty()) {
      if (count(s, open_quote) % 2 == 1) open_quote = {};
      continue;
    }
    if (s.empty() || s.front() == '#') continue;
    if (s.front() == '[') {
      size_t close = s.find(']');
      table = normalize(s.substr(1, close == std::string_view::npos ? s.size() - 1 : close - 1));
      lines.emplace(table, n);
      continue;
    }
    size_t eq = s.find('=');
    if (eq == std::string_view::npos) continue;
    std::string key = normalize(s.substr(0, eq));
    lines.emplace(table.empty() ? key : table + "." + key, n);
    std::string_view value = s.substr(eq + 1);
    for (std::string_view q : {std::string_view("\"\"\""), std::string_view("'''")}) {
      if (count(value, q) % 2 == 1) open_quote = q;
    }
  }
  return lines;
}

// A TOML value as it would appear in the file, for messages.
std::string render_toml(const cpptoml::base& b) {
  if (auto s = b.as<std::string>()) return toml_quote(s->get()) + " (a string)";
  if (auto i = b.as<int64_t>()) return std::to_string(i->get());
  if (auto d = b.as<double>()) return format_number(d->get());
  if (auto v = b.as<bool>()) return v->get() ? "true" : "false";
  if (b.is_array()) return "an array";
  if (b.is_table()) return "a table";
  return "a date or time";
}

// The TOML value as the field's type; nullopt when it is another type.
std::optional<Value> from_toml(const FieldRef& r, const cpptoml::base& b) {
  return std::visit(
      [&](auto* p) -> std::optional<Value> {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) {
          if (auto v = b.as<bool>()) return Value(v->get());
        } else if constexpr (kIsInteger<T>) {
          if (auto v = b.as<int64_t>()) return Value(v->get());
        } else if constexpr (std::is_same_v<T, double>) {
          if (auto v = b.as<double>()) return Value(v->get());  // integers too: lr = 1
        } else {
          if (auto v = b.as<std::string>()) return Value(v->get());
        }
        return std::nullopt;
      },
      r);
}

class FileReader {
 public:
  FileReader(std::string path, const std::string& text, Config& c, std::vector<std::string>& errors)
      : path_(std::move(path)), lines_(toml_lines(text)), config_(c), errors_(errors) {}

  void walk(const cpptoml::table& table, const std::string& prefix) {
    // cpptoml's tables are unordered; go in file order so messages are stable.
    std::vector<std::pair<std::string, std::shared_ptr<cpptoml::base>>> entries(table.begin(),
                                                                                table.end());
    auto order = [&](const auto& e) {
      return std::make_pair(line_of(join_key(prefix, e.first)), e.first);
    };
    std::sort(entries.begin(), entries.end(),
              [&](const auto& a, const auto& b) { return order(a) < order(b); });
    for (const auto& [name, value] : entries) {
      std::string key = join_key(prefix, name);
      if (const Field* f = find_field(key)) {
        set(*f, *value, key);
      } else if (value->is_table() && is_section(key)) {
        walk(*value->as_table(), key);
      } else if (value->is_table() && prefix.empty()) {
        std::vector<std::string> sections;
        for (const Field& fd : fields()) {
          std::string s(section_of(fd.key));
          if (!s.empty() && std::find(sections.begin(), sections.end(), s) == sections.end()) {
            sections.push_back(s);
          }
        }
        std::string guess = closest(key, sections, '.');
        errors_.push_back(
            fmt::format("{}: unknown table [{}]{}", where(key), key,
                        guess.empty() ? did_you_mean("") : did_you_mean("[" + guess + "]")));
      } else {
        errors_.push_back(fmt::format("{}: unknown key {}{}", where(key), key,
                                      did_you_mean(closest(key, all_keys(), '.'))));
      }
    }
  }

 private:
  static std::string join_key(const std::string& prefix, const std::string& name) {
    return prefix.empty() ? name : prefix + "." + name;
  }
  int line_of(const std::string& key) const {
    auto it = lines_.find(key);
    return it == lines_.end() ? 0 : it->second;
  }
  std::string where(const std::string& key) const {
    int line = line_of(key);
    return line > 0 ? fmt::format("{}:{}", path_, line) : path_;
  }

  void set(const Field& f, const cpptoml::base& b, const std::string& key) {
    FieldRef r = f.ref(config_);
    std::string source = "file " + where(key);
    std::optional<Value> v = from_toml(r, b);
    std::string detail;
    if (!v || !acceptable(f, r, *v, &detail)) {
      errors_.push_back(bad_value(f, r, render_toml(b), source, detail));
      return;
    }
    store(r, *v);
    config_.sources[key] = source;
  }

  std::string path_;
  std::map<std::string, int> lines_;
  Config& config_;
  std::vector<std::string>& errors_;
};

// cpptoml says "Unterminated string literal at line 3"; we say
// "PATH:3: Unterminated string literal".
std::string parse_error(const std::string& path, std::string what) {
  constexpr std::string_view kAt = " at line ";
  std::string where = path;
  size_t at = what.rfind(kAt);
  if (at != std::string::npos) {
    where += ":" + what.substr(at + kAt.size());
    what.resize(at);
  }
  if (what.find("Failed to parse value") != std::string::npos) {
    what += " (strings need quotes: role = \"worker\"; booleans are true or false)";
  }
  return fmt::format("config file {}: TOML syntax error: {}", where, what);
}

}  // namespace

Status read_file(const std::string& path, const std::string& origin, Config& c,
                 std::vector<std::string>& errors) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return NotFound(fmt::format("config file {} (from {}) cannot be opened: {}", path, origin,
                                std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();
  std::istringstream parse_in(text.str());
  std::shared_ptr<cpptoml::table> root;
  try {
    cpptoml::parser parser(parse_in);
    root = parser.parse();
  } catch (const cpptoml::parse_exception& e) {
    return InvalidArgument(parse_error(path, e.what()));
  } catch (const std::exception& e) {
    return InvalidArgument(fmt::format("config file {}: {}", path, e.what()));
  }
  FileReader(path, text.str(), c, errors).walk(*root, "");
  return Status::Ok();
}

}  // namespace psld::config_detail
