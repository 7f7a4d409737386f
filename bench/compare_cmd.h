// bench/compare_cmd.h — `psld bench compare` (tools/psld.cc calls it).
#pragma once

#include <filesystem>
#include <string>

namespace psld::bench {

// The revision the programs in a build's bench directory were built from
// (`git describe --always --dirty`, as vcs_tag wrote it into the directory's
// build_info.cc at its last build), or "" where there is none. psld bench
// compare --rerun runs BASE's programs only where this is BASE's revision.
std::string revision_at(const std::filesystem::path& bench_dir);

// argv holds what follows "psld bench compare". Returns the exit status:
// 1 on a regression, 0 on none, 2 on bad input.
int cmd_compare(int argc, char** argv);

// `psld bench merge OUT IN...`: the repetitions of several reports in one.
int cmd_merge(int argc, char** argv);

}  // namespace psld::bench
