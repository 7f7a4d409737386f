// bench/profiles.cc — reading tensor-size profiles (format in profiles.h).
#include "bench/profiles.h"

#include <fmt/format.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <unordered_map>
#include <utility>

#ifndef PSLD_PROFILES_DIR
#error "PSLD_PROFILES_DIR (the shipped profiles' directory) is set by bench/meson.build"
#endif

namespace psld::bench {
namespace {

// A whole decimal number, no sign, no spaces, no overflow.
bool parse_u64(std::string_view text, uint64_t& out) {
  if (text.empty()) return false;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, out);
  return ec == std::errc() && ptr == end;
}

Status parse_line(std::string_view line, std::string_view where, TensorSpec& spec) {
  std::vector<std::string_view> fields;
  size_t start = 0;
  while (true) {
    size_t tab = line.find('\t', start);
    fields.push_back(line.substr(start, tab == std::string_view::npos ? tab : tab - start));
    if (tab == std::string_view::npos) break;
    start = tab + 1;
  }
  if (fields.size() != 3) {
    return InvalidArgument(
        fmt::format("{}: expected 3 tab-separated fields (name, shape, elements), found {}", where,
                    fields.size()));
  }
  const std::string_view name = fields[0], shape = fields[1], elements = fields[2];

  if (name.empty() || name.find_first_of(" \t\r\n\v\f") != std::string_view::npos) {
    return InvalidArgument(
        fmt::format("{}: tensor name '{}' is empty or contains whitespace", where, name));
  }

  spec.name = std::string(name);
  spec.shape.clear();
  uint64_t product = 1;
  size_t dim_start = 0;
  while (true) {
    size_t x = shape.find('x', dim_start);
    std::string_view dim_text =
        shape.substr(dim_start, x == std::string_view::npos ? x : x - dim_start);
    uint64_t dim = 0;
    if (!parse_u64(dim_text, dim) || dim == 0) {
      return InvalidArgument(fmt::format(
          "{}: bad shape '{}' for {}: expected positive integers joined by 'x', e.g. 64x3x7x7",
          where, shape, name));
    }
    if (product > std::numeric_limits<uint64_t>::max() / dim) {
      return InvalidArgument(
          fmt::format("{}: shape '{}' of {} has more than 2^64 elements", where, shape, name));
    }
    product *= dim;
    spec.shape.push_back(dim);
    if (x == std::string_view::npos) break;
    dim_start = x + 1;
  }

  if (!parse_u64(elements, spec.elements)) {
    return InvalidArgument(fmt::format(
        "{}: bad element count '{}' for {}: expected a decimal integer", where, elements, name));
  }
  if (spec.elements != product) {
    return InvalidArgument(fmt::format("{}: {} has {} elements, but its shape {} holds {}", where,
                                       name, spec.elements, shape, product));
  }
  return Status::Ok();
}

}  // namespace

std::string profiles_dir() {
  return PSLD_PROFILES_DIR;
}

Result<std::vector<TensorSpec>> parse_profile(std::string_view text, std::string_view source) {
  std::vector<TensorSpec> specs;
  std::unordered_map<std::string, size_t> first_line;  // name -> line it was defined on
  size_t line_no = 0;
  size_t start = 0;
  while (start < text.size()) {
    size_t nl = text.find('\n', start);
    std::string_view line =
        text.substr(start, nl == std::string_view::npos ? std::string_view::npos : nl - start);
    start = nl == std::string_view::npos ? text.size() : nl + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);  // written on Windows
    if (line.empty() || line.front() == '#') continue;

    const std::string where = fmt::format("{}:{}", source, line_no);
    TensorSpec spec;
    PSLD_RETURN_IF_ERROR(parse_line(line, where, spec));
    auto [it, inserted] = first_line.emplace(spec.name, line_no);
    if (!inserted) {
      return InvalidArgument(fmt::format("{}: tensor {} appears twice (first on line {})", where,
                                         spec.name, it->second));
    }
    specs.push_back(std::move(spec));
  }
  if (specs.empty()) {
    return InvalidArgument(fmt::format("{}: the profile lists no tensors", source));
  }
  return specs;
}

Result<std::vector<TensorSpec>> load_profile(const std::string& path_or_name) {
  if (path_or_name.empty()) {
    return InvalidArgument(
        "empty profile name: give a shipped name (resnet50, vgg16, bert_base) or a path");
  }
  const bool bare_name = path_or_name.find('/') == std::string::npos &&
                         !std::string_view(path_or_name).ends_with(".tsv");
  const std::string path = bare_name ? profiles_dir() + "/" + path_or_name + ".tsv" : path_or_name;

  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!file) {
    const int err = errno;
    std::string message = fmt::format("profile {} cannot be opened: {}", path, std::strerror(err));
    if (bare_name) {
      message +=
          fmt::format(" (shipped profiles are in {}: resnet50, vgg16, bert_base)", profiles_dir());
    }
    if (err == ENOENT || err == ENOTDIR) return NotFound(std::move(message));
    return InvalidArgument(std::move(message));
  }
  std::string text;
  char buf[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, file.get())) > 0)
    text.append(buf, n);
  if (std::ferror(file.get())) {
    // A directory opens but cannot be read (EISDIR).
    return InvalidArgument(
        fmt::format("profile {} cannot be read: {}", path, std::strerror(errno)));
  }
  return parse_profile(text, path);
}

}  // namespace psld::bench
