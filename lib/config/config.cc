// lib/config/config.cc — loading, validating and printing psld::Config.
//
// Every key is described once, in fields() (fields.cc), and every source,
// validate(), to_string() and config_keys() walk that one table. The sources
// have files of their own: env.cc (PSLD_ variables), launchers.cc (the
// environment of OpenMPI, Slurm, torchrun and psld launch) and file.cc (TOML);
// fields.h and sources.h declare what they share. Flags are parsed here.
#include "psld/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "lib/config/fields.h"
#include "lib/config/sources.h"

namespace psld {

using namespace config_detail;

namespace {

void apply(const TextSetting& s, Config& c, std::vector<std::string>& errors) {
  FieldRef r = s.field->ref(c);
  std::optional<Value> v = parse_text(r, s.text);
  std::string detail;
  if (!v || !acceptable(*s.field, r, *v, &detail)) {
    errors.push_back(bad_value(*s.field, r, "'" + s.text + "'", s.source, detail));
    return;
  }
  store(r, *v);
  c.sources[std::string(s.field->key)] = s.source;
}

// ---- flags -----------------------------------------------------------------

struct Flags {
  std::vector<TextSetting> settings;
  std::string config_path;  // --config, "" if absent
};

bool is_bool_text(std::string_view s) {
  return s == "true" || s == "false" || s == "1" || s == "0";
}

Flags parse_flags(const std::vector<std::string>& args, std::vector<std::string>& errors) {
  Flags flags;
  Config scratch;  // only to ask a field its type
  for (size_t i = 0; i < args.size(); ++i) {
    std::string_view a = args[i];
    if (a.size() <= 2 || a.substr(0, 2) != "--") {
      errors.push_back(fmt::format(
          "unexpected argument '{}': settings are flags --key=value (e.g. --job.num_workers=4)",
          a));
      continue;
    }
    std::string_view body = a.substr(2);
    size_t eq = body.find('=');
    std::string name(body.substr(0, eq));
    std::optional<std::string> value;
    if (eq != std::string_view::npos) value = std::string(body.substr(eq + 1));
    const Field* f = name == "config" ? nullptr : find_field(name);
    if (name != "config" && f == nullptr) {
      errors.push_back(fmt::format("unknown flag --{}{}", name,
                                   did_you_mean(closest(name, all_keys(), '.'), "--")));
      if (!value && i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) ++i;
      continue;
    }
    bool is_bool = f != nullptr && std::holds_alternative<bool*>(f->ref(scratch));
    if (!value) {
      if (is_bool) {
        // `--balancer.enabled` alone is true; a following true/false/1/0 is its value.
        if (i + 1 < args.size() && is_bool_text(args[i + 1])) {
          value = args[++i];
        } else {
          value = "true";
        }
      } else if (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
        value = args[++i];
      } else {
        errors.push_back(fmt::format("flag --{} needs a value: --{}=VALUE", name, name));
        continue;
      }
    }
    if (f == nullptr) {
      flags.config_path = *value;
    } else {
      flags.settings.push_back({f, *value, "flag --" + name});
    }
  }
  return flags;
}

Status errors_status(const std::vector<std::string>& errors) {
  if (errors.empty()) return Status::Ok();
  std::string message = errors[0];
  for (size_t i = 1; i < errors.size(); ++i)
    message += "\n" + errors[i];
  return InvalidArgument(std::move(message));
}

// Defaults that depend on another key, for keys no source set.
void derive_defaults(Config& c) {
  auto unset = [&](const char* key) { return source_of(c, key) == "default"; };
  if (c.optimizer.kind == OptimizerKind::kMomentum && unset("optimizer.momentum")) {
    c.optimizer.momentum = 0.9;
    c.sources["optimizer.momentum"] = "default for optimizer.kind = momentum";
  }
  if (c.optimizer.kind == OptimizerKind::kAdamW && unset("optimizer.weight_decay")) {
    c.optimizer.weight_decay = 0.01;  // torch.optim.AdamW's default
    c.sources["optimizer.weight_decay"] = "default for optimizer.kind = adamw";
  }
  if (c.job.colocate_servers && unset("job.num_servers")) {
    c.job.num_servers = c.job.num_workers;
    c.sources["job.num_servers"] = "job.num_workers, as job.colocate_servers = true";
  }
}

}  // namespace

std::string_view role_name(Role role) {
  return enum_name(role);
}
std::string_view sync_mode_name(SyncMode mode) {
  return enum_name(mode);
}
std::string_view server_mode_name(ServerMode mode) {
  return enum_name(mode);
}
std::string_view optimizer_kind_name(OptimizerKind kind) {
  return enum_name(kind);
}

bool operator==(const Config& a, const Config& b) {
  // Every section; a new one must be added here.
  return a.log == b.log && a.job == b.job && a.data == b.data && a.server == b.server &&
         a.optimizer == b.optimizer && a.liveness == b.liveness && a.stats == b.stats &&
         a.balancer == b.balancer && a.ucx == b.ucx && a.verbs == b.verbs && a.link == b.link &&
         a.checkpoint == b.checkpoint && a.replication == b.replication && a.metrics == b.metrics;
}

Status validate(const Config& c) {
  std::vector<std::string> errors;
  for (const Field& f : fields()) {
    FieldRef r = cref(f, c);
    Value v = load(r);
    std::string detail;
    if (!acceptable(f, r, v, &detail)) {
      errors.push_back(bad_value(f, r, render(v), source_of(c, f.key), detail));
    }
  }
  if (!errors.empty()) return errors_status(errors);

  // Rules between keys. "4 from env OMPI_COMM_WORLD_SIZE"
  auto shown = [&](const char* key) {
    return render_field(*find_field(key), c) + from(source_of(c, key));
  };
  const JobConfig& job = c.job;
  int64_t rank_limit = job.num_workers;
  std::string limit_text = fmt::format("job.num_workers ({})", shown("job.num_workers"));
  if (job.role == Role::kServer) {
    rank_limit = int64_t{job.num_servers} + job.num_standby;
    limit_text = fmt::format("job.num_servers + job.num_standby ({})", rank_limit);
  } else if (job.role == Role::kCoordinator) {
    rank_limit = 1;
    limit_text = "1 (there is one coordinator)";
  }
  if (job.rank >= rank_limit) {
    errors.push_back(fmt::format("job.rank: {} must be -1 or below {} for job.role = {}",
                                 shown("job.rank"), limit_text, role_name(job.role)));
  }
  if (job.colocate_servers && job.num_servers != job.num_workers) {
    errors.push_back(fmt::format(
        "job.num_servers: {} must equal job.num_workers ({}) when job.colocate_servers = true "
        "(leave job.num_servers unset and it follows job.num_workers)",
        shown("job.num_servers"), shown("job.num_workers")));
  }
  if (c.liveness.heartbeat_timeout_ms <= 2 * c.liveness.heartbeat_interval_ms) {
    errors.push_back(fmt::format(
        "liveness.heartbeat_timeout_ms: {} must exceed 2 x liveness.heartbeat_interval_ms ({})",
        shown("liveness.heartbeat_timeout_ms"), shown("liveness.heartbeat_interval_ms")));
  }
  if (const uint32_t n = c.ucx.notify_ring_slots; n != 0 && (n < 16 || (n & (n - 1)) != 0)) {
    errors.push_back(
        fmt::format("ucx.notify_ring_slots: {} is not 0 or a power of two from 16 to 65536",
                    shown("ucx.notify_ring_slots")));
  }
  if (c.balancer.interval_ms < c.stats.interval_ms) {
    errors.push_back(fmt::format(
        "balancer.interval_ms: {} must be at least stats.interval_ms ({}): the balancer needs "
        "a new load report each time it plans",
        shown("balancer.interval_ms"), shown("stats.interval_ms")));
  }
  const std::pair<const char*, double> above_zero[] = {
      {"balancer.straggler_threshold", c.balancer.straggler_threshold},
      {"balancer.max_step_fraction", c.balancer.max_step_fraction},
      {"balancer.scale_out_utilisation", c.balancer.scale_out_utilisation},
  };
  for (const auto& [key, value] : above_zero) {
    if (value <= 0) errors.push_back(fmt::format("{}: {} must be above 0", key, shown(key)));
  }
  if (c.balancer.scale_in_utilisation >= c.balancer.scale_out_utilisation) {
    errors.push_back(fmt::format(
        "balancer.scale_in_utilisation: {} must be below balancer.scale_out_utilisation ({}), or "
        "the balancer would scale out and back in forever",
        shown("balancer.scale_in_utilisation"), shown("balancer.scale_out_utilisation")));
  }
  if (c.optimizer.nesterov && (c.optimizer.momentum <= 0 || c.optimizer.dampening != 0)) {
    errors.push_back(fmt::format(
        "optimizer.nesterov: {} needs optimizer.momentum > 0 (it is {}) and "
        "optimizer.dampening = 0 (it is {})",
        shown("optimizer.nesterov"), shown("optimizer.momentum"), shown("optimizer.dampening")));
  }
  const CheckpointConfig& ck = c.checkpoint;
  if ((ck.every_rounds != 0 || ck.resume) && ck.dir.empty()) {
    errors.push_back(
        fmt::format("checkpoint.dir: empty, but checkpoint.{} ({}) needs it",
                    ck.resume ? "resume" : "every_rounds",
                    ck.resume ? shown("checkpoint.resume") : shown("checkpoint.every_rounds")));
  }
  if ((ck.every_rounds != 0 || ck.resume) && c.data.sync != SyncMode::kBsp) {
    errors.push_back(fmt::format(
        "checkpoint.{}: {} needs data.sync = bsp ({}): only BSP rounds give every key one state "
        "at the same round",
        ck.resume ? "resume" : "every_rounds",
        ck.resume ? shown("checkpoint.resume") : shown("checkpoint.every_rounds"),
        shown("data.sync")));
  }
  if (c.replication.factor > 1) {
    if (c.data.sync != SyncMode::kBsp && c.balancer.enabled) {
      errors.push_back(fmt::format(
          "replication.factor: {} with data.sync = {} needs balancer.enabled = false ({}): "
          "replicated ranges move in BSP mode only (docs/replication.md)",
          shown("replication.factor"), sync_mode_name(c.data.sync), shown("balancer.enabled")));
    }
  }
  return errors_status(errors);
}

Result<Config> load_config(const ConfigSources& sources) {
  Env env(sources);
  Config c;
  for (const Field& f : fields())
    c.sources[std::string(f.key)] = "default";

  std::vector<std::string> errors;
  Flags flags = parse_flags(sources.args, errors);
  std::vector<TextSetting> env_settings = read_psld_env(env, errors);

  std::string path = flags.config_path;
  std::string origin = "flag --config";
  if (path.empty()) {
    if (const char* p = env.get("PSLD_CONFIG"); p != nullptr && *p != '\0') {
      path = p;
      origin = "env PSLD_CONFIG";
    }
  }
  if (!path.empty()) PSLD_RETURN_IF_ERROR(read_file(path, origin, c, errors));

  // The launcher maps its world size by role, and the role may come from a
  // source that outranks it: look at the role every source gives first.
  Config role_only = c;
  bool role_given = false;
  std::vector<std::string> ignored;  // reported when applied below
  for (const auto* list : {&env_settings, &flags.settings}) {
    for (const TextSetting& s : *list) {
      if (s.field->key != "job.role") continue;
      apply(s, role_only, ignored);
      role_given = true;
    }
  }
  Launcher launcher = detect_launcher(env, role_only.job.role, role_given, c.job.coordinator);
  c.launcher = launcher.name;
  errors.insert(errors.end(), launcher.errors.begin(), launcher.errors.end());

  for (const auto* list : {&launcher.settings, &env_settings, &flags.settings}) {
    for (const TextSetting& s : *list)
      apply(s, c, errors);
  }
  PSLD_RETURN_IF_ERROR(errors_status(errors));
  PSLD_RETURN_IF_ERROR(apply_secret_rules(env, sources.args_on_command_line, c));
  derive_defaults(c);
  PSLD_RETURN_IF_ERROR(validate(c));
  return c;
}

std::string to_string(const Config& c, bool with_sources) {
  struct Line {
    std::string text;
    std::string source;
  };
  std::vector<std::pair<std::string, std::vector<Line>>> sections;
  for (const Field& f : fields()) {
    std::string section(section_of(f.key));
    if (sections.empty() || sections.back().first != section) sections.push_back({section, {}});
    std::string text = fmt::format("{} = {}", leaf_of(f.key), render_field(f, c));
    // The secret's line is a comment, so the text still loads as a file.
    if (f.secret) text = "# " + text + " (never printed)";
    std::string source = source_of(c, f.key);
    sections.back().second.push_back({text, source.empty() ? "set in code" : source});
  }
  std::string out;
  if (with_sources) {
    out += fmt::format("# psld configuration; launcher: {}\n", c.launcher);
    out += "# precedence: default < file < launcher env < PSLD_ env < flag\n";
  }
  for (const auto& [section, lines] : sections) {
    if (!section.empty()) out += fmt::format("\n[{}]\n", section);
    size_t width = 0;
    for (const Line& l : lines)
      width = std::max(width, l.text.size());
    for (const Line& l : lines) {
      if (with_sources) {
        out += fmt::format("{:<{}}  # {}\n", l.text, width, l.source);
      } else {
        out += l.text + "\n";
      }
    }
  }
  return out;
}

std::vector<ConfigKeyInfo> config_keys() {
  Config defaults;
  std::vector<ConfigKeyInfo> keys;
  for (const Field& f : fields()) {
    keys.push_back({std::string(f.key), env_name(f.key), render_field(f, defaults),
                    accepted(f, cref(f, defaults)), std::string(f.meaning)});
  }
  return keys;
}

}  // namespace psld
