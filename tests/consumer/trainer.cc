// A trainer outside the psld tree: built against an installed psld (its own
// meson.build finds it through pkg-config, its CMakeLists.txt through
// find_package) and run as a worker under `psld launch`. Every round each
// worker pushes integers that depend on its rank and the round, and checks
// that the pull brought back their exact sum over all workers.
//
//   trainer [ROUNDS]    (default 10)
#include <psld/c_api.h>
#include <psld/coordinator.h>
#include <psld/server.h>
#include <psld/version.h>
#include <psld/worker.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {
int fail(const psld::Status& s) {
  std::fprintf(stderr, "trainer: %s\n", s.to_string().c_str());
  return 1;
}
}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 10;
  if (std::strcmp(psld::version(), PSLD_VERSION_STRING) != 0) {
    std::fprintf(stderr, "headers %s, library %s\n", PSLD_VERSION_STRING, psld_version());
    return 1;
  }
  auto config = psld::load_config({});  // the launcher's PSLD_* environment
  if (!config.ok()) return fail(config.status());
  auto worker = psld::Worker::join(*config);
  if (!worker.ok()) return fail(worker.status());
  psld::Worker& w = **worker;
  const uint32_t rank = w.rank(), n = w.num_workers();

  std::vector<float> grad(1000);
  auto t =
      w.register_tensor("grad", psld::DType::kFloat32, grad.size() * sizeof(float), grad.data());
  if (!t.ok()) return fail(t.status());
  for (int r = 1; r <= rounds; ++r) {
    for (size_t i = 0; i < grad.size(); ++i)
      grad[i] = static_cast<float>((rank + 1) * 1000 + i + r);
    auto req = w.push_pull(*t);
    psld::Status s = req.ok() ? req->wait(std::chrono::seconds(60)) : req.status();
    if (!s.ok()) return fail(s.with_context("round " + std::to_string(r)));
    for (size_t i = 0; i < grad.size(); ++i) {
      // The sum over ranks k = 0..n-1 of (k + 1) * 1000 + i + r.
      const float want = static_cast<float>(1000 * n * (n + 1) / 2 + n * (i + r));
      if (grad[i] != want) {
        std::fprintf(stderr, "round %d element %zu: %.1f != %.1f\n", r, i, grad[i], want);
        return 1;
      }
    }
  }
  std::printf("worker %u of %u: %d rounds exact (psld %s)\n", rank, n, rounds, psld::version());
  return w.shutdown().ok() ? 0 : 1;
}
