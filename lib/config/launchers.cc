// lib/config/launchers.cc — detect_launcher: torchrun, OpenMPI, Slurm, psld launch; what they say.
#include <fmt/format.h>

#include "lib/config/sources.h"

namespace psld::config_detail {
namespace {

std::string bracket_host(std::string_view host) {
  if (host.find(':') != std::string_view::npos && host.front() != '[') {
    return "[" + std::string(host) + "]";
  }
  return std::string(host);
}

// Splits an endpoint that check_endpoint accepts; the host keeps its brackets.
bool split_endpoint(std::string_view v, std::string* host, std::string* port) {
  if (!check_endpoint(v, 0).empty()) return false;
  size_t colon = v.rfind(':');
  *host = std::string(v.substr(0, colon));
  *port = std::string(v.substr(colon + 1));
  return true;
}

}  // namespace

// The launcher whose environment this process runs in, and what it says.
// Innermost first: torchrun under srun, or mpirun inside an sbatch
// allocation, sees both sets of variables, and the inner one is right.
// Every launched process is taken to be a worker of one SPMD job (or a server
// when job.role says so); MPMD jobs set PSLD_JOB_* explicitly.
Launcher detect_launcher(const Env& env, Role role, const std::string& coordinator) {
  struct Vars {
    const char* name;
    const char* rank;
    const char* size;
    const char* local_rank;
  };
  // Slurm: SLURM_PROCID and SLURM_NTASKS are also set in an sbatch script's
  // own shell, where nothing was launched; SLURM_STEP_ID is set only for the
  // tasks of an srun step. SLURM_STEP_NUM_TASKS is the step's size when the
  // step is smaller than the allocation.
  const Vars kLaunchers[] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
      {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
  };
  Launcher out;
  const Vars* found = nullptr;
  for (const Vars& v : kLaunchers) {
    if (env.get(v.rank) == nullptr || env.get(v.size) == nullptr) continue;
    if (std::string_view(v.name) == "slurm" && env.get("SLURM_STEP_ID") == nullptr) continue;
    found = &v;
    break;
  }
  if (found == nullptr) {
    if (env.get("PSLD_JOB_RANK") != nullptr) out.name = "psld";  // psld launch
    return out;
  }
  out.name = found->name;
  auto add = [&](const char* key, const char* var) {
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

  // The coordinator's address: torchrun's MASTER_ADDR:MASTER_PORT, or the
  // node srun ran on (the first node of an sbatch allocation). A part the
  // launcher does not give is kept from the file or the default.
  std::string host;
  std::string port;
  if (!split_endpoint(coordinator, &host, &port)) return out;  // validate reports it
  std::vector<std::string> used;
  auto take = [&](const char* var, std::string* part, bool is_host) {
    if (const char* v = env.get(var); v != nullptr && *v != '\0') {
      *part = is_host ? bracket_host(v) : std::string(v);
      used.emplace_back(var);
    }
  };
  if (out.name == "torchrun") {
    take("MASTER_ADDR", &host, true);
    take("MASTER_PORT", &port, false);
  } else if (out.name == "slurm") {
    take("SLURM_LAUNCH_NODE_IPADDR", &host, true);
  }
  if (!used.empty()) {
    std::string source = "env " + used[0];
    for (size_t i = 1; i < used.size(); ++i)
      source += ", " + used[i];
    out.settings.push_back({find_field("job.coordinator"), host + ":" + port, source});
  }
  return out;
}

}  // namespace psld::config_detail
