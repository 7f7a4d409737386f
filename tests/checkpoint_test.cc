#include "lib/checkpoint/checkpoint.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include "tests/temp_dir.h"

namespace psld::checkpoint {
namespace {

using psld::testing::TempDir;

namespace fs = std::filesystem;

const std::string kHashA(64, 'a');
const std::string kHashB = std::string(63, '0') + "9";

// Tensor 1: f32, 40 bytes in chunks of 16 (3 chunks); tensor 2: f16, 8
// bytes in chunks of 4 (2 chunks). 5 keys, in two files of 3 and 2.
Manifest example() {
  Manifest m;
  m.round = 100;
  m.epoch = 3;
  m.keys = 5;
  m.tensors = {{1, "fc1.weight", DType::kFloat32, 40, 16},
               {2, "fc 1 bias ", DType::kFloat16, 8, 4},
               {7, "empty", DType::kBFloat16, 0, 2}};
  m.files = {{0, "server-0.psck", 1000, 3, kHashA}, {1, "server-1.psck", 500, 2, kHashB}};
  return m;
}

TEST(Manifest, EncodesOneFieldPerLine) {
  EXPECT_EQ(encode_manifest(example()),
            "psld-checkpoint 1\n"
            "round 100\n"
            "epoch 3\n"
            "keys 5\n"
            "tensor 1 f32 40 16 fc1.weight\n"
            "tensor 2 f16 8 4 fc 1 bias \n"
            "tensor 7 bf16 0 2 empty\n"
            "file 0 server-0.psck 1000 3 " +
                kHashA +
                "\n"
                "file 1 server-1.psck 500 2 " +
                kHashB + "\n");
}

TEST(Manifest, RoundTrips) {
  const Manifest m = example();
  auto back = decode_manifest(encode_manifest(m));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, m);

  Manifest big;
  big.round = std::numeric_limits<uint64_t>::max();
  big.epoch = std::numeric_limits<uint64_t>::max();
  back = decode_manifest(encode_manifest(big));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, big);
}

TEST(Manifest, FieldsInAnyOrder) {
  auto m = decode_manifest("psld-checkpoint 1\nkeys 0\nepoch 1\nround 2\n");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->round, 2u);
  EXPECT_EQ(m->epoch, 1u);
}

// The example's text with `from` replaced by `to` (which must be there).
std::string edited(const std::string& from, const std::string& to) {
  std::string text = encode_manifest(example());
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

struct BadManifest {
  std::string what;
  std::string text;
  std::string message;  // a part of the DataLoss message
};

TEST(Manifest, RejectsEachMalformation) {
  const std::string file0 = "file 0 server-0.psck 1000 3 " + kHashA + "\n";
  // The files hold 6 records, the manifest says 6 keys; the tensors have 5.
  std::string records_and_keys_6 = edited("keys 5", "keys 6");
  records_and_keys_6.replace(records_and_keys_6.find("psck 500 2"), 10, "psck 500 3");
  const std::vector<BadManifest> cases = {
      {"empty", "", "empty"},
      {"first line", edited("psld-checkpoint 1", "psld-checkpoint"), "line 1: "},
      {"not a manifest", "round 1\n", "line 1: \"round 1\" is not a psld checkpoint manifest"},
      {"newer format", edited("psld-checkpoint 1", "psld-checkpoint 2"),
       "line 1: format 2; this build reads format 1"},
      {"no final newline",
       encode_manifest(example()).substr(0, encode_manifest(example()).size() - 1),
       "line 9: no newline at its end"},
      {"unknown field", edited("epoch 3\n", "epoch 3\ncolour blue\n"),
       "line 4: unknown field \"colour\""},
      {"blank line", edited("epoch 3\n", "epoch 3\n\n"), "line 4: field \"\" has no value"},
      {"field without value", edited("epoch 3", "epoch"), "line 3: field \"epoch\" has no value"},
      {"missing round", edited("round 100\n", ""), "no \"round\" line"},
      {"missing keys", edited("keys 5\n", ""), "no \"keys\" line"},
      {"round twice", edited("epoch 3\n", "epoch 3\nround 100\n"),
       "line 4: round given twice (first on line 2)"},
      {"junk after a number", edited("round 100", "round 100x"),
       "line 2: round \"100x\" is not a number"},
      {"signed number", edited("round 100", "round +100"), "line 2: round \"+100\" is not"},
      {"space in a number", edited("round 100", "round  100"), "line 2: round \" 100\" is not"},
      {"number out of range", edited("epoch 3", "epoch 18446744073709551616"),
       "line 3: epoch \"18446744073709551616\" is not a number from 0 to 2^64-1"},
      {"tensor id out of range", edited("tensor 2 ", "tensor 4294967296 "),
       "line 6: tensor: ID \"4294967296\" is not a number from 0 to 4294967295"},
      {"unknown dtype", edited("tensor 1 f32", "tensor 1 f64"),
       "line 5: tensor 1: DTYPE \"f64\" is not f32, f16 or bf16"},
      {"short tensor line", edited("tensor 1 f32 40 16 fc1.weight", "tensor 1 f32 40 16"),
       "line 5: tensor: expected"},
      {"empty tensor name", edited("tensor 1 f32 40 16 fc1.weight", "tensor 1 f32 40 16 "),
       "line 5: tensor 1: NAME is empty"},
      {"tensor bytes junk", edited("f32 40 16", "f32 4O 16"), "line 5: tensor 1: BYTES \"4O\""},
      {"tensor id twice", edited("tensor 2 ", "tensor 1 "),
       "line 6: tensor id 1 given twice (first on line 5)"},
      {"tensor name twice", edited("tensor 7 bf16 0 2 empty", "tensor 7 bf16 0 2 fc1.weight"),
       "line 7: tensor name \"fc1.weight\" given twice (first on line 5)"},
      {"chunk_bytes 0", edited("f32 40 16", "f32 40 0"), "line 5: tensor 1: chunk_bytes is 0"},
      {"chunk_bytes not a multiple", edited("f32 40 16", "f32 40 18"),
       "line 5: tensor 1: chunk_bytes 18 is not a multiple of the f32 size (4 bytes)"},
      {"bytes not whole elements", edited("f16 8 4", "f16 7 4"),
       "line 6: tensor 2 has 7 bytes, not a whole number of 2-byte elements"},
      {"too many chunks", edited("f16 8 4", "f16 17179869188 2"), "at most 2^32"},
      {"server out of range", edited("file 1 ", "file 4294967296 "),
       "line 9: file: SERVER \"4294967296\" is not a number"},
      {"name of another server", edited("file 1 server-1.psck", "file 1 server-0.psck"),
       "line 9: file of server 1: NAME \"server-0.psck\" is not server-1.psck"},
      {"a path as name", edited("file 1 server-1.psck", "file 1 ../server-1.psck"),
       "NAME \"../server-1.psck\" is not server-1.psck"},
      {"server twice", edited("file 1 server-1.psck", "file 0 server-0.psck"),
       "line 9: server 0 (server-0.psck) given twice (first on line 8)"},
      {"file records junk", edited("psck 500 2", "psck 500 -2"),
       "line 9: file server-1.psck: RECORDS \"-2\""},
      {"file line too long", edited("psck 500 2 " + kHashB, "psck 500 2 " + kHashB + " x"),
       "line 9: file: expected"},
      {"hash in upper case", edited(kHashA, std::string(64, 'A')),
       "line 8: file server-0.psck: BLAKE2B \"AAAA"},
      {"short hash", edited(kHashA, std::string(63, 'a')), "is not 64 lowercase hex digits"},
      {"keys not the records", edited("file 1 server-1.psck 500 2", "file 1 server-1.psck 500 3"),
       "line 4: keys 5, but the files hold 6 records"},
      {"keys not the chunks", records_and_keys_6, "line 4: keys 6, but the tensors have 5 chunks"},
      {"records add up past 2^64",
       edited(file0, "file 0 server-0.psck 1000 18446744073709551615 " + kHashA + "\n"),
       "line 9: the files' records add up to more than 2^64-1"},
  };
  for (const BadManifest& c : cases) {
    auto m = decode_manifest(c.text);
    ASSERT_FALSE(m.ok()) << c.what << " decoded:\n" << c.text;
    EXPECT_EQ(m.status().code(), StatusCode::kDataLoss) << c.what;
    EXPECT_NE(m.status().message().find(c.message), std::string::npos)
        << c.what << ": " << m.status().message() << "\n(expected to contain: " << c.message << ")";
  }
}

TEST(Manifest, NamesJoin) {
  EXPECT_EQ(round_dir("/ck", 100), "/ck/round-00000000000000000100");
  EXPECT_EQ(round_dir("/ck/", 7), "/ck/round-00000000000000000007");
  EXPECT_EQ(round_dir("/ck", std::numeric_limits<uint64_t>::max()),
            "/ck/round-18446744073709551615");
  EXPECT_EQ(server_file_name(12), "server-12.psck");
}

// ---- Files.

Key k(TensorId t, uint32_t c) {
  return make_key(t, c);
}

// Floats whose bits a lossy path would change: NaN with a payload, -0,
// a subnormal, infinities.
std::vector<float> tricky_floats(size_t n, uint32_t seed) {
  std::vector<float> v(n);
  const uint32_t specials[] = {0x7fc12345u, 0x80000000u, 0x00000001u, 0x7f800000u, 0xff800000u};
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits =
        i < 5 ? specials[(i + seed) % 5] : (seed * 2654435761u) ^ static_cast<uint32_t>(i * 40503u);
    std::memcpy(&v[i], &bits, 4);
  }
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The three keys of files_manifest's tensors: tensor 1 (f32, 24 bytes in
// chunks of 16: 4 and 2 elements, with Adam's moments), tensor 2 (f16, 6
// bytes: 3 elements, the parameter alone).
std::vector<KeyRecord> example_records() {
  std::vector<KeyRecord> r(3);
  r[0] = {k(1, 0), DType::kFloat32, 16, 100, 3, 4, tricky_floats(12, 1)};
  r[1] = {k(1, 1), DType::kFloat32, 8, 99, 3, 2, tricky_floats(6, 2)};
  r[2] = {k(2, 0), DType::kFloat16, 6, 100, 1, 3, tricky_floats(3, 3)};
  return r;
}

std::vector<TensorEntry> example_tensors() {
  return {{1, "w", DType::kFloat32, 24, 16}, {2, "b", DType::kFloat16, 6, 8}};
}

// Writes round `round` as two servers would (server 0: records 0 and 2,
// server 1: record 1), and its MANIFEST when `manifest`.
Manifest write_round(const std::string& dir, uint64_t round, bool manifest = true) {
  const std::vector<KeyRecord> records = example_records();
  Manifest m;
  m.round = round;
  m.epoch = 4;
  m.keys = 3;
  m.tensors = example_tensors();
  const std::vector<std::vector<size_t>> by_server = {{0, 2}, {1}};
  for (uint32_t server = 0; server < by_server.size(); ++server) {
    auto w = FileWriter::create(dir, round, server);
    EXPECT_TRUE(w.ok()) << w.status().to_string();
    if (!w.ok()) return m;
    for (size_t i : by_server[server]) {
      Status s = w->append(records[i]);
      EXPECT_TRUE(s.ok()) << s.to_string();
    }
    EXPECT_EQ(w->records(), by_server[server].size());
    auto entry = w->commit();
    EXPECT_TRUE(entry.ok()) << entry.status().to_string();
    if (entry.ok()) m.files.push_back(*entry);
  }
  if (manifest) {
    Status s = write_manifest(dir, m);
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
  return m;
}

uint64_t record_bytes(const KeyRecord& r) {
  return kRecordHeaderBytes + r.state.size() * sizeof(float);
}

TEST(Files, RoundTripBitForBit) {
  TempDir tmp("psld-checkpoint");
  const Manifest written = write_round(tmp.path(), 100);
  const std::vector<KeyRecord> records = example_records();
  ASSERT_EQ(written.files.size(), 2u);
  EXPECT_EQ(written.files[0].name, "server-0.psck");
  EXPECT_EQ(written.files[0].records, 2u);
  EXPECT_EQ(written.files[0].bytes,
            kFileHeaderBytes + record_bytes(records[0]) + record_bytes(records[2]));
  EXPECT_EQ(written.files[1].bytes, kFileHeaderBytes + record_bytes(records[1]));
  EXPECT_EQ(written.files[0].blake2b.size(), 64u);
  EXPECT_NE(written.files[0].blake2b, written.files[1].blake2b);
  // Nothing but the two files and the manifest: no .tmp left.
  const std::string rdir = round_dir(tmp.path(), 100);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(rdir))
    names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"MANIFEST", "server-0.psck", "server-1.psck"}));

  auto found = find_latest(tmp.path());
  ASSERT_TRUE(found.ok()) << found.status().to_string();
  EXPECT_EQ(found->manifest, written);
  EXPECT_EQ(found->dir, rdir);
  EXPECT_TRUE(found->skipped.empty());

  auto reader = Reader::open(*found);
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  EXPECT_EQ(reader->keys(), 3u);
  EXPECT_EQ(reader->manifest(), written);
  EXPECT_EQ(reader->sorted_keys(), (std::vector<Key>{k(1, 0), k(1, 1), k(2, 0)}));
  for (const KeyRecord& want : records) {
    EXPECT_TRUE(reader->has(want.key));
    auto got = reader->read(want.key);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_EQ(got->key, want.key);
    EXPECT_EQ(got->dtype, want.dtype);
    EXPECT_EQ(got->bytes, want.bytes);
    EXPECT_EQ(got->version, want.version);
    EXPECT_EQ(got->arrays, want.arrays);
    EXPECT_EQ(got->elements, want.elements);
    EXPECT_TRUE(same_bits(got->state, want.state)) << "key " << want.key;
  }
  EXPECT_FALSE(reader->has(k(2, 1)));
  EXPECT_EQ(reader->read(k(2, 1)).status().code(), StatusCode::kNotFound);

  // A Reader moves with its files.
  Reader moved = std::move(reader).value();
  EXPECT_TRUE(moved.read(k(1, 1)).ok());
}

TEST(Files, UncommittedWriterLeavesNoFile) {
  TempDir tmp("psld-checkpoint");
  const std::string rdir = round_dir(tmp.path(), 5);
  {
    auto w = FileWriter::create(tmp.path(), 5, 3);
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    EXPECT_EQ(w->path(), rdir + "/server-3.psck");
    EXPECT_TRUE(fs::exists(rdir + "/server-3.psck.tmp"));
    ASSERT_TRUE(w->append(example_records()[0]).ok());
    // Moved into another writer, which goes out of scope with it.
    FileWriter other = std::move(w).value();
    EXPECT_EQ(other.records(), 1u);
  }
  EXPECT_TRUE(fs::is_directory(rdir));
  EXPECT_TRUE(fs::is_empty(rdir));

  // A writer replaced by assignment removes its file too.
  auto a = FileWriter::create(tmp.path(), 5, 0);
  auto b = FileWriter::create(tmp.path(), 5, 1);
  ASSERT_TRUE(a.ok() && b.ok());
  *a = std::move(*b);
  EXPECT_FALSE(fs::exists(rdir + "/server-0.psck.tmp"));
  EXPECT_TRUE(fs::exists(rdir + "/server-1.psck.tmp"));
  auto entry = a->commit();
  ASSERT_TRUE(entry.ok()) << entry.status().to_string();
  EXPECT_EQ(entry->server, 1u);
  EXPECT_EQ(entry->bytes, kFileHeaderBytes);
  EXPECT_EQ(entry->records, 0u);
  EXPECT_EQ(a->commit().status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(a->append(example_records()[0]).code(), StatusCode::kFailedPrecondition);
}

TEST(Files, AppendRefusesInconsistentRecords) {
  TempDir tmp("psld-checkpoint");
  auto w = FileWriter::create(tmp.path(), 1, 0);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  const std::vector<float> four(4, 1.0f);
  EXPECT_EQ(w->append(k(1, 0), DType::kFloat32, 16, 1, 2, four).code(),
            StatusCode::kInvalidArgument);  // arrays 2
  EXPECT_EQ(w->append(k(1, 0), DType::kFloat32, 12, 1, 1, four).code(),
            StatusCode::kInvalidArgument);  // 3 elements, 4 floats
  EXPECT_EQ(w->append(k(1, 0), DType::kFloat16, 7, 1, 1, four).code(),
            StatusCode::kInvalidArgument);  // half an element
  EXPECT_EQ(w->append(k(1, 0), DType::kFloat32, 0, 1, 1, {}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(w->append(k(1, 0), static_cast<DType>(9), 16, 1, 1, four).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(w->append(k(1, 0), DType::kFloat16, 8, 1, 1, four).ok());
  Status twice = w->append(k(1, 0), DType::kFloat16, 8, 1, 1, four);
  EXPECT_EQ(twice.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(twice.message().find("appended twice"), std::string::npos) << twice.message();
  EXPECT_EQ(w->records(), 1u);
}

TEST(Files, CreateNamesThePathOnError) {
  TempDir tmp("psld-checkpoint");
  // A file where the round directory would go.
  std::ofstream(tmp.path() + "/plain") << "x";
  auto w = FileWriter::create(tmp.path() + "/plain", 1, 0);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find(tmp.path() + "/plain"), std::string::npos)
      << w.status().message();
}

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x20);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(FindLatest, PassesOverIncompleteAndDamagedRounds) {
  TempDir tmp("psld-checkpoint");
  write_round(tmp.path(), 100);
  const Manifest truncated = write_round(tmp.path(), 200);
  write_round(tmp.path(), 300);
  write_round(tmp.path(), 400, /*manifest=*/false);
  const std::string f200 = round_dir(tmp.path(), 200) + "/server-1.psck";
  ASSERT_EQ(::truncate(f200.c_str(), static_cast<off_t>(truncated.files[1].bytes - 4)), 0);
  flip_byte(round_dir(tmp.path(), 300) + "/server-0.psck", kFileHeaderBytes + 50);
  // Not round directories: ignored.
  fs::create_directory(tmp.path() + "/round-latest");
  std::ofstream(tmp.path() + "/notes.txt") << "hello";

  auto found = find_latest(tmp.path());
  ASSERT_TRUE(found.ok()) << found.status().to_string();
  EXPECT_EQ(found->manifest.round, 100u);
  EXPECT_EQ(found->dir, round_dir(tmp.path(), 100));
  ASSERT_EQ(found->skipped.size(), 3u);
  EXPECT_TRUE(contains(found->skipped[0], "round 400: no MANIFEST (torn")) << found->skipped[0];
  EXPECT_TRUE(contains(found->skipped[1], "round 300: server-0.psck has BLAKE2b "))
      << found->skipped[1];
  EXPECT_TRUE(contains(found->skipped[2],
                       fmt::format("round 200: server-1.psck is {} bytes, the manifest says {}",
                                   truncated.files[1].bytes - 4, truncated.files[1].bytes)))
      << found->skipped[2];
}

TEST(FindLatest, PassesOverBadManifests) {
  TempDir tmp("psld-checkpoint");
  write_round(tmp.path(), 100);
  write_round(tmp.path(), 200);
  write_round(tmp.path(), 300);
  // Round 300's manifest copied to round 200, and a missing file at 300.
  fs::copy_file(round_dir(tmp.path(), 300) + "/MANIFEST", round_dir(tmp.path(), 200) + "/MANIFEST",
                fs::copy_options::overwrite_existing);
  fs::remove(round_dir(tmp.path(), 300) + "/server-1.psck");
  // A manifest that does not decode.
  fs::create_directory(round_dir(tmp.path(), 500));
  std::ofstream(round_dir(tmp.path(), 500) + "/MANIFEST") << "psld-checkpoint 1\nround 500\n";

  auto found = find_latest(tmp.path());
  ASSERT_TRUE(found.ok()) << found.status().to_string();
  EXPECT_EQ(found->manifest.round, 100u);
  ASSERT_EQ(found->skipped.size(), 3u);
  EXPECT_TRUE(contains(found->skipped[0], "round 500: MANIFEST: no \"epoch\" line"))
      << found->skipped[0];
  EXPECT_TRUE(contains(found->skipped[1], "round 300: server-1.psck is missing"))
      << found->skipped[1];
  EXPECT_TRUE(contains(found->skipped[2], "round 200: MANIFEST says round 300"))
      << found->skipped[2];
}

TEST(FindLatest, NotFoundWhenNothingIsComplete) {
  TempDir tmp("psld-checkpoint");
  auto none = find_latest(tmp.path());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(contains(none.status().message(),
                       "no complete checkpoint in " + tmp.path() + " (no round directories)"))
      << none.status().message();

  write_round(tmp.path(), 100, /*manifest=*/false);
  none = find_latest(tmp.path());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(contains(none.status().message(),
                       "no complete checkpoint in " + tmp.path() + "; round 100: no MANIFEST"))
      << none.status().message();

  auto missing = find_latest(tmp.path() + "/nowhere");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(contains(missing.status().message(), tmp.path() + "/nowhere does not exist"))
      << missing.status().message();
}

TEST(Reader, ChecksFilesAgainstTheManifest) {
  TempDir tmp("psld-checkpoint");
  const Manifest m = write_round(tmp.path(), 100);
  Found found{m, round_dir(tmp.path(), 100), {}};
  ASSERT_TRUE(Reader::open(found).ok());

  // Written as round 100; a manifest that says 200 does not get its records.
  Found other_round = found;
  other_round.manifest.round = 200;
  auto r = Reader::open(other_round);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(contains(r.status().message(), "its header says round 100, the manifest 200"))
      << r.status().message();

  // Tensor 2 with another chunk size: the record of 6 bytes does not fit.
  Found other_chunks = found;
  other_chunks.manifest.tensors[1].bytes = 12;
  other_chunks.manifest.tensors[1].chunk_bytes = 6;
  other_chunks.manifest.tensors[0].bytes = 16;  // keep 3 chunks in all
  r = Reader::open(other_chunks);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "the tensor has 1 chunks")) << r.status().message();

  // A file the manifest says is longer.
  Found longer = found;
  longer.manifest.files[0].bytes += 1;
  r = Reader::open(longer);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "the manifest says")) << r.status().message();

  // Not a manifest that decodes.
  Found invalid = found;
  invalid.manifest.keys = 4;
  EXPECT_EQ(Reader::open(invalid).status().code(), StatusCode::kInvalidArgument);
}

TEST(WriteManifest, RefusesWhatWouldNotReadBack) {
  TempDir tmp("psld-checkpoint");
  Manifest m = example();
  m.tensors[0].name = "two\nlines";
  Status s = write_manifest(tmp.path(), m);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(round_dir(tmp.path(), m.round) + "/MANIFEST"));
}

// ---- Scanning file bytes.

std::vector<uint8_t> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

TEST(Scan, ReadsWhatTheWriterWrote) {
  TempDir tmp("psld-checkpoint");
  const Manifest m = write_round(tmp.path(), 100);
  std::vector<uint8_t> bytes = file_bytes(round_dir(tmp.path(), 100) + "/server-0.psck");
  auto scan = scan_records(bytes);
  ASSERT_TRUE(scan.ok()) << scan.status().to_string();
  EXPECT_EQ(scan->header, (FileHeader{kFormat, 0, 100}));
  ASSERT_EQ(scan->records.size(), 2u);
  EXPECT_EQ(scan->records[0].offset, kFileHeaderBytes);
  EXPECT_EQ(scan->records[0].header, (RecordHeader{k(1, 0), DType::kFloat32, 3, 16, 100, 4}));
  EXPECT_EQ(scan->records[1].header, (RecordHeader{k(2, 0), DType::kFloat16, 1, 6, 100, 3}));

  struct Bad {
    std::string what;
    std::vector<uint8_t> bytes;
    std::string message;
  };
  auto with = [&bytes](size_t at, uint8_t v) {
    std::vector<uint8_t> b = bytes;
    b[at] = v;
    return b;
  };
  std::vector<uint8_t> longer = bytes;
  longer.resize(bytes.size() + 7);
  std::vector<uint8_t> twice = bytes;
  twice.insert(twice.end(), bytes.begin() + kFileHeaderBytes, bytes.end());
  const size_t r0 = kFileHeaderBytes;
  const std::vector<Bad> cases = {
      {"short", std::vector<uint8_t>(bytes.begin(), bytes.begin() + 20), "shorter than a file"},
      {"magic", with(0, 'X'), "not a psld checkpoint file"},
      {"format", with(8, 2), "file format 2; this build reads format 1"},
      {"reserved", with(31, 1), "reserved field"},
      {"dtype", with(r0 + 8, 4),
       "record 0 at byte 32: key 0x100000000 (tensor 1, chunk 0): "
       "dtype 4"},
      {"arrays", with(r0 + 9, 2), "arrays 2, not 1 or 3"},
      {"padding", with(r0 + 12, 1), "zero fields"},
      {"elements", with(r0 + 32, 5), "elements 5, but 16 bytes of f32 are 4 elements"},
      {"cut short", std::vector<uint8_t>(bytes.begin(), bytes.end() - 1),
       "runs past the end of the file"},
      {"trailing bytes", longer, "7 bytes left, less than a record header"},
      {"a key twice", twice, "again (first at byte 32)"},
  };
  for (const Bad& c : cases) {
    auto s = scan_records(c.bytes);
    ASSERT_FALSE(s.ok()) << c.what;
    EXPECT_EQ(s.status().code(), StatusCode::kDataLoss) << c.what;
    EXPECT_TRUE(contains(s.status().message(), c.message))
        << c.what << ": " << s.status().message();
  }
}

// ---- Prune.

std::vector<std::string> listing(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir))
    names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(Prune, KeepsTheNewestComplete) {
  TempDir tmp("psld-checkpoint");
  const std::string d = tmp.path();
  write_round(d, 100);
  write_round(d, 200);
  write_round(d, 250, /*manifest=*/false);  // older than the newest complete: gone
  write_round(d, 300);
  write_round(d, 400);
  write_round(d, 500, /*manifest=*/false);  // perhaps being written: kept
  // Not round directories, or not directories: never touched.
  std::ofstream(d + "/notes.txt") << "x";
  fs::create_directory(d + "/round-latest");
  fs::create_directory_symlink(round_dir(d, 100), round_dir(d, 50));
  std::ofstream(round_dir(d, 10)) << "a file of a round's name";

  std::vector<std::string> removed;
  Status s = prune(d, 2, &removed);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(removed,
            (std::vector<std::string>{round_dir(d, 250), round_dir(d, 200), round_dir(d, 100)}));
  EXPECT_EQ(listing(d), (std::vector<std::string>{
                            "notes.txt", "round-00000000000000000010", "round-00000000000000000050",
                            "round-00000000000000000300", "round-00000000000000000400",
                            "round-00000000000000000500", "round-latest"}));
  auto found = find_latest(d);
  ASSERT_TRUE(found.ok()) << found.status().to_string();
  EXPECT_EQ(found->manifest.round, 400u);

  // Again: nothing more to remove.
  removed.clear();
  ASSERT_TRUE(prune(d, 2, &removed).ok());
  EXPECT_TRUE(removed.empty());
  ASSERT_TRUE(prune(d, 1).ok());
  EXPECT_FALSE(fs::exists(round_dir(d, 300)));
  EXPECT_TRUE(fs::exists(round_dir(d, 400)));
  EXPECT_TRUE(fs::exists(round_dir(d, 500)));

  EXPECT_EQ(prune(d, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(prune(d + "/nowhere", 2).code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace psld::checkpoint
