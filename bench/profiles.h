// bench/profiles.h — tensor-size profiles of real models, for benchmarks.
//
// A profile is the list of parameter tensors a data-parallel trainer pushes
// every round (ResNet-50, VGG-16, BERT-base ship in bench/profiles/; see
// docs/profiles.md). The file format, one tensor a line in the framework's
// registration order:
//
//   # a comment (lines starting with '#'; empty lines are skipped too)
//   name<TAB>shape<TAB>elements        e.g. conv1.weight<TAB>64x3x7x7<TAB>9408
//
// shape is one or more positive dimensions joined by 'x'; elements must equal
// their product. Names are unique within a profile.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "psld/status.h"

namespace psld::bench {

struct TensorSpec {
  std::string name;
  std::vector<uint64_t> shape;
  uint64_t elements = 0;
};

// Loads a profile. A bare name ("resnet50": no '/' and no ".tsv") is the
// shipped profile bench/profiles/<name>.tsv, whatever the working directory;
// anything else is a path. NotFound names the path when there is no such
// file; InvalidArgument says "file:line: what is wrong" for a malformed line.
Result<std::vector<TensorSpec>> load_profile(const std::string& path_or_name);

// Parses a profile's text; `source` names it in error messages ("file:line").
Result<std::vector<TensorSpec>> parse_profile(std::string_view text, std::string_view source);

// The directory load_profile resolves bare names in (compiled in).
std::string profiles_dir();

}  // namespace psld::bench
