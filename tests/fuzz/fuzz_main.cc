// tests/fuzz/fuzz_main.cc — linked into every harness: `--write-seeds DIR`
// writes the harness's seeds (fuzz.h) into DIR and exits, before libFuzzer
// reads its flags; anything else is libFuzzer's, after the harness's
// default_flags().
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  for (int i = 1; i + 1 < *argc; ++i) {
    if (std::strcmp((*argv)[i], "--write-seeds") != 0) continue;
    const std::string dir = (*argv)[i + 1];
    int written = 0;
    for (const psld::fuzz::Seed& s : psld::fuzz::seeds()) {
      const std::string path = dir + "/" + s.name;
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(s.bytes.data()),
                static_cast<std::streamsize>(s.bytes.size()));
      if (!out) {
        std::fprintf(stderr, "cannot write %s (does %s exist?)\n", path.c_str(), dir.c_str());
        std::exit(1);
      }
      ++written;
    }
    std::printf("wrote %d seeds to %s\n", written, dir.c_str());
    std::exit(0);
  }
  if (psld::fuzz::default_flags != nullptr) {
    // Before the command line's, so that those win (libFuzzer keeps the
    // last value of a flag). Kept for the life of the process, as argv is.
    static std::vector<std::string> flags = psld::fuzz::default_flags();
    static std::vector<char*> args;
    args.push_back((*argv)[0]);
    for (std::string& f : flags)
      args.push_back(f.data());
    for (int i = 1; i < *argc; ++i)
      args.push_back((*argv)[i]);
    args.push_back(nullptr);
    *argc = static_cast<int>(args.size() - 1);
    *argv = args.data();
  }
  return 0;
}
