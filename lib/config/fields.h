// The table of configuration keys (fields(), in fields.cc: the one place a key
// is added) and the helpers that find a key and read, check, store and print
// its value, shared by lib/config/'s files (config, env, launchers, file).
// Internal to lib/config/.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "psld/config.h"

namespace psld::config_detail {

template <typename E>
std::span<const std::string_view> enum_names();
template <>
std::span<const std::string_view> enum_names<Role>();
template <>
std::span<const std::string_view> enum_names<SyncMode>();
template <>
std::span<const std::string_view> enum_names<ServerMode>();
template <>
std::span<const std::string_view> enum_names<OptimizerKind>();

template <typename E>
std::string_view enum_name(E value) {
  auto names = enum_names<E>();
  auto i = static_cast<size_t>(value);
  return i < names.size() ? names[i] : std::string_view("?");
}

// A pointer to one member of a Config; the alternative says its type.
using FieldRef = std::variant<int*, uint32_t*, int64_t*, uint64_t*, double*, bool*, std::string*,
                              Role*, SyncMode*, ServerMode*, OptimizerKind*>;

// A candidate value before it is stored, from text, TOML or a member.
using Value = std::variant<bool, int64_t, double, std::string>;

// "" when a string has an acceptable form, else what is wrong with it.
using StringCheck = std::string (*)(std::string_view value);

struct Field {
  std::string_view key;  // "job.num_workers": the member's path
  FieldRef (*ref)(Config&) = nullptr;
  std::string_view meaning;
  int64_t min = 0;  // integers: a multiple of multiple_of in [min, max]
  int64_t max = 0;
  int64_t multiple_of = 1;
  double lo = 0;  // numbers: finite, in [lo, hi], or [lo, hi) when hi_open
  double hi = 0;
  bool hi_open = false;
  std::span<const std::string_view> names = {};  // strings from a fixed set
  StringCheck check = nullptr;                   // strings of some form
  std::string_view accepted = {};                // overrides the generated description
  bool secret = false;                           // never printed or echoed
};

template <typename T>
constexpr bool kIsEnum = std::is_enum_v<T>;

template <typename T>
constexpr bool kIsInteger = std::is_integral_v<T> && !std::is_same_v<T, bool>;

bool is_space(char c);
std::string_view trim(std::string_view s);
std::string check_endpoint(std::string_view v, int min_port);
// Splits an endpoint that check_endpoint(v, 0) accepts; the host keeps its
// brackets. False for anything else.
bool split_endpoint(std::string_view v, std::string* host, std::string* port);
// The same with an IPv6 host out of its brackets ("::1"): what getaddrinfo
// takes.
bool split_endpoint_unbracketed(std::string_view v, std::string* host, std::string* port);
// "A:B" (trace.rounds) with 1 <= A <= B; false for anything else.
bool parse_round_range(std::string_view v, uint64_t* first, uint64_t* last);

// Every key, in printing order.
const std::vector<Field>& fields();
const Field* find_field(std::string_view key);
std::string env_name(std::string_view key);
std::string_view section_of(std::string_view key);
std::string_view leaf_of(std::string_view key);
bool is_section(std::string_view name);
FieldRef cref(const Field& f, const Config& c);

std::string format_number(double d);
std::string toml_quote(std::string_view s);
std::string accepted(const Field& f, const FieldRef& r);
Value load(const FieldRef& r);
void store(const FieldRef& r, const Value& v);
bool acceptable(const Field& f, const FieldRef& r, const Value& v, std::string* detail);
std::optional<Value> parse_text(const FieldRef& r, std::string_view text);
std::string render(const Value& v);
std::string render_field(const Field& f, const Config& c);
std::string from(std::string_view source);
std::string source_of(const Config& c, std::string_view key);
std::string bad_value(const Field& f, const FieldRef& r, std::string_view shown,
                      std::string_view source, std::string_view detail);

std::string closest(std::string_view name, const std::vector<std::string>& candidates, char sep,
                    std::string_view prefix = "");
std::vector<std::string> all_keys();
std::string did_you_mean(const std::string& suggestion, std::string_view before = "");

}  // namespace psld::config_detail
