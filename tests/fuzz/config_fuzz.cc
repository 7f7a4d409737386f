// Config files (lib/config/file.cc): `--config=PATH` and PSLD_CONFIG name a
// TOML file that load_config reads, checking every value against its key.
// The input is the file's text. A file that loads must load again, to an
// equal Config, from what `psld config` prints of it (to_string promises
// that); one that does not load is InvalidArgument, never a crash.
//
// The text goes to a memfd and load_config reads /proc/self/fd/N: no file
// on disk per input, and nothing from the process environment is read.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "psld/config.h"
#include "tests/fuzz/fuzz.h"

namespace psld::fuzz {
namespace {

class MemFile {
 public:
  MemFile() : fd_(memfd_create("psld-config-fuzz", 0)) {
    if (fd_ < 0) {
      std::perror("memfd_create");
      std::abort();
    }
  }
  // The path load_config opens, holding `text`.
  std::string write(std::string_view text) {
    if (ftruncate(fd_, 0) != 0 ||
        pwrite(fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
      std::perror("memfd write");
      std::abort();
    }
    return "/proc/self/fd/" + std::to_string(fd_);
  }

 private:
  int fd_;
};

Result<Config> load_file(MemFile& file, std::string_view text) {
  ConfigSources sources;
  sources.args = {"--config=" + file.write(text)};
  sources.getenv = [](const char*) -> const char* { return nullptr; };
  sources.env_names = [] { return std::vector<std::string>(); };
  return load_config(sources);
}

Seed text_seed(std::string name, std::string_view text) {
  return Seed{std::move(name), std::vector<uint8_t>(text.begin(), text.end())};
}

}  // namespace

// Entropic scheduling (libFuzzer's default) spent 56% of this harness's
// time in InputCorpus::UpdateFeatureFrequency (perf): cpptoml gives the
// inputs tens of thousands of features. Without it, 6 times the inputs
// per second (44 against 7, measured side by side).
std::vector<std::string> default_flags() {
  return {"-entropic=0"};
}

std::vector<Seed> seeds() {
  std::vector<Seed> out;
  MemFile file;
  auto defaults = load_file(file, "");
  out.push_back(text_seed("defaults", to_string(*defaults, false)));
  out.push_back(text_seed("defaults_with_sources", to_string(*defaults, true)));
  out.push_back(text_seed("small",
                          "# a job of 4 workers and 2 servers\n"
                          "[job]\n"
                          "num_workers = 4\n"
                          "num_servers = 2\n"
                          "coordinator = \"127.0.0.1:9000\"\n"
                          "[optimizer]\n"
                          "kind = \"adamw\"\n"
                          "lr = 1e-3\n"
                          "[balancer]\n"
                          "enabled = true\n"
                          "interval_ms = 500\n"));
  out.push_back(text_seed("strings_and_errors",
                          "log = 'debug'\n"
                          "[ucx]\n"
                          "tls = \"\"\"tcp\"\"\"\n"
                          "[data]\n"
                          "sync = \"bps\"\n"
                          "[unknown]\n"
                          "x = [1, 2.5, \"s\", true, 1979-05-27T07:32:00Z]\n"));
  return out;
}

}  // namespace psld::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace psld;
  static fuzz::MemFile file;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  Result<Config> first = fuzz::load_file(file, text);
  if (!first.ok()) {
    PSLD_FUZZ_CHECK(first.status().code() == StatusCode::kInvalidArgument);
    return 0;
  }
  const std::string printed = to_string(*first, false);
  Result<Config> again = fuzz::load_file(file, printed);
  if (!again.ok()) {
    std::fprintf(stderr, "the printed config does not load: %s\n--- printed:\n%s\n",
                 again.status().to_string().c_str(), printed.c_str());
  }
  PSLD_FUZZ_CHECK(again.ok());
  // The one key to_string never prints.
  again->job.secret = first->job.secret;
  if (!(*again == *first)) {
    std::fprintf(stderr, "--- printed:\n%s\n--- reloaded:\n%s\n", printed.c_str(),
                 to_string(*again, false).c_str());
  }
  PSLD_FUZZ_CHECK(*again == *first);
  return 0;
}
