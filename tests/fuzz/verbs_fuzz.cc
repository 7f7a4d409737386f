// The verbs backend's wire formats (transports/verbs/verbs_protocol.h): the
// hello each side reads from its TCP side channel, the packed remote key a
// peer hands over in a control message, and the host:port text of an
// address. The first byte picks the decoder. A hello or key that decodes
// must encode to the same bytes; an address that parses must parse again,
// to the same host and port, from its formatted text.
#include <string>
#include <vector>

#include "tests/fuzz/fuzz.h"
#include "transports/verbs/verbs_protocol.h"

namespace psld::fuzz {
namespace {

using namespace psld::transport::verbs;

// The first byte of an input: which decoder (dispatch, in this order).
enum Selector : uint8_t { kHello = 0, kKey = 1, kHostPort = 2 };

void fuzz_hello(std::span<const uint8_t> in) {
  auto h = decode_hello(in);
  if (!h.ok()) {
    PSLD_FUZZ_CHECK(h.status().code() == StatusCode::kDataLoss ||
                    h.status().code() == StatusCode::kFailedPrecondition);
    return;
  }
  PSLD_FUZZ_CHECK(same_bytes(encode_hello(*h), in));
  PSLD_FUZZ_CHECK(check_hello_reply(*h, *h).ok());
  PSLD_FUZZ_CHECK(!h->gid.to_string().empty());
}

void fuzz_key(std::span<const uint8_t> in) {
  auto k = decode_remote_key(in);
  if (!k.ok()) {
    PSLD_FUZZ_CHECK(k.status().code() == StatusCode::kDataLoss);
    return;
  }
  PSLD_FUZZ_CHECK(same_bytes(encode_remote_key(*k), in));
  PSLD_FUZZ_CHECK(k->length > 0 && k->addr + k->length > k->addr);
}

void fuzz_host_port(std::span<const uint8_t> in) {
  if (in.empty()) return;
  const bool port_required = (in[0] & 1) != 0;
  const std::string_view text(reinterpret_cast<const char*>(in.data()) + 1, in.size() - 1);
  auto hp = parse_host_port(text, port_required);
  if (!hp.ok()) {
    PSLD_FUZZ_CHECK(hp.status().code() == StatusCode::kInvalidArgument);
    return;
  }
  auto again = parse_host_port(format_host_port(*hp), port_required);
  PSLD_FUZZ_CHECK(again.ok() && again->host == hp->host && again->port == hp->port);
}

Hello sample_hello(LinkLayer link) {
  Hello h;
  h.link_layer = link;
  h.mtu = kMtu4096;
  h.lid = link == LinkLayer::kInfiniBand ? 7 : 0;
  h.qp_num = 0x1234;
  h.psn = 0xabcdef;
  h.gid.raw = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1};
  h.transport_id = 0x1111'2222'3333'4444;
  h.nonce = 0x5555'6666'7777'8888;
  return h;
}

}  // namespace

std::vector<Seed> seeds() {
  RemoteKey key{0x1111'2222'3333'4444, 3, 0x7f00'0000'1000, 1 << 20, 0x42, 0x9999};
  auto text = [](std::string_view s, bool port_required) {
    std::vector<uint8_t> b = {static_cast<uint8_t>(port_required ? 1 : 0)};
    b.insert(b.end(), s.begin(), s.end());
    return b;
  };
  return {
      tagged("hello_ib", kHello, encode_hello(sample_hello(LinkLayer::kInfiniBand))),
      tagged("hello_roce", kHello, encode_hello(sample_hello(LinkLayer::kEthernet))),
      tagged("remote_key", kKey, encode_remote_key(key)),
      tagged("host_port_v4", kHostPort, text("10.0.0.1:18515", true)),
      tagged("host_port_v6", kHostPort, text("[fe80::1]:0", false)),
      tagged("host_only", kHostPort, text("node-1", false)),
  };
}

}  // namespace psld::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace psld::fuzz;
  return dispatch(data, size, {fuzz_hello, fuzz_key, fuzz_host_port});
}
