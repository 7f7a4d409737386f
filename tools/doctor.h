// psld doctor (tools/doctor.cc): what this node offers a psld job and what it
// lacks, with the fix for each.
#pragma once

#include <string>

#include "psld/config.h"

namespace psld::tools {

// argv[1] is "doctor"; configuration flags follow.
int cmd_doctor(int argc, char** argv);

// tools/doctor_peer.cc: the two ends of `psld doctor --peer`.
int cmd_doctor_serve(const Config& config, bool once);
int cmd_doctor_peer(const Config& config, const std::string& address);

}  // namespace psld::tools
