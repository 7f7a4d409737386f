// The loopback backend's remote key (transports/loopback/loopback.h), which
// import_region decodes before it looks the region up: a key that decodes
// must encode to the same bytes; anything else is DataLoss.
#include <vector>

#include "tests/fuzz/fuzz.h"
#include "transports/loopback/loopback.h"

namespace psld::fuzz {

std::vector<Seed> seeds() {
  const transport::LoopbackKey key{0x1234'5678'9abc'def0, 2, 7, 4096, 0x5ec7e7};
  return {{"remote_key", transport::encode_loopback_key(key)}};
}

}  // namespace psld::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace psld;
  const std::span<const uint8_t> in(data, size);
  auto key = transport::decode_loopback_key(in);
  if (!key.ok()) {
    PSLD_FUZZ_CHECK(key.status().code() == StatusCode::kDataLoss);
    return 0;
  }
  PSLD_FUZZ_CHECK(psld::fuzz::same_bytes(transport::encode_loopback_key(*key), in));
  return 0;
}
