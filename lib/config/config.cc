// lib/config/config.cc — loading, validating and printing psld::Config.
//
// Every key is described once, in fields() below: its path in the struct (which
// is also its TOML key and flag name), its range or accepted names, and what it
// means. The TOML reader, the environment and flag parsers, validate(),
// to_string() and config_keys() all walk that one table, so a key cannot be
// readable from one source and missing from another.
#include "psld/config.h"

// cpptoml 0.1.1 trips -Wnull-dereference inside its own parser at -O2 (a
// false positive from inlining); the pragma keeps our build warning-free
// without silencing the warning for our code.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference"
#include <cpptoml.h>
#pragma GCC diagnostic pop

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <span>
#include <sstream>
#include <utility>
#include <variant>

namespace psld {
namespace {

constexpr std::array<std::string_view, 4> kRoleNames = {"auto", "worker", "server", "coordinator"};
constexpr std::array<std::string_view, 3> kSyncNames = {"bsp", "async", "staleness"};
constexpr std::array<std::string_view, 2> kServerModeNames = {"sum", "optimizer"};
constexpr std::array<std::string_view, 4> kOptimizerNames = {"sgd", "momentum", "adam", "adamw"};
constexpr std::array<std::string_view, 4> kLogNames = {"error", "warn", "info", "debug"};
constexpr std::array<std::string_view, 3> kTransportNames = {"ucx", "verbs", "loopback"};
constexpr std::array<std::string_view, 3> kWritePathNames = {"auto", "put", "am"};
constexpr std::array<std::string_view, 3> kGpuPathNames = {"auto", "direct", "staged"};
constexpr std::array<std::string_view, 2> kServerDeviceNames = {"cpu", "cuda"};

// PSLD_ variables that are not configuration keys, read elsewhere. Any other
// PSLD_ variable that is not a key is an error (a typo). Add new ones here.
constexpr std::array<std::string_view, 4> kOtherPsldVariables = {
    "PSLD_CONFIG",          // the config file, read by load_config itself
    "PSLD_KERNEL_ISA",      // kernels/cpu: lowers the SIMD instruction set
    "PSLD_JOBS",            // tools/dev: compile parallelism
    "PSLD_PLACEMENT_EMIT",  // tests: path of the placement_emit helper
};

constexpr double kInf = std::numeric_limits<double>::infinity();

template <typename E>
std::span<const std::string_view> enum_names();
template <>
std::span<const std::string_view> enum_names<Role>() {
  return kRoleNames;
}
template <>
std::span<const std::string_view> enum_names<SyncMode>() {
  return kSyncNames;
}
template <>
std::span<const std::string_view> enum_names<ServerMode>() {
  return kServerModeNames;
}
template <>
std::span<const std::string_view> enum_names<OptimizerKind>() {
  return kOptimizerNames;
}

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

// "job.num_workers" and a function returning &config.job.num_workers.
#define PSLD_KEY(path) #path, [](Config & c) -> FieldRef { return &c.path; }

Field integer(std::string_view key, FieldRef (*ref)(Config&), int64_t min, int64_t max,
              std::string_view meaning) {
  Field f{.key = key, .ref = ref, .meaning = meaning};
  f.min = min;
  f.max = max;
  return f;
}

Field number(std::string_view key, FieldRef (*ref)(Config&), double lo, double hi, bool hi_open,
             std::string_view meaning) {
  Field f{.key = key, .ref = ref, .meaning = meaning};
  f.lo = lo;
  f.hi = hi;
  f.hi_open = hi_open;
  return f;
}

// Booleans and enums: the type says what is accepted.
Field plain(std::string_view key, FieldRef (*ref)(Config&), std::string_view meaning) {
  return Field{.key = key, .ref = ref, .meaning = meaning};
}

Field named(std::string_view key, FieldRef (*ref)(Config&), std::span<const std::string_view> names,
            std::string_view meaning) {
  Field f{.key = key, .ref = ref, .meaning = meaning};
  f.names = names;
  return f;
}

Field string_field(std::string_view key, FieldRef (*ref)(Config&), StringCheck check,
                   std::string_view accepted, std::string_view meaning) {
  Field f{.key = key, .ref = ref, .meaning = meaning};
  f.check = check;
  f.accepted = accepted;
  return f;
}

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front()))
    s.remove_prefix(1);
  while (!s.empty() && is_space(s.back()))
    s.remove_suffix(1);
  return s;
}

// "host:port" or "[v6 address]:port" with a port in min_port..65535.
std::string check_endpoint(std::string_view v, int min_port) {
  if (v.empty()) return "empty";
  std::string_view host;
  std::string_view port;
  if (v.front() == '[') {
    size_t close = v.find(']');
    if (close == std::string_view::npos) return "no ']' after the IPv6 address";
    host = v.substr(1, close - 1);
    std::string_view rest = v.substr(close + 1);
    if (rest.empty() || rest.front() != ':') return "no ':port'";
    port = rest.substr(1);
  } else {
    size_t colon = v.rfind(':');
    if (colon == std::string_view::npos) return "no ':port'";
    host = v.substr(0, colon);
    port = v.substr(colon + 1);
    if (host.find(':') != std::string_view::npos) {
      return "an IPv6 address needs brackets, e.g. [::1]:29600";
    }
  }
  if (host.empty()) return "no host";
  if (std::any_of(host.begin(), host.end(), is_space)) return "a space in the host";
  int n = -1;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), n);
  if (port.empty() || ec != std::errc() || end != port.data() + port.size() || n < min_port ||
      n > 65535) {
    return fmt::format("the port must be in {}..65535", min_port);
  }
  return "";
}

std::string check_coordinator(std::string_view v) {
  return check_endpoint(v, 1);
}
std::string check_listen(std::string_view v) {
  return check_endpoint(v, 0);
}

// UCX_TLS syntax: comma-separated transport names, optionally led by '^'
// (everything but these).
std::string check_ucx_tls(std::string_view v) {
  if (v.empty()) return "";
  if (v.front() == '^') v.remove_prefix(1);
  size_t start = 0;
  while (start <= v.size()) {
    size_t comma = std::min(v.find(',', start), v.size());
    std::string_view name = v.substr(start, comma - start);
    if (name.empty()) return "an empty name in the list";
    for (char c : name) {
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != ':') {
        return fmt::format("'{}' in a transport name", c);
      }
    }
    start = comma + 1;
  }
  return "";
}

std::string check_device(std::string_view v) {
  for (char c : v) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' && c != '.') {
      return fmt::format("'{}' in a device name", c);
    }
  }
  return "";
}

std::string check_any(std::string_view) {
  return "";
}

// Every key, in printing order. Top-level keys first (TOML needs them before
// any [table]), then one table per section.
const std::vector<Field>& fields() {
  static const std::vector<Field> kFields = {
      named(PSLD_KEY(log), kLogNames, "level of the messages psld writes on stderr"),

      plain(PSLD_KEY(job.role),
            "what this process is; auto: decided at start (a launched trainer process is a "
            "worker)"),
      integer(PSLD_KEY(job.rank), -1, 65535,
              "rank among the processes of its role; -1: assigned by the coordinator"),
      integer(PSLD_KEY(job.local_rank), -1, 65535,
              "rank among this job's processes on this machine (GPU/NIC choice); -1: unknown"),
      integer(PSLD_KEY(job.num_workers), 1, 65536, "worker processes in the job"),
      integer(PSLD_KEY(job.num_servers), 1, 65536,
              "servers holding keys at start; follows job.num_workers when "
              "job.colocate_servers is set and this is not"),
      integer(PSLD_KEY(job.num_standby), 0, 65536,
              "extra servers that start empty; the balancer may scale out to them"),
      plain(PSLD_KEY(job.colocate_servers),
            "every worker process also runs a server (mpirun -np N / srun -n N jobs)"),
      string_field(PSLD_KEY(job.coordinator), check_coordinator,
                   "host:port with a port in 1..65535",
                   "address the coordinator listens on and every process dials; IPv6 in brackets"),
      [] {
        Field f = string_field(PSLD_KEY(job.secret), check_any, "any string",
                               "shared job secret proven at hello; empty: none; never printed");
        f.secret = true;
        return f;
      }(),
      named(PSLD_KEY(job.transport), kTransportNames, "data-path backend"),
      string_field(PSLD_KEY(job.listen), check_listen, "host:port with a port in 0..65535 (0: any)",
                   "address this process listens on for peers"),

      [] {
        Field f = integer(PSLD_KEY(data.chunk_bytes), 8, int64_t{1} << 30,
                          "largest chunk a tensor is cut into: the unit of transfer, "
                          "aggregation and placement");
        f.multiple_of = 8;
        f.accepted = "a multiple of 8 in 8..1073741824";
        return f;
      }(),
      integer(PSLD_KEY(data.slots_per_worker), 1, 4096,
              "landing slots (credits) each server grants each worker; a server's landing "
              "memory is num_workers x slots_per_worker x chunk_bytes"),
      plain(PSLD_KEY(data.sync),
            "bsp: a round is applied once every worker pushed it; async: on arrival; "
            "staleness: async with workers at most data.staleness_rounds apart"),
      integer(PSLD_KEY(data.staleness_rounds), 1, 1000000,
              "with data.sync = staleness, how many rounds a worker may run ahead"),
      integer(PSLD_KEY(data.request_timeout_ms), 0, 86400000,
              "a push or pull not complete after this long fails with Timeout; 0: never"),
      named(PSLD_KEY(data.gpu_path), kGpuPathNames,
            "tensors in CUDA memory: auto: direct where the transport can register device "
            "memory, else staged through pinned host memory; direct or staged: force one"),

      plain(PSLD_KEY(server.mode),
            "optimizer: the server applies optimizer.*; sum: it only sums (summation service)"),
      integer(PSLD_KEY(server.threads), 1, 1024, "aggregation and update threads per server"),
      named(PSLD_KEY(server.device), kServerDeviceNames,
            "where servers keep their keys and run reduce and optimizer: cpu, or cuda (GPU "
            "memory and the CUDA kernels; pushes and pulls still go through host memory)"),

      plain(PSLD_KEY(optimizer.kind),
            "server update rule, PyTorch semantics; sgd with momentum > 0 is SGD with momentum"),
      number(PSLD_KEY(optimizer.lr), 0, kInf, false, "learning rate"),
      number(PSLD_KEY(optimizer.momentum), 0, 1, true,
             "sgd, momentum; default 0, or 0.9 with optimizer.kind = momentum"),
      number(PSLD_KEY(optimizer.dampening), 0, 1, false, "sgd, momentum"),
      plain(PSLD_KEY(optimizer.nesterov),
            "sgd, momentum; needs momentum > 0 and dampening = 0 (as PyTorch)"),
      number(PSLD_KEY(optimizer.beta1), 0, 1, true, "adam, adamw"),
      number(PSLD_KEY(optimizer.beta2), 0, 1, true, "adam, adamw"),
      number(PSLD_KEY(optimizer.eps), 0, kInf, false, "adam, adamw"),
      number(PSLD_KEY(optimizer.weight_decay), 0, kInf, false,
             "L2 penalty (decoupled for adamw); default 0, or 0.01 with optimizer.kind = adamw"),

      integer(PSLD_KEY(liveness.heartbeat_interval_ms), 1, 3600000, "time between heartbeats"),
      integer(PSLD_KEY(liveness.heartbeat_timeout_ms), 1, 86400000,
              "a peer silent this long is dead; must exceed 2 x heartbeat_interval_ms"),
      integer(PSLD_KEY(liveness.connect_timeout_ms), 1, 86400000,
              "joining the job and dialling a peer give up after this long"),

      integer(PSLD_KEY(stats.interval_ms), 1, 3600000,
              "how often servers and workers report load to the coordinator"),

      plain(PSLD_KEY(balancer.enabled), "move key ranges and scale servers while training runs"),
      integer(PSLD_KEY(balancer.interval_ms), 1, 86400000,
              "how often the balancer plans; at least stats.interval_ms"),
      number(PSLD_KEY(balancer.straggler_threshold), 0, 10, false,
             "a server is a straggler when its predicted time per round exceeds the others' by "
             "this fraction (above 0) ..."),
      integer(PSLD_KEY(balancer.straggler_windows), 1, 1000000,
              "... for this many statistics windows in a row"),
      number(PSLD_KEY(balancer.horizon_rounds), 1, 1e9, false,
             "rounds over which a migration's cost is amortised: a move must gain more"),
      number(PSLD_KEY(balancer.max_step_fraction), 0, 1, false,
             "at most this fraction of a server's load moves per decision (above 0)"),
      integer(PSLD_KEY(balancer.evaluation_windows), 1, 1000,
              "windows measured at a new epoch before a move is judged (and rolled back)"),
      number(PSLD_KEY(balancer.rollback_tolerance), 0, 10, false,
             "a move is rolled back when the measured round grew by more than this fraction"),
      plain(PSLD_KEY(balancer.scale_out),
            "add standby servers when even a balanced placement keeps the servers busy"),
      plain(PSLD_KEY(balancer.scale_in), "drain a server that is idle or persistently slow"),
      number(PSLD_KEY(balancer.scale_out_utilisation), 0, 1, false,
             "scale out when balanced servers would be busy this fraction of a round (above 0)"),
      number(PSLD_KEY(balancer.scale_in_utilisation), 0, 1, false,
             "scale in when the others would be busy at most this fraction of a round without "
             "the server; below balancer.scale_out_utilisation"),
      integer(PSLD_KEY(balancer.min_active_servers), 1, 65536,
              "scale-in never leaves fewer active servers"),

      string_field(PSLD_KEY(ucx.tls), check_ucx_tls,
                   "a UCX_TLS list such as tcp or rc,sm,self, or empty",
                   "UCX transports psld's UCX context may use; empty: UCX's choice (UCX_TLS)"),
      named(PSLD_KEY(ucx.write_path), kWritePathNames,
            "auto: true put on RDMA and shared-memory lanes, active-message rendezvous "
            "elsewhere; put or am: force one"),
      [] {
        Field f = integer(PSLD_KEY(ucx.notify_ring_slots), 0, 65536,
                          "slots of the shared-memory ring a peer on this host writes its "
                          "write notifications into (polled, no active message per write); 0: "
                          "no ring, active messages only");
        f.accepted = "0 or a power of two from 16 to 65536";
        return f;
      }(),

      string_field(PSLD_KEY(verbs.device), check_device,
                   "an RDMA device name such as mlx5_0, or empty",
                   "RDMA device; empty: the first with an active port"),
      integer(PSLD_KEY(verbs.port), 1, 255, "port of verbs.device"),
      integer(PSLD_KEY(verbs.gid_index), -1, 255, "GID index; -1: a RoCE v2 GID chosen for you"),

      integer(PSLD_KEY(link.egress_bytes_per_second), 0, 10000000000000,
              "emulated link: send rate limit; 0: unlimited"),
      integer(PSLD_KEY(link.ingress_bytes_per_second), 0, 10000000000000,
              "emulated link: receive rate limit; 0: unlimited"),
      integer(PSLD_KEY(link.latency_us), 0, 10000000,
              "emulated link: one-way latency added to everything sent"),
  };
  return kFields;
}

#undef PSLD_KEY

const Field* find_field(std::string_view key) {
  for (const Field& f : fields()) {
    if (f.key == key) return &f;
  }
  return nullptr;
}

// PSLD_ + the key in capitals, '.' written '_': job.num_workers -> PSLD_JOB_NUM_WORKERS.
std::string env_name(std::string_view key) {
  std::string name = "PSLD_";
  for (char c : key) {
    name += c == '.' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  return name;
}

// "job" for "job.rank", "" for top-level keys.
std::string_view section_of(std::string_view key) {
  size_t dot = key.find('.');
  return dot == std::string_view::npos ? std::string_view() : key.substr(0, dot);
}

std::string_view leaf_of(std::string_view key) {
  size_t dot = key.find('.');
  return dot == std::string_view::npos ? key : key.substr(dot + 1);
}

bool is_section(std::string_view name) {
  return std::any_of(fields().begin(), fields().end(),
                     [&](const Field& f) { return section_of(f.key) == name; });
}

// Read-only access to a member of a const Config: ref() is shared with the
// writers, and nothing here writes through it.
FieldRef cref(const Field& f, const Config& c) {
  return f.ref(const_cast<Config&>(c));
}

template <typename T>
constexpr bool kIsEnum = std::is_enum_v<T>;

template <typename T>
constexpr bool kIsInteger = std::is_integral_v<T> && !std::is_same_v<T, bool>;

std::span<const std::string_view> names_of(const Field& f, const FieldRef& r) {
  return std::visit(
      [&](auto* p) -> std::span<const std::string_view> {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (kIsEnum<T>) {
          return enum_names<T>();
        } else {
          return f.names;
        }
      },
      r);
}

std::string join(std::span<const std::string_view> names, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += sep;
    out += names[i];
  }
  return out;
}

std::string format_number(double d) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), d);
  std::string s(buf, ec == std::errc() ? end : buf);
  // TOML reads "1" as an integer; keep floats floats. ("inf" has an 'n'.)
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  // "1e-08" -> "1e-8": cpptoml rejects leading zeros in an exponent.
  size_t e = s.find('e');
  if (e != std::string::npos) {
    size_t digits = e + 1 < s.size() && (s[e + 1] == '-' || s[e + 1] == '+') ? e + 2 : e + 1;
    while (digits + 1 < s.size() && s[digits] == '0')
      s.erase(digits, 1);
  }
  return s;
}

// A TOML basic string.
std::string toml_quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
          out += fmt::format("\\u{:04X}", static_cast<unsigned>(static_cast<unsigned char>(c)));
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return out;
}

// What is accepted, for messages and the documentation.
std::string accepted(const Field& f, const FieldRef& r) {
  if (!f.accepted.empty()) return std::string(f.accepted);
  return std::visit(
      [&](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) {
          return "true or false";
        } else if constexpr (kIsInteger<T>) {
          return fmt::format("an integer in {}..{}", f.min, f.max);
        } else if constexpr (std::is_same_v<T, double>) {
          if (f.hi == kInf) return fmt::format("a finite number >= {}", f.lo);
          return fmt::format("a number in [{}, {}{}", f.lo, f.hi, f.hi_open ? ")" : "]");
        } else {
          auto names = names_of(f, r);
          if (!names.empty()) return "one of " + join(names, ", ");
          return "any string";
        }
      },
      r);
}

Value load(const FieldRef& r) {
  return std::visit(
      [](auto* p) -> Value {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, double> ||
                      std::is_same_v<T, std::string>) {
          return *p;
        } else if constexpr (kIsInteger<T>) {
          return static_cast<int64_t>(*p);
        } else {
          auto names = enum_names<T>();
          auto i = static_cast<size_t>(*p);
          if (i < names.size()) return std::string(names[i]);
          return std::to_string(i);
        }
      },
      r);
}

// Stores a value that acceptable() approved.
void store(const FieldRef& r, const Value& v) {
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) {
          *p = std::get<bool>(v);
        } else if constexpr (kIsInteger<T>) {
          *p = static_cast<T>(std::get<int64_t>(v));
        } else if constexpr (std::is_same_v<T, double>) {
          *p = std::get<double>(v);
        } else if constexpr (std::is_same_v<T, std::string>) {
          *p = std::get<std::string>(v);
        } else {
          auto names = enum_names<T>();
          auto it = std::find(names.begin(), names.end(), std::get<std::string>(v));
          *p = static_cast<T>(it - names.begin());
        }
      },
      r);
}

// Whether `v` fits the field's type and range; *detail may say more.
bool acceptable(const Field& f, const FieldRef& r, const Value& v, std::string* detail) {
  return std::visit(
      [&](auto* p) -> bool {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) {
          return std::holds_alternative<bool>(v);
        } else if constexpr (kIsInteger<T>) {
          const int64_t* i = std::get_if<int64_t>(&v);
          return i != nullptr && *i >= f.min && *i <= f.max && *i % f.multiple_of == 0;
        } else if constexpr (std::is_same_v<T, double>) {
          const double* d = std::get_if<double>(&v);
          return d != nullptr && std::isfinite(*d) && *d >= f.lo &&
                 (f.hi_open ? *d < f.hi : *d <= f.hi);
        } else {
          const std::string* s = std::get_if<std::string>(&v);
          if (s == nullptr) return false;
          auto names = names_of(f, r);
          if (!names.empty()) return std::find(names.begin(), names.end(), *s) != names.end();
          if (f.check == nullptr) return true;
          *detail = f.check(*s);
          return detail->empty();
        }
      },
      r);
}

// Text from the environment or a flag, as the field's type; nullopt when it
// is not one.
std::optional<Value> parse_text(const FieldRef& r, std::string_view text) {
  return std::visit(
      [&](auto* p) -> std::optional<Value> {
        using T = std::remove_pointer_t<decltype(p)>;
        std::string_view t = trim(text);
        if constexpr (std::is_same_v<T, bool>) {
          if (t == "true" || t == "1") return Value(true);
          if (t == "false" || t == "0") return Value(false);
          return std::nullopt;
        } else if constexpr (kIsInteger<T> || std::is_same_v<T, double>) {
          using N = std::conditional_t<std::is_same_v<T, double>, double, int64_t>;
          if (!t.empty() && t.front() == '+') t.remove_prefix(1);
          N n{};
          auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), n);
          if (t.empty() || ec != std::errc() || end != t.data() + t.size()) return std::nullopt;
          return Value(n);
        } else if constexpr (std::is_same_v<T, std::string>) {
          return Value(std::string(text));  // strings verbatim: a secret may have spaces
        } else {
          return Value(std::string(t));
        }
      },
      r);
}

// The value as TOML writes it.
std::string render(const Value& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, bool>) {
          return x ? "true" : "false";
        } else if constexpr (std::is_same_v<T, int64_t>) {
          return std::to_string(x);
        } else if constexpr (std::is_same_v<T, double>) {
          return format_number(x);
        } else {
          return toml_quote(x);
        }
      },
      v);
}

std::string render_field(const Field& f, const Config& c) {
  if (f.secret) return std::get<std::string>(load(cref(f, c))).empty() ? "<unset>" : "<set>";
  return render(load(cref(f, c)));
}

// " from env X", " by default" or "" (set in code), after a value in a message.
std::string from(std::string_view source) {
  if (source.empty()) return "";
  if (source == "default") return " by default";
  return " from " + std::string(source);
}

std::string source_of(const Config& c, std::string_view key) {
  auto it = c.sources.find(std::string(key));
  return it == c.sources.end() ? std::string() : it->second;
}

// "job.num_workers: 'abc' from env PSLD_JOB_NUM_WORKERS is not an integer in 1..65536"
std::string bad_value(const Field& f, const FieldRef& r, std::string_view shown,
                      std::string_view source, std::string_view detail) {
  return fmt::format("{}: {}{} is not {}{}", f.key, f.secret ? "<redacted>" : shown, from(source),
                     accepted(f, r), detail.empty() ? "" : fmt::format(" ({})", detail));
}

// Levenshtein distance, ignoring case.
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j)
    row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                  std::tolower(static_cast<unsigned char>(b[j - 1]));
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (same ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// The candidate a typo most likely meant, or "". `sep` separates a name's
// parts ('.' in keys, '_' in variables): a name that matches the end of
// exactly one candidate ("num_workers" for "job.num_workers") is taken first,
// since leaving out the section is the likeliest mistake.
std::string closest(std::string_view name, const std::vector<std::string>& candidates, char sep,
                    std::string_view prefix = "") {
  std::string n = lower(name);
  std::replace(n.begin(), n.end(), '-', '_');
  std::string rest = n.substr(std::min(n.size(), prefix.size()));
  const std::string* suffix_match = nullptr;
  int suffix_matches = 0;
  for (const std::string& c : candidates) {
    std::string lc = lower(c);
    if (!rest.empty() && lc.size() > rest.size() + prefix.size() &&
        lc.compare(lc.size() - rest.size(), rest.size(), rest) == 0 &&
        lc[lc.size() - rest.size() - 1] == static_cast<char>(std::tolower(sep))) {
      suffix_match = &c;
      ++suffix_matches;
    }
  }
  if (suffix_matches == 1) return *suffix_match;
  const std::string* best = nullptr;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (const std::string& c : candidates) {
    size_t d = edit_distance(name, c);
    if (d < best_distance) {
      best_distance = d;
      best = &c;
    }
  }
  if (best != nullptr && best_distance <= std::max<size_t>(2, name.size() / 3)) return *best;
  return "";
}

std::vector<std::string> all_keys() {
  std::vector<std::string> keys;
  for (const Field& f : fields())
    keys.emplace_back(f.key);
  return keys;
}

std::string did_you_mean(const std::string& suggestion, std::string_view before = "") {
  if (suggestion.empty()) return "; docs/configuration.md lists every key";
  return fmt::format("; did you mean {}{}?", before, suggestion);
}

// One value from the environment, a flag or a launcher, waiting to be applied.
struct TextSetting {
  const Field* field;
  std::string text;
  std::string source;
};

void apply(const TextSetting& s, Config& c, std::vector<std::string>& errors) {
  FieldRef r = s.field->ref(c);
  std::optional<Value> v = parse_text(r, s.text);
  std::string detail;
  if (!v || !acceptable(*s.field, r, *v, &detail)) {
    errors.push_back(bad_value(*s.field, r, "'" + s.text + "'", s.source, detail));
    return;
  }
  store(r, *v);
  c.sources[std::string(s.field->key)] = s.source;
}

// ---- flags -----------------------------------------------------------------

struct Flags {
  std::vector<TextSetting> settings;
  std::string config_path;  // --config, "" if absent
};

bool is_bool_text(std::string_view s) {
  return s == "true" || s == "false" || s == "1" || s == "0";
}

Flags parse_flags(const std::vector<std::string>& args, std::vector<std::string>& errors) {
  Flags flags;
  Config scratch;  // only to ask a field its type
  for (size_t i = 0; i < args.size(); ++i) {
    std::string_view a = args[i];
    if (a.size() <= 2 || a.substr(0, 2) != "--") {
      errors.push_back(fmt::format(
          "unexpected argument '{}': settings are flags --key=value (e.g. --job.num_workers=4)",
          a));
      continue;
    }
    std::string_view body = a.substr(2);
    size_t eq = body.find('=');
    std::string name(body.substr(0, eq));
    std::optional<std::string> value;
    if (eq != std::string_view::npos) value = std::string(body.substr(eq + 1));
    const Field* f = name == "config" ? nullptr : find_field(name);
    if (name != "config" && f == nullptr) {
      errors.push_back(fmt::format("unknown flag --{}{}", name,
                                   did_you_mean(closest(name, all_keys(), '.'), "--")));
      if (!value && i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) ++i;
      continue;
    }
    bool is_bool = f != nullptr && std::holds_alternative<bool*>(f->ref(scratch));
    if (!value) {
      if (is_bool) {
        // `--balancer.enabled` alone is true; a following true/false/1/0 is its value.
        if (i + 1 < args.size() && is_bool_text(args[i + 1])) {
          value = args[++i];
        } else {
          value = "true";
        }
      } else if (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
        value = args[++i];
      } else {
        errors.push_back(fmt::format("flag --{} needs a value: --{}=VALUE", name, name));
        continue;
      }
    }
    if (f == nullptr) {
      flags.config_path = *value;
    } else {
      flags.settings.push_back({f, *value, "flag --" + name});
    }
  }
  return flags;
}

// ---- environment -----------------------------------------------------------

std::vector<std::string> process_env_names() {
  std::vector<std::string> names;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string_view entry(*e);
    names.emplace_back(entry.substr(0, entry.find('=')));
  }
  return names;
}

class Env {
 public:
  explicit Env(const ConfigSources& s) : s_(s) {}
  // nullptr when unset.
  const char* get(const std::string& name) const {
    return s_.getenv ? s_.getenv(name.c_str()) : nullptr;
  }
  std::vector<std::string> names() const {
    return s_.env_names ? s_.env_names() : process_env_names();
  }

 private:
  const ConfigSources& s_;
};

std::vector<TextSetting> read_psld_env(const Env& env, std::vector<std::string>& errors) {
  std::vector<TextSetting> settings;
  std::vector<std::string> known;
  for (const Field& f : fields()) {
    std::string name = env_name(f.key);
    if (const char* v = env.get(name)) settings.push_back({&f, v, "env " + name});
    known.push_back(std::move(name));
  }
  std::vector<std::string> unknown;
  for (const std::string& name : env.names()) {
    if (name.rfind("PSLD_", 0) != 0 || env.get(name) == nullptr) continue;
    if (std::find(known.begin(), known.end(), name) != known.end()) continue;
    if (std::find(kOtherPsldVariables.begin(), kOtherPsldVariables.end(), name) !=
        kOtherPsldVariables.end()) {
      continue;
    }
    unknown.push_back(name);
  }
  std::sort(unknown.begin(), unknown.end());
  unknown.erase(std::unique(unknown.begin(), unknown.end()), unknown.end());
  for (const std::string& name : unknown) {
    errors.push_back(fmt::format(
        "unknown environment variable {}{} (psld reads PSLD_ + a key in capitals, '.' as '_')",
        name, did_you_mean(closest(name, known, '_', "PSLD_"))));
  }
  return settings;
}

// ---- launchers -------------------------------------------------------------

std::string bracket_host(std::string_view host) {
  if (host.find(':') != std::string_view::npos && host.front() != '[') {
    return "[" + std::string(host) + "]";
  }
  return std::string(host);
}

// Splits an endpoint that check_endpoint accepts; the host keeps its brackets.
bool split_endpoint(std::string_view v, std::string* host, std::string* port) {
  if (!check_endpoint(v, 0).empty()) return false;
  size_t colon = v.rfind(':');
  *host = std::string(v.substr(0, colon));
  *port = std::string(v.substr(colon + 1));
  return true;
}

struct Launcher {
  std::string name = "none";
  std::vector<TextSetting> settings;
};

// The launcher whose environment this process runs in, and what it says.
// Innermost first: torchrun under srun, or mpirun inside an sbatch
// allocation, sees both sets of variables, and the inner one is right.
// Every launched process is taken to be a worker of one SPMD job (or a server
// when job.role says so); MPMD jobs set PSLD_JOB_* explicitly.
Launcher detect_launcher(const Env& env, Role role, const std::string& coordinator) {
  struct Vars {
    const char* name;
    const char* rank;
    const char* size;
    const char* local_rank;
  };
  // Slurm: SLURM_PROCID and SLURM_NTASKS are also set in an sbatch script's
  // own shell, where nothing was launched; SLURM_STEP_ID is set only for the
  // tasks of an srun step. SLURM_STEP_NUM_TASKS is the step's size when the
  // step is smaller than the allocation.
  const Vars kLaunchers[] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
      {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
  };
  Launcher out;
  const Vars* found = nullptr;
  for (const Vars& v : kLaunchers) {
    if (env.get(v.rank) == nullptr || env.get(v.size) == nullptr) continue;
    if (std::string_view(v.name) == "slurm" && env.get("SLURM_STEP_ID") == nullptr) continue;
    found = &v;
    break;
  }
  if (found == nullptr) {
    if (env.get("PSLD_JOB_RANK") != nullptr) out.name = "psld";  // psld launch
    return out;
  }
  out.name = found->name;
  auto add = [&](const char* key, const char* var) {
    if (const char* v = env.get(var)) {
      out.settings.push_back({find_field(key), v, fmt::format("env {}", var)});
    }
  };
  if (role != Role::kCoordinator) {
    add("job.rank", found->rank);
    const char* size = found->size;
    if (out.name == "slurm" && env.get("SLURM_STEP_NUM_TASKS") != nullptr) {
      size = "SLURM_STEP_NUM_TASKS";
    }
    add(role == Role::kServer ? "job.num_servers" : "job.num_workers", size);
  }
  add("job.local_rank", found->local_rank);

  // The coordinator's address: torchrun's MASTER_ADDR:MASTER_PORT, or the
  // node srun ran on (the first node of an sbatch allocation). A part the
  // launcher does not give is kept from the file or the default.
  std::string host;
  std::string port;
  if (!split_endpoint(coordinator, &host, &port)) return out;  // validate reports it
  std::vector<std::string> used;
  auto take = [&](const char* var, std::string* part, bool is_host) {
    if (const char* v = env.get(var); v != nullptr && *v != '\0') {
      *part = is_host ? bracket_host(v) : std::string(v);
      used.emplace_back(var);
    }
  };
  if (out.name == "torchrun") {
    take("MASTER_ADDR", &host, true);
    take("MASTER_PORT", &port, false);
  } else if (out.name == "slurm") {
    take("SLURM_LAUNCH_NODE_IPADDR", &host, true);
  }
  if (!used.empty()) {
    std::string source = "env " + used[0];
    for (size_t i = 1; i < used.size(); ++i)
      source += ", " + used[i];
    out.settings.push_back({find_field("job.coordinator"), host + ":" + port, source});
  }
  return out;
}

// ---- the file ----------------------------------------------------------------

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
  FileReader(std::string path, std::string text, Config& c, std::vector<std::string>& errors)
      : path_(std::move(path)), lines_(toml_lines(text)), c_(c), errors_(errors) {}

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
    FieldRef r = f.ref(c_);
    std::string source = "file " + where(key);
    std::optional<Value> v = from_toml(r, b);
    std::string detail;
    if (!v || !acceptable(f, r, *v, &detail)) {
      errors_.push_back(bad_value(f, r, render_toml(b), source, detail));
      return;
    }
    store(r, *v);
    c_.sources[key] = source;
  }

  std::string path_;
  std::map<std::string, int> lines_;
  Config& c_;
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

Status errors_status(const std::vector<std::string>& errors) {
  if (errors.empty()) return Status::Ok();
  std::string message = errors[0];
  for (size_t i = 1; i < errors.size(); ++i)
    message += "\n" + errors[i];
  return InvalidArgument(std::move(message));
}

// Defaults that depend on another key, for keys no source set.
void derive_defaults(Config& c) {
  auto unset = [&](const char* key) { return source_of(c, key) == "default"; };
  if (c.optimizer.kind == OptimizerKind::kMomentum && unset("optimizer.momentum")) {
    c.optimizer.momentum = 0.9;
    c.sources["optimizer.momentum"] = "default for optimizer.kind = momentum";
  }
  if (c.optimizer.kind == OptimizerKind::kAdamW && unset("optimizer.weight_decay")) {
    c.optimizer.weight_decay = 0.01;  // torch.optim.AdamW's default
    c.sources["optimizer.weight_decay"] = "default for optimizer.kind = adamw";
  }
  if (c.job.colocate_servers && unset("job.num_servers")) {
    c.job.num_servers = c.job.num_workers;
    c.sources["job.num_servers"] = "job.num_workers, as job.colocate_servers = true";
  }
}

}  // namespace

std::string_view role_name(Role role) {
  return enum_name(role);
}
std::string_view sync_mode_name(SyncMode mode) {
  return enum_name(mode);
}
std::string_view server_mode_name(ServerMode mode) {
  return enum_name(mode);
}
std::string_view optimizer_kind_name(OptimizerKind kind) {
  return enum_name(kind);
}

bool operator==(const Config& a, const Config& b) {
  // Every section; a new one must be added here.
  return a.log == b.log && a.job == b.job && a.data == b.data && a.server == b.server &&
         a.optimizer == b.optimizer && a.liveness == b.liveness && a.stats == b.stats &&
         a.balancer == b.balancer && a.ucx == b.ucx && a.verbs == b.verbs && a.link == b.link;
}

Status validate(const Config& c) {
  std::vector<std::string> errors;
  for (const Field& f : fields()) {
    FieldRef r = cref(f, c);
    Value v = load(r);
    std::string detail;
    if (!acceptable(f, r, v, &detail)) {
      errors.push_back(bad_value(f, r, render(v), source_of(c, f.key), detail));
    }
  }
  if (!errors.empty()) return errors_status(errors);

  // Rules between keys. "4 from env OMPI_COMM_WORLD_SIZE"
  auto shown = [&](const char* key) {
    return render_field(*find_field(key), c) + from(source_of(c, key));
  };
  const JobConfig& job = c.job;
  int64_t rank_limit = job.num_workers;
  std::string limit_text = fmt::format("job.num_workers ({})", shown("job.num_workers"));
  if (job.role == Role::kServer) {
    rank_limit = int64_t{job.num_servers} + job.num_standby;
    limit_text = fmt::format("job.num_servers + job.num_standby ({})", rank_limit);
  } else if (job.role == Role::kCoordinator) {
    rank_limit = 1;
    limit_text = "1 (there is one coordinator)";
  }
  if (job.rank >= rank_limit) {
    errors.push_back(fmt::format("job.rank: {} must be -1 or below {} for job.role = {}",
                                 shown("job.rank"), limit_text, role_name(job.role)));
  }
  if (job.colocate_servers && job.num_servers != job.num_workers) {
    errors.push_back(fmt::format(
        "job.num_servers: {} must equal job.num_workers ({}) when job.colocate_servers = true "
        "(leave job.num_servers unset and it follows job.num_workers)",
        shown("job.num_servers"), shown("job.num_workers")));
  }
  if (c.liveness.heartbeat_timeout_ms <= 2 * c.liveness.heartbeat_interval_ms) {
    errors.push_back(fmt::format(
        "liveness.heartbeat_timeout_ms: {} must exceed 2 x liveness.heartbeat_interval_ms ({})",
        shown("liveness.heartbeat_timeout_ms"), shown("liveness.heartbeat_interval_ms")));
  }
  if (const uint32_t n = c.ucx.notify_ring_slots; n != 0 && (n < 16 || (n & (n - 1)) != 0)) {
    errors.push_back(
        fmt::format("ucx.notify_ring_slots: {} is not 0 or a power of two from 16 to 65536",
                    shown("ucx.notify_ring_slots")));
  }
  if (c.balancer.interval_ms < c.stats.interval_ms) {
    errors.push_back(fmt::format(
        "balancer.interval_ms: {} must be at least stats.interval_ms ({}): the balancer needs "
        "a new load report each time it plans",
        shown("balancer.interval_ms"), shown("stats.interval_ms")));
  }
  const std::pair<const char*, double> above_zero[] = {
      {"balancer.straggler_threshold", c.balancer.straggler_threshold},
      {"balancer.max_step_fraction", c.balancer.max_step_fraction},
      {"balancer.scale_out_utilisation", c.balancer.scale_out_utilisation},
  };
  for (const auto& [key, value] : above_zero) {
    if (value <= 0) errors.push_back(fmt::format("{}: {} must be above 0", key, shown(key)));
  }
  if (c.balancer.scale_in_utilisation >= c.balancer.scale_out_utilisation) {
    errors.push_back(fmt::format(
        "balancer.scale_in_utilisation: {} must be below balancer.scale_out_utilisation ({}), or "
        "the balancer would scale out and back in forever",
        shown("balancer.scale_in_utilisation"), shown("balancer.scale_out_utilisation")));
  }
  if (c.optimizer.nesterov && (c.optimizer.momentum <= 0 || c.optimizer.dampening != 0)) {
    errors.push_back(fmt::format(
        "optimizer.nesterov: {} needs optimizer.momentum > 0 (it is {}) and "
        "optimizer.dampening = 0 (it is {})",
        shown("optimizer.nesterov"), shown("optimizer.momentum"), shown("optimizer.dampening")));
  }
  return errors_status(errors);
}

Result<Config> load_config(const ConfigSources& sources) {
  Env env(sources);
  Config c;
  for (const Field& f : fields())
    c.sources[std::string(f.key)] = "default";

  std::vector<std::string> errors;
  Flags flags = parse_flags(sources.args, errors);
  std::vector<TextSetting> env_settings = read_psld_env(env, errors);

  std::string path = flags.config_path;
  std::string origin = "flag --config";
  if (path.empty()) {
    if (const char* p = env.get("PSLD_CONFIG"); p != nullptr && *p != '\0') {
      path = p;
      origin = "env PSLD_CONFIG";
    }
  }
  if (!path.empty()) PSLD_RETURN_IF_ERROR(read_file(path, origin, c, errors));

  // The launcher maps its world size by role, and the role may come from a
  // source that outranks it: look at the role every source gives first.
  Config role_only = c;
  std::vector<std::string> ignored;  // reported when applied below
  for (const auto* list : {&env_settings, &flags.settings}) {
    for (const TextSetting& s : *list) {
      if (s.field->key == "job.role") apply(s, role_only, ignored);
    }
  }
  Launcher launcher = detect_launcher(env, role_only.job.role, c.job.coordinator);
  c.launcher = launcher.name;

  for (const auto* list : {&launcher.settings, &env_settings, &flags.settings}) {
    for (const TextSetting& s : *list)
      apply(s, c, errors);
  }
  PSLD_RETURN_IF_ERROR(errors_status(errors));
  derive_defaults(c);
  PSLD_RETURN_IF_ERROR(validate(c));
  return c;
}

std::string to_string(const Config& c, bool with_sources) {
  struct Line {
    std::string text;
    std::string source;
  };
  std::vector<std::pair<std::string, std::vector<Line>>> sections;
  for (const Field& f : fields()) {
    std::string section(section_of(f.key));
    if (sections.empty() || sections.back().first != section) sections.push_back({section, {}});
    std::string text = fmt::format("{} = {}", leaf_of(f.key), render_field(f, c));
    // The secret's line is a comment, so the text still loads as a file.
    if (f.secret) text = "# " + text + " (never printed)";
    std::string source = source_of(c, f.key);
    sections.back().second.push_back({text, source.empty() ? "set in code" : source});
  }
  std::string out;
  if (with_sources) {
    out += fmt::format("# psld configuration; launcher: {}\n", c.launcher);
    out += "# precedence: default < file < launcher env < PSLD_ env < flag\n";
  }
  for (const auto& [section, lines] : sections) {
    if (!section.empty()) out += fmt::format("\n[{}]\n", section);
    size_t width = 0;
    for (const Line& l : lines)
      width = std::max(width, l.text.size());
    for (const Line& l : lines) {
      if (with_sources) {
        out += fmt::format("{:<{}}  # {}\n", l.text, width, l.source);
      } else {
        out += l.text + "\n";
      }
    }
  }
  return out;
}

std::vector<ConfigKeyInfo> config_keys() {
  Config defaults;
  std::vector<ConfigKeyInfo> keys;
  for (const Field& f : fields()) {
    keys.push_back({std::string(f.key), env_name(f.key), render_field(f, defaults),
                    accepted(f, cref(f, defaults)), std::string(f.meaning)});
  }
  return keys;
}

}  // namespace psld
