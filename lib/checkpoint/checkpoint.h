// lib/checkpoint/checkpoint.h — the on-disk format of psld's consistent
// checkpoints, and how they are written, found, read and pruned.
//
// A job with checkpoint.dir = DIR and checkpoint.every_rounds = N writes, at
// rounds R = N, 2N, ..., one file per server and then a manifest:
//
//   DIR/round-00000000000000000100/server-0.psck
//   DIR/round-00000000000000000100/server-1.psck
//   DIR/round-00000000000000000100/MANIFEST
//
// (R zero-padded to 20 digits, so that names sort as rounds do.) Every file is
// written as NAME.tmp, fsync'd, renamed to NAME and its directory fsync'd. The
// MANIFEST comes last: its presence marks the checkpoint complete, and it
// carries each server file's size, record count and BLAKE2b-256, so a file
// that a crash, a full disk or a bad copy left short or changed is found
// before anything is read from it (find_latest).
//
// A server file, little-endian:
//   header (32 bytes): "PSLDCKPT", u32 format (kFormat), u32 server,
//                      u64 round, u64 reserved (0)
//   records, one per key, back to back (40-byte header, then the state):
//     u64 key, u8 dtype, u8 arrays (1 or 3), u16 0, u32 0, u64 bytes,
//     u64 version, u64 elements, then arrays * elements f32
// with nothing after the last record.
//
// Everything here is safe on hostile bytes: decode_manifest and scan_records
// are fuzzed (tests/fuzz/checkpoint_fuzz.cc).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "psld/keys.h"
#include "psld/status.h"
#include "psld/worker.h"  // DType

namespace psld::checkpoint {

inline constexpr uint32_t kFormat = 1;

// ---- The manifest.

struct TensorEntry {
  TensorId id = 0;
  std::string name;  // not empty; no newline
  DType dtype = DType::kFloat32;
  uint64_t bytes = 0;
  uint64_t chunk_bytes = 0;
  bool operator==(const TensorEntry&) const = default;
};

struct FileEntry {
  uint32_t server = 0;
  std::string name;  // server_file_name(server)
  uint64_t bytes = 0;
  uint64_t records = 0;
  std::string blake2b;  // 64 lowercase hex digits: BLAKE2b-256 of the whole file
  bool operator==(const FileEntry&) const = default;
};

struct Manifest {
  uint64_t round = 0;  // every key's state after this round was applied
  uint64_t epoch = 0;  // the placement epoch then (information only)
  // Records in all files together: the sum of the files' records, and the
  // number of chunks the tensors have.
  uint64_t keys = 0;
  std::vector<TensorEntry> tensors;
  std::vector<FileEntry> files;
  bool operator==(const Manifest&) const = default;
};

// A text document an operator can read, one "field value" line each:
//   psld-checkpoint 1
//   round 100
//   epoch 3
//   keys 5
//   tensor ID DTYPE BYTES CHUNK_BYTES NAME      (one per tensor; DTYPE f32,
//                                               f16 or bf16; NAME last, may
//                                               hold spaces)
//   file SERVER NAME BYTES RECORDS BLAKE2B     (one per server file)
// A tensor name with a newline cannot be written (decode_manifest refuses
// what this would make of it; write_manifest checks before writing).
std::string encode_manifest(const Manifest& m);

// The largest MANIFEST find_latest reads: a tensor line is ~100 bytes, so
// this leaves room for over half a million tensors.
inline constexpr size_t kMaxManifestBytes = size_t{64} << 20;

// DataLoss naming the line and what is wrong with it for anything malformed:
// a first line other than "psld-checkpoint 1"; unknown, missing or repeated
// fields; numbers out of range or with anything but digits; tensor ids or
// names given twice; servers or file names given twice; a file name other
// than server_file_name(server); keys other than the sum of the files'
// records or the tensors' chunks (ChunkLayout); a chunk_bytes that is 0 or
// not a multiple of the dtype's size; no newline after the last line.
// Never crashes; allocates at most in proportion to the text.
Result<Manifest> decode_manifest(std::string_view text);

// DIR/round-%020llu.
std::string round_dir(const std::string& dir, uint64_t round);
// "server-N.psck".
std::string server_file_name(uint32_t server);

// ---- Server files.

inline constexpr size_t kFileHeaderBytes = 32;
inline constexpr size_t kRecordHeaderBytes = 40;

struct FileHeader {
  uint32_t format = kFormat;
  uint32_t server = 0;
  uint64_t round = 0;
  bool operator==(const FileHeader&) const = default;
};

// What precedes one key's state in a server file.
struct RecordHeader {
  Key key = 0;
  DType dtype = DType::kFloat32;  // the tensor's; the state is f32 whatever it is
  uint32_t arrays = 1;            // 1: the parameter; 3: and the optimizer's two moments
  uint64_t bytes = 0;             // the chunk's size in the tensor's dtype
  uint64_t version = 0;           // rounds applied
  uint64_t elements = 0;          // bytes / the dtype's size
  // The f32 state after the header. decode_record_header guarantees that
  // this does not overflow.
  uint64_t state_bytes() const { return uint64_t{arrays} * elements * sizeof(float); }
  bool operator==(const RecordHeader&) const = default;
};

std::array<uint8_t, kFileHeaderBytes> encode_file_header(const FileHeader& h);
// DataLoss unless `bytes` starts with a file header of this format (magic,
// format, reserved 0).
Result<FileHeader> decode_file_header(std::span<const uint8_t> bytes);

std::array<uint8_t, kRecordHeaderBytes> encode_record_header(const RecordHeader& h);
// DataLoss unless `bytes` starts with a consistent record header: a known
// dtype, arrays 1 or 3, the zero fields zero, bytes > 0 and a whole number of
// elements, elements == bytes / the dtype's size.
Result<RecordHeader> decode_record_header(std::span<const uint8_t> bytes);

// One record of a server file, where it lies.
struct ScannedRecord {
  RecordHeader header;
  uint64_t offset = 0;  // of its header; the state follows at offset + kRecordHeaderBytes
};

struct FileScan {
  FileHeader header;
  std::vector<ScannedRecord> records;  // in file order
};

// Reads out.size() bytes at `offset` (all of them, or an error).
using ReadAt = std::function<Status(uint64_t offset, std::span<uint8_t> out)>;

// The header and every record header of a server file of `file_bytes`
// bytes, read through `read_at` (the states are skipped, not read). DataLoss
// naming the record and its offset when a header is malformed, a key comes
// twice, or a record runs past the end. Memory: one ScannedRecord a record,
// at most file_bytes / kRecordHeaderBytes of them.
Result<FileScan> scan_records(uint64_t file_bytes, const ReadAt& read_at);
// The same for a file in memory.
Result<FileScan> scan_records(std::span<const uint8_t> file);

// One key's state: `arrays` arrays of `elements` floats each, back to back:
// the parameter, then (arrays == 3) the optimizer's first and second moment.
struct KeyRecord {
  Key key = 0;
  DType dtype = DType::kFloat32;
  uint64_t bytes = 0;
  uint64_t version = 0;  // rounds applied
  uint32_t arrays = 1;
  uint64_t elements = 0;
  std::vector<float> state;
};

// One server's file for one round.
//
//   PSLD_ASSIGN_OR_RETURN(auto w, FileWriter::create(dir, round, server));
//   for (...) PSLD_RETURN_IF_ERROR(w.append(key, dtype, bytes, version, arrays, state));
//   PSLD_ASSIGN_OR_RETURN(FileEntry entry, w.commit());  // for the manifest
//
// A writer that is destroyed without a commit removes its .tmp file, so a
// failed or abandoned checkpoint leaves nothing behind but its directory.
// Errors are Status values naming the path and the system's reason; after
// one, the writer only answers with it.
class FileWriter {
 public:
  // Makes round_dir(dir, round) (and dir) where missing and opens
  // server_file_name(server) + ".tmp" there (replacing one a failed
  // attempt left).
  static Result<FileWriter> create(const std::string& dir, uint64_t round, uint32_t server);

  // One key's record: InvalidArgument when arrays is not 1 or 3, bytes is 0
  // or not a whole number of dtype elements, state.size() is not arrays *
  // (bytes / the dtype's size), or the key was appended before.
  Status append(Key key, DType dtype, uint64_t bytes, uint64_t version, uint32_t arrays,
                std::span<const float> state);
  Status append(const KeyRecord& r) {
    return append(r.key, r.dtype, r.bytes, r.version, r.arrays, r.state);
  }

  // fsyncs and closes the file, renames it to its final name, fsyncs the
  // directory, and returns the file's manifest entry. Once only.
  Result<FileEntry> commit();

  uint64_t records() const;
  uint64_t bytes() const;  // written so far, header included
  // The final path (the file is at path() + ".tmp" until commit).
  const std::string& path() const;

  FileWriter(FileWriter&&) noexcept;
  FileWriter& operator=(FileWriter&&) noexcept;
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  ~FileWriter();

 private:
  struct State;
  explicit FileWriter(std::unique_ptr<State> state);
  std::unique_ptr<State> s_;
};

// Writes MANIFEST into round_dir(dir, m.round): MANIFEST.tmp, fsync, rename,
// fsync the directory. Call it after every server's commit: from then on the
// checkpoint is complete. InvalidArgument, writing nothing, when m would not
// decode (the message says why).
Status write_manifest(const std::string& dir, const Manifest& m);

// The newest complete checkpoint under a checkpoint.dir.
struct Found {
  Manifest manifest;
  std::string dir;  // the round directory
  // The newer round directories passed over, one line each, newest first:
  // "round 300: no MANIFEST (torn: the job stopped while writing it)".
  std::vector<std::string> skipped;
};

// Round directories newest first; the first complete one wins: its MANIFEST
// decodes, its round matches the directory's name, and every file it lists
// is there with exactly that size and BLAKE2b (every file is read). NotFound
// "no complete checkpoint in DIR" with the skipped reasons when there is
// none, NotFound naming dir when it does not exist.
Result<Found> find_latest(const std::string& dir);

// The checkpoint of `round` in dir, as find_latest found it before: its
// MANIFEST read and decoded, the files not hashed again (a resumed job's
// servers open the one its coordinator chose and checked).
Result<Found> open_round(const std::string& dir, uint64_t round);

// Reads a found checkpoint's files. open() scans every file's record headers
// (scan_records), checks each file's header against the manifest (format,
// server, round), its size and record count, and every record against the
// manifest's tensors (a known tensor, a chunk in range, its dtype and size),
// no key in two files; and builds an index key -> (file, offset). read()
// reads one record's state with pread. Memory: the index only, not the
// states. read() may be called from several threads at once.
class Reader {
 public:
  static Result<Reader> open(const Found& found);

  bool has(Key key) const;
  size_t keys() const;
  // Every key in the checkpoint, ascending.
  std::vector<Key> sorted_keys() const;
  // NotFound when the checkpoint has no such key; DataLoss when the file
  // changed since open().
  Result<KeyRecord> read(Key key) const;
  const Manifest& manifest() const;

  Reader(Reader&&) noexcept;
  Reader& operator=(Reader&&) noexcept;
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;
  ~Reader();

 private:
  struct State;
  explicit Reader(std::unique_ptr<State> state);
  std::unique_ptr<State> s_;
};

// Removes, under dir, the round directories older than the newest `keep`
// complete ones (complete: it holds a MANIFEST; nothing is hashed here), and
// every round directory without a MANIFEST older than the newest complete
// one. Newer incomplete ones may be in the making and stay. Nothing but
// round-NNN directories is touched (a symlink of that name is not followed
// or removed). `removed`, when given, gets the directories removed. Returns
// the first error; InvalidArgument for keep == 0.
Status prune(const std::string& dir, uint32_t keep, std::vector<std::string>* removed = nullptr);

}  // namespace psld::checkpoint
