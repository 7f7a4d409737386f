// `psld launch`: a whole job on this machine (a coordinator in this process,
// servers and workers as children), their output prefixed with who printed it.
#pragma once

namespace psld::tools {

// argv[1] is "launch"; `usage` is the tool's usage text, shown on bad flags.
int cmd_launch(int argc, char** argv, const char* usage);

}  // namespace psld::tools
