// Checkpoints on disk (lib/checkpoint/checkpoint.h): a MANIFEST, which
// find_latest decodes from whatever a crash, a bad copy or an operator left
// in checkpoint.dir, and a server file's record headers, which
// Reader::open scans (scan_records) before it reads any state.
//
// The first byte picks the decoder (even: the manifest, odd: a server
// file), which gets the rest. A manifest that decodes must decode again, to
// an equal Manifest, from its encoding, and that encoding must be its own
// again (one text per manifest); the counts it promises must add up. A file
// that scans must be exactly its header and records, back to back: each
// header encodes to the bytes it came from, the records tile the file to its
// last byte, and no key comes twice. Anything else is DataLoss.
#include <string>
#include <unordered_set>
#include <vector>

#include "lib/checkpoint/checkpoint.h"
#include "tests/fuzz/fuzz.h"

namespace psld::fuzz {
namespace {

using namespace psld::checkpoint;

constexpr uint8_t kManifest = 0;
constexpr uint8_t kServerFile = 1;

void fuzz_manifest(std::span<const uint8_t> in) {
  const std::string_view text(reinterpret_cast<const char*>(in.data()), in.size());
  auto m = decode_manifest(text);
  if (!m.ok()) {
    PSLD_FUZZ_CHECK(m.status().code() == StatusCode::kDataLoss);
    return;
  }
  const std::string encoded = encode_manifest(*m);
  auto again = decode_manifest(encoded);
  if (!again.ok()) {
    std::fprintf(stderr, "the encoding does not decode: %s\n--- encoded:\n%s\n",
                 again.status().to_string().c_str(), encoded.c_str());
  }
  PSLD_FUZZ_CHECK(again.ok());
  PSLD_FUZZ_CHECK(*again == *m);
  PSLD_FUZZ_CHECK(encode_manifest(*again) == encoded);
  uint64_t records = 0;
  for (const FileEntry& f : m->files) {
    PSLD_FUZZ_CHECK(f.name == server_file_name(f.server));
    PSLD_FUZZ_CHECK(f.blake2b.size() == 64);
    records += f.records;
  }
  PSLD_FUZZ_CHECK(records == m->keys);
  for (const TensorEntry& t : m->tensors) {
    PSLD_FUZZ_CHECK(!t.name.empty());
    PSLD_FUZZ_CHECK(t.name.find('\n') == std::string::npos);
    PSLD_FUZZ_CHECK(t.chunk_bytes > 0);
  }
}

void fuzz_server_file(std::span<const uint8_t> in) {
  auto scan = scan_records(in);
  if (!scan.ok()) {
    PSLD_FUZZ_CHECK(scan.status().code() == StatusCode::kDataLoss);
    return;
  }
  PSLD_FUZZ_CHECK(in.size() >= kFileHeaderBytes);
  PSLD_FUZZ_CHECK(same_bytes(encode_file_header(scan->header), in.first(kFileHeaderBytes)));
  uint64_t at = kFileHeaderBytes;
  std::unordered_set<Key> keys;
  for (const ScannedRecord& r : scan->records) {
    PSLD_FUZZ_CHECK(r.offset == at);
    PSLD_FUZZ_CHECK(r.offset + kRecordHeaderBytes <= in.size());
    PSLD_FUZZ_CHECK(
        same_bytes(encode_record_header(r.header), in.subspan(r.offset, kRecordHeaderBytes)));
    PSLD_FUZZ_CHECK(r.header.arrays == 1 || r.header.arrays == 3);
    PSLD_FUZZ_CHECK(r.header.elements > 0);
    PSLD_FUZZ_CHECK(keys.insert(r.header.key).second);
    at = r.offset + kRecordHeaderBytes + r.header.state_bytes();
    PSLD_FUZZ_CHECK(at <= in.size());
  }
  PSLD_FUZZ_CHECK(at == in.size());
}

Seed text_seed(std::string name, const std::string& text) {
  return tagged(std::move(name), kManifest,
                std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

// A server file as FileWriter writes it, built with the same encoders.
std::vector<uint8_t> server_file(uint32_t server, uint64_t round,
                                 const std::vector<RecordHeader>& records) {
  std::vector<uint8_t> out;
  const auto head = encode_file_header({kFormat, server, round});
  out.insert(out.end(), head.begin(), head.end());
  for (const RecordHeader& r : records) {
    const auto h = encode_record_header(r);
    out.insert(out.end(), h.begin(), h.end());
    // The state's bytes: any pattern; the scan does not read them.
    for (uint64_t i = 0; i < r.state_bytes(); ++i)
      out.push_back(static_cast<uint8_t>(i * 37 + r.key));
  }
  return out;
}

}  // namespace

std::vector<Seed> seeds() {
  std::vector<Seed> out;
  Manifest m;
  m.round = 300;
  m.epoch = 2;
  m.keys = 5;
  m.tensors = {{1, "fc1.weight", DType::kFloat32, 40, 16},
               {2, "encoder layer 0 / bias", DType::kFloat16, 8, 4},
               {3, "empty", DType::kBFloat16, 0, 2}};
  m.files = {{0, "server-0.psck", 4096, 3, std::string(64, 'a')},
             {1, "server-1.psck", 2048, 2,
              "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}};
  out.push_back(text_seed("manifest", encode_manifest(m)));
  out.push_back(text_seed("manifest_empty", encode_manifest(Manifest{})));

  out.push_back(tagged("file_empty", kServerFile, server_file(0, 300, {})));
  out.push_back(tagged("file_two_records", kServerFile,
                       server_file(1, 300,
                                   {{make_key(1, 0), DType::kFloat32, 3, 16, 300, 4},
                                    {make_key(2, 1), DType::kBFloat16, 1, 6, 299, 3}})));
  return out;
}

}  // namespace psld::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace psld::fuzz;
  return dispatch(data, size, {fuzz_manifest, fuzz_server_file});
}
