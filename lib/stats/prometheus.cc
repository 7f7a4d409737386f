#include "lib/stats/prometheus.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace psld::prometheus {
namespace {

bool name_char(char c, bool first, bool colon) {
  const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  if (alpha || (colon && c == ':')) return true;
  return !first && c >= '0' && c <= '9';
}

bool valid_name(std::string_view name, bool colon) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (!name_char(name[i], i == 0, colon)) return false;
  }
  return true;
}

std::string sanitized(std::string_view name, bool colon) {
  std::string out(name.empty() ? "_" : name);
  for (size_t i = 0; i < out.size(); ++i) {
    if (!name_char(out[i], i == 0, colon)) out[i] = '_';
  }
  return out;
}

std::string_view type_name(Type t) {
  switch (t) {
    case Type::kCounter:
      return "counter";
    case Type::kGauge:
      return "gauge";
    case Type::kHistogram:
      return "histogram";
  }
  return "untyped";
}

// Backslash and newline always; '"' in label values only.
std::string escaped(std::string_view v, bool quotes) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\' || (quotes && c == '"')) {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

bool valid_metric_name(std::string_view name) {
  return valid_name(name, true);
}
bool valid_label_name(std::string_view name) {
  return valid_name(name, false);
}

std::string escape_label_value(std::string_view v) {
  return escaped(v, true);
}

std::string escape_help(std::string_view v) {
  return escaped(v, false);
}

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  constexpr double kExact = 9007199254740992.0;  // 2^53
  if (v == std::trunc(v) && std::fabs(v) <= kExact) {
    return fmt::format("{}", static_cast<int64_t>(v));
  }
  return fmt::format("{}", v);  // the shortest text that reads back as v
}

void Writer::family(std::string_view name, Type type, std::string_view help) {
  current_ = sanitized(name, true);
  type_ = type;
  if (std::find(started_.begin(), started_.end(), current_) != started_.end()) return;
  started_.push_back(current_);
  out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", current_, escape_help(help), current_,
                      type_name(type));
}

void Writer::line(std::string_view suffix, const Labels& labels, std::string_view extra_name,
                  std::string_view extra_value, double value) {
  out_ += current_;
  out_ += suffix;
  if (!labels.empty() || !extra_name.empty()) {
    out_ += '{';
    bool first = true;
    auto label = [&](std::string_view k, std::string_view v) {
      if (!first) out_ += ',';
      first = false;
      out_ += sanitized(k, false);
      out_ += "=\"";
      out_ += escape_label_value(v);
      out_ += '"';
    };
    for (const auto& [k, v] : labels)
      label(k, v);
    if (!extra_name.empty()) label(extra_name, extra_value);
    out_ += '}';
  }
  out_ += ' ';
  out_ += format_value(value);
  out_ += '\n';
}

void Writer::sample(const Labels& labels, double value) {
  line("", labels, "", "", value);
}

void Writer::histogram(const Labels& labels, std::span<const double> bounds,
                       std::span<const uint64_t> cumulative, uint64_t count, double sum) {
  for (size_t i = 0; i < bounds.size() && i < cumulative.size(); ++i) {
    line("_bucket", labels, "le", format_value(bounds[i]), static_cast<double>(cumulative[i]));
  }
  line("_bucket", labels, "le", "+Inf", static_cast<double>(count));
  line("_sum", labels, "", "", sum);
  line("_count", labels, "", "", static_cast<double>(count));
}

}  // namespace psld::prometheus
