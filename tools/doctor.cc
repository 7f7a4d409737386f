// psld doctor: what this node offers a psld job and what it lacks, with the
// fix for each (docs/operations.md, "psld doctor").
//
// Everything is read from the kernel's files (/sys, /proc) and from the
// libraries psld loads (UCX, libcuda); nothing is changed. --root DIR puts
// another directory in place of / for the files (the tests give it a fake
// /sys and /proc).
#include "tools/doctor.h"

#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gpu/cuda_driver.h"
#include "lib/config/interface.h"
#include "lib/config/runtime_options.h"
#include "psld/config.h"
#include "psld/version.h"
#if PSLD_DOCTOR_UCX
#include "transports/ucx/ucx_transport.h"
#endif

namespace psld::tools {

namespace {

namespace fs = std::filesystem;

constexpr const char* kDoctorUsage = R"(usage: psld doctor [--root DIR] [--key=value ...]
       psld doctor --serve [--job.listen=HOST:PORT] [--key=value ...]
       psld doctor --peer HOST:PORT [--key=value ...]
  Says what this node offers a psld job and what it lacks, with the fix for
  each: the pinned-memory limit, RDMA devices, their ports and GIDs, UCX's
  version and transports, NVIDIA GPUs and the GPUDirect RDMA path (dma-buf,
  nvidia-peermem), huge pages, and the network interface the configuration
  chooses (job.interface, job.coordinator). Reads the configuration like
  every psld command. Exit status 0; 1 only when it cannot run.
  --root DIR  read /sys and /proc under DIR instead (for tests)
  --serve     listen on job.listen (and keep a ucx_perftest server) for
              `psld doctor --peer` from another node; --serve-once ends
              after one peer
  --peer HOST:PORT  a short latency and bandwidth check against a node
              running --serve, through psld's transport and, next to it,
              ucx_perftest's ucp_am_lat and ucp_am_bw (same job.secret and
              ucx.tls on both sides)
)";

enum class Level { kOk, kInfo, kWarn, kMissing };

struct Finding {
  Level level = Level::kOk;
  std::string area;
  std::string what;
  std::string fix;  // empty for ok and info
};

std::string_view level_name(Level l) {
  switch (l) {
    case Level::kOk:
      return "ok";
    case Level::kInfo:
      return "info";
    case Level::kWarn:
      return "warn";
    case Level::kMissing:
      return "missing";
  }
  return "?";
}

class Doctor {
 public:
  explicit Doctor(std::string root) : root_(std::move(root)) {}

  void memlock();
  void rdma();
  void ucx();
  void cuda();
  void huge_pages();
  void interface(const Config& config);

  const std::vector<Finding>& findings() const { return findings_; }

 private:
  void add(Level level, std::string area, std::string what, std::string fix = "") {
    findings_.push_back({level, std::move(area), std::move(what), std::move(fix)});
  }
  fs::path at(const std::string& path) const { return fs::path(root_ + path); }
  // The first line of a file under the root, trimmed; "" when unreadable.
  std::string read_line(const fs::path& path) const {
    std::ifstream in(path);
    std::string line;
    std::getline(in, line);
    while (!line.empty() && (line.back() == '\n' || line.back() == ' ' || line.back() == '\r'))
      line.pop_back();
    return line;
  }
  std::vector<std::string> entries(const fs::path& dir) const {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec))
      out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }

  std::string root_;
  std::vector<Finding> findings_;
  bool rdma_devices_ = false;
};

std::string kib_text(rlim_t bytes) {
  if (bytes == RLIM_INFINITY) return "unlimited";
  if (bytes >= (rlim_t{1} << 30)) return fmt::format("{} GiB", bytes >> 30);
  if (bytes >= (rlim_t{1} << 20)) return fmt::format("{} MiB", bytes >> 20);
  return fmt::format("{} KiB", bytes >> 10);
}

void Doctor::memlock() {
  rlimit l{};
  if (getrlimit(RLIMIT_MEMLOCK, &l) != 0) {
    add(Level::kWarn, "memlock", "getrlimit(RLIMIT_MEMLOCK) failed", "");
    return;
  }
  // Registration pins every tensor and slot region: a real job pins
  // gigabytes. 1 GiB is a floor below which even a small model fails.
  constexpr rlim_t kEnough = rlim_t{1} << 30;
  const std::string what = fmt::format("pinned-memory limit (ulimit -l) {}, hard limit {}",
                                       kib_text(l.rlim_cur), kib_text(l.rlim_max));
  if (l.rlim_cur == RLIM_INFINITY || l.rlim_cur >= kEnough) {
    add(Level::kOk, "memlock", what);
    return;
  }
  add(Level::kWarn, "memlock",
      what + ": RDMA registers (pins) every tensor and landing slot, and fails past it",
      "ulimit -l unlimited in the job's shell; for good: '* - memlock unlimited' in "
      "/etc/security/limits.d/psld.conf, LimitMEMLOCK=infinity for a systemd unit, "
      "--ulimit memlock=-1 for docker, a Slurm PropagateResourceLimits that keeps it");
}

void Doctor::rdma() {
  const fs::path ib = at("/sys/class/infiniband");
  const auto devices = entries(ib);
  if (devices.empty()) {
    add(Level::kMissing, "rdma",
        "no RDMA device (/sys/class/infiniband is empty): the verbs transport cannot run and UCX "
        "moves data over TCP between hosts",
        "load the NIC's RDMA driver (mlx5_ib, irdma, bnxt_re, efa) and rdma-core's "
        "ibverbs-providers; only to test the path without RDMA hardware, Soft-RoCE: "
        "rdma link add rxe0 type rxe netdev eth0");
    return;
  }
  rdma_devices_ = true;
  if (entries(at("/dev/infiniband")).empty()) {
    add(Level::kWarn, "rdma",
        fmt::format("{} RDMA device(s) but no /dev/infiniband/uverbs*: this process cannot "
                    "open them",
                    devices.size()),
        "in a container, pass the devices (docker --device=/dev/infiniband, or the RDMA "
        "device plugin on Kubernetes); else load ib_uverbs");
  }
  for (const auto& dev : devices) {
    const fs::path ports = ib / dev / "ports";
    const auto port_list = entries(ports);
    if (port_list.empty()) {
      add(Level::kWarn, "rdma", fmt::format("{}: no ports", dev), "check the driver (dmesg)");
      continue;
    }
    for (const auto& port : port_list) {
      const fs::path p = ports / port;
      const std::string state = read_line(p / "state");      // "4: ACTIVE"
      const std::string link = read_line(p / "link_layer");  // "Ethernet", "InfiniBand"
      const std::string rate = read_line(p / "rate");        // "100 Gb/sec (4X EDR)"
      const bool active = state.find("ACTIVE") != std::string::npos;
      const bool roce = link == "Ethernet";
      // RoCE v2 GIDs: the ones psld's verbs backend picks (verbs.gid_index -1).
      std::vector<std::string> v2;
      for (const auto& index : entries(p / "gid_attrs" / "types")) {
        const std::string type = read_line(p / "gid_attrs" / "types" / index);
        const std::string gid = read_line(p / "gids" / index);
        if (type == "RoCE v2" && !gid.empty() && gid != "0000:0000:0000:0000:0000:0000:0000:0000") {
          v2.push_back(fmt::format("{} ({})", index, gid));
        }
      }
      std::string what =
          fmt::format("{} port {}: {}, {}{}", dev, port, state.empty() ? "state unknown" : state,
                      link.empty() ? "link layer unknown" : link + (roce ? " (RoCE)" : ""),
                      rate.empty() ? "" : ", " + rate);
      if (roce) {
        what += v2.empty() ? ", no RoCE v2 GID"
                           : fmt::format(", RoCE v2 GID {}{}", v2.front(),
                                         v2.size() > 1 ? fmt::format(" (+{})", v2.size() - 1) : "");
      }
      if (!active) {
        add(Level::kWarn, "rdma", what,
            "the port is not up: check the cable and switch port (ibstat, rdma link show); an "
            "InfiniBand port needs a subnet manager (opensm)");
      } else if (roce && v2.empty()) {
        add(Level::kWarn, "rdma", what,
            "give the port's network interface an IP address: RoCE v2 GIDs follow the "
            "interface's addresses (or set verbs.gid_index to a RoCE v1 GID)");
      } else {
        add(Level::kOk, "rdma", what);
      }
    }
  }
#if !PSLD_DOCTOR_VERBS
  add(Level::kWarn, "rdma", "this psld was built without the verbs transport",
      "install libibverbs-dev and rebuild (meson configure -Dverbs=enabled)");
#endif
}

void Doctor::ucx() {
#if PSLD_DOCTOR_UCX
  auto inv = transport::ucx_inventory();
  if (!inv.ok()) {
    add(Level::kMissing, "ucx", "UCX does not answer: " + inv.status().message(),
        "check UCX_* variables in the environment (ucx_info -d shows what UCX sees)");
    return;
  }
  std::string list;
  bool rdma = false;
  bool cuda = false;
  for (const auto& t : inv->transports) {
    list += (list.empty() ? "" : ", ") + t;
    rdma = rdma || t.rfind("rc", 0) == 0 || t.rfind("dc", 0) == 0 || t.rfind("ud", 0) == 0;
    cuda = cuda || t.rfind("cuda", 0) == 0 || t.rfind("gdr", 0) == 0;
  }
  add(Level::kOk, "ucx",
      fmt::format("UCX {}: {}", inv->version, list.empty() ? "no transports" : list));
  for (const auto& p : inv->problems)
    add(Level::kInfo, "ucx", p);
  if (!rdma) {
    add(rdma_devices_ ? Level::kWarn : Level::kInfo, "ucx",
        "no RDMA transport (rc, dc, ud): UCX moves data between hosts over TCP",
        rdma_devices_ ? "UCX sees none of the RDMA devices above: install rdma-core's "
                        "ibverbs-providers and a UCX built with verbs (ucx_info -d)"
                      : "");
  }
  if (const char* tls = std::getenv("UCX_TLS"); tls != nullptr) {
    add(Level::kInfo, "ucx",
        fmt::format("UCX_TLS={} in the environment limits what UCX uses (psld sets it from "
                    "ucx.tls)",
                    tls));
  }
  if (!cuda) {
    add(Level::kInfo, "ucx",
        "no CUDA transport (cuda_copy, cuda_ipc, gdr_copy): tensors in GPU memory are staged "
        "through pinned host memory");
  }
#else
  add(Level::kMissing, "ucx", "this psld was built without UCX, the default transport",
      "install libucx-dev and ucx-utils and rebuild (meson configure -Ducx=enabled)");
#endif
}

void Doctor::cuda() {
  const std::string version = read_line(at("/proc/driver/nvidia/version"));
  const auto gpus = entries(at("/proc/driver/nvidia/gpus"));
  if (gpus.empty()) {
    add(Level::kMissing, "cuda",
        version.empty() ? "no NVIDIA driver (/proc/driver/nvidia absent): tensors and server "
                          "keys stay in host memory"
                        : "the NVIDIA driver is loaded but lists no GPU",
        "only needed for tensors in GPU memory or server.device = cuda: install the NVIDIA "
        "driver (nvidia-smi must list the GPUs)");
    return;
  }
  for (const auto& bus : gpus) {
    std::ifstream info(at("/proc/driver/nvidia/gpus") / bus / "information");
    std::string model;
    for (std::string line; std::getline(info, line);) {
      if (line.rfind("Model:", 0) == 0) model = line.substr(line.find_first_not_of(" \t", 6));
    }
    add(Level::kOk, "cuda",
        fmt::format("GPU {} {}", bus, model.empty() ? "(model unknown)" : model));
  }
  if (!version.empty()) add(Level::kInfo, "cuda", version);
  auto driver = transport::CudaDriver::get();
  bool dmabuf = false;
  if (driver.ok()) {
    dmabuf = (*driver)->can_export_dmabuf();
    add(Level::kOk, "cuda",
        fmt::format("libcuda loads and initialises; dma-buf export of GPU memory {}",
                    dmabuf ? "available"
                           : "not available (driver older than 11.7 API, or "
                             "the proprietary kernel modules)"));
  } else {
    add(Level::kWarn, "cuda", "libcuda.so.1: " + driver.status().message(),
        "install the driver's user-space library (libcuda1 / nvidia-driver-libs) matching the "
        "kernel module");
  }
  const bool peermem = fs::exists(at("/sys/module/nvidia_peermem"));
  if (!rdma_devices_) {
    add(Level::kInfo, "gpudirect",
        "no RDMA device: GPU tensors go through pinned host memory (UCX's cuda_copy or psld's "
        "copy engine)");
  } else if (dmabuf || peermem) {
    add(Level::kOk, "gpudirect",
        fmt::format("GPUDirect RDMA through {}",
                    dmabuf ? "dma-buf (ibv_reg_dmabuf_mr)" : "nvidia-peermem (ibv_reg_mr)"));
  } else {
    add(Level::kWarn, "gpudirect",
        "RDMA devices and GPUs, but no way for the NIC to reach GPU memory: tensors are staged "
        "through host memory",
        "modprobe nvidia-peermem, or use the driver's open kernel modules with Linux >= 5.12 "
        "for dma-buf");
  }
}

void Doctor::huge_pages() {
  std::ifstream meminfo(at("/proc/meminfo"));
  long total = -1;
  long free_pages = -1;
  std::string size;
  for (std::string line; std::getline(meminfo, line);) {
    std::istringstream f(line);
    std::string key;
    f >> key;
    if (key == "HugePages_Total:") f >> total;
    if (key == "HugePages_Free:") f >> free_pages;
    if (key == "Hugepagesize:") {
      long kb = 0;
      f >> kb;
      size = fmt::format("{} KiB", kb);
    }
  }
  std::string thp = read_line(at("/sys/kernel/mm/transparent_hugepage/enabled"));
  const size_t open = thp.find('[');
  const size_t close = thp.find(']');
  if (open != std::string::npos && close > open) thp = thp.substr(open + 1, close - open - 1);
  add(Level::kInfo, "hugepages",
      fmt::format("{} reserved huge pages of {} ({} free); transparent huge pages: {} (psld "
                  "needs none; UCX may use them for registered buffers)",
                  total < 0 ? 0 : total, size.empty() ? "?" : size, free_pages < 0 ? 0 : free_pages,
                  thp.empty() ? "unknown" : thp));
}

void Doctor::interface(const Config& config) {
  RuntimeOptions o = runtime_options_from_config(config);
  auto describe = [&](const std::string& name) {
    const fs::path net = at("/sys/class/net") / name;
    const std::string mtu = read_line(net / "mtu");
    const std::string speed = read_line(net / "speed");
    const std::string state = read_line(net / "operstate");
    std::string out;
    if (!state.empty()) out += ", " + state;
    if (!mtu.empty()) out += ", mtu " + mtu;
    if (!speed.empty() && speed != "-1") out += ", " + speed + " Mb/s";
    return out;
  };
  if (config.job.interface.empty()) {
    add(Level::kInfo, "interface",
        fmt::format("job.interface not set: listening on {}; UCX's TCP transport uses every "
                    "interface it finds",
                    config.job.listen),
        "");
    const std::string& coord = config.job.coordinator;
    const bool local = coord.rfind("127.", 0) == 0 || coord.rfind("[::1]", 0) == 0 ||
                       coord.rfind("localhost", 0) == 0;
    if (!coord.empty() && !local) {
      auto toward = interface_toward(coord);
      if (toward.ok()) {
        add(Level::kInfo, "interface",
            fmt::format("job.interface=auto would choose {} ({}{}), the route to {}", toward->name,
                        toward->address, describe(toward->name), coord));
      } else {
        add(Level::kWarn, "interface",
            fmt::format("no route to job.coordinator {}: {}", coord, toward.status().message()),
            "check the address and this host's routes (ip route get)");
      }
    }
    return;
  }
  if (Status s = apply_interface(config, o); !s.ok()) {
    add(Level::kMissing, "interface", "job.interface=" + config.job.interface + ": " + s.message(),
        "set job.interface to one of the interfaces named, or auto");
    return;
  }
  const std::string& name = o.net.options.common.interface;
  add(Level::kOk, "interface",
      fmt::format("job.interface={}: {}, listening on {}{}", config.job.interface, name,
                  o.net.options.common.listen_address, describe(name)));
}

}  // namespace

int cmd_doctor(int argc, char** argv) {
  ConfigSources sources;
  std::string root;
  std::string peer;
  bool serve = false;
  bool once = false;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kDoctorUsage, stdout);
      return 0;
    }
    if (a == "--root" && i + 1 < argc) {
      root = argv[++i];
      continue;
    }
    if (a == "--peer" && i + 1 < argc) {
      peer = argv[++i];
      continue;
    }
    if (a == "--serve" || a == "--serve-once") {
      serve = true;
      once = a == "--serve-once";
      continue;
    }
    sources.args.push_back(a);
  }
  auto config = load_config(sources);
  if (!config.ok()) {
    std::fprintf(stderr, "psld doctor: %s\n", config.status().message().c_str());
    return 1;
  }
  if (serve) return cmd_doctor_serve(*config, once);
  if (!peer.empty()) return cmd_doctor_peer(*config, peer);
  Doctor d(root);
  d.memlock();
  d.rdma();
  d.ucx();
  d.cuda();
  d.huge_pages();
  d.interface(*config);

  utsname u{};
  uname(&u);
  std::printf("psld doctor %s on %s (Linux %s)\n\n", PSLD_VERSION_STRING, u.nodename, u.release);
  size_t counts[4] = {0, 0, 0, 0};
  for (const auto& f : d.findings()) {
    ++counts[static_cast<int>(f.level)];
    std::printf("%-7s %-9s  %s\n", std::string(level_name(f.level)).c_str(), f.area.c_str(),
                f.what.c_str());
    if (!f.fix.empty()) std::printf("%-7s %-9s  fix: %s\n", "", "", f.fix.c_str());
  }
  std::printf("\n%zu ok, %zu info, %zu warn, %zu missing\n", counts[0], counts[1], counts[2],
              counts[3]);
  return 0;
}

}  // namespace psld::tools
