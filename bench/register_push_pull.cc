// build/bench/register_push_pull: the C++ side of bench/python/register_push_pull.py.
//
//   register_push_pull --bytes N --repeat R [--key=value ...]
//
// One job in this process (a coordinator, one server and one worker, over
// the configured transport: UCX by default), then R times: a fresh heap
// tensor of N bytes registered, one push_pull, and a second push_pull of the
// same tensor. One JSON line per repetition on stdout, with the seconds of
// each step. bench/python/register_push_pull.py times the same steps from
// Python and prints the two side by side; psld's logs go to stderr.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "psld/config.h"
#include "psld/coordinator.h"
#include "psld/server.h"
#include "psld/worker.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int fail(const psld::Status& status) {
  std::fprintf(stderr, "register_push_pull: %s\n", status.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  size_t bytes = 64ull << 20;
  int repeat = 5;
  std::vector<std::string> flags;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--bytes" && i + 1 < argc) {
      bytes = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--repeat" && i + 1 < argc) {
      repeat = std::atoi(argv[++i]);
    } else {
      flags.push_back(a);
    }
  }
  if (bytes == 0 || bytes % 4 != 0 || repeat < 1) {
    std::fprintf(
        stderr,
        "usage: register_push_pull --bytes N (a multiple of 4) --repeat R [--key=value ...]\n");
    return 2;
  }
  psld::ConfigSources sources;
  sources.args = flags;
  auto config = psld::load_config(sources);
  if (!config.ok()) return fail(config.status());

  auto coordinator = psld::Coordinator::start(*config);
  if (!coordinator.ok()) return fail(coordinator.status());
  psld::Result<std::unique_ptr<psld::Server>> server = psld::Internal("not started");
  std::thread server_thread([&] { server = psld::Server::start(*config); });
  auto worker = psld::Worker::join(*config);
  server_thread.join();
  if (!worker.ok()) return fail(worker.status());
  if (!server.ok()) return fail(server.status());

  const size_t floats = bytes / sizeof(float);
  for (int r = 0; r < repeat; ++r) {
    // Heap memory, as a numpy array's or a CPU torch tensor's is; every page
    // written once before the clock starts, as numpy.ones would.
    std::vector<float> tensor(floats, 1.0f);
    const std::string name = "t" + std::to_string(r);
    auto start = Clock::now();
    auto handle = (*worker)->register_tensor(name, psld::DType::kFloat32, bytes, tensor.data());
    if (!handle.ok()) return fail(handle.status());
    const double register_s = seconds_since(start);
    start = Clock::now();
    auto first = (*worker)->push_pull(*handle);
    if (!first.ok()) return fail(first.status());
    if (psld::Status s = first->wait(); !s.ok()) return fail(s);
    const double first_s = seconds_since(start);
    start = Clock::now();
    auto second = (*worker)->push_pull(*handle);
    if (!second.ok()) return fail(second.status());
    if (psld::Status s = second->wait(); !s.ok()) return fail(s);
    const double second_s = seconds_since(start);
    std::printf("{\"register_s\": %.6f, \"push_pull_s\": %.6f, \"second_push_pull_s\": %.6f}\n",
                register_s, first_s, second_s);
    std::fflush(stdout);
  }
  if (psld::Status s = (*worker)->shutdown(); !s.ok()) return fail(s);
  if (psld::Status s = (*coordinator)->wait(std::chrono::seconds(30)); !s.ok()) return fail(s);
  return 0;
}
