// The UCX backend's wire formats (transports/ucx/core.h): the remote key a
// peer hands over (checked before UCX unpacks it), the hello and its answer
// with the notification ring offer, a notification batch (kAmNotify), and a
// record of the notification ring in shared memory, and a frame of the
// bootstrap (the first bytes anyone who reaches a job's port can send). The
// first byte picks the decoder. What decodes must encode to the same bytes; a write that
// in_region() lets through must lie inside the region.
#include <cstring>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz.h"
#include "transports/ucx/core.h"

namespace psld::fuzz {
namespace {

using namespace psld::transport::ucx_detail;

// The first byte of an input: which decoder (dispatch, in this order).
enum Selector : uint8_t { kKey = 0, kHello = 1, kNotify = 2, kRingRecord = 3, kBootFrame = 4 };

__extension__ typedef unsigned __int128 u128;

void check_in_region(const WriteHeader& h, uint64_t region_length) {
  const bool inside = u128{h.offset} + h.length <= region_length;
  PSLD_FUZZ_CHECK(in_region(h, region_length) == inside);
}

void fuzz_key(std::span<const uint8_t> in) {
  auto k = decode_remote_key(in);
  if (!k.ok()) {
    PSLD_FUZZ_CHECK(k.status().code() == StatusCode::kDataLoss);
    return;
  }
  PSLD_FUZZ_CHECK(k->length > 0 && k->base + k->length >= k->base && !k->packed.empty());
  PSLD_FUZZ_CHECK(k->kind == MemoryKind::kHost || k->kind == MemoryKind::kCuda);
  PSLD_FUZZ_CHECK(k->packed.data() >= in.data() &&
                  k->packed.data() + k->packed.size() <= in.data() + in.size());
  PSLD_FUZZ_CHECK(same_bytes(encode_remote_key(*k), in));
}

void fuzz_hello(std::span<const uint8_t> in) {
  HelloFields h;
  if (!decode_hello(in, &h)) return;
  PSLD_FUZZ_CHECK(h.listen.size() <= kMaxAddressString);
  PSLD_FUZZ_CHECK(h.ring_key.size() <= kMaxPackedRkey);
  PSLD_FUZZ_CHECK(same_bytes(encode_hello(h), in));
}

void fuzz_notify(std::span<const uint8_t> in) {
  const size_t n = notify_batch_records(in);
  if (n == 0) return;
  PSLD_FUZZ_CHECK(n <= kNotifyBatch && in.size() == 4 + n * kWriteHeaderBytes);
  std::vector<uint8_t> again(in.size());
  store_le(again.data(), n, 4);
  for (size_t i = 0; i < n; ++i) {
    const WriteHeader h = decode_header(in.data() + 4 + i * kWriteHeaderBytes);
    check_in_region(h, h.notify);  // a region length the input picks
    check_in_region(h, UINT64_MAX);
    encode_header(h, again.data() + 4 + i * kWriteHeaderBytes);
  }
  PSLD_FUZZ_CHECK(same_bytes(again, in));
}

// A ring slot as the owner reads it: the record's fields, and its stamp at
// kRingStampAt (position + 1 when the record at `position` is there).
void fuzz_ring_record(std::span<const uint8_t> in) {
  if (in.size() != kRingRecordBytes) return;
  alignas(8) uint8_t slot[kRingRecordBytes];
  std::memcpy(slot, in.data(), sizeof(slot));
  const uint64_t stamp = ring_word(slot, kRingStampAt).load(std::memory_order_relaxed);
  PSLD_FUZZ_CHECK(stamp == load_le(in.data() + kRingStampAt, 8));
  const WriteHeader h = decode_header(slot);
  check_in_region(h, stamp);
  uint8_t again[kRingRecordBytes];
  std::memcpy(again, slot, sizeof(again));
  std::memset(again, 0, kWriteHeaderBytes);
  encode_header(h, again);
  PSLD_FUZZ_CHECK(std::memcmp(again, in.data(), sizeof(again)) == 0);
}

// The front of a byte stream: a frame, not yet one (only ever a short
// prefix), or refused. A frame encodes back to its bytes, and any prefix of
// it is never a frame.
void fuzz_boot_frame(std::span<const uint8_t> in) {
  BootFrame f;
  const ptrdiff_t n = decode_boot_frame(in, &f);
  PSLD_FUZZ_CHECK(n >= -1 && n <= static_cast<ptrdiff_t>(in.size()));
  if (n == 0) {
    PSLD_FUZZ_CHECK(in.size() < 4 + kMaxBootFrame);  // buffering is bounded
    return;
  }
  if (n < 0) return;
  PSLD_FUZZ_CHECK(f.address.size() <= kMaxWorkerAddress && f.reason.size() <= kMaxBootReason);
  PSLD_FUZZ_CHECK(same_bytes(encode_boot_frame(f), in.first(static_cast<size_t>(n))));
  BootFrame g;
  PSLD_FUZZ_CHECK(decode_boot_frame(in.first(static_cast<size_t>(n) - 1), &g) <= 0);
}

std::vector<uint8_t> notify_batch(size_t n) {
  std::vector<uint8_t> b(4 + n * kWriteHeaderBytes);
  store_le(b.data(), n, 4);
  for (size_t i = 0; i < n; ++i) {
    const WriteHeader h{i + 1, 0x5ec7e7, 64 * i, 64, static_cast<uint32_t>(100 + i), i};
    encode_header(h, b.data() + 4 + i * kWriteHeaderBytes);
  }
  return b;
}

}  // namespace

std::vector<Seed> seeds() {
  // UCX's packed keys are 9..40 bytes (UCX 1.13); the harness never unpacks one.
  const std::vector<uint8_t> packed = {1, 0, 2, 0, 3, 0, 4, 0, 5, 6, 7, 8, 9, 10, 11, 12};
  RemoteKeyFields key;
  key.owner = 0x1111'2222'3333'4444;
  key.region = 7;
  key.base = 0x7f00'0000'1000;
  key.length = 1 << 20;
  key.secret = 0x5ec7e7;
  key.packed = packed;
  RemoteKeyFields cuda_key = key;
  cuda_key.kind = MemoryKind::kCuda;
  HelloFields hello;
  hello.instance = 0x1111'2222'3333'4444;
  hello.conn = 3;
  hello.process_namespace = 0x5555'6666'7777'8889;
  hello.pid = 4242;
  hello.listen = "127.0.0.1:41234";
  HelloFields ring_hello = hello;
  ring_hello.ring_slots = 256;
  ring_hello.ring_base = 0x7f00'0000'2000;
  ring_hello.ring_key = packed;
  std::vector<uint8_t> record(kRingRecordBytes, 0);
  encode_header({7, 0x5ec7e7, 128, 64, 9, 41}, record.data());
  store_le(record.data() + kRingStampAt, 42, 8);
  BootFrame challenge;
  challenge.type = BootType::kChallenge;
  challenge.nonce.fill(0x11);
  challenge.instance = 0x1111'2222'3333'4444;
  BootFrame request;
  request.type = BootType::kRequest;
  request.nonce.fill(0x22);
  request.instance = 0x5555'6666'7777'8888;
  request.token = 0xabcd;
  request.address.assign(64, 0x33);
  request.proof.fill(0x44);
  BootFrame accept = request;
  accept.type = BootType::kAccept;
  BootFrame refuse;
  refuse.type = BootType::kRefuse;
  refuse.reason = "wrong job secret";
  BootFrame bye;
  bye.type = BootType::kBye;
  return {
      tagged("boot_challenge", kBootFrame, encode_boot_frame(challenge)),
      tagged("boot_request", kBootFrame, encode_boot_frame(request)),
      tagged("boot_accept", kBootFrame, encode_boot_frame(accept)),
      tagged("boot_refuse", kBootFrame, encode_boot_frame(refuse)),
      tagged("boot_bye", kBootFrame, encode_boot_frame(bye)),
      tagged("remote_key_host", kKey, encode_remote_key(key)),
      tagged("remote_key_cuda", kKey, encode_remote_key(cuda_key)),
      tagged("hello", kHello, encode_hello(hello)),
      tagged("hello_ring_offer", kHello, encode_hello(ring_hello)),
      tagged("notify_one", kNotify, notify_batch(1)),
      tagged("notify_batch", kNotify, notify_batch(5)),
      tagged("ring_record", kRingRecord, record),
  };
}

}  // namespace psld::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace psld::fuzz;
  return dispatch(data, size,
                  {fuzz_key, fuzz_hello, fuzz_notify, fuzz_ring_record, fuzz_boot_frame});
}
