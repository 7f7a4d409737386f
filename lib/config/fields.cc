// lib/config/fields.cc — the table of configuration keys and the helpers around it.
//
// Every key is described once, in fields() below: its path in the struct (which
// is also its TOML key and flag name), its range or accepted names, and what it
// means. The TOML reader, the environment and flag parsers, validate(),
// to_string() and config_keys() all walk that one table, so a key cannot be
// readable from one source and missing from another.
#include "lib/config/fields.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>

#include "base/log.h"

namespace psld::config_detail {
namespace {

constexpr std::array<std::string_view, 4> kRoleNames = {"auto", "worker", "server", "coordinator"};
constexpr std::array<std::string_view, 3> kSyncNames = {"bsp", "async", "staleness"};
constexpr std::array<std::string_view, 2> kServerModeNames = {"sum", "optimizer"};
constexpr std::array<std::string_view, 4> kOptimizerNames = {"sgd", "momentum", "adam", "adamw"};
constexpr std::array<std::string_view, 3> kTransportNames = {"ucx", "verbs", "loopback"};
constexpr std::array<std::string_view, 3> kWritePathNames = {"auto", "put", "am"};
constexpr std::array<std::string_view, 3> kGpuPathNames = {"auto", "direct", "staged"};
constexpr std::array<std::string_view, 2> kServerDeviceNames = {"cpu", "cuda"};

constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

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

namespace {

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

}  // namespace

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

bool parse_round_range(std::string_view v, uint64_t* first, uint64_t* last) {
  const size_t colon = v.find(':');
  if (colon == std::string_view::npos) return false;
  auto number = [](std::string_view s, uint64_t* out) {
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
    return !s.empty() && ec == std::errc() && end == s.data() + s.size();
  };
  return number(v.substr(0, colon), first) && number(v.substr(colon + 1), last) && *first >= 1 &&
         *first <= *last;
}

// "host:port" or "[v6 address]:port" with a port in min_port..65535.
bool split_endpoint(std::string_view v, std::string* host, std::string* port) {
  if (!check_endpoint(v, 0).empty()) return false;
  const size_t colon = v.rfind(':');
  *host = std::string(v.substr(0, colon));
  *port = std::string(v.substr(colon + 1));
  return true;
}

bool split_endpoint_unbracketed(std::string_view v, std::string* host, std::string* port) {
  if (!split_endpoint(v, host, port)) return false;
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  return true;
}

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

namespace {

std::string check_coordinator(std::string_view v) {
  return check_endpoint(v, 1);
}
std::string check_listen(std::string_view v) {
  return check_endpoint(v, 0);
}
// "A:B" with 1 <= A <= B.
std::string check_rounds(std::string_view v) {
  uint64_t a = 0;
  uint64_t b = 0;
  return parse_round_range(v, &a, &b) ? "" : "not A:B with 1 <= A <= B";
}
std::string check_listen_or_empty(std::string_view v) {
  return v.empty() ? "" : check_endpoint(v, 0);
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

std::string check_log(std::string_view v) {
  LogSpec spec;
  return parse_log_spec(v, &spec);
}

// A Linux interface name (at most 15 bytes), or auto.
std::string check_interface(std::string_view v) {
  if (v.size() > 15) return "longer than an interface name can be (15 bytes)";
  for (char c : v) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return fmt::format("'{}' does not belong in an interface name", c);
  }
  return "";
}

std::string check_path(std::string_view v) {
  for (char c : v) {
    if (c == '\0' || c == '\n' || c == '\r') return "a newline or NUL in the path";
  }
  return "";
}

std::string check_any(std::string_view) {
  return "";
}

}  // namespace

// Every key, in printing order. Top-level keys first (TOML needs them before
// any [table]), then one table per section.
const std::vector<Field>& fields() {
  static const std::vector<Field> kFields = {
      string_field(PSLD_KEY(log), check_log,
                   "a comma-separated list: a level (error, warn, info, debug) and/or "
                   "component=level items",
                   "levels of the messages psld writes (on stderr, or to PSLD_LOG_FILE): a "
                   "default and by component, e.g. warn,ucx=debug (docs/logging.md)"),

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
      string_field(PSLD_KEY(job.interface), check_interface,
                   "an interface name (eth0), auto, or empty",
                   "network interface this process uses: its address is job.listen's host "
                   "when job.listen is not set, and UCX's TCP transport uses only it; auto: the "
                   "one on the route to job.coordinator; empty: none chosen"),

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
      integer(PSLD_KEY(data.batch_chunk_bytes), 0, int64_t{1} << 30,
              "pushes of chunks of at most this many bytes that wait for the same server go out "
              "together, as one batch (one message and one write); 0: never"),
      integer(PSLD_KEY(data.batch_bytes), 1024, int64_t{1} << 30,
              "largest batch of small pushes, in bytes (and at most data.chunk_bytes)"),
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
      integer(PSLD_KEY(stats.worker_peers), 0, 65536,
              "servers a worker's load report names each window: its slowest and a rotating "
              "sample; 0: every server while num_workers x servers <= 65536, else 65536 / "
              "num_workers (at least 4)"),

      plain(PSLD_KEY(balancer.enabled), "move key ranges and scale servers while training runs"),
      integer(PSLD_KEY(balancer.interval_ms), 1, 86400000,
              "how often the balancer plans; at least stats.interval_ms"),
      number(PSLD_KEY(balancer.straggler_threshold), 0, 10, false,
             "a server is a straggler when its predicted time per round exceeds the others' by "
             "this fraction (above 0) ..."),
      integer(PSLD_KEY(balancer.straggler_windows), 1, 1000000,
              "... for this many statistics windows in a row, ..."),
      number(PSLD_KEY(balancer.false_alarm_windows), 10, 1e12, false,
             "... once a sequential test on its windows tells the change from noise: the test's "
             "mean windows between false alarms per server (larger: calmer, slower to see a "
             "small straggler)"),
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

      string_field(PSLD_KEY(checkpoint.dir), check_path, "a directory path (a string), or empty",
                   "where consistent checkpoints are written (and read with checkpoint.resume); "
                   "every server and the coordinator must see it; empty: none"),
      integer(PSLD_KEY(checkpoint.every_rounds), 0, 1000000000,
              "a checkpoint after every this many rounds (needs checkpoint.dir and data.sync = "
              "bsp); 0: none"),
      integer(PSLD_KEY(checkpoint.keep), 1, 1000000, "complete checkpoints kept in checkpoint.dir"),
      plain(PSLD_KEY(checkpoint.resume),
            "start from the newest complete checkpoint in checkpoint.dir: parameters, optimizer "
            "state and rounds as they were"),

      integer(PSLD_KEY(replication.factor), 1, 2,
              "copies of every key range: 1, the owner only (a lost server fails the job); 2, a "
              "backup on another server takes the range over when its owner dies (async and "
              "staleness: with the balancer off)"),

      string_field(PSLD_KEY(trace.dir), check_path, "a directory path (a string), or empty",
                   "where each process writes a Chrome trace (Perfetto) of trace.rounds: worker "
                   "chunks' push, wait and pull, server reduce and update, epoch switches; "
                   "empty: none"),
      string_field(PSLD_KEY(trace.rounds), check_rounds, "a string A:B with 1 <= A <= B",
                   "the rounds traced; a process writes its file once past B, or when it ends"),
      string_field(PSLD_KEY(metrics.listen), check_listen_or_empty,
                   "host:port with a port in 0..65535 (0: any), or empty",
                   "where the coordinator serves /metrics (Prometheus) and /status.json (psld "
                   "top) over HTTP, unauthenticated: loopback or a trusted network; empty: off"),
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

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

// The candidate a typo most likely meant, or "". `sep` separates a name's
// parts ('.' in keys, '_' in variables): a name that matches the end of
// exactly one candidate ("num_workers" for "job.num_workers") is taken first,
// since leaving out the section is the likeliest mistake.
std::string closest(std::string_view name, const std::vector<std::string>& candidates, char sep,
                    std::string_view prefix) {
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

std::string did_you_mean(const std::string& suggestion, std::string_view before) {
  if (suggestion.empty()) return "; docs/configuration.md lists every key";
  return fmt::format("; did you mean {}{}?", before, suggestion);
}

}  // namespace psld::config_detail
