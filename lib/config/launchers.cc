// lib/config/launchers.cc — detect_launcher: torchrun, BytePS/ps-lite, the MPIs, Slurm, PMIx,
// Kubernetes, psld launch; what they say.
#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <optional>
#include <string_view>

#include "lib/config/sources.h"

namespace psld::config_detail {
namespace {

std::string bracket_host(std::string_view host) {
  if (host.find(':') != std::string_view::npos && host.front() != '[') {
    return "[" + std::string(host) + "]";
  }
  return std::string(host);
}

// A count or index a launcher set: decimal digits only, below 2^20 (the
// config's own range checks come after); nullopt otherwise.
std::optional<uint64_t> parse_count(const char* text) {
  const std::string_view v(text);
  uint64_t n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size() || n >= (uint64_t{1} << 20)) {
    return std::nullopt;
  }
  return n;
}

std::string lower(std::string_view v) {
  std::string out(v);
  for (char& ch : out)
    ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return out;
}

// BytePS and ps-lite jobs (DMLC_*): the role, both counts, the worker's
// rank and the scheduler's address, for every role. BytePS counts worker
// machines (DMLC_NUM_WORKER, DMLC_WORKER_ID), each running BYTEPS_LOCAL_SIZE
// processes (BYTEPS_LOCAL_RANK), and every one of those is a psld worker.
// `role` stands when a PSLD_ variable or a flag gave it (role_given).
void read_dmlc(const Env& env, Role role, bool role_given, Launcher& out) {
  auto setting = [&](const char* key, std::string text, std::string source) {
    out.settings.push_back({find_field(key), std::move(text), std::move(source)});
  };
  if (!role_given) {
    struct DmlcRole {
      const char* dmlc;
      const char* psld;
      Role role;
    };
    static constexpr DmlcRole kRoles[] = {{"worker", "worker", Role::kWorker},
                                          {"server", "server", Role::kServer},
                                          {"scheduler", "coordinator", Role::kCoordinator}};
    const std::string v = lower(env.get("DMLC_ROLE"));
    const DmlcRole* found = nullptr;
    for (const DmlcRole& r : kRoles) {
      if (v == r.dmlc) found = &r;
    }
    if (found == nullptr) {
      out.errors.push_back(fmt::format(
          "env DMLC_ROLE: '{}' is not worker, server or scheduler (the coordinator)", v));
    } else {
      setting("job.role", found->psld, "env DMLC_ROLE");
      role = found->role;
    }
  }
  // Both BYTEPS_LOCAL_ variables or neither; the size scales the worker count.
  const char* local_rank = env.get("BYTEPS_LOCAL_RANK");
  const char* local_size = env.get("BYTEPS_LOCAL_SIZE");
  std::optional<uint64_t> size;
  if (local_size != nullptr) {
    size = parse_count(local_size);
    if (!size || *size == 0) {
      out.errors.push_back(
          fmt::format("env BYTEPS_LOCAL_SIZE: '{}' is not a count of 1 or more", local_size));
      return;
    }
  }
  if (local_rank != nullptr && !size) {
    out.errors.push_back("env BYTEPS_LOCAL_RANK is set without BYTEPS_LOCAL_SIZE");
    return;
  }
  auto count = [&](const char* var) -> std::optional<uint64_t> {
    const char* text = env.get(var);
    if (text == nullptr) return std::nullopt;
    std::optional<uint64_t> n = parse_count(text);
    if (!n) out.errors.push_back(fmt::format("env {}: '{}' is not a number", var, text));
    return n;
  };
  if (std::optional<uint64_t> n = count("DMLC_NUM_WORKER")) {
    if (size) {
      setting("job.num_workers", std::to_string(*n * *size),
              "env DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE");
    } else {
      setting("job.num_workers", std::to_string(*n), "env DMLC_NUM_WORKER");
    }
  }
  if (std::optional<uint64_t> n = count("DMLC_NUM_SERVER")) {
    setting("job.num_servers", std::to_string(*n), "env DMLC_NUM_SERVER");
  }
  if (role == Role::kWorker || role == Role::kAuto) {
    std::optional<uint64_t> machine = count("DMLC_WORKER_ID");
    if (machine && local_rank != nullptr && size) {
      std::optional<uint64_t> r = parse_count(local_rank);
      if (!r || *r >= *size) {
        out.errors.push_back(
            fmt::format("env BYTEPS_LOCAL_RANK: '{}' is not below "
                        "BYTEPS_LOCAL_SIZE ({})",
                        local_rank, *size));
        return;
      }
      setting("job.rank", std::to_string(*machine * *size + *r),
              "env DMLC_WORKER_ID x BYTEPS_LOCAL_SIZE + BYTEPS_LOCAL_RANK");
      setting("job.local_rank", local_rank, "env BYTEPS_LOCAL_RANK");
    } else if (machine) {
      setting("job.rank", std::to_string(*machine), "env DMLC_WORKER_ID");
    }
  }
}

}  // namespace

// The launcher whose environment this process runs in, and what it says.
// Innermost first: torchrun under srun, or mpirun inside an sbatch
// allocation, sees both sets of variables, and the inner one is right.
// Every launched process is taken to be a worker of one SPMD job (or a server
// when job.role says so); MPMD jobs set PSLD_JOB_* explicitly. BytePS and
// ps-lite jobs say each process's role (DMLC_ROLE).
Launcher detect_launcher(const Env& env, Role role, bool role_given,
                         const std::string& coordinator) {
  // rank (or what detects the launcher) and size must be set; a launcher
  // without a size variable (nullptr) leaves the count to the config.
  struct Vars {
    const char* name;
    const char* rank;
    const char* size;
    const char* local_rank;
  };
  // Slurm: SLURM_PROCID and SLURM_NTASKS are also set in an sbatch script's
  // own shell, where nothing was launched; SLURM_STEP_ID is set only for the
  // tasks of an srun step. SLURM_STEP_NUM_TASKS is the step's size when the
  // step is smaller than the allocation. PMIx after Slurm and OpenMPI, which
  // set PMIX_RANK too and also give the size; Kubernetes' Indexed Job last:
  // its index is the pod's, and whatever runs inside the pod is innermost.
  const Vars kLaunchers[] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
      {"dmlc", "DMLC_ROLE", nullptr, nullptr},  // read_dmlc
      {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
      {"mvapich", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"},
      {"mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
      {"pmix", "PMIX_RANK", nullptr, nullptr},
      {"kubernetes", "JOB_COMPLETION_INDEX", nullptr, nullptr},
  };
  Launcher out;
  const Vars* found = nullptr;
  for (const Vars& v : kLaunchers) {
    if (env.get(v.rank) == nullptr || (v.size != nullptr && env.get(v.size) == nullptr)) continue;
    if (std::string_view(v.name) == "slurm" && env.get("SLURM_STEP_ID") == nullptr) continue;
    found = &v;
    break;
  }
  if (found == nullptr) {
    if (env.get("PSLD_JOB_RANK") != nullptr) out.name = "psld";  // psld launch
    return out;
  }
  out.name = found->name;

  // The coordinator's address: torchrun's MASTER_ADDR:MASTER_PORT, the
  // scheduler's DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT, or the node srun ran on
  // (the first node of an sbatch allocation). A part the launcher does not
  // give is kept from the file or the default.
  std::string host;
  std::string port;
  const bool endpoint = split_endpoint(coordinator, &host, &port);  // else validate reports it
  std::vector<std::string> used;
  auto take = [&](const char* var, std::string* part, bool is_host) {
    if (const char* v = env.get(var); v != nullptr && *v != '\0') {
      *part = is_host ? bracket_host(v) : std::string(v);
      used.emplace_back(var);
    }
  };
  if (out.name == "dmlc") {
    read_dmlc(env, role, role_given, out);
    take("DMLC_PS_ROOT_URI", &host, true);
    take("DMLC_PS_ROOT_PORT", &port, false);
  } else {
    auto add = [&](const char* key, const char* var) {
      if (var == nullptr) return;
      if (const char* v = env.get(var)) {
        out.settings.push_back({find_field(key), v, fmt::format("env {}", var)});
      }
    };
    if (role != Role::kCoordinator) {
      add("job.rank", found->rank);
      const char* size = found->size;
      if (out.name == "slurm" && env.get("SLURM_STEP_NUM_TASKS") != nullptr) {
        size = "SLURM_STEP_NUM_TASKS";
      }
      add(role == Role::kServer ? "job.num_servers" : "job.num_workers", size);
    }
    add("job.local_rank", found->local_rank);
    if (out.name == "torchrun") {
      take("MASTER_ADDR", &host, true);
      take("MASTER_PORT", &port, false);
    } else if (out.name == "slurm") {
      take("SLURM_LAUNCH_NODE_IPADDR", &host, true);
    }
  }
  if (endpoint && !used.empty()) {
    std::string source = "env " + used[0];
    for (size_t i = 1; i < used.size(); ++i)
      source += ", " + used[i];
    out.settings.push_back({find_field("job.coordinator"), host + ":" + port, source});
  }
  return out;
}

}  // namespace psld::config_detail
