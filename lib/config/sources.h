// What load_config reads besides its flags and the defaults: the PSLD_
// environment (env.cc), the environment of launchers (launchers.cc) and the
// TOML file (file.cc). Internal to lib/config/.
#pragma once

#include <string>
#include <vector>

#include "lib/config/fields.h"
#include "psld/config.h"
#include "psld/status.h"

namespace psld::config_detail {

// One value from the environment, a flag or a launcher, waiting to be applied.
struct TextSetting {
  const Field* field;
  std::string text;
  std::string source;
};

std::vector<std::string> process_env_names();

class Env {
 public:
  explicit Env(const ConfigSources& s) : sources_(s) {}
  // nullptr when unset.
  const char* get(const std::string& name) const {
    return sources_.getenv ? sources_.getenv(name.c_str()) : nullptr;
  }
  std::vector<std::string> names() const {
    return sources_.env_names ? sources_.env_names() : process_env_names();
  }

 private:
  const ConfigSources& sources_;
};

std::vector<TextSetting> read_psld_env(const Env& env, std::vector<std::string>& errors);

struct Launcher {
  std::string name = "none";
  std::vector<TextSetting> settings;
  std::vector<std::string> errors;  // what it set that cannot be read
};

// `role` as the sources that outrank the launcher give it (role_given) or
// the file or the default do; a launcher that says each process's role
// (DMLC_ROLE) sets it when role_given is false.
Launcher detect_launcher(const Env& env, Role role, bool role_given,
                         const std::string& coordinator);

// The job secret's sources (secret_file.cc): PSLD_SECRET_FILE names a file
// holding it (owned by this user, mode 0600 or stricter), and a flag among
// args that came from a command line is refused (ps shows it to everyone).
Status apply_secret_rules(const Env& env, bool args_on_command_line, Config& c);

Status read_file(const std::string& path, const std::string& origin, Config& c,
                 std::vector<std::string>& errors);

}  // namespace psld::config_detail
