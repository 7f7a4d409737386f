// A fresh directory under $TMPDIR (or /tmp) for one test, removed with
// everything in it when the test is done, whatever happened.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace psld::testing {

class TempDir {
 public:
  // `prefix` names the directory ("psld-config" -> psld-config-XXXXXX).
  explicit TempDir(const std::string& prefix = "psld-test") {
    const std::string base = std::filesystem::temp_directory_path() / (prefix + "-XXXXXX");
    std::vector<char> buf(base.begin(), base.end());
    buf.push_back('\0');
    const char* made = mkdtemp(buf.data());
    EXPECT_NE(made, nullptr) << "mkdtemp " << base;
    path_ = made != nullptr ? made : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // Empty when the directory could not be made (the test has failed then).
  const std::string& path() const { return path_; }

  // Writes `text` into the file `name` in it; returns the file's path.
  std::string write(const std::string& name, const std::string& text) const {
    std::string p = path_ + "/" + name;
    std::ofstream(p) << text;
    return p;
  }

 private:
  std::string path_;
};

}  // namespace psld::testing
