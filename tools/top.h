// psld top (tools/top.cc): a live view of a running job from its
// coordinator's metrics endpoint.
#pragma once

namespace psld::tools {

// argv[1] is "top"; its flags follow.
int cmd_top(int argc, char** argv);

}  // namespace psld::tools
