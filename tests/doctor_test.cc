// psld doctor against a fake /sys and /proc (--root): RDMA
// devices with active, down and GID-less ports, GPUs with and without a
// GPUDirect path, huge pages; the pinned-memory limit through the shell's
// ulimit; the interface the configuration chooses. Every finding that is
// not ok names its fix.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/temp_dir.h"
#include "tests/test_process.h"

namespace {

using namespace std::chrono_literals;
using psld::testing::psld;
using psld::testing::run_process;
using psld::testing::RunResult;

void put(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path) << text;
}

// The report's line of `level` and `area` that holds `text`, and the line
// after it ("fix: ..." for warn and missing), or "" when there is none.
std::string finding(const std::string& report, const std::string& level, const std::string& area,
                    const std::string& text) {
  std::istringstream in(report);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);)
    lines.push_back(l);
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& l = lines[i];
    if (l.rfind(level + " ", 0) == 0 && l.find(" " + area + " ") != std::string::npos &&
        l.find(text) != std::string::npos) {
      return l + "\n" + (i + 1 < lines.size() ? lines[i + 1] : "");
    }
  }
  return "";
}

RunResult doctor(const std::string& root, std::vector<std::string> args = {},
                 const std::string& shell_prefix = "") {
  std::string cmd = shell_prefix + "exec '" + psld() + "' doctor --root '" + root + "'";
  for (const auto& a : args)
    cmd += " '" + a + "'";
  return run_process({"/bin/sh", "-c", cmd}, {}, 60s);
}

TEST(Doctor, ABareNodeSaysWhatIsMissingAndHowToFixIt) {
  psld::testing::TempDir root;
  RunResult r = doctor(root.path());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::string f = finding(r.output, "missing", "rdma", "no RDMA device");
  EXPECT_NE(f.find("fix: load the NIC's RDMA driver"), std::string::npos) << r.output;
  EXPECT_NE(f.find("Soft-RoCE"), std::string::npos) << r.output;
  f = finding(r.output, "missing", "cuda", "no NVIDIA driver");
  EXPECT_NE(f.find("fix:"), std::string::npos) << r.output;
  EXPECT_NE(finding(r.output, "info", "hugepages", "0 reserved"), "") << r.output;
  EXPECT_NE(r.output.find(" ok, "), std::string::npos) << r.output;
  EXPECT_NE(finding(r.output, "ok", "ucx", "UCX 1."), "") << r.output;
}

TEST(Doctor, RdmaPortsGidsAndTheGpuDirectPathAreRead) {
  psld::testing::TempDir root;
  const std::string ib = root.path() + "/sys/class/infiniband";
  // mlx5_0: port 1 up, RoCE with a v2 GID; port 2 down.
  put(ib + "/mlx5_0/ports/1/state", "4: ACTIVE\n");
  put(ib + "/mlx5_0/ports/1/link_layer", "Ethernet\n");
  put(ib + "/mlx5_0/ports/1/rate", "100 Gb/sec (4X EDR)\n");
  put(ib + "/mlx5_0/ports/1/gids/0", "fe80:0000:0000:0000:0000:0000:0000:0001\n");
  put(ib + "/mlx5_0/ports/1/gid_attrs/types/0", "IB/RoCE v1\n");
  put(ib + "/mlx5_0/ports/1/gids/3", "0000:0000:0000:0000:0000:ffff:0a00:0005\n");
  put(ib + "/mlx5_0/ports/1/gid_attrs/types/3", "RoCE v2\n");
  put(ib + "/mlx5_0/ports/2/state", "1: DOWN\n");
  put(ib + "/mlx5_0/ports/2/link_layer", "InfiniBand\n");
  // mlx5_1: up, RoCE, but its interface has no address: no v2 GID.
  put(ib + "/mlx5_1/ports/1/state", "4: ACTIVE\n");
  put(ib + "/mlx5_1/ports/1/link_layer", "Ethernet\n");
  put(ib + "/mlx5_1/ports/1/gids/0", "0000:0000:0000:0000:0000:0000:0000:0000\n");
  put(ib + "/mlx5_1/ports/1/gid_attrs/types/0", "RoCE v2\n");
  // No /dev/infiniband: a container without the devices.
  put(root.path() + "/proc/driver/nvidia/version",
      "NVRM version: NVIDIA UNIX Kernel Module 550.54\n");
  put(root.path() + "/proc/driver/nvidia/gpus/0000:17:00.0/information",
      "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ: 42\n");
  put(root.path() + "/proc/meminfo",
      "MemTotal: 1000 kB\nHugePages_Total:      16\n"
      "HugePages_Free:       8\nHugepagesize:       2048 kB\n");
  put(root.path() + "/sys/kernel/mm/transparent_hugepage/enabled", "always [madvise] never\n");

  RunResult r = doctor(root.path());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(finding(r.output, "ok", "rdma",
                    "mlx5_0 port 1: 4: ACTIVE, Ethernet (RoCE), 100 Gb/sec (4X EDR), RoCE v2 GID "
                    "3 (0000:0000:0000:0000:0000:ffff:0a00:0005)"),
            "")
      << r.output;
  EXPECT_NE(finding(r.output, "warn", "rdma", "mlx5_0 port 2: 1: DOWN, InfiniBand")
                .find("fix: the port is not up"),
            std::string::npos)
      << r.output;
  EXPECT_NE(finding(r.output, "warn", "rdma", "mlx5_1 port 1").find("fix: give the port's"),
            std::string::npos)
      << r.output;
  EXPECT_NE(finding(r.output, "warn", "rdma", "no /dev/infiniband/uverbs").find("--device"),
            std::string::npos)
      << r.output;
  EXPECT_NE(finding(r.output, "ok", "cuda", "GPU 0000:17:00.0 NVIDIA H100 80GB HBM3"), "")
      << r.output;
  // This machine's libcuda is not the fake's: with neither dma-buf nor
  // nvidia-peermem the NIC cannot reach GPU memory.
  EXPECT_NE(finding(r.output, "warn", "gpudirect", "no way for the NIC").find("nvidia-peermem"),
            std::string::npos)
      << r.output;
  EXPECT_NE(finding(r.output, "info", "hugepages",
                    "16 reserved huge pages of 2048 KiB (8 free); transparent huge pages: madvise"),
            "")
      << r.output;

  put(root.path() + "/sys/module/nvidia_peermem/refcnt", "0\n");
  r = doctor(root.path());
  EXPECT_NE(finding(r.output, "ok", "gpudirect", "GPUDirect RDMA through nvidia-peermem"), "")
      << r.output;
}

TEST(Doctor, ThePinnedMemoryLimitIsJudged) {
  psld::testing::TempDir root;
  RunResult r = doctor(root.path(), {}, "ulimit -l 64; ");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(
      finding(r.output, "warn", "memlock", "(ulimit -l) 64 KiB").find("fix: ulimit -l unlimited"),
      std::string::npos)
      << r.output;
  rlimit l{};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &l), 0);
  if (l.rlim_max != RLIM_INFINITY) {
    GTEST_SKIP() << "the hard pinned-memory limit here is " << l.rlim_max
                 << " bytes: the unlimited case cannot be made";
  }
  r = doctor(root.path(), {}, "ulimit -l unlimited; ");
  EXPECT_NE(finding(r.output, "ok", "memlock", "(ulimit -l) unlimited"), "") << r.output;
}

TEST(Doctor, TheChosenInterfaceIsShownOrItsMistakeNamed) {
  psld::testing::TempDir root;
  put(root.path() + "/sys/class/net/lo/mtu", "65536\n");
  RunResult r = doctor(root.path(), {"--job.interface=lo"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(finding(r.output, "ok", "interface", "job.interface=lo: lo, listening on 127.0.0.1:0"),
            "")
      << r.output;
  EXPECT_NE(r.output.find("mtu 65536"), std::string::npos) << r.output;
  r = doctor(root.path(), {"--job.interface=nosuch0"});
  EXPECT_NE(finding(r.output, "missing", "interface", "nosuch0").find("fix: set job.interface"),
            std::string::npos)
      << r.output;
  r = doctor(root.path(), {"--job.interface=bad name!"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("job.interface"), std::string::npos) << r.output;
}

// --peer against a --serve-once on this machine over TCP: both rows, with
// ucx_perftest's figures beside psld's where it is installed.
TEST(Doctor, APeerCheckMeasuresLatencyAndBandwidthNextToUcxPerftest) {
  psld::testing::Background serve(
      {psld(), "doctor", "--serve-once", "--ucx.tls=tcp", "--job.listen=127.0.0.1:0"},
      {"PSLD_JOB_SECRET=doctor-test"});
  ASSERT_TRUE(serve.wait_for_output("serving at ", 30s)) << serve.output();
  std::smatch m;
  const std::string out = serve.output();
  ASSERT_TRUE(std::regex_search(out, m, std::regex("serving at ([0-9.]+:[0-9]+)"))) << out;
  RunResult r = run_process({psld(), "doctor", "--peer", m[1], "--ucx.tls=tcp"},
                            {"PSLD_JOB_SECRET=doctor-test"}, 120s);
  ASSERT_EQ(r.exit_code, 0) << r.output << serve.output();
  EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(latency 8 B, one-way +[0-9.]+ us)")))
      << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(bandwidth, 4 MiB +[0-9]+ MiB/s)")))
      << r.output;
  if (access("/usr/bin/ucx_perftest", X_OK) == 0) {
    EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(us \(ucp_am_lat\) +[0-9.]+x)")))
        << r.output;
    EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(MiB/s \(ucp_am_bw\) +[0-9.]+x)")))
        << r.output;
  }
  EXPECT_EQ(serve.wait(20s), 0) << serve.output();
  EXPECT_NE(serve.output().find("the peer is done"), std::string::npos) << serve.output();
}

TEST(Doctor, APeerWithoutTheJobSecretIsRefusedClearly) {
  psld::testing::Background serve(
      {psld(), "doctor", "--serve-once", "--ucx.tls=tcp", "--job.listen=127.0.0.1:0"},
      {"PSLD_JOB_SECRET=the-right-one"});
  ASSERT_TRUE(serve.wait_for_output("serving at ", 30s)) << serve.output();
  std::smatch m;
  const std::string out = serve.output();
  ASSERT_TRUE(std::regex_search(out, m, std::regex("serving at ([0-9.]+:[0-9]+)"))) << out;
  RunResult r = run_process({psld(), "doctor", "--peer", m[1], "--ucx.tls=tcp"},
                            {"PSLD_JOB_SECRET=a-wrong-one"}, 60s);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("psld doctor: peer " + m[1].str()), std::string::npos) << r.output;
  EXPECT_EQ(serve.wait(0s), std::nullopt) << "the serving side must outlive a refused peer";
}

}  // namespace
