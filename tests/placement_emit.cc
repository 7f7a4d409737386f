// tests/placement_emit.cc — writes the bytes of a placement scenario to stdout.
//
// placement_test runs this program twice, in fresh processes, and compares
// what they print with each other and with the same scenario built in its own
// process: a placement must not depend on addresses, allocation order or
// anything else that differs between processes. The scenarios live here and
// are compiled into placement_test too (with PSLD_PLACEMENT_EMIT_NO_MAIN), so
// both sides build exactly the same thing.
//
//   placement_emit initial|chain
#include <cstdio>
#include <string_view>
#include <vector>

#include "lib/placement/placement.h"

namespace psld::scenarios {

// The bytes of scenario `name`: the final epoch's serialization followed by
// the serialization of every delta that led to it.
Result<std::vector<uint8_t>> placement_scenario_bytes(std::string_view name) {
  std::vector<uint8_t> out;
  auto append = [&out](const std::vector<uint8_t>& bytes) {
    out.insert(out.end(), bytes.begin(), bytes.end());
  };
  PSLD_ASSIGN_OR_RETURN(Placement p,
                        Placement::initial({{1, 1.0}, {2, 1.0}, {3, 2.0}, {4, 0.5}, {7, 1.0}}, 64));
  if (name == "initial") {
    append(p.serialize());
    return out;
  }
  if (name != "chain") return InvalidArgument("unknown scenario (expected initial or chain)");

  std::vector<PlacementDelta> deltas;
  auto step = [&](Result<PlacementChange> change) -> Status {
    if (!change.ok()) return change.status();
    p = std::move(change->next);
    deltas.push_back(std::move(change->delta));
    return Status::Ok();
  };
  PSLD_RETURN_IF_ERROR(step(p.add_server({9, 1.5})));
  PSLD_RETURN_IF_ERROR(step(p.drain_server(2)));
  const Arc a = p.arc(5);
  PSLD_RETURN_IF_ERROR(step(p.split_arc(a.lo + (a.hi - a.lo) / 3)));
  const Key key = make_key(7, 42);
  PSLD_RETURN_IF_ERROR(step(p.isolate_key(key)));
  PSLD_RETURN_IF_ERROR(step(p.move_arc(p.arc_index_of_hash(hash_key(key)), 9)));
  PSLD_RETURN_IF_ERROR(step(p.move_range(uint64_t{1} << 62, (uint64_t{1} << 62) + 12345, 4)));
  PSLD_RETURN_IF_ERROR(step(p.add_server_empty({11, 1.0})));
  PSLD_RETURN_IF_ERROR(step(p.set_state(7, ServerState::kDraining)));
  PSLD_RETURN_IF_ERROR(step(p.coalesce()));
  PSLD_RETURN_IF_ERROR(step(p.remove_server(2)));

  append(p.serialize());
  for (const PlacementDelta& d : deltas)
    append(d.serialize());
  return out;
}

}  // namespace psld::scenarios

#ifndef PSLD_PLACEMENT_EMIT_NO_MAIN
int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s initial|chain\n", argv[0]);
    return 2;
  }
  auto bytes = psld::scenarios::placement_scenario_bytes(argv[1]);
  if (!bytes.ok()) {
    std::fprintf(stderr, "placement_emit: %s\n", bytes.status().to_string().c_str());
    return 1;
  }
  if (std::fwrite(bytes->data(), 1, bytes->size(), stdout) != bytes->size() ||
      std::fflush(stdout) != 0) {
    std::perror("placement_emit: writing stdout");
    return 1;
  }
  return 0;
}
#endif
