// tests/fuzz/fuzz.h — what every libFuzzer harness here shares (docs/fuzzing.md).
//
// A harness feeds libFuzzer's input to one family of decoders. Where the
// input decodes, it also checks what the decoder promises: that encoding the
// value gives the same bytes back, and the family's own invariants. A broken
// promise traps, so libFuzzer keeps the input as a crash: the harnesses find
// logic errors, not only memory errors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

namespace psld::fuzz {

// Stops the run with the failed condition named; libFuzzer saves the input.
#define PSLD_FUZZ_CHECK(cond)                                                             \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "fuzz check failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      __builtin_trap();                                                                   \
    }                                                                                     \
  } while (0)

inline bool same_bytes(std::span<const uint8_t> a, std::span<const uint8_t> b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

// A valid input, made with the encoders: the seed corpus
// (tests/fuzz/corpus/NAME/, written by `NAME_fuzz --write-seeds DIR`).
struct Seed {
  std::string name;  // the file's name
  std::vector<uint8_t> bytes;
};
// Defined by each harness.
std::vector<Seed> seeds();

// libFuzzer flags a harness runs with unless the command line says
// otherwise (fuzz_main.cc puts them first). A harness that needs some
// defines this; the others get none.
std::vector<std::string> default_flags() __attribute__((weak));

// For a harness of several decoders: the input's first byte picks one of
// `decoders` (modulo their count), which gets the rest.
using Decoder = void (*)(std::span<const uint8_t>);
inline int dispatch(const uint8_t* data, size_t size, std::initializer_list<Decoder> decoders) {
  if (size == 0) return 0;
  decoders.begin()[data[0] % decoders.size()](std::span<const uint8_t>(data + 1, size - 1));
  return 0;
}

// A seed for a harness whose first byte picks the decoder.
inline Seed tagged(std::string name, uint8_t selector, std::span<const uint8_t> payload) {
  Seed s{std::move(name), {selector}};
  s.bytes.insert(s.bytes.end(), payload.begin(), payload.end());
  return s;
}

}  // namespace psld::fuzz
