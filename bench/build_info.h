// bench/build_info.h — what a benchmark report says about the build that ran
// it (bench/meson.build fills these in).
#pragma once

namespace psld::bench {

extern const char* const kGitDescribe;  // `git describe --always --dirty`, or "unknown"
extern const char* const kBuildType;    // meson's buildtype of this build
extern const char* const kCompiler;     // "gcc 12.2.0"

}  // namespace psld::bench
