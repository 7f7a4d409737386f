// psld doctor (tools/doctor.cc): what this node offers a psld job and what it
// lacks, with the fix for each.
#pragma once

namespace psld::tools {

// argv[1] is "doctor"; configuration flags follow.
int cmd_doctor(int argc, char** argv);

}  // namespace psld::tools
