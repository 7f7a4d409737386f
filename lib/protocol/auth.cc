// lib/protocol/auth.cc — HMAC-SHA256 proofs and CSPRNG nonces, from libsodium.
#include "lib/protocol/auth.h"

#include <sodium.h>

#include <cstdio>
#include <cstdlib>

namespace psld::protocol {
namespace {

// sodium_init is safe to call from several threads and more than once; it
// fails only where the system has no entropy source, which leaves nothing to
// prove anything with.
void ensure_sodium() {
  static const bool ready = [] {
    if (sodium_init() < 0) {
      std::fprintf(stderr, "psld: libsodium cannot initialise (no entropy source?)\n");
      std::abort();
    }
    return true;
  }();
  (void)ready;
}

// The layout every proof covers; the version tag changes with the handshake.
constexpr std::string_view kTag = "psld handshake v1";

void update(crypto_auth_hmacsha256_state* st, std::span<const uint8_t> bytes) {
  crypto_auth_hmacsha256_update(st, bytes.data(), bytes.size());
}

void update_sized(crypto_auth_hmacsha256_state* st, std::span<const uint8_t> bytes) {
  // Length-prefixed, so no two inputs concatenate to the same stream.
  uint8_t len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<uint8_t>(static_cast<uint64_t>(bytes.size()) >> (8 * i));
  update(st, len);
  update(st, bytes);
}

std::span<const uint8_t> bytes_of(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace

Nonce make_nonce() {
  ensure_sodium();
  Nonce n;
  randombytes_buf(n.data(), n.size());
  return n;
}

Proof prove(const std::string& secret, const ProofInput& input) {
  ensure_sodium();
  static const Nonce kNone{};
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, reinterpret_cast<const unsigned char*>(secret.data()),
                              secret.size());
  update_sized(&st, bytes_of(kTag));
  update_sized(&st, bytes_of(input.conversation));
  const uint8_t side = static_cast<uint8_t>(input.side);
  update(&st, {&side, 1});
  update(&st, input.acceptor_nonce ? *input.acceptor_nonce : kNone);
  update(&st, input.dialer_nonce ? *input.dialer_nonce : kNone);
  update_sized(&st, input.claims);
  Proof p;
  crypto_auth_hmacsha256_final(&st, p.data());
  sodium_memzero(&st, sizeof(st));
  return p;
}

bool proofs_equal(const Proof& a, const Proof& b) {
  static_assert(kProofBytes == crypto_auth_hmacsha256_BYTES);
  return crypto_verify_32(a.data(), b.data()) == 0;
}

std::string make_secret() {
  ensure_sodium();
  uint8_t raw[32];
  randombytes_buf(raw, sizeof(raw));
  char hex[2 * sizeof(raw) + 1];
  sodium_bin2hex(hex, sizeof(hex), raw, sizeof(raw));
  sodium_memzero(raw, sizeof(raw));
  std::string s(hex, 2 * sizeof(raw));
  sodium_memzero(hex, sizeof(hex));
  return s;
}

}  // namespace psld::protocol
