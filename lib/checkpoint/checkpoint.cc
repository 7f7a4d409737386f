// lib/checkpoint/checkpoint.cc — checkpoint manifests and server files:
// their codecs, the writer, find_latest, the reader and prune.
#include "lib/checkpoint/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sodium.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <unordered_map>
#include <utility>

#include "base/wire.h"
#include "lib/protocol/protocol.h"

namespace psld::checkpoint {
namespace {

constexpr std::string_view kManifestName = "MANIFEST";
constexpr std::string_view kTmpSuffix = ".tmp";
constexpr std::string_view kRoundPrefix = "round-";
constexpr size_t kRoundDigits = 20;  // UINT64_MAX has 20 decimal digits
constexpr std::string_view kMagic = "PSLDCKPT";
constexpr size_t kHashBytes = crypto_generichash_blake2b_BYTES;  // 32: BLAKE2b-256
constexpr size_t kHashHexDigits = 2 * kHashBytes;

// The file carries the public enum's values, as the wire does
// (lib/protocol/protocol.cc checks the same): changing one is a format
// change (kFormat).
static_assert(static_cast<uint8_t>(DType::kFloat32) == 1);
static_assert(static_cast<uint8_t>(DType::kFloat16) == 2);
static_assert(static_cast<uint8_t>(DType::kBFloat16) == 3);

bool valid_dtype(uint8_t v) {
  return v >= 1 && v <= 3;
}

// The manifest's names of the dtypes.
std::string_view dtype_label(DType d) {
  switch (d) {
    case DType::kFloat32:
      return "f32";
    case DType::kFloat16:
      return "f16";
    case DType::kBFloat16:
      return "bf16";
  }
  return "unknown";
}

bool parse_dtype_label(std::string_view s, DType* d) {
  for (DType x : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    if (s == dtype_label(x)) {
      *d = x;
      return true;
    }
  }
  return false;
}

std::string key_name(Key key) {
  return fmt::format("key {:#x} (tensor {}, chunk {})", key, key_tensor(key), key_chunk(key));
}

// A piece of hostile text in a message: quoted, at most 64 bytes, control
// and non-ASCII bytes as '?', so an error line stays one readable line.
std::string shown(std::string_view s) {
  constexpr size_t kMax = 64;
  std::string out = "\"";
  for (size_t i = 0; i < s.size() && i < kMax; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  out += s.size() > kMax ? "\"..." : "\"";
  return out;
}

// ---- File system helpers: every error names the path and errno's text.

Status io_error(std::string_view what, const std::string& path, int err) {
  std::string msg = fmt::format("checkpoint: cannot {} {}: {}", what, path, std::strerror(err));
  switch (err) {
    case ENOENT:
      return NotFound(std::move(msg));
    case ENOSPC:
    case EDQUOT:
      return ResourceExhausted(std::move(msg));
    case EACCES:
    case EPERM:
    case EROFS:
      return FailedPrecondition(std::move(msg));
    default:
      return Unavailable(std::move(msg));
  }
}

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  // Closes and reports close's error: on NFS that is where a failed write
  // can show up first.
  int close() {
    const int fd = std::exchange(fd_, -1);
    return fd >= 0 && ::close(fd) != 0 ? errno : 0;
  }

 private:
  int fd_ = -1;
};

std::string join(const std::string& dir, std::string_view name) {
  if (dir.empty()) return std::string(name);
  if (dir.back() == '/') return dir + std::string(name);
  return dir + "/" + std::string(name);
}

Status write_all(int fd, std::span<const uint8_t> bytes, const std::string& path) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return io_error("write", path, errno);
    bytes = bytes.subspan(static_cast<size_t>(n));
  }
  return Status::Ok();
}

Status pread_all(int fd, uint64_t offset, std::span<uint8_t> out, const std::string& path) {
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t n =
        ::pread(fd, out.data() + got, out.size() - got, static_cast<off_t>(offset + got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return io_error("read", path, errno);
    if (n == 0) {
      return DataLoss(fmt::format("checkpoint: {} ends at byte {}, {} bytes short", path,
                                  offset + got, out.size() - got));
    }
    got += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status fsync_dir(const std::string& dir) {
  const std::string path = dir.empty() ? "." : dir;
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return io_error("open directory", path, errno);
  if (::fsync(fd.get()) != 0) return io_error("fsync directory", path, errno);
  return Status::Ok();
}

// mkdir -p, then an fsync of the parent, so that a round directory made
// now is still there after a crash once the files in it are.
Status make_dirs(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) return io_error("create directory", path, ec.value());
  const std::string parent = std::filesystem::path(path).parent_path().string();
  return fsync_dir(parent);
}

// NAME.tmp, fsync, rename to NAME, fsync the directory.
Status write_durably(const std::string& dir, std::string_view name, std::string_view text) {
  const std::string path = join(dir, name);
  const std::string tmp = path + std::string(kTmpSuffix);
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.valid()) return io_error("create", tmp, errno);
  Status s = write_all(fd.get(),
                       std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()), tmp);
  if (s.ok() && ::fsync(fd.get()) != 0) s = io_error("fsync", tmp, errno);
  if (const int err = fd.close(); s.ok() && err != 0) s = io_error("close", tmp, err);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) s = io_error("rename", tmp, errno);
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  return fsync_dir(dir);
}

// BLAKE2b-256 in lowercase hex. libsodium picks its fastest implementation in
// sodium_init; before that it hashes with the portable one, the same digest.
class Hasher {
 public:
  Hasher() {
    static const bool ready = sodium_init() >= 0;
    (void)ready;
    crypto_generichash_blake2b_init(&st_, nullptr, 0, kHashBytes);
  }
  void update(std::span<const uint8_t> b) {
    crypto_generichash_blake2b_update(&st_, b.data(), b.size());
  }
  std::string hex() {
    uint8_t out[kHashBytes];
    crypto_generichash_blake2b_final(&st_, out, kHashBytes);
    char text[kHashHexDigits + 1];
    sodium_bin2hex(text, sizeof(text), out, kHashBytes);
    return std::string(text, kHashHexDigits);
  }

 private:
  crypto_generichash_blake2b_state st_;
};

// ---- Manifest text.

bool parse_u64(std::string_view s, uint64_t* v) {
  if (s.empty() || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return false;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *v);
  return ec == std::errc() && end == s.data() + s.size();
}

bool parse_u32(std::string_view s, uint32_t* v) {
  uint64_t wide = 0;
  if (!parse_u64(s, &wide) || wide > std::numeric_limits<uint32_t>::max()) return false;
  *v = static_cast<uint32_t>(wide);
  return true;
}

bool is_hash_hex(std::string_view s) {
  return s.size() == kHashHexDigits && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

// `s` cut at single spaces into at most `max` parts, the last holding the
// rest (spaces included).
std::vector<std::string_view> split(std::string_view s, size_t max) {
  std::vector<std::string_view> parts;
  while (parts.size() + 1 < max) {
    const size_t sp = s.find(' ');
    if (sp == std::string_view::npos) break;
    parts.push_back(s.substr(0, sp));
    s.remove_prefix(sp + 1);
  }
  parts.push_back(s);
  return parts;
}

struct LineError {
  size_t line;
  Status operator()(std::string_view what) const {
    return DataLoss(fmt::format("line {}: {}", line, what));
  }
};

// `name` gets a view of the name in `value`, for the duplicate check.
Status parse_tensor(std::string_view value, const LineError& bad, TensorEntry* t,
                    std::string_view* name) {
  const std::vector<std::string_view> p = split(value, 5);
  if (p.size() != 5) return bad("tensor: expected \"tensor ID DTYPE BYTES CHUNK_BYTES NAME\"");
  if (!parse_u32(p[0], &t->id)) {
    return bad(fmt::format("tensor: ID {} is not a number from 0 to {}", shown(p[0]),
                           std::numeric_limits<uint32_t>::max()));
  }
  if (!parse_dtype_label(p[1], &t->dtype)) {
    return bad(fmt::format("tensor {}: DTYPE {} is not f32, f16 or bf16", t->id, shown(p[1])));
  }
  if (!parse_u64(p[2], &t->bytes)) {
    return bad(
        fmt::format("tensor {}: BYTES {} is not a number from 0 to 2^64-1", t->id, shown(p[2])));
  }
  if (!parse_u64(p[3], &t->chunk_bytes)) {
    return bad(fmt::format("tensor {}: CHUNK_BYTES {} is not a number from 0 to 2^64-1", t->id,
                           shown(p[3])));
  }
  if (p[4].empty()) return bad(fmt::format("tensor {}: NAME is empty", t->id));
  t->name = std::string(p[4]);
  *name = p[4];
  return Status::Ok();
}

Status parse_file(std::string_view value, const LineError& bad, FileEntry* f) {
  const std::vector<std::string_view> p = split(value, 6);
  if (p.size() != 5) return bad("file: expected \"file SERVER NAME BYTES RECORDS BLAKE2B\"");
  if (!parse_u32(p[0], &f->server)) {
    return bad(fmt::format("file: SERVER {} is not a number from 0 to {}", shown(p[0]),
                           std::numeric_limits<uint32_t>::max()));
  }
  // The name is joined to the round directory: anything but the server's
  // own name (a path, "..") is refused here, not trusted there.
  if (p[1] != server_file_name(f->server)) {
    return bad(fmt::format("file of server {}: NAME {} is not {}", f->server, shown(p[1]),
                           server_file_name(f->server)));
  }
  f->name = std::string(p[1]);
  if (!parse_u64(p[2], &f->bytes)) {
    return bad(
        fmt::format("file {}: BYTES {} is not a number from 0 to 2^64-1", f->name, shown(p[2])));
  }
  if (!parse_u64(p[3], &f->records)) {
    return bad(
        fmt::format("file {}: RECORDS {} is not a number from 0 to 2^64-1", f->name, shown(p[3])));
  }
  if (!is_hash_hex(p[4])) {
    return bad(fmt::format("file {}: BLAKE2B {} is not {} lowercase hex digits", f->name,
                           shown(p[4]), kHashHexDigits));
  }
  f->blake2b = std::string(p[4]);
  return Status::Ok();
}

// ---- Server file bytes.

template <size_t N>
void put_magic(std::array<uint8_t, N>& out) {
  std::memcpy(out.data(), kMagic.data(), kMagic.size());
}

}  // namespace

// ---- Manifest.

std::string encode_manifest(const Manifest& m) {
  std::string out = fmt::format("psld-checkpoint {}\nround {}\nepoch {}\nkeys {}\n", kFormat,
                                m.round, m.epoch, m.keys);
  for (const TensorEntry& t : m.tensors) {
    fmt::format_to(std::back_inserter(out), "tensor {} {} {} {} {}\n", t.id, dtype_label(t.dtype),
                   t.bytes, t.chunk_bytes, t.name);
  }
  for (const FileEntry& f : m.files) {
    fmt::format_to(std::back_inserter(out), "file {} {} {} {} {}\n", f.server, f.name, f.bytes,
                   f.records, f.blake2b);
  }
  return out;
}

Result<Manifest> decode_manifest(std::string_view text) {
  if (text.empty()) return DataLoss("empty (no \"psld-checkpoint 1\" line)");
  Manifest m;
  // Where each field and name was first given, for "given twice" messages.
  size_t round_line = 0, epoch_line = 0, keys_line = 0;
  std::unordered_map<TensorId, size_t> tensor_ids;
  std::unordered_map<std::string_view, size_t> tensor_names;
  std::unordered_map<uint32_t, size_t> servers;
  uint64_t chunks = 0;
  uint64_t records = 0;

  size_t line_no = 0;
  while (!text.empty()) {
    ++line_no;
    const LineError bad{line_no};
    const size_t nl = text.find('\n');
    // The last line's newline shows the text was not cut short mid-line.
    if (nl == std::string_view::npos) return bad("no newline at its end (cut short?)");
    const std::string_view line = text.substr(0, nl);
    text.remove_prefix(nl + 1);

    if (line_no == 1) {
      constexpr std::string_view kHead = "psld-checkpoint ";
      uint32_t format = 0;
      if (line.substr(0, kHead.size()) != kHead || !parse_u32(line.substr(kHead.size()), &format)) {
        return bad(
            fmt::format("{} is not a psld checkpoint manifest's first line (\"psld-checkpoint "
                        "{}\")",
                        shown(line), kFormat));
      }
      if (format != kFormat) {
        return bad(fmt::format("format {}; this build reads format {}", format, kFormat));
      }
      continue;
    }

    const size_t sp = line.find(' ');
    const std::string_view field = line.substr(0, sp);
    if (sp == std::string_view::npos) {
      return bad(fmt::format("field {} has no value (expected \"FIELD VALUE\")", shown(field)));
    }
    const std::string_view value = line.substr(sp + 1);

    if (field == "round" || field == "epoch" || field == "keys") {
      size_t* first = field == "round" ? &round_line : field == "epoch" ? &epoch_line : &keys_line;
      uint64_t* target = field == "round" ? &m.round : field == "epoch" ? &m.epoch : &m.keys;
      if (*first != 0) return bad(fmt::format("{} given twice (first on line {})", field, *first));
      if (!parse_u64(value, target)) {
        return bad(fmt::format("{} {} is not a number from 0 to 2^64-1", field, shown(value)));
      }
      *first = line_no;
    } else if (field == "tensor") {
      TensorEntry t;
      std::string_view name;
      PSLD_RETURN_IF_ERROR(parse_tensor(value, bad, &t, &name));
      if (auto [it, fresh] = tensor_ids.emplace(t.id, line_no); !fresh) {
        return bad(fmt::format("tensor id {} given twice (first on line {})", t.id, it->second));
      }
      const uint32_t element = protocol::dtype_bytes(t.dtype);
      if (t.chunk_bytes == 0) return bad(fmt::format("tensor {}: chunk_bytes is 0", t.id));
      if (t.chunk_bytes % element != 0) {
        return bad(
            fmt::format("tensor {}: chunk_bytes {} is not a multiple of the {} size ({} bytes)",
                        t.id, t.chunk_bytes, dtype_label(t.dtype), element));
      }
      Result<ChunkLayout> layout = ChunkLayout::make(t.id, t.bytes, t.chunk_bytes, element);
      if (!layout.ok()) return bad(layout.status().message());
      if (layout->num_chunks() > std::numeric_limits<uint64_t>::max() - chunks) {
        return bad("the tensors' chunks add up to more than 2^64-1");
      }
      chunks += layout->num_chunks();
      // Keyed by views into the text, which outlives the decode's maps
      // (the entries' own strings move as m.tensors grows).
      if (auto [it, fresh] = tensor_names.emplace(name, line_no); !fresh) {
        return bad(
            fmt::format("tensor name {} given twice (first on line {})", shown(name), it->second));
      }
      m.tensors.push_back(std::move(t));
    } else if (field == "file") {
      FileEntry f;
      PSLD_RETURN_IF_ERROR(parse_file(value, bad, &f));
      // Names follow from servers (parse_file), so one check covers both.
      if (auto [it, fresh] = servers.emplace(f.server, line_no); !fresh) {
        return bad(fmt::format("server {} ({}) given twice (first on line {})", f.server, f.name,
                               it->second));
      }
      if (f.records > std::numeric_limits<uint64_t>::max() - records) {
        return bad("the files' records add up to more than 2^64-1");
      }
      records += f.records;
      m.files.push_back(std::move(f));
    } else {
      return bad(fmt::format("unknown field {}", shown(field)));
    }
  }

  for (auto [name, line] : {std::pair<std::string_view, size_t>{"round", round_line},
                            {"epoch", epoch_line},
                            {"keys", keys_line}}) {
    if (line == 0) return DataLoss(fmt::format("no \"{}\" line", name));
  }
  if (m.keys != records) {
    return DataLoss(
        fmt::format("line {}: keys {}, but the files hold {} records", keys_line, m.keys, records));
  }
  if (m.keys != chunks) {
    return DataLoss(
        fmt::format("line {}: keys {}, but the tensors have {} chunks", keys_line, m.keys, chunks));
  }
  return m;
}

std::string round_dir(const std::string& dir, uint64_t round) {
  return join(dir, fmt::format("{}{:0{}}", kRoundPrefix, round, kRoundDigits));
}

std::string server_file_name(uint32_t server) {
  return fmt::format("server-{}.psck", server);
}

// ---- Server file headers.

std::array<uint8_t, kFileHeaderBytes> encode_file_header(const FileHeader& h) {
  std::array<uint8_t, kFileHeaderBytes> out{};
  put_magic(out);
  store_le(out.data() + 8, h.format, 4);
  store_le(out.data() + 12, h.server, 4);
  store_le(out.data() + 16, h.round, 8);
  store_le(out.data() + 24, 0, 8);  // reserved
  return out;
}

Result<FileHeader> decode_file_header(std::span<const uint8_t> bytes) {
  if (bytes.size() < kFileHeaderBytes) {
    return DataLoss(fmt::format("{} bytes, shorter than a file header ({} bytes)", bytes.size(),
                                kFileHeaderBytes));
  }
  if (std::memcmp(bytes.data(), kMagic.data(), kMagic.size()) != 0) {
    return DataLoss("not a psld checkpoint file (its first bytes are not \"PSLDCKPT\")");
  }
  WireReader r(bytes.subspan(kMagic.size(), kFileHeaderBytes - kMagic.size()));
  FileHeader h;
  h.format = r.u32();
  h.server = r.u32();
  h.round = r.u64();
  const uint64_t reserved = r.u64();
  if (h.format != kFormat) {
    return DataLoss(fmt::format("file format {}; this build reads format {}", h.format, kFormat));
  }
  if (reserved != 0) {
    return DataLoss(fmt::format("file header: reserved field is {:#x}, not 0", reserved));
  }
  return h;
}

std::array<uint8_t, kRecordHeaderBytes> encode_record_header(const RecordHeader& h) {
  std::array<uint8_t, kRecordHeaderBytes> out{};
  store_le(out.data() + 0, h.key, 8);
  out[8] = static_cast<uint8_t>(h.dtype);
  out[9] = static_cast<uint8_t>(h.arrays);
  // out[10..16): u16 0, u32 0
  store_le(out.data() + 16, h.bytes, 8);
  store_le(out.data() + 24, h.version, 8);
  store_le(out.data() + 32, h.elements, 8);
  return out;
}

Result<RecordHeader> decode_record_header(std::span<const uint8_t> bytes) {
  if (bytes.size() < kRecordHeaderBytes) {
    return DataLoss(fmt::format("{} bytes, shorter than a record header ({} bytes)", bytes.size(),
                                kRecordHeaderBytes));
  }
  WireReader r(bytes.first(kRecordHeaderBytes));
  RecordHeader h;
  h.key = r.u64();
  const uint8_t dtype = r.u8();
  const uint8_t arrays = r.u8();
  const uint16_t pad16 = r.u16();
  const uint32_t pad32 = r.u32();
  h.bytes = r.u64();
  h.version = r.u64();
  h.elements = r.u64();
  const std::string who = key_name(h.key);
  if (!valid_dtype(dtype)) {
    return DataLoss(fmt::format("{}: dtype {} is not f32 (1), f16 (2) or bf16 (3)", who, dtype));
  }
  h.dtype = static_cast<DType>(dtype);
  if (arrays != 1 && arrays != 3) {
    return DataLoss(fmt::format("{}: arrays {}, not 1 or 3", who, arrays));
  }
  h.arrays = arrays;
  if (pad16 != 0 || pad32 != 0) {
    return DataLoss(
        fmt::format("{}: the zero fields of its header are {:#x} and {:#x}", who, pad16, pad32));
  }
  const uint32_t element = protocol::dtype_bytes(h.dtype);
  if (h.bytes == 0 || h.bytes % element != 0) {
    return DataLoss(fmt::format("{}: bytes {} is not a whole, non-zero number of {} elements", who,
                                h.bytes, dtype_label(h.dtype)));
  }
  if (h.elements != h.bytes / element) {
    return DataLoss(fmt::format("{}: elements {}, but {} bytes of {} are {} elements", who,
                                h.elements, h.bytes, dtype_label(h.dtype), h.bytes / element));
  }
  // So that state_bytes() and the offset after the record cannot overflow.
  if (h.elements > (std::numeric_limits<uint64_t>::max() - kRecordHeaderBytes) /
                       (uint64_t{h.arrays} * sizeof(float))) {
    return DataLoss(fmt::format("{}: {} elements is more than any file holds", who, h.elements));
  }
  return h;
}

Result<FileScan> scan_records(uint64_t file_bytes, const ReadAt& read_at) {
  if (file_bytes < kFileHeaderBytes) {
    return DataLoss(fmt::format("{} bytes, shorter than a file header ({} bytes)", file_bytes,
                                kFileHeaderBytes));
  }
  std::array<uint8_t, kFileHeaderBytes> head;
  PSLD_RETURN_IF_ERROR(read_at(0, head));
  FileScan scan;
  PSLD_ASSIGN_OR_RETURN(scan.header, decode_file_header(head));

  std::unordered_map<Key, uint64_t> first_at;
  uint64_t at = kFileHeaderBytes;
  while (at < file_bytes) {
    const std::string where = fmt::format("record {} at byte {}", scan.records.size(), at);
    const uint64_t left = file_bytes - at;
    if (left < kRecordHeaderBytes) {
      return DataLoss(fmt::format("{}: {} bytes left, less than a record header ({} bytes)", where,
                                  left, kRecordHeaderBytes));
    }
    std::array<uint8_t, kRecordHeaderBytes> raw;
    PSLD_RETURN_IF_ERROR(read_at(at, raw));
    Result<RecordHeader> h = decode_record_header(raw);
    if (!h.ok()) return h.status().with_context(where);
    if (h->state_bytes() > left - kRecordHeaderBytes) {
      return DataLoss(
          fmt::format("{}: {}: its state of {} bytes runs past the end of the file "
                      "({} bytes left)",
                      where, key_name(h->key), h->state_bytes(), left - kRecordHeaderBytes));
    }
    if (auto [it, fresh] = first_at.emplace(h->key, at); !fresh) {
      return DataLoss(
          fmt::format("{}: {} again (first at byte {})", where, key_name(h->key), it->second));
    }
    scan.records.push_back({*h, at});
    at += kRecordHeaderBytes + h->state_bytes();
  }
  return scan;
}

Result<FileScan> scan_records(std::span<const uint8_t> file) {
  return scan_records(file.size(), [file](uint64_t offset, std::span<uint8_t> out) -> Status {
    if (offset > file.size() || out.size() > file.size() - offset) {
      return DataLoss(fmt::format("read of {} bytes at {} past the end ({} bytes)", out.size(),
                                  offset, file.size()));
    }
    std::memcpy(out.data(), file.data() + offset, out.size());
    return Status::Ok();
  });
}

// ---- FileWriter.

struct FileWriter::State {
  std::string dir;   // the round directory
  std::string path;  // the final name
  std::string tmp;
  uint32_t server = 0;
  UniqueFd fd;
  Hasher hash;
  uint64_t bytes = 0;
  uint64_t records = 0;
  std::unordered_map<Key, uint64_t> keys;  // -> record index, to refuse a key twice
  Status failed;  // the first write error; the writer answers only with it after one
  bool committed = false;

  Status write(std::span<const uint8_t> b) {
    if (Status s = write_all(fd.get(), b, tmp); !s.ok()) {
      failed = s;
      return s;
    }
    hash.update(b);
    bytes += b.size();
    return Status::Ok();
  }

  // The floats as little-endian f32, in place on a little-endian host.
  Status write_floats(std::span<const float> v) {
    if constexpr (std::endian::native == std::endian::little) {
      return write(std::span(reinterpret_cast<const uint8_t*>(v.data()), v.size_bytes()));
    } else {
      std::vector<uint8_t> buf;
      constexpr size_t kBlock = 16384;
      for (size_t i = 0; i < v.size(); i += kBlock) {
        const size_t n = std::min(kBlock, v.size() - i);
        buf.resize(n * sizeof(float));
        for (size_t j = 0; j < n; ++j)
          store_le(buf.data() + 4 * j, std::bit_cast<uint32_t>(v[i + j]), 4);
        PSLD_RETURN_IF_ERROR(write(buf));
      }
      return Status::Ok();
    }
  }
};

FileWriter::FileWriter(std::unique_ptr<State> state) : s_(std::move(state)) {}
FileWriter::FileWriter(FileWriter&&) noexcept = default;
FileWriter& FileWriter::operator=(FileWriter&& o) noexcept {
  if (this != &o) {
    FileWriter gone(std::move(*this));  // removes this one's .tmp, as its destructor would
    s_ = std::move(o.s_);
  }
  return *this;
}

FileWriter::~FileWriter() {
  if (s_ == nullptr || s_->committed) return;
  s_->fd.reset();
  ::unlink(s_->tmp.c_str());
}

Result<FileWriter> FileWriter::create(const std::string& dir, uint64_t round, uint32_t server) {
  auto s = std::make_unique<State>();
  s->dir = round_dir(dir, round);
  s->path = join(s->dir, server_file_name(server));
  s->tmp = s->path + std::string(kTmpSuffix);
  s->server = server;
  PSLD_RETURN_IF_ERROR(make_dirs(s->dir));
  // A MANIFEST already here is an earlier attempt's at this round (a job
  // resumed from an older checkpoint because this one failed its check). It
  // stays: it lists its files' hashes, so a mix of its files and ours never
  // passes find_latest, and the coordinator's new MANIFEST replaces it.
  s->fd = UniqueFd(::open(s->tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!s->fd.valid()) return io_error("create", s->tmp, errno);
  FileWriter w(std::move(s));
  // From here the writer's destructor removes the .tmp on any failure.
  PSLD_RETURN_IF_ERROR(w.s_->write(encode_file_header({kFormat, server, round})));
  return w;
}

Status FileWriter::append(Key key, DType dtype, uint64_t bytes, uint64_t version, uint32_t arrays,
                          std::span<const float> state) {
  if (s_ == nullptr) return FailedPrecondition("checkpoint: append to a moved-from FileWriter");
  if (!s_->failed.ok()) return s_->failed;
  if (s_->committed) {
    return FailedPrecondition(
        fmt::format("checkpoint: {} is committed; append after commit", s_->path));
  }
  // Formatted only for an error: append runs once a key and round.
  auto who = [&] { return fmt::format("checkpoint: {}: {}", s_->tmp, key_name(key)); };
  if (!valid_dtype(static_cast<uint8_t>(dtype))) {
    return InvalidArgument(
        fmt::format("{}: dtype {} is not a DType", who(), static_cast<unsigned>(dtype)));
  }
  if (arrays != 1 && arrays != 3) {
    return InvalidArgument(
        fmt::format("{}: arrays {}, not 1 (parameter) or 3 (and moments)", who(), arrays));
  }
  const uint32_t element = protocol::dtype_bytes(dtype);
  if (bytes == 0 || bytes % element != 0) {
    return InvalidArgument(
        fmt::format("{}: bytes {} is not a whole, non-zero number of {} elements", who(), bytes,
                    dtype_label(dtype)));
  }
  const uint64_t elements = bytes / element;
  if (state.size() / arrays != elements || state.size() % arrays != 0) {
    return InvalidArgument(
        fmt::format("{}: {} floats of state, but {} arrays of {} elements are {}", who(),
                    state.size(), arrays, elements, arrays * elements));
  }
  if (auto [it, fresh] = s_->keys.emplace(key, s_->records); !fresh) {
    return InvalidArgument(
        fmt::format("{}: appended twice (first as record {})", who(), it->second));
  }
  PSLD_RETURN_IF_ERROR(
      s_->write(encode_record_header({key, dtype, arrays, bytes, version, elements})));
  PSLD_RETURN_IF_ERROR(s_->write_floats(state));
  ++s_->records;
  return Status::Ok();
}

Result<FileEntry> FileWriter::commit() {
  if (s_ == nullptr) return FailedPrecondition("checkpoint: commit of a moved-from FileWriter");
  if (!s_->failed.ok()) return s_->failed;
  if (s_->committed) {
    return FailedPrecondition(fmt::format("checkpoint: {} is committed already", s_->path));
  }
  State& s = *s_;
  auto fail = [&s](Status st) {
    s.failed = st;
    return st;
  };
  if (::fsync(s.fd.get()) != 0) return fail(io_error("fsync", s.tmp, errno));
  if (const int err = s.fd.close(); err != 0) return fail(io_error("close", s.tmp, err));
  if (::rename(s.tmp.c_str(), s.path.c_str()) != 0) return fail(io_error("rename", s.tmp, errno));
  s.committed = true;
  // Renamed: the file is ours no longer to remove, even if the directory's
  // fsync fails (the caller then writes no manifest for it).
  PSLD_RETURN_IF_ERROR(fsync_dir(s.dir));
  return FileEntry{s.server, server_file_name(s.server), s.bytes, s.records, s.hash.hex()};
}

uint64_t FileWriter::records() const {
  return s_ ? s_->records : 0;
}
uint64_t FileWriter::bytes() const {
  return s_ ? s_->bytes : 0;
}
const std::string& FileWriter::path() const {
  static const std::string kNone;
  return s_ ? s_->path : kNone;
}

// ---- Manifest files and finding the newest checkpoint.

Status write_manifest(const std::string& dir, const Manifest& m) {
  const std::string text = encode_manifest(m);
  if (Result<Manifest> back = decode_manifest(text); !back.ok()) {
    return InvalidArgument(
        fmt::format("checkpoint: the manifest of round {} would not read back: {}", m.round,
                    back.status().message()));
  } else if (!(*back == m)) {
    return InvalidArgument(fmt::format(
        "checkpoint: the manifest of round {} would not read back as written (a tensor name with "
        "a newline?)",
        m.round));
  }
  const std::string rdir = round_dir(dir, m.round);
  PSLD_RETURN_IF_ERROR(make_dirs(rdir));
  return write_durably(rdir, kManifestName, text);
}

namespace {

struct RoundDir {
  uint64_t round = 0;
  std::string path;
  bool is_dir = false;  // a directory itself, not a symlink to one
};

// "round-" and exactly 20 digits: what round_dir makes, and nothing else.
bool parse_round_name(std::string_view name, uint64_t* round) {
  if (name.size() != kRoundPrefix.size() + kRoundDigits ||
      name.substr(0, kRoundPrefix.size()) != kRoundPrefix)
    return false;
  return parse_u64(name.substr(kRoundPrefix.size()), round);
}

// The round directories under dir, newest first.
Result<std::vector<RoundDir>> list_rounds(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) {
      return NotFound(fmt::format("checkpoint: directory {} does not exist", dir));
    }
    return io_error("list", dir, errno);
  }
  std::vector<RoundDir> out;
  errno = 0;
  while (const dirent* e = ::readdir(d)) {
    uint64_t round = 0;
    if (!parse_round_name(e->d_name, &round)) continue;
    struct stat st = {};
    const bool is_dir =
        ::fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode);
    out.push_back({round, join(dir, e->d_name), is_dir});
    errno = 0;
  }
  const int err = errno;
  ::closedir(d);
  if (err != 0) return io_error("list", dir, err);
  std::sort(out.begin(), out.end(),
            [](const RoundDir& a, const RoundDir& b) { return a.round > b.round; });
  return out;
}

// The file's size and BLAKE2b, or what is wrong with it, as one phrase.
Status check_file(const std::string& path, const FileEntry& f) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    if (errno == ENOENT) return NotFound(fmt::format("{} is missing", f.name));
    return Unavailable(fmt::format("{}: cannot open it: {}", f.name, std::strerror(errno)));
  }
  struct stat st = {};
  if (::fstat(fd.get(), &st) != 0) {
    return Unavailable(fmt::format("{}: cannot stat it: {}", f.name, std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) return DataLoss(fmt::format("{} is not a regular file", f.name));
  if (static_cast<uint64_t>(st.st_size) != f.bytes) {
    return DataLoss(fmt::format("{} is {} bytes, the manifest says {}", f.name,
                                static_cast<uint64_t>(st.st_size), f.bytes));
  }
  // 1 MiB a read: few system calls for a file of gigabytes, and a buffer
  // small enough to allocate per file.
  std::vector<uint8_t> buf(size_t{1} << 20);
  Hasher hash;
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      return Unavailable(fmt::format("{}: cannot read it: {}", f.name, std::strerror(errno)));
    if (n == 0) break;
    hash.update(std::span(buf.data(), static_cast<size_t>(n)));
  }
  const std::string got = hash.hex();
  if (got != f.blake2b) {
    return DataLoss(
        fmt::format("{} has BLAKE2b {}, the manifest says {} (changed after it was "
                    "written)",
                    f.name, got, f.blake2b));
  }
  return Status::Ok();
}

// The MANIFEST of the round directory `path`, decoded, naming `round`; else
// why not, as one phrase for Found::skipped. Its files are not looked at.
Result<Manifest> read_manifest(const std::string& path_of_round, uint64_t round) {
  const std::string path = join(path_of_round, kManifestName);
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    if (errno == ENOENT) {
      return NotFound("no MANIFEST (torn: the job stopped while writing it, or is writing it now)");
    }
    return Unavailable(fmt::format("MANIFEST: cannot open it: {}", std::strerror(errno)));
  }
  struct stat st = {};
  if (::fstat(fd.get(), &st) != 0) {
    return Unavailable(fmt::format("MANIFEST: cannot stat it: {}", std::strerror(errno)));
  }
  if (static_cast<uint64_t>(st.st_size) > kMaxManifestBytes) {
    return DataLoss(fmt::format("MANIFEST is {} bytes, more than a manifest may have ({})",
                                static_cast<uint64_t>(st.st_size), kMaxManifestBytes));
  }
  // One byte more than fstat said, to see a file that grew meanwhile.
  std::string text(static_cast<size_t>(st.st_size) + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd.get(), text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      return Unavailable(fmt::format("MANIFEST: cannot read it: {}", std::strerror(errno)));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  if (got != static_cast<size_t>(st.st_size)) {
    return DataLoss("MANIFEST changed while it was read");
  }
  text.resize(got);
  Result<Manifest> m = decode_manifest(text);
  if (!m.ok()) return m.status().with_context("MANIFEST");
  if (m->round != round) {
    return DataLoss(fmt::format("MANIFEST says round {}", m->round));
  }
  return m;
}

// The round's manifest when the checkpoint is complete; else why not, as one
// phrase for Found::skipped.
Result<Manifest> check_round(const RoundDir& r) {
  if (!r.is_dir) return FailedPrecondition("not a directory");
  PSLD_ASSIGN_OR_RETURN(Manifest m, read_manifest(r.path, r.round));
  for (const FileEntry& f : m.files) {
    PSLD_RETURN_IF_ERROR(check_file(join(r.path, f.name), f));
  }
  return m;
}

}  // namespace

Result<Found> open_round(const std::string& dir, uint64_t round) {
  Found found;
  found.dir = round_dir(dir, round);
  auto m = read_manifest(found.dir, round);
  if (!m.ok()) return m.status().with_context(fmt::format("checkpoint: {}", found.dir));
  found.manifest = std::move(m).value();
  return found;
}

Result<Found> find_latest(const std::string& dir) {
  PSLD_ASSIGN_OR_RETURN(std::vector<RoundDir> rounds, list_rounds(dir));
  Found found;
  for (const RoundDir& r : rounds) {
    Result<Manifest> m = check_round(r);
    if (m.ok()) {
      found.manifest = std::move(m).value();
      found.dir = r.path;
      return found;
    }
    found.skipped.push_back(fmt::format("round {}: {}", r.round, m.status().message()));
  }
  std::string msg = fmt::format("checkpoint: no complete checkpoint in {}", dir);
  if (found.skipped.empty()) msg += " (no round directories)";
  for (const std::string& s : found.skipped)
    msg += "; " + s;
  return NotFound(std::move(msg));
}

// ---- Reader.

namespace {

struct Location {
  uint32_t file = 0;  // index into the manifest's files
  ScannedRecord record;
};

struct TensorShape {
  DType dtype;
  ChunkLayout layout;
};

}  // namespace

struct Reader::State {
  Manifest manifest;
  std::vector<std::string> paths;
  std::vector<UniqueFd> fds;
  std::unordered_map<Key, Location> index;
};

Reader::Reader(std::unique_ptr<State> state) : s_(std::move(state)) {}
Reader::Reader(Reader&&) noexcept = default;
Reader& Reader::operator=(Reader&&) noexcept = default;
Reader::~Reader() = default;

Result<Reader> Reader::open(const Found& found) {
  // A Found is plain data: one made by hand gets the same checks as a
  // decoded manifest, which the layouts below rely on (chunk_bytes > 0).
  if (Result<Manifest> again = decode_manifest(encode_manifest(found.manifest)); !again.ok()) {
    return InvalidArgument(fmt::format("checkpoint: the manifest of {} is not valid: {}", found.dir,
                                       again.status().message()));
  }
  auto s = std::make_unique<State>();
  s->manifest = found.manifest;
  const Manifest& m = s->manifest;

  std::unordered_map<TensorId, TensorShape> tensors;
  for (const TensorEntry& t : m.tensors) {
    PSLD_ASSIGN_OR_RETURN(ChunkLayout layout, ChunkLayout::make(t.id, t.bytes, t.chunk_bytes,
                                                                protocol::dtype_bytes(t.dtype)));
    tensors.emplace(t.id, TensorShape{t.dtype, layout});
  }

  for (uint32_t i = 0; i < m.files.size(); ++i) {
    const FileEntry& f = m.files[i];
    const std::string path = join(found.dir, f.name);
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) return io_error("open", path, errno);
    struct stat st = {};
    if (::fstat(fd.get(), &st) != 0) return io_error("stat", path, errno);
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    if (size != f.bytes) {
      return DataLoss(
          fmt::format("checkpoint: {} is {} bytes, the manifest says {}", path, size, f.bytes));
    }
    const int raw_fd = fd.get();
    Result<FileScan> scan =
        scan_records(size, [raw_fd, &path](uint64_t offset, std::span<uint8_t> out) {
          return pread_all(raw_fd, offset, out, path);
        });
    if (!scan.ok()) return scan.status().with_context("checkpoint: " + path);
    auto bad = [&path](std::string what) {
      return DataLoss(fmt::format("checkpoint: {}: {}", path, what));
    };
    if (scan->header.server != f.server) {
      return bad(
          fmt::format("its header says server {}, the manifest {}", scan->header.server, f.server));
    }
    if (scan->header.round != m.round) {
      return bad(
          fmt::format("its header says round {}, the manifest {}", scan->header.round, m.round));
    }
    if (scan->records.size() != f.records) {
      return bad(fmt::format("{} records, the manifest says {}", scan->records.size(), f.records));
    }
    for (const ScannedRecord& r : scan->records) {
      const RecordHeader& h = r.header;
      const std::string who = fmt::format("record at byte {}: {}", r.offset, key_name(h.key));
      auto t = tensors.find(key_tensor(h.key));
      if (t == tensors.end()) {
        return bad(fmt::format("{}: the manifest has no tensor {}", who, key_tensor(h.key)));
      }
      const ChunkLayout& layout = t->second.layout;
      if (key_chunk(h.key) >= layout.num_chunks()) {
        return bad(fmt::format("{}: the tensor has {} chunks", who, layout.num_chunks()));
      }
      if (h.dtype != t->second.dtype) {
        return bad(fmt::format("{}: dtype {}, the tensor's is {}", who, dtype_label(h.dtype),
                               dtype_label(t->second.dtype)));
      }
      const uint64_t want = layout.chunk(key_chunk(h.key)).bytes;
      if (h.bytes != want) {
        return bad(fmt::format("{}: {} bytes, the chunk has {}", who, h.bytes, want));
      }
      if (auto [it, fresh] = s->index.emplace(h.key, Location{i, r}); !fresh) {
        return bad(fmt::format("{}: also in {}", who, m.files[it->second.file].name));
      }
    }
    s->paths.push_back(path);
    s->fds.push_back(std::move(fd));
  }
  if (s->index.size() != m.keys) {
    return DataLoss(fmt::format("checkpoint: {}: {} keys in the files, the manifest says {}",
                                found.dir, s->index.size(), m.keys));
  }
  return Reader(std::move(s));
}

bool Reader::has(Key key) const {
  return s_ != nullptr && s_->index.count(key) != 0;
}

size_t Reader::keys() const {
  return s_ ? s_->index.size() : 0;
}

std::vector<Key> Reader::sorted_keys() const {
  std::vector<Key> out;
  if (s_ == nullptr) return out;
  out.reserve(s_->index.size());
  for (const auto& [key, loc] : s_->index)
    out.push_back(key);
  std::sort(out.begin(), out.end());
  return out;
}

Result<KeyRecord> Reader::read(Key key) const {
  if (s_ == nullptr) return FailedPrecondition("checkpoint: read from a moved-from Reader");
  auto it = s_->index.find(key);
  if (it == s_->index.end()) {
    return NotFound(
        fmt::format("checkpoint: round {} has no {}", s_->manifest.round, key_name(key)));
  }
  const Location& loc = it->second;
  const int fd = s_->fds[loc.file].get();
  const std::string& path = s_->paths[loc.file];
  std::array<uint8_t, kRecordHeaderBytes> raw;
  PSLD_RETURN_IF_ERROR(pread_all(fd, loc.record.offset, raw, path));
  Result<RecordHeader> h = decode_record_header(raw);
  if (!h.ok() || !(*h == loc.record.header)) {
    return DataLoss(
        fmt::format("checkpoint: {}: the record of {} at byte {} changed since the "
                    "checkpoint was opened",
                    path, key_name(key), loc.record.offset));
  }
  KeyRecord r;
  r.key = key;
  r.dtype = h->dtype;
  r.bytes = h->bytes;
  r.version = h->version;
  r.arrays = h->arrays;
  r.elements = h->elements;
  r.state.resize(h->arrays * h->elements);
  std::span<uint8_t> bytes(reinterpret_cast<uint8_t*>(r.state.data()), h->state_bytes());
  PSLD_RETURN_IF_ERROR(pread_all(fd, loc.record.offset + kRecordHeaderBytes, bytes, path));
  if constexpr (std::endian::native != std::endian::little) {
    for (float& v : r.state) {
      uint8_t le[4];
      std::memcpy(le, &v, 4);
      v = std::bit_cast<float>(static_cast<uint32_t>(load_le(le, 4)));
    }
  }
  return r;
}

const Manifest& Reader::manifest() const {
  static const Manifest kNone;
  return s_ ? s_->manifest : kNone;
}

// ---- Prune.

Status prune(const std::string& dir, uint32_t keep, std::vector<std::string>* removed) {
  if (keep == 0) {
    return InvalidArgument("checkpoint: prune with keep 0 would remove every checkpoint");
  }
  PSLD_ASSIGN_OR_RETURN(std::vector<RoundDir> rounds, list_rounds(dir));
  uint32_t complete = 0;
  for (const RoundDir& r : rounds) {
    if (!r.is_dir) continue;  // never followed, never removed
    const std::string manifest = join(r.path, kManifestName);
    struct stat st = {};
    const bool has_manifest = ::lstat(manifest.c_str(), &st) == 0 && S_ISREG(st.st_mode);
    if (has_manifest) ++complete;
    // Kept: the newest `keep` complete ones, and incomplete ones newer than
    // every complete one (they may be being written now).
    if (has_manifest ? complete <= keep : complete == 0) continue;
    // The MANIFEST first: a removal cut short leaves an incomplete
    // directory, which the next prune removes, and not one that still
    // counts as complete with files missing.
    if (has_manifest && ::unlink(manifest.c_str()) != 0 && errno != ENOENT) {
      return io_error("remove", manifest, errno);
    }
    std::error_code ec;
    std::filesystem::remove_all(r.path, ec);
    if (ec) return io_error("remove", r.path, ec.value());
    if (removed != nullptr) removed->push_back(r.path);
  }
  return Status::Ok();
}

}  // namespace psld::checkpoint
