// The version in psld/version.h, psld_version() and psld::version() against
// meson's project(version:), which the build passes as PSLD_PROJECT_VERSION.
#include "psld/version.h"

#include <gtest/gtest.h>

#include <string>

#include "psld/c_api.h"

namespace {

TEST(Version, HeaderMatchesProjectVersion) {
  EXPECT_STREQ(PSLD_VERSION_STRING, PSLD_PROJECT_VERSION);
  const std::string parts = std::to_string(PSLD_VERSION_MAJOR) + "." +
                            std::to_string(PSLD_VERSION_MINOR) + "." +
                            std::to_string(PSLD_VERSION_PATCH);
  EXPECT_EQ(parts, PSLD_PROJECT_VERSION);
}

TEST(Version, LibraryMatchesHeader) {
  EXPECT_STREQ(psld_version(), PSLD_VERSION_STRING);
  EXPECT_STREQ(psld::version(), PSLD_VERSION_STRING);
}

}  // namespace
