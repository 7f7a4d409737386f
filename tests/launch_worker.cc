// A small trainer used by the launch tests: joins the job from its
// environment, runs BSP push_pull rounds on integer-valued data and checks
// every element of every round against the exact sum.
//
//   launch_worker [--rounds N] [--fail-rank R] [--fail-code C] [--die-rank R]
//                 [--print-every K] [--spam BYTES] [--spam-raw BYTES] [--big BYTES]
//                 [--stop-file PATH] [--no-check] [--total] [--dump PATH]
//
// --print-every K prints "worker R: round N" every K rounds; --spam prints
// BYTES of text lines per round, --spam-raw BYTES with no newline at all
// (a progress bar redrawn with '\r'), both to stdout. --big adds a
// tensor of BYTES (an embedding table) to the three small ones. --stop-file:
// once PATH holds a round number ahead of every worker, that round is the
// last one (a test ends an open-ended job cleanly, every worker at the same
// round).
//
// In a job resumed from a checkpoint the rounds go on from the checkpoint's
// (Worker::round), which it prints ("worker R: resumed at round N").
// --no-check skips the exact-sum check (server.mode = optimizer: the
// parameters are no sums); --dump PATH: worker 0 writes its tensors' final
// contents to PATH, raw fp32 one after another (a test compares two runs
// bit for bit). --total: for async and bounded-staleness jobs (sum mode),
// no round is checked; after the last, every worker waits for the others
// (a barrier), pulls each tensor and checks that it holds the total of every
// push of every worker ("worker R: N rounds, total exact").
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "psld/worker.h"

int main(int argc, char** argv) {
  int rounds = 20, fail_rank = -1, fail_code = 3, die_rank = -1, print_every = 0;
  size_t spam = 0, spam_raw = 0, big = 0;
  const char* stop_file = nullptr;
  const char* dump = nullptr;
  bool check = true, total = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--total") {
      total = true;
      check = false;
      continue;
    }
    if (flag == "--no-check") {
      check = false;
      continue;
    }
    if (i + 1 >= argc) break;
    const char* v = argv[++i];
    if (flag == "--dump") dump = v;
    if (flag == "--rounds") rounds = std::atoi(v);
    if (flag == "--fail-rank") fail_rank = std::atoi(v);
    if (flag == "--fail-code") fail_code = std::atoi(v);
    if (flag == "--die-rank") die_rank = std::atoi(v);
    if (flag == "--print-every") print_every = std::atoi(v);
    if (flag == "--spam") spam = std::strtoull(v, nullptr, 10);
    if (flag == "--spam-raw") spam_raw = std::strtoull(v, nullptr, 10);
    if (flag == "--big") big = std::strtoull(v, nullptr, 10);
    if (flag == "--stop-file") stop_file = v;
  }
  std::string line(79, 'x');
  line += '\n';
  std::string raw(spam_raw, 'y');
  for (size_t i = 99; i < raw.size(); i += 100)
    raw[i] = '\r';
  auto config = psld::load_config({});
  if (!config.ok()) {
    std::fprintf(stderr, "config: %s\n", config.status().to_string().c_str());
    return 1;
  }
  auto worker = psld::Worker::join(*config);
  if (!worker.ok()) {
    std::fprintf(stderr, "join: %s\n", worker.status().to_string().c_str());
    return 1;
  }
  psld::Worker& w = **worker;
  const int rank = static_cast<int>(w.rank());
  const int n = static_cast<int>(w.num_workers());
  if (rank == fail_rank) {
    std::fprintf(stderr, "worker %d failing on purpose with code %d\n", rank, fail_code);
    return fail_code;
  }
  std::vector<size_t> sizes = {1, 333, 70000};
  if (big > 0) sizes.push_back(big / 4);
  std::vector<std::vector<float>> data;
  std::vector<psld::TensorHandle> handles;
  for (size_t t = 0; t < sizes.size(); ++t) {
    data.emplace_back(sizes[t]);
    auto h = w.register_tensor("t" + std::to_string(t), psld::DType::kFloat32, sizes[t] * 4,
                               data.back().data());
    if (!h.ok()) {
      std::fprintf(stderr, "register: %s\n", h.status().to_string().c_str());
      return 1;
    }
    handles.push_back(*h);
  }
  auto resumed = w.round(handles[0]);
  if (!resumed.ok()) {
    std::fprintf(stderr, "round: %s\n", resumed.status().to_string().c_str());
    return 1;
  }
  if (*resumed > 0) {
    std::printf("worker %d: resumed at round %llu\n", rank,
                static_cast<unsigned long long>(*resumed));
    std::fflush(stdout);
  }
  const auto started = std::chrono::steady_clock::now();
  for (int r = static_cast<int>(*resumed) + 1; r <= rounds; ++r) {
    if (stop_file != nullptr) {
      if (std::FILE* f = std::fopen(stop_file, "r")) {
        int last = 0;
        if (std::fscanf(f, "%d", &last) == 1 && last >= r) rounds = last;
        std::fclose(f);
      }
    }
    if (rank == die_rank && r == rounds / 2) {
      std::fprintf(stderr, "worker %d dying mid-job\n", rank);
      std::fflush(stderr);
      std::_Exit(9);  // no goodbye, no cleanup: as if killed
    }
    if (print_every > 0 && r % print_every == 0) {
      std::printf("worker %d: round %d\n", rank, r);
      std::fflush(stdout);
    }
    for (size_t sent = 0; sent < spam; sent += line.size())
      std::fwrite(line.data(), 1, line.size(), stdout);
    if (spam_raw > 0) std::fwrite(raw.data(), 1, raw.size(), stdout);
    if (spam + spam_raw > 0) std::fflush(stdout);
    std::vector<psld::Request> reqs;
    for (size_t t = 0; t < sizes.size(); ++t) {
      for (size_t i = 0; i < sizes[t]; ++i)
        data[t][i] = static_cast<float>(rank + r + i % 5);
      auto req = w.push_pull(handles[t]);
      if (!req.ok()) {
        std::fprintf(stderr, "push_pull: %s\n", req.status().to_string().c_str());
        return 1;
      }
      reqs.push_back(*req);
    }
    for (auto& q : reqs) {
      psld::Status s = q.wait(std::chrono::seconds(60));
      if (!s.ok()) {
        std::fprintf(stderr, "round %d: %s\n", r, s.to_string().c_str());
        return 1;
      }
    }
    for (size_t t = 0; check && t < sizes.size(); ++t) {
      for (size_t i = 0; i < sizes[t]; ++i) {
        const float want = static_cast<float>(n * (n - 1) / 2 + n * (r + static_cast<int>(i % 5)));
        if (data[t][i] != want) {
          std::fprintf(stderr, "round %d tensor %zu element %zu: %g != %g\n", r, t, i,
                       static_cast<double>(data[t][i]), static_cast<double>(want));
          return 1;
        }
      }
    }
  }
  if (total) {
    psld::Status s = w.barrier(std::chrono::minutes(2));
    std::vector<psld::Request> pulls;
    for (size_t t = 0; s.ok() && t < sizes.size(); ++t) {
      auto req = w.pull(handles[t]);
      if (!req.ok()) {
        s = req.status();
        break;
      }
      pulls.push_back(*req);
    }
    for (auto& q : pulls) {
      if (s.ok()) s = q.wait(std::chrono::seconds(60));
    }
    if (!s.ok()) {
      std::fprintf(stderr, "the pull of the totals: %s\n", s.to_string().c_str());
      return 1;
    }
    // Every worker pushed rank + r + i % 5 in rounds 1..rounds.
    const double base = static_cast<double>(rounds) * (n * (n - 1) / 2) +
                        static_cast<double>(n) * rounds * (rounds + 1) / 2;
    for (size_t t = 0; t < sizes.size(); ++t) {
      for (size_t i = 0; i < sizes[t]; ++i) {
        const double want = base + static_cast<double>(n) * rounds * static_cast<double>(i % 5);
        if (static_cast<double>(data[t][i]) != want) {
          std::fprintf(stderr, "tensor %zu element %zu: total %.1f != %.1f\n", t, i,
                       static_cast<double>(data[t][i]), want);
          return 1;
        }
      }
    }
  }
  if (dump != nullptr && rank == 0) {
    std::FILE* f = std::fopen(dump, "wb");
    bool ok = f != nullptr;
    for (size_t t = 0; ok && t < sizes.size(); ++t)
      ok = std::fwrite(data[t].data(), 4, sizes[t], f) == sizes[t];
    if (f != nullptr) ok = std::fclose(f) == 0 && ok;
    if (!ok) {
      std::fprintf(stderr, "cannot write %s\n", dump);
      return 1;
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::printf("worker %d: %d rounds %s (%.3f s)\n", rank, rounds,
              check ? "exact" : (total ? "total exact" : "done"), seconds);
  return w.shutdown().ok() ? 0 : 1;
}
