// bench/ps_bench.cc — the parameter server's goodput next to the raw
// transport's write bandwidth, measured in the same run (docs/ps-bench-results.md).
//
//   ps_bench [--tls tcp|shm|all] [--workers W --servers S] [--sizes 4K,...,64M]
//            [--mode push_pull|push|pull|all|raw] [--seconds T] [--repeat N]
//            [--chunk-bytes B] [--slots N] [--raw-threads N]
//            [--tensor-memory psld|heap] [--server-device cpu|cuda] [--quick]
//            [--replication 1,2] [--batch-chunk-bytes B] [--profile NAME]
//            [--sync bsp|async] [--json FILE]
//
// One process holds a coordinator, S servers and W workers on the `ucx`
// transport (tcp: UCX_TLS=tcp; shm: UCX_TLS=sm,tcp), server mode sum, BSP,
// like ps-lite's test_benchmark (--server-device cuda: the servers keep
// their keys in GPU memory, docs/gpu.md "GPU servers"). For every tensor size each worker registers
// a set of fp32 tensors of that size that puts `slots_per_worker` chunks on
// every server (picked from the coordinator's epoch-0 placement, so that no
// server owns more than its share), and runs rounds of the mode over the set:
//
//   push_pull  push every tensor and get the round's sum back
//   push       push every tensor (complete when the bytes left the tensor)
//   pull       pull every tensor's current value
//
// goodput = bytes the workers' requests moved (tensor bytes pushed plus
// tensor bytes pulled, summed over workers) / wall time of the timed rounds,
// in GB/s (10^9 bytes/s).
//
// The yardstick, measured right before the modes of the same size: W sender
// and S receiver transports of the same backend and TLS, W x S connections,
// each keeping `slots_per_worker` writes of min(size, chunk_bytes) in flight
// from a registered heap buffer into an allocate_memory region (what a push
// does: tensor -> landing slot), refilled from the write's completion; bytes
// counted at the receivers' on_write. Each transport is progressed the way
// the runtime's endpoints are, by a ProgressThread that sleeps when idle
// (--raw-threads N: N busy-polling threads instead).
//
// Progress goes to stderr; the table (markdown) to stdout, a row at a time;
// --json FILE writes the rows as Google Benchmark-shaped JSON too (bench/report.h;
// psld bench run's ps suite): BM_ps_<mode>/<tls>/<W>x<S>/<bytes> with
// bytes_per_second = goodput, ratio = goodput / raw and yardstick
// BM_ps_raw/<tls>/<W>x<S>/<bytes>, whose bytes_per_second is the raw rate;
// real_time is the ns a MiB took.
// --profile NAME replaces the sizes with one point: every tensor of a
// model's profile (bench/profiles, e.g. resnet50's 161), fp32, carved one
// after another from one block per worker, push_pulled together each round.
// Its yardstick is the rate raw writes move the same bytes at in the same
// chunk sizes: the profile's chunks grouped by the power of two their size
// rounds up to, each group's raw rate measured at that size, and the group
// times summed. Its rows are named by the profile (BM_ps_push_pull/shm/4x2/resnet50).
// --replication 1,2 runs a job per replication.factor side by side (each
// point measured on both, interleaved; docs/replication.md) and ends with a
// table of their goodputs; rows of factor 2 are BM_ps_<mode>_r2/....
// --sync async runs the jobs in async mode instead of BSP (each worker's
// rounds at its own pace; with --replication, the cost of copies counted
// per push: docs/replication.md).
// Every wait has a timeout and a watchdog ends the process with a message
// if a phase overruns, so the benchmark never hangs.
// Under valgrind --tool=callgrind each timed span's instructions are dumped
// on their own with its count of operations: tools/chunk-cost prints the
// instructions per raw write and per push_pull chunk.

#include <fmt/format.h>
#include <strings.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <latch>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define PSLD_HAVE_CALLGRIND 1
#else
#define PSLD_HAVE_CALLGRIND 0
#endif

#include "bench/bench_util.h"
#include "bench/profiles.h"
#include "bench/report.h"
#include "lib/coordinator/service.h"
#include "lib/server/service.h"
#include "lib/worker/service.h"
#include "transports/transport.h"

namespace psld {
namespace {

using bench::on_threads;
using bench::Watchdog;

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// ---- options

struct Medium {
  std::string label;  // "tcp" or "shm"
  std::string tls;    // UCX_TLS for it
};

enum class Mode { kPushPull, kPush, kPull };

std::string_view mode_name(Mode m) {
  switch (m) {
    case Mode::kPushPull:
      return "push_pull";
    case Mode::kPush:
      return "push";
    case Mode::kPull:
      return "pull";
  }
  return "?";
}

struct Shape {
  uint32_t workers = 0;
  uint32_t servers = 0;
};

// The point of --profile in Options::sizes (no real size is 0).
constexpr uint64_t kProfilePoint = 0;

struct Options {
  std::vector<Medium> media;
  std::vector<Shape> shapes;
  std::vector<uint64_t> sizes;
  std::vector<Mode> modes;
  double seconds = 1.0;
  uint32_t repeat = 1;
  uint64_t chunk_bytes = kDefaultChunkBytes;
  uint32_t slots = 16;
  // data.batch_chunk_bytes of the job (0: no batches); the config's default.
  uint64_t batch_chunk_bytes = DataConfig{}.batch_chunk_bytes;
  uint32_t raw_threads = 0;  // 0: one sleeping progress thread per transport
  bool psld_memory = true;   // tensors in Worker::allocate memory, else malloc'd
  ServerDeviceKind server_device = ServerDeviceKind::kCpu;
  std::vector<uint32_t> replication = {1};  // replication.factor of the jobs, side by side
  SyncMode sync = SyncMode::kBsp;           // data.sync of the jobs
  // --profile: a model's tensors (bench/profiles) as one more point, pushed
  // together each round; its name labels the rows.
  std::string profile;
  std::vector<bench::TensorSpec> profile_tensors;
  std::string json;  // --json FILE, or empty
};

constexpr std::string_view kUsage =
    "usage: ps_bench [--tls tcp|shm|all] [--workers W --servers S] [--sizes 4K,...,64M]\n"
    "                [--mode push_pull|push|pull|all|raw] [--seconds T] [--repeat N]\n"
    "                [--chunk-bytes B] [--slots N] [--raw-threads N]\n"
    "                [--tensor-memory psld|heap] [--server-device cpu|cuda] [--quick]\n"
    "                [--replication 1,2] [--batch-chunk-bytes B] [--profile NAME]\n"
    "                [--sync bsp|async] [--json FILE]\n"
    "\n"
    "  --tls         tcp (UCX_TLS=tcp), shm (UCX_TLS=sm,tcp) or all (default: all)\n"
    "  --workers, --servers  one job shape, given together (default: 2x2 and 4x2)\n"
    "  --sizes       tensor sizes, comma-separated, K/M/G = KiB/MiB/GiB\n"
    "                (default: 4K,16K,64K,256K,1M,4M,16M,64M)\n"
    "  --mode        push_pull, push, pull or all (default: all); raw: the yardstick only\n"
    "  --seconds     timed seconds per point (default: 1)\n"
    "  --repeat      measure every point N times, interleaved, keep the best (default: 1)\n"
    "  --chunk-bytes data.chunk_bytes of the job (default: 4M)\n"
    "  --profile     a model's tensors (resnet50, vgg16, bert_base or a .tsv; bench/profiles)\n"
    "                as the point instead of --sizes: every tensor push_pulled each round;\n"
    "                raw = the raw writes of the same chunks (rate per power-of-two size)\n"
    "  --batch-chunk-bytes  data.batch_chunk_bytes of the job: small pushes to a server\n"
    "                submitted together travel in batches; 0 = none (default: 16K)\n"
    "  --slots       slots_per_worker of the job, also the yardstick's writes in flight\n"
    "                per connection (default: 16)\n"
    "  --raw-threads the yardstick's progress: 0 = a sleeping progress thread per transport,\n"
    "                as the runtime has (default); N = N busy-polling threads\n"
    "  --tensor-memory  where the workers' tensors are: psld = Worker::allocate (servers on\n"
    "                this host write pulls into it directly; default), heap = aligned_alloc\n"
    "  --server-device where servers keep their keys: cpu (default) or cuda (GPU memory,\n"
    "                server.device = cuda; needs a GPU)\n"
    "  --quick       a short run for CI: 2x2, sizes 64K,1M,4M, 0.2 s per point\n"
    "                (flags given explicitly still win)\n"
    "  --replication replication.factor of the job: 1, 2, or 1,2 (a job of each, measured\n"
    "                side by side; default: 1)\n"
    "  --sync        data.sync of the jobs: bsp (default) or async\n"
    "  --json        also write the rows to FILE as Google Benchmark-shaped JSON\n";

Status bad_flag(const std::string& message) {
  return InvalidArgument(message + "\n\n" + std::string(kUsage));
}

// "4K", "64M", "1G" (binary units, optional "iB"/"B"), or plain bytes.
Result<uint64_t> parse_bytes(std::string_view text) {
  std::string t(text);
  uint64_t mult = 1;
  auto strip = [&](std::string_view suffix) {
    if (t.size() > suffix.size() &&
        strcasecmp(t.c_str() + t.size() - suffix.size(), std::string(suffix).c_str()) == 0) {
      t.resize(t.size() - suffix.size());
      return true;
    }
    return false;
  };
  if (!strip("iB")) strip("B");
  if (strip("K")) {
    mult = uint64_t{1} << 10;
  } else if (strip("M")) {
    mult = uint64_t{1} << 20;
  } else if (strip("G")) {
    mult = uint64_t{1} << 30;
  }
  if (t.empty() || t.find_first_not_of("0123456789") != std::string::npos || t.size() > 12) {
    return InvalidArgument(fmt::format("'{}' is not a size (e.g. 4096, 4K, 64M)", text));
  }
  return std::stoull(t) * mult;
}

Result<uint64_t> parse_uint(std::string_view flag, std::string_view text, uint64_t lo,
                            uint64_t hi) {
  const std::string t(text);
  if (t.empty() || t.find_first_not_of("0123456789") != std::string::npos || t.size() > 9 ||
      std::stoull(t) < lo || std::stoull(t) > hi) {
    return InvalidArgument(
        fmt::format("{} '{}' is not valid: a whole number in [{}, {}]", flag, text, lo, hi));
  }
  return std::stoull(t);
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (true) {
    const size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end - start));
    if (end == std::string_view::npos) return out;
    start = end + 1;
  }
}

std::string human_size(uint64_t n) {
  if (n >= (uint64_t{1} << 30) && n % (uint64_t{1} << 30) == 0) {
    return fmt::format("{} GiB", n >> 30);
  }
  if (n >= (uint64_t{1} << 20) && n % (uint64_t{1} << 20) == 0) {
    return fmt::format("{} MiB", n >> 20);
  }
  if (n >= 1024 && n % 1024 == 0) return fmt::format("{} KiB", n >> 10);
  return fmt::format("{} B", n);
}

Result<Options> parse_args(int argc, char** argv) {
  Options o;
  std::optional<std::string> tls, mode, sizes, replication;
  std::optional<uint64_t> workers, servers, repeat, chunk, slots, batch_chunk;
  std::optional<double> seconds;
  std::optional<uint64_t> raw_threads;
  std::string tensor_memory = "psld";
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage.data(), stdout);
      std::exit(0);
    }
    if (arg == "--quick") {
      quick = true;
      continue;
    }
    std::string value;
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg.resize(eq);
    } else {
      static const char* const kTakesValue[] = {
          "--tls",         "--workers",       "--servers",
          "--sizes",       "--mode",          "--seconds",
          "--repeat",      "--chunk-bytes",   "--slots",
          "--raw-threads", "--tensor-memory", "--server-device",
          "--json",        "--replication",   "--batch-chunk-bytes",
          "--profile",     "--sync"};
      const bool known = std::any_of(std::begin(kTakesValue), std::end(kTakesValue),
                                     [&](const char* f) { return arg == f; });
      if (!known) return bad_flag(fmt::format("unknown argument '{}'", arg));
      if (i + 1 >= argc) return bad_flag(fmt::format("{} needs a value", arg));
      value = argv[++i];
    }
    if (arg == "--tls") {
      tls = value;
    } else if (arg == "--mode") {
      mode = value;
    } else if (arg == "--sizes") {
      sizes = value;
    } else if (arg == "--workers") {
      PSLD_ASSIGN_OR_RETURN(workers, parse_uint(arg, value, 1, 64));
    } else if (arg == "--servers") {
      PSLD_ASSIGN_OR_RETURN(servers, parse_uint(arg, value, 1, 64));
    } else if (arg == "--repeat") {
      PSLD_ASSIGN_OR_RETURN(repeat, parse_uint(arg, value, 1, 100));
    } else if (arg == "--tensor-memory") {
      if (value != "psld" && value != "heap") {
        return bad_flag(fmt::format("--tensor-memory '{}' is not psld or heap", value));
      }
      tensor_memory = value;
    } else if (arg == "--server-device") {
      if (value != "cpu" && value != "cuda") {
        return bad_flag(fmt::format("--server-device '{}' is not cpu or cuda", value));
      }
      o.server_device = value == "cuda" ? ServerDeviceKind::kCuda : ServerDeviceKind::kCpu;
    } else if (arg == "--replication") {
      replication = value;
    } else if (arg == "--sync") {
      if (value != "bsp" && value != "async") {
        return bad_flag(fmt::format("--sync '{}' is not bsp or async", value));
      }
      o.sync = value == "async" ? SyncMode::kAsync : SyncMode::kBsp;
    } else if (arg == "--json") {
      if (value.empty()) return bad_flag("--json needs a file name");
      o.json = value;
    } else if (arg == "--raw-threads") {
      PSLD_ASSIGN_OR_RETURN(raw_threads, parse_uint(arg, value, 0, 256));
    } else if (arg == "--slots") {
      PSLD_ASSIGN_OR_RETURN(slots, parse_uint(arg, value, 1, 1024));
    } else if (arg == "--profile") {
      auto tensors = bench::load_profile(value);
      if (!tensors.ok()) return bad_flag("--profile: " + tensors.status().message());
      if (tensors->empty()) return bad_flag(fmt::format("--profile '{}' has no tensors", value));
      o.profile = value.substr(value.find_last_of('/') + 1);
      if (o.profile.size() > 4 && o.profile.ends_with(".tsv"))
        o.profile.resize(o.profile.size() - 4);
      o.profile_tensors = std::move(tensors).value();
    } else if (arg == "--batch-chunk-bytes") {
      PSLD_ASSIGN_OR_RETURN(batch_chunk, parse_bytes(value));
    } else if (arg == "--chunk-bytes") {
      PSLD_ASSIGN_OR_RETURN(chunk, parse_bytes(value));
      if (*chunk < 4096 || *chunk > (uint64_t{256} << 20) || *chunk % 4 != 0) {
        return bad_flag(fmt::format(
            "--chunk-bytes '{}' is not valid: 4K to 256M, a multiple of 4 bytes", value));
      }
    } else if (arg == "--seconds") {
      char* end = nullptr;
      const double v = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(v > 0.0) || v > 600.0) {
        return bad_flag(
            fmt::format("--seconds '{}' is not valid: a number of seconds in (0, 600]", value));
      }
      seconds = v;
    } else {
      return bad_flag(fmt::format("unknown argument '{}'", arg));
    }
  }

  const std::string t = tls.value_or("all");
  if (t == "tcp" || t == "all") o.media.push_back({"tcp", "tcp"});
  // UCX 1.13 establishes a socket-address connection only with tcp among the
  // transports; with sm in the list shared memory carries the data.
  if (t == "shm" || t == "all") o.media.push_back({"shm", "sm,tcp"});
  if (o.media.empty()) {
    return bad_flag(fmt::format("--tls '{}' is not valid; accepted values: tcp, shm, all", t));
  }

  if (workers.has_value() != servers.has_value()) {
    return bad_flag("--workers and --servers go together (e.g. --workers 4 --servers 2)");
  }
  if (workers) {
    o.shapes.push_back({static_cast<uint32_t>(*workers), static_cast<uint32_t>(*servers)});
  } else if (quick) {
    o.shapes = {{2, 2}};
  } else {
    o.shapes = {{2, 2}, {4, 2}};
  }

  const std::string m = mode.value_or("all");
  if (m == "push_pull" || m == "all") o.modes.push_back(Mode::kPushPull);
  if (m == "push" || m == "all") o.modes.push_back(Mode::kPush);
  if (m == "pull" || m == "all") o.modes.push_back(Mode::kPull);
  if (o.modes.empty() && m != "raw") {
    return bad_flag(fmt::format(
        "--mode '{}' is not valid; accepted values: push_pull, push, pull, all, raw", m));
  }

  if (!o.profile.empty()) {
    if (sizes) return bad_flag("--profile and --sizes go apart: the profile gives the sizes");
    o.sizes = {kProfilePoint};
  }
  const std::string sz = sizes.value_or(quick ? "64K,1M,4M" : "4K,16K,64K,256K,1M,4M,16M,64M");
  for (std::string_view part :
       !o.profile.empty() ? std::vector<std::string_view>{} : split(sz, ',')) {
    auto b = parse_bytes(part);
    if (!b.ok()) return bad_flag("--sizes: " + b.status().message());
    if (*b < 4 || *b % 4 != 0 || *b > (uint64_t{1} << 30)) {
      return bad_flag(fmt::format(
          "--sizes: '{}' is not valid: 4 bytes to 1G, a multiple of 4 (fp32 tensors)", part));
    }
    o.sizes.push_back(*b);
  }

  o.seconds = seconds.value_or(quick ? 0.2 : 1.0);
  o.repeat = static_cast<uint32_t>(repeat.value_or(1));
  o.chunk_bytes = chunk.value_or(kDefaultChunkBytes);
  o.slots = static_cast<uint32_t>(slots.value_or(16));
  if (batch_chunk) o.batch_chunk_bytes = *batch_chunk;
  o.raw_threads = static_cast<uint32_t>(raw_threads.value_or(0));
  o.psld_memory = tensor_memory != "heap";
  if (replication) {
    o.replication.clear();
    for (std::string_view part : split(*replication, ',')) {
      PSLD_ASSIGN_OR_RETURN(const uint64_t f, parse_uint("--replication", part, 1, 2));
      o.replication.push_back(static_cast<uint32_t>(f));
    }
    for (const Shape& shape : o.shapes) {
      if (shape.servers < 2 && std::count(o.replication.begin(), o.replication.end(), 2u) > 0) {
        return bad_flag("--replication 2 needs at least 2 servers");
      }
    }
  }
  return o;
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t, FreeDeleter>;

Result<Buffer> zeroed_buffer(uint64_t bytes) {
  const uint64_t rounded = (std::max<uint64_t>(bytes, 1) + 4095) / 4096 * 4096;
  Buffer b(static_cast<uint8_t*>(std::aligned_alloc(4096, rounded)));
  if (!b) return ResourceExhausted(fmt::format("cannot allocate {}", human_size(rounded)));
  std::memset(b.get(), 0, rounded);  // zeros: sums stay finite and never denormal
  return b;
}

double since(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double>(t1 - t0).count();
}

// CPU time of the whole process (every thread), user + system, in seconds.
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto sec = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

// What one measurement gives: bytes/s, and the cores the process kept busy
// meanwhile (CPU seconds / wall seconds), which tells a CPU-bound point from
// one that waits.
struct Rate {
  double bytes_per_s = 0;
  double cores = 0;
};

// Under valgrind --tool=callgrind (tools/chunk-cost), the instructions of each
// timed span are dumped on their own, its description naming the point and
// how many operations (raw writes, push_pull chunks) it did; tools/chunk-cost
// divides one by the other. Without valgrind these cost a few instructions.
void count_instructions_from_here() {
#if PSLD_HAVE_CALLGRIND
  CALLGRIND_ZERO_STATS;
#endif
}

void dump_instructions(std::string_view tag, std::string_view what, uint64_t ops) {
#if PSLD_HAVE_CALLGRIND
  const std::string desc = fmt::format("ps_bench {} {} ops={}", tag, what, ops);
  CALLGRIND_DUMP_STATS_AT(desc.c_str());
#else
  (void)tag, (void)what, (void)ops;
#endif
}

// ---- the yardstick: the transport alone

// W sender and S receiver transports, W x S connections, progressed by one
// busy-polling thread per core (senders and receivers spread over them), the
// way bench/transport_bench and ucx_perftest measure a pair: all the CPU
// there is, spent on nothing but the transport. The threads spin while a
// measurement runs and nap between measurements, so that they take nothing
// from the parameter server's points.
class RawRig {
 public:
  static Result<std::unique_ptr<RawRig>> create(const Medium& m, Shape shape, uint32_t window,
                                                uint64_t max_chunk, uint32_t poll_threads) {
    std::unique_ptr<RawRig> rig(new RawRig);
    rig->window_ = window;
    rig->max_chunk_ = max_chunk;
    transport::TransportOptions o;
    o.ucx.tls = m.tls;
    o.common.op_timeout = 30s;
    for (uint32_t s = 0; s < shape.servers; ++s) {
      auto node = std::make_unique<Node>();
      PSLD_ASSIGN_OR_RETURN(node->transport, transport::create_transport("ucx", o, &node->handler));
      rig->receivers_.push_back(std::move(node));
    }
    transport::TransportOptions so = o;
    so.common.listen_address.clear();  // senders only dial, like workers
    for (uint32_t w = 0; w < shape.workers; ++w) {
      auto node = std::make_unique<Node>();
      PSLD_ASSIGN_OR_RETURN(node->transport,
                            transport::create_transport("ucx", so, &node->handler));
      PSLD_ASSIGN_OR_RETURN(node->buffer, zeroed_buffer(window * max_chunk));
      PSLD_ASSIGN_OR_RETURN(node->source,
                            node->transport->register_memory(node->buffer.get(), window * max_chunk,
                                                             MemoryKind::kHost));
      rig->senders_.push_back(std::move(node));
    }
    // poll_threads == 0: a ProgressThread per transport, as the runtime's
    // endpoints have.
    const uint32_t threads = poll_threads == 0
                                 ? shape.workers + shape.servers
                                 : std::min(poll_threads, shape.workers + shape.servers);
    rig->sleeping_ = poll_threads == 0;
    std::vector<std::vector<transport::Transport*>> share(threads);
    for (uint32_t w = 0; w < shape.workers; ++w)
      share[w % threads].push_back(rig->senders_[w]->transport.get());
    for (uint32_t s = 0; s < shape.servers; ++s)
      share[(shape.workers + s) % threads].push_back(rig->receivers_[s]->transport.get());
    for (auto& mine : share)
      rig->pollers_.emplace_back([raw = rig.get(), mine] { raw->poll(mine); });
    for (auto& sender : rig->senders_) {
      for (auto& receiver : rig->receivers_) {
        auto st = std::make_unique<Stream>();
        st->source = sender->source.get();
        // A ring of landing slots, as a server grants a worker.
        PSLD_ASSIGN_OR_RETURN(st->target, receiver->transport->allocate_memory(window * max_chunk,
                                                                               MemoryKind::kHost));
        PSLD_ASSIGN_OR_RETURN(st->conn, sender->transport->connect(receiver->transport->address()));
        // A key imported before the handshake chose the lanes is unpacked
        // without the shared-memory ones and cannot be mapped (writes to it
        // then take the active-message path); the runtime imports its keys
        // later, from Grant and TensorKey messages.
        const auto deadline = Clock::now() + 30s;
        while (st->conn->write_path() != "put" && st->conn->write_path() != "am") {
          if (Clock::now() > deadline) return Timeout("the raw connection's handshake never ended");
          std::this_thread::sleep_for(1ms);
        }
        PSLD_ASSIGN_OR_RETURN(st->remote, st->conn->import_region(st->target->remote_key()));
        rig->streams_.push_back(std::move(st));
      }
    }
    rig->path_ = rig->streams_.empty() ? "" : rig->streams_.front()->conn->write_path();
    return rig;
  }

  ~RawRig() {
    stop_ = true;
    for (auto& n : senders_)
      n->transport->wake();
    for (auto& n : receivers_)
      n->transport->wake();
    for (auto& t : pollers_)
      t.join();
    streams_.clear();
    for (auto& n : senders_)
      n->transport->shutdown();
    for (auto& n : receivers_)
      n->transport->shutdown();
  }

  const std::string& path() const { return path_; }

  // Aggregate bytes/s landed at the receivers while every connection keeps
  // window_ writes of `chunk` bytes in flight.
  Result<Rate> measure(uint64_t chunk, double seconds, std::string_view tag) {
    if (chunk > max_chunk_) return InvalidArgument("chunk larger than the rig's slots");
    chunk_ = chunk;
    failures_ = 0;
    running_ = true;
    spin_ = true;
    for (auto& st : streams_) {
      for (uint32_t slot = 0; slot < window_; ++slot)
        issue(*st, slot);
    }
    const double warm = std::min(0.25, seconds / 2);
    std::this_thread::sleep_for(std::chrono::duration<double>(warm));
    count_instructions_from_here();
    const uint64_t b0 = landed_bytes();
    const double c0 = cpu_seconds();
    const auto t0 = Clock::now();
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    const uint64_t b1 = landed_bytes();
    dump_instructions(tag, fmt::format("raw {}", human_size(chunk)), (b1 - b0) / chunk);
    const double c1 = cpu_seconds();
    const auto t1 = Clock::now();
    running_ = false;
    // Let the writes in flight finish and land, so the next point starts clean.
    const auto deadline = Clock::now() + 30s;
    Status drained;
    while (true) {
      bool idle = true;
      for (auto& st : streams_) {
        if (st->outstanding.load() != 0) idle = false;
      }
      uint64_t landed = 0;
      for (auto& r : receivers_)
        landed += r->handler.writes.load();
      if (idle && landed == issued_.load()) break;
      if (Clock::now() > deadline) {
        drained =
            Timeout(fmt::format("raw writes of {} did not drain within 30 s ({} of {} landed)",
                                human_size(chunk), landed, issued_.load()));
        break;
      }
      std::this_thread::sleep_for(1ms);
    }
    spin_ = false;
    PSLD_RETURN_IF_ERROR(drained);
    if (failures_.load() != 0) {
      return Internal(
          fmt::format("{} raw writes failed; first: {}", failures_.load(), first_failure()));
    }
    return Rate{static_cast<double>(b1 - b0) / since(t0, t1), (c1 - c0) / since(t0, t1)};
  }

 private:
  struct Counter final : transport::Handler {
    void on_accept(const transport::ConnectionPtr& conn) override {
      std::lock_guard<std::mutex> lock(mu);
      accepted.push_back(conn);
    }
    void on_write(const transport::ConnectionPtr&, uint32_t, uint64_t length) override {
      bytes.fetch_add(length, std::memory_order_relaxed);
      writes.fetch_add(1, std::memory_order_relaxed);
    }
    void on_message(const transport::ConnectionPtr&, std::span<const uint8_t>) override {}
    std::atomic<uint64_t> bytes{0};
    std::atomic<uint64_t> writes{0};
    std::mutex mu;
    std::vector<transport::ConnectionPtr> accepted;
  };
  struct Node {
    Counter handler;  // outlives the transport (declared first, destroyed last)
    std::unique_ptr<transport::Transport> transport;
    Buffer buffer;
    std::shared_ptr<transport::MemoryRegion> source;
  };
  struct Stream {
    const transport::MemoryRegion* source = nullptr;
    std::shared_ptr<transport::MemoryRegion> target;
    transport::ConnectionPtr conn;
    std::shared_ptr<transport::RemoteRegion> remote;
    std::atomic<uint32_t> outstanding{0};
  };

  RawRig() = default;

  void poll(const std::vector<transport::Transport*>& mine) {
    while (!stop_.load(std::memory_order_relaxed)) {
      size_t work = 0;
      for (transport::Transport* t : mine)
        work += t->progress();
      if (work != 0) continue;
      if (sleeping_) {
        mine.front()->wait(100ms);
      } else if (!spin_.load(std::memory_order_relaxed)) {
        std::this_thread::sleep_for(2ms);
      }
    }
  }

  // One write into `slot`; its completion (on the sender's polling thread)
  // issues the next one while the measurement runs.
  void issue(Stream& st, uint32_t slot) {
    st.outstanding.fetch_add(1);
    issued_.fetch_add(1);
    const transport::WriteRequest wr{st.source,         slot * chunk_, st.remote.get(),
                                     slot * max_chunk_, chunk_,        slot + 1};
    Status s = st.conn->write(wr, [this, &st, slot](Status done) {
      if (!done.ok()) record_failure(done);
      if (done.ok() && running_.load(std::memory_order_relaxed)) issue(st, slot);
      st.outstanding.fetch_sub(1);
    });
    if (!s.ok()) {
      record_failure(s);
      issued_.fetch_sub(1);
      st.outstanding.fetch_sub(1);
    }
  }
  void record_failure(const Status& s) {
    if (failures_.fetch_add(1) == 0) {
      std::lock_guard<std::mutex> lock(failure_mu_);
      first_failure_ = s.to_string();
    }
  }
  std::string first_failure() {
    std::lock_guard<std::mutex> lock(failure_mu_);
    return first_failure_;
  }
  uint64_t landed_bytes() const {
    uint64_t b = 0;
    for (const auto& r : receivers_)
      b += r->handler.bytes.load();
    return b;
  }

  uint32_t window_ = 0;
  uint64_t max_chunk_ = 0;
  uint64_t chunk_ = 0;
  std::string path_;
  std::vector<std::unique_ptr<Node>> receivers_, senders_;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::atomic<bool> running_{false};
  std::atomic<bool> spin_{false};
  bool sleeping_ = false;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> issued_{0};
  std::atomic<uint64_t> failures_{0};
  std::mutex failure_mu_;
  std::string first_failure_;
  std::vector<std::thread> pollers_;  // last: joined before the rest goes
};

// ---- the parameter server

class Cluster {
 public:
  static Result<std::unique_ptr<Cluster>> start(const Options& opts, const Medium& m, Shape shape,
                                                uint32_t replication) {
    std::unique_ptr<Cluster> c(new Cluster);
    c->psld_memory_ = opts.psld_memory;
    c->profile_ = opts.profile_tensors;
    RuntimeOptions& base = c->base_;
    base.net.transport = "ucx";
    base.net.options.ucx.tls = m.tls;
    base.net.options.common.op_timeout = 30s;
    base.secret = "ps_bench";
    base.num_workers = shape.workers;
    base.num_servers = shape.servers;
    base.chunk_bytes = opts.chunk_bytes;
    base.slots_per_worker = opts.slots;
    base.batch_chunk_bytes = opts.batch_chunk_bytes;
    base.sync = opts.sync;
    base.mode = ServerMode::kSum;
    base.server_device = opts.server_device;
    base.replication_factor = replication;
    // Generous: two cores run every member's threads at full load.
    base.heartbeat_timeout = 20s;
    base.connect_timeout = 30s;
    PSLD_ASSIGN_OR_RETURN(c->coordinator_, CoordinatorService::start(base));
    base.coordinator_address = c->coordinator_->address();
    c->servers_.resize(shape.servers);
    c->workers_.resize(shape.workers);
    PSLD_RETURN_IF_ERROR(on_threads(shape.servers + shape.workers, [&](uint32_t i) -> Status {
      if (i < shape.servers) {
        PSLD_ASSIGN_OR_RETURN(c->servers_[i], ServerService::start(c->base_));
        return Status::Ok();
      }
      RuntimeOptions o = c->base_;
      o.rank = static_cast<int32_t>(i - shape.servers);
      PSLD_ASSIGN_OR_RETURN(c->workers_[i - shape.servers], WorkerService::start(o));
      return Status::Ok();
    }));
    if (!c->coordinator_->placement()) return Internal("the job has no placement");
    return c;
  }

  ~Cluster() {
    for (auto& w : workers_) {
      if (w) (void)w->shutdown();
    }
    if (coordinator_) (void)coordinator_->wait(5s);
    for (auto& s : servers_) {
      if (s) s->shutdown();
    }
    if (coordinator_) coordinator_->shutdown();
    workers_.clear();  // before the tensors' memory goes
  }

  // Registers the tensor set for `size` on every worker (once per size).
  Status prepare(uint64_t size) {
    if (sets_.count(size)) return Status::Ok();
    if (size == kProfilePoint) return prepare_profile();
    TensorSet set;
    const uint32_t num_servers = base_.num_servers;
    const uint64_t chunks = (size + base_.chunk_bytes - 1) / base_.chunk_bytes;
    const uint64_t want = uint64_t{base_.slots_per_worker} * num_servers;
    set.count = static_cast<uint32_t>(std::max<uint64_t>(1, (want + chunks / 2) / chunks));
    const uint64_t cap = (set.count * chunks + num_servers - 1) / num_servers;
    // The coordinator numbers tensors 1, 2, ... in the order their names are
    // first registered, so the next id is known: a candidate whose chunks
    // would give a server more than its share is registered empty (0 bytes,
    // no chunks) to use up its id, and the next id is tried.
    const Placement placement = *coordinator_->placement();
    std::map<ServerId, uint64_t> load;
    std::vector<std::string> names;
    WorkerService& first = *workers_[0];
    set.memory.resize(workers_.size());
    set.base.resize(workers_.size());
    set.handles.resize(workers_.size());
    PSLD_RETURN_IF_ERROR(tensor_memory(set, 0, set.count * size));
    uint32_t scanned = 0;
    while (names.size() < set.count) {
      const TensorId id = next_tensor_id_++;
      std::map<ServerId, uint64_t> add;
      for (uint64_t c = 0; c < chunks; ++c)
        ++add[placement.owner_of_key(make_key(id, static_cast<uint32_t>(c)))];
      bool fits = true;
      for (const auto& [server, n] : add) {
        if (load[server] + n > cap) fits = false;
      }
      // Past a few thousand tries take what comes; the imbalance is reported.
      if (!fits && ++scanned < 4096) {
        auto skip =
            first.register_tensor(fmt::format("skip{}", id), DType::kFloat32, 0, nullptr, nullptr);
        if (!skip.ok()) return skip.status().with_context("registering a placeholder tensor");
        continue;
      }
      for (const auto& [server, n] : add)
        load[server] += n;
      names.push_back(fmt::format("t{}_{}", size, names.size()));
      // Worker 0 registers in id order; the others follow below.
      PSLD_ASSIGN_OR_RETURN(
          uint32_t h, first.register_tensor(names.back(), DType::kFloat32, size,
                                            set.base[0] + (names.size() - 1) * size, nullptr));
      set.handles[0].push_back(h);
    }
    set.max_share = 0;
    for (const auto& [server, n] : load)
      set.max_share = std::max(set.max_share, n);
    set.chunks_per_round = set.count * chunks;
    set.bytes = set.count * size;
    PSLD_RETURN_IF_ERROR(
        on_threads(static_cast<uint32_t>(workers_.size() - 1), [&](uint32_t i) -> Status {
          const uint32_t wi = i + 1;
          PSLD_RETURN_IF_ERROR(tensor_memory(set, wi, set.count * size));
          for (size_t t = 0; t < names.size(); ++t) {
            PSLD_ASSIGN_OR_RETURN(uint32_t h,
                                  workers_[wi]->register_tensor(names[t], DType::kFloat32, size,
                                                                set.base[wi] + t * size, nullptr));
            set.handles[wi].push_back(h);
          }
          return Status::Ok();
        }));
    sets_[size] = std::move(set);
    // One push_pull round: the servers create the keys' state, every path
    // is set up.
    return on_threads(num_workers(),
                      [&](uint32_t w) { return round(w, sets_[size], RequestKind::kPushPull); });
  }

  // The --profile point: every tensor of the profile, fp32, one after
  // another (64-byte aligned) in one block per worker, in the profile's
  // order, as a trainer registers its model's parameters.
  Status prepare_profile() {
    TensorSet set;
    std::vector<uint64_t> offsets;
    uint64_t total = 0;
    for (const auto& t : profile_) {
      total = (total + 63) & ~uint64_t{63};
      offsets.push_back(total);
      total += t.elements * 4;
      set.bytes += t.elements * 4;
    }
    set.count = static_cast<uint32_t>(profile_.size());
    set.memory.resize(workers_.size());
    set.base.resize(workers_.size());
    set.handles.resize(workers_.size());
    const Placement placement = *coordinator_->placement();
    std::map<ServerId, uint64_t> load;
    // Worker 0 first: the coordinator numbers tensors in that order.
    for (uint32_t wi = 0; wi < num_workers(); ++wi) {
      PSLD_RETURN_IF_ERROR(tensor_memory(set, wi, total));
      for (size_t t = 0; t < profile_.size(); ++t) {
        PSLD_ASSIGN_OR_RETURN(uint32_t h,
                              workers_[wi]->register_tensor(profile_[t].name, DType::kFloat32,
                                                            profile_[t].elements * 4,
                                                            set.base[wi] + offsets[t], nullptr));
        set.handles[wi].push_back(h);
        if (wi != 0) continue;
        const TensorId id = next_tensor_id_++;
        const uint64_t chunks =
            (profile_[t].elements * 4 + base_.chunk_bytes - 1) / base_.chunk_bytes;
        for (uint64_t c = 0; c < chunks; ++c)
          ++load[placement.owner_of_key(make_key(id, static_cast<uint32_t>(c)))];
        set.chunks_per_round += chunks;
      }
    }
    for (const auto& [server, n] : load)
      set.max_share = std::max(set.max_share, n);
    sets_[kProfilePoint] = std::move(set);
    return on_threads(num_workers(), [&](uint32_t w) {
      return round(w, sets_[kProfilePoint], RequestKind::kPushPull);
    });
  }

  uint32_t num_workers() const { return static_cast<uint32_t>(workers_.size()); }
  uint32_t tensors(uint64_t size) const { return sets_.at(size).count; }
  // The most chunks of one round that one server owns, against the even share.
  std::pair<uint64_t, double> balance(uint64_t size) const {
    const TensorSet& s = sets_.at(size);
    return {s.max_share, static_cast<double>(s.chunks_per_round) / base_.num_servers};
  }

  // Goodput in bytes/s of `mode` on the tensors of `size`.
  Result<Rate> measure(uint64_t size, Mode mode, double seconds, std::string_view tag) {
    TensorSet& set = sets_.at(size);
    const RequestKind kind = mode == Mode::kPushPull ? RequestKind::kPushPull
                             : mode == Mode::kPush   ? RequestKind::kPush
                                                     : RequestKind::kPull;
    // Warm-up: two rounds; the second one's time sizes the timed part. In
    // BSP every worker must run the same number of rounds.
    std::vector<double> warm(num_workers(), 0.0);
    PSLD_RETURN_IF_ERROR(on_threads(num_workers(), [&](uint32_t w) -> Status {
      PSLD_RETURN_IF_ERROR(round(w, set, kind));
      const auto t0 = Clock::now();
      PSLD_RETURN_IF_ERROR(round(w, set, kind));
      warm[w] = since(t0, Clock::now());
      return Status::Ok();
    }));
    const double per_round = std::max(*std::max_element(warm.begin(), warm.end()), 1e-6);
    const uint64_t rounds =
        std::clamp<uint64_t>(static_cast<uint64_t>(seconds / per_round + 0.5), 3, 1000000);
    std::vector<Clock::time_point> begin(num_workers()), end(num_workers());
    std::latch go(num_workers());
    count_instructions_from_here();
    const double c0 = cpu_seconds();
    const auto t0 = Clock::now();
    PSLD_RETURN_IF_ERROR(on_threads(num_workers(), [&](uint32_t w) -> Status {
      go.arrive_and_wait();
      begin[w] = Clock::now();
      for (uint64_t r = 0; r < rounds; ++r)
        PSLD_RETURN_IF_ERROR(round(w, set, kind));
      end[w] = Clock::now();
      return Status::Ok();
    }));
    dump_instructions(
        tag,
        fmt::format("{} {}", mode_name(mode), size == kProfilePoint ? "profile" : human_size(size)),
        rounds * set.chunks_per_round * num_workers());
    const double cores = (cpu_seconds() - c0) / since(t0, Clock::now());
    const double wall = since(*std::min_element(begin.begin(), begin.end()),
                              *std::max_element(end.begin(), end.end()));
    if (mode == Mode::kPush) {
      // A push is complete once its bytes left the tensor; pulling the last
      // round waits until the servers applied it, so the next point starts
      // with nothing in flight.
      PSLD_RETURN_IF_ERROR(
          on_threads(num_workers(), [&](uint32_t w) { return round(w, set, RequestKind::kPull); }));
    }
    const uint64_t bytes_per_round =
        set.bytes * (mode == Mode::kPushPull ? uint64_t{2} : uint64_t{1});
    return Rate{static_cast<double>(rounds * bytes_per_round * num_workers()) / wall, cores};
  }

 private:
  struct TensorSet {
    uint32_t count = 0;
    uint64_t bytes = 0;  // of all its tensors, per worker
    uint64_t chunks_per_round = 0;
    uint64_t max_share = 0;
    std::vector<Buffer> memory;                  // per worker, with --tensor-memory heap
    std::vector<uint8_t*> base;                  // per worker: where its tensors are
    std::vector<std::vector<uint32_t>> handles;  // per worker
  };

  Cluster() = default;

  // Worker w's memory for the set: from Worker::allocate (zero-filled), or
  // zeroed heap memory with --tensor-memory heap.
  Status tensor_memory(TensorSet& set, uint32_t w, uint64_t bytes) {
    if (psld_memory_) {
      PSLD_ASSIGN_OR_RETURN(void* p, workers_[w]->allocate(bytes));
      set.base[w] = static_cast<uint8_t*>(p);
      return Status::Ok();
    }
    PSLD_ASSIGN_OR_RETURN(set.memory[w], zeroed_buffer(bytes));
    set.base[w] = set.memory[w].get();
    return Status::Ok();
  }

  // Submits the request on every tensor of the set together (as
  // Worker::push_pull of a span does, so small chunks travel in batches),
  // then waits for all.
  Status round(uint32_t w, const TensorSet& set, RequestKind kind) {
    WorkerService& worker = *workers_[w];
    PSLD_ASSIGN_OR_RETURN(auto reqs, worker.submit_many(set.handles[w], kind));
    for (auto& r : reqs) {
      // The context is formatted only on failure, not once a tensor a round.
      if (Status st = r->wait(30s); !st.ok()) return st.with_context(fmt::format("worker {}", w));
    }
    return Status::Ok();
  }

  RuntimeOptions base_;
  std::vector<bench::TensorSpec> profile_;  // Options::profile_tensors
  bool psld_memory_ = true;                 // Options::psld_memory
  std::map<uint64_t, TensorSet> sets_;      // by size; outlives the workers (see ~Cluster)
  std::unique_ptr<CoordinatorService> coordinator_;
  std::vector<std::unique_ptr<ServerService>> servers_;
  std::vector<std::unique_ptr<WorkerService>> workers_;
  TensorId next_tensor_id_ = 1;
};

// ---- the run

struct Row {
  std::string medium;
  Shape shape;
  uint64_t size = 0;  // kProfilePoint: the profile's, named by `label`
  std::string label;
  Mode mode = Mode::kPushPull;
  double goodput = 0;  // bytes/s
  double raw = 0;      // bytes/s
  uint32_t replication = 1;
};

constexpr double kTarget = 0.8;
constexpr uint64_t kTargetFrom = uint64_t{1} << 20;

std::string target_cell(const Row& r) {
  if (r.mode != Mode::kPushPull || r.size < kTargetFrom || r.replication != 1 || !r.label.empty())
    return "";
  return r.goodput >= kTarget * r.raw ? "ok" : "MISS";
}

void print_row(const Row& r) {
  std::printf(
      "| %s | %ux%u | %s | %s%s | %.2f | %.2f | %.2fx | %s |\n", r.medium.c_str(), r.shape.workers,
      r.shape.servers, r.label.empty() ? human_size(r.size).c_str() : r.label.c_str(),
      std::string(mode_name(r.mode)).c_str(), r.replication > 1 ? " r=2" : "", r.goodput / 1e9,
      r.raw / 1e9, r.raw > 0 ? r.goodput / r.raw : 0.0, target_cell(r).c_str());
  std::fflush(stdout);
}

// The rows as bench/report.h's JSON: per point a raw row (the yardstick) and
// one row per mode, all repetition 0 of 1 (psld bench run repeats the process).
Status write_json(const std::string& path, const std::vector<Row>& rows) {
  bench::Report report;
  report.context["executable"] = "ps_bench";
  std::map<std::string, bool> raw_written;
  auto add = [&](std::string name, std::string yardstick, double bytes_per_s, double ratio) {
    bench::Row r;
    r.name = std::move(name);
    r.yardstick = std::move(yardstick);
    r.values["bytes_per_second"] = bytes_per_s;
    r.values["real_time"] = bytes_per_s > 0 ? 1e9 * (1 << 20) / bytes_per_s : 0;
    r.values["cpu_time"] = r.values["real_time"];
    r.values["iterations"] = 1;
    if (!r.yardstick.empty()) r.values["ratio"] = ratio;
    report.rows.push_back(std::move(r));
  };
  for (const Row& r : rows) {
    const std::string point = fmt::format("{}/{}x{}/{}", r.medium, r.shape.workers, r.shape.servers,
                                          r.label.empty() ? std::to_string(r.size) : r.label);
    const std::string raw = "BM_ps_raw/" + point;
    if (!raw_written[raw]) {
      add(raw, "", r.raw, 0);
      raw_written[raw] = true;
    }
    add(fmt::format("BM_ps_{}{}/{}", mode_name(r.mode), r.replication > 1 ? "_r2" : "", point), raw,
        r.goodput, r.raw > 0 ? r.goodput / r.raw : 0);
  }
  return bench::write_report(path, report);
}

// With --replication 1,2: each point's goodput with two copies next to one.
void print_replication_table(const std::vector<Row>& rows) {
  std::map<std::tuple<std::string, uint32_t, uint32_t, uint64_t, Mode>, std::pair<double, double>>
      by_point;
  for (const Row& r : rows) {
    auto& [one, two] = by_point[{r.medium, r.shape.workers, r.shape.servers, r.size, r.mode}];
    (r.replication > 1 ? two : one) = r.goodput;
  }
  std::printf("\n| tls | WxS | size | mode | r=1 GB/s | r=2 GB/s | r=2 / r=1 |\n");
  std::printf("| --- | --- | ---: | --- | ---: | ---: | ---: |\n");
  for (const auto& [point, rates] : by_point) {
    const auto& [medium, w, srv, size, mode] = point;
    if (rates.first <= 0 || rates.second <= 0) continue;
    std::printf("| %s | %ux%u | %s | %s | %.2f | %.2f | %.2fx |\n", medium.c_str(), w, srv,
                human_size(size).c_str(), std::string(mode_name(mode)).c_str(), rates.first / 1e9,
                rates.second / 1e9, rates.second / rates.first);
  }
  std::fflush(stdout);
}

template <typename... Args>
void progress(fmt::format_string<Args...> f, Args&&... args) {
  std::fputs(("[ps_bench] " + fmt::format(f, std::forward<Args>(args)...) + "\n").c_str(), stderr);
}

Status run(const Options& o, Watchdog& watchdog, std::vector<Row>& rows) {
  // A point's limit: its timed part, warm-ups, and a lot of slack; a stuck
  // request fails after 30 s on its own.
  const auto point_limit =
      std::chrono::milliseconds(static_cast<int64_t>(1000 * (120 + 10 * o.seconds)));
  std::printf("| tls | WxS | size | mode | goodput GB/s | raw GB/s | ratio | target |\n");
  std::printf("| --- | --- | ---: | --- | ---: | ---: | ---: | --- |\n");
  std::fflush(stdout);
  for (const Medium& m : o.media) {
    for (const Shape& shape : o.shapes) {
      const std::string where = fmt::format("{} {}x{}", m.label, shape.workers, shape.servers);
      watchdog.arm(120s, "starting " + where);
      uint64_t max_chunk = 4;
      for (uint64_t s : o.sizes)
        max_chunk = std::max(max_chunk, std::min(s, o.chunk_bytes));
      // The profile's chunks, by the power of two their size rounds up to:
      // bytes per class, each class's raw rate measured at that size.
      std::map<uint64_t, uint64_t> classes;
      for (const auto& t : o.profile_tensors) {
        uint64_t left = t.elements * 4;
        while (left > 0) {
          const uint64_t c = std::min(left, o.chunk_bytes);
          classes[std::min(std::bit_ceil(std::max<uint64_t>(c, 64)), o.chunk_bytes)] += c;
          left -= c;
        }
      }
      for (const auto& [c, bytes] : classes)
        max_chunk = std::max(max_chunk, c);
      auto rig = RawRig::create(m, shape, o.slots, max_chunk, o.raw_threads);
      if (!rig.ok()) return rig.status().with_context("the raw transport rig, " + where);
      // --mode raw: the yardstick alone, no job. One job per replication
      // factor, side by side.
      std::vector<std::unique_ptr<Cluster>> clusters;
      for (uint32_t f : o.modes.empty() ? std::vector<uint32_t>{} : o.replication) {
        auto c = Cluster::start(o, m, shape, f);
        if (!c.ok()) {
          return c.status().with_context(
              fmt::format("starting the job (replication.factor {}), {}", f, where));
        }
        clusters.push_back(std::move(c).value());
      }
      progress("{}: ready; raw writes use {}; server keys in {} memory", where, (*rig)->path(),
               o.server_device == ServerDeviceKind::kCuda ? "GPU" : "host");
      for (uint64_t size : o.sizes) {
        const uint64_t chunk = std::min(size, o.chunk_bytes);
        const std::string point = size == kProfilePoint ? o.profile : human_size(size);
        watchdog.arm(point_limit, fmt::format("{} {}", where, point));
        for (auto& cluster : clusters) {
          PSLD_RETURN_IF_ERROR(cluster->prepare(size).with_context(
              fmt::format("registering {} tensors, {}", point, where)));
          const auto [share, even] = cluster->balance(size);
          progress(
              "{} {}: {} tensors per worker; a round puts at most {} chunks on one server "
              "(even share {:.1f})",
              where, point, cluster->tensors(size), share, even);
        }
        const std::string label = size == kProfilePoint ? o.profile : "";  // the row's
        // The yardstick: raw writes of `chunk`; for the profile, the rate at
        // which raw writes move the same bytes in the same chunk sizes (the
        // time of each class at its own rate, summed).
        auto measure_raw = [&]() -> Result<Rate> {
          if (size != kProfilePoint) return (*rig)->measure(chunk, o.seconds, where);
          double seconds = 0, bytes = 0, cores = 0;
          for (const auto& [c, b] : classes) {
            PSLD_ASSIGN_OR_RETURN(Rate r, (*rig)->measure(c, o.seconds, where));
            if (r.bytes_per_s <= 0) return Internal(fmt::format("no raw writes of {} landed", c));
            seconds += static_cast<double>(b) / r.bytes_per_s;
            bytes += static_cast<double>(b);
            cores += r.cores * static_cast<double>(b) / r.bytes_per_s;
          }
          return Rate{bytes / seconds, cores / seconds};
        };
        Rate raw;
        std::map<std::pair<uint32_t, Mode>, Rate> best;
        for (uint32_t rep = 0; rep < o.repeat; ++rep) {
          auto r = measure_raw();
          if (!r.ok()) {
            return r.status().with_context(fmt::format(
                "raw writes of {}, {}", label.empty() ? human_size(chunk) : label, where));
          }
          if (r->bytes_per_s > raw.bytes_per_s) raw = *r;
          for (size_t ci = 0; ci < clusters.size(); ++ci) {
            const uint32_t f = o.replication[ci];
            for (Mode mode : o.modes) {
              auto g = clusters[ci]->measure(size, mode, o.seconds,
                                             fmt::format("{} r={}", where, o.replication[ci]));
              if (!g.ok()) {
                return g.status().with_context(fmt::format("{} of {} (replication.factor {}), {}",
                                                           mode_name(mode), point, f, where));
              }
              if (g->bytes_per_s > best[{f, mode}].bytes_per_s) best[{f, mode}] = *g;
            }
          }
        }
        progress("{} {} raw: {:.2f} GB/s on {:.2f} cores", where, point, raw.bytes_per_s / 1e9,
                 raw.cores);
        for (uint32_t f : clusters.empty() ? std::vector<uint32_t>{} : o.replication) {
          for (Mode mode : o.modes) {
            const Rate& got = best[{f, mode}];
            Row row{m.label, shape, size, label, mode, got.bytes_per_s, raw.bytes_per_s, f};
            progress("{} {} {}{}: {:.2f} GB/s on {:.2f} cores, {:.2f}x raw", where, point,
                     mode_name(mode), f > 1 ? " r=2" : "", row.goodput / 1e9, got.cores,
                     row.raw > 0 ? row.goodput / row.raw : 0.0);
            print_row(row);
            rows.push_back(row);
          }
        }
      }
      watchdog.arm(60s, "stopping " + where);
      clusters.clear();
      rig->reset();
    }
  }
  return Status::Ok();
}

}  // namespace
}  // namespace psld

int main(int argc, char** argv) {
  psld::bench::reexec_with_ucx_defaults(argv);
  auto opts = psld::parse_args(argc, argv);
  if (!opts.ok()) {
    std::fprintf(stderr, "ps_bench: %s\n", opts.status().message().c_str());
    return 2;
  }
  const auto backends = psld::transport::available_transports();
  if (std::find(backends.begin(), backends.end(), "ucx") == backends.end()) {
    std::fprintf(stderr, "ps_bench: this build has no ucx transport\n");
    return 2;
  }
  psld::bench::Watchdog watchdog("ps_bench");
  std::vector<psld::Row> rows;
  const auto t0 = psld::Clock::now();
  psld::Status s = psld::run(*opts, watchdog, rows);
  watchdog.arm(std::chrono::seconds(60), "stopping");
  if (!s.ok()) {
    std::fprintf(stderr, "ps_bench: %s\n", s.to_string().c_str());
    return 1;
  }
  if (opts->replication.size() > 1) psld::print_replication_table(rows);
  if (!opts->json.empty()) {
    s = psld::write_json(opts->json, rows);
    if (!s.ok()) {
      std::fprintf(stderr, "ps_bench: %s\n", s.to_string().c_str());
      return 1;
    }
  }
  int misses = 0, checked = 0;
  for (const auto& r : rows) {
    const std::string t = psld::target_cell(r);
    checked += !t.empty();
    misses += t == "MISS";
  }
  std::fprintf(
      stderr, "ps_bench: %zu rows in %.1f s; push_pull at >= 1 MiB: %d of %d at least %.1fx raw\n",
      rows.size(), psld::since(t0, psld::Clock::now()), checked - misses, checked, psld::kTarget);
  return 0;
}
