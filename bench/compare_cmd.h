// bench/compare_cmd.h — `psld bench compare` (tools/psld.cc calls it).
#pragma once

namespace psld::bench {

// argv holds what follows "psld bench compare". Returns the exit status:
// 1 on a regression, 0 on none, 2 on bad input.
int cmd_compare(int argc, char** argv);

// `psld bench merge OUT IN...`: the repetitions of several reports in one.
int cmd_merge(int argc, char** argv);

}  // namespace psld::bench
