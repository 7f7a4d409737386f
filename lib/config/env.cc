// lib/config/env.cc — the PSLD_ environment variables: one per key, and typos among the rest.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>

#include "lib/config/sources.h"

namespace psld::config_detail {
namespace {

// PSLD_ variables that are not configuration keys, read elsewhere. Any other
// PSLD_ variable that is not a key is an error (a typo). Add new ones here.
constexpr std::array<std::string_view, 5> kOtherPsldVariables = {
    "PSLD_CONFIG",          // the config file, read by load_config itself
    "PSLD_SECRET_FILE",     // the job secret's file (secret_file.cc)
    "PSLD_KERNEL_ISA",      // kernels/cpu: lowers the SIMD instruction set
    "PSLD_JOBS",            // tools/dev: compile parallelism
    "PSLD_PLACEMENT_EMIT",  // tests: path of the placement_emit helper
};

}  // namespace

std::vector<std::string> process_env_names() {
  std::vector<std::string> names;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string_view entry(*e);
    names.emplace_back(entry.substr(0, entry.find('=')));
  }
  return names;
}

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

}  // namespace psld::config_detail
