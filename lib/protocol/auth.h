// lib/protocol/auth.h — proving knowledge of the job secret at every hello.
//
// Each connection starts with a mutual challenge-response (docs/reliability.md,
// "Authentication"): both ends draw a nonce from libsodium's CSPRNG, and
// each proves it knows the job secret with an HMAC-SHA256, keyed by the
// secret, over both nonces, the conversation, its side and what it claims
// (role, rank). A proof is good for one pair of nonces, so a recorded hello
// replayed on a new connection fails; the side is in the MAC, so a proof
// reflected back to its sender fails too. The secret itself never travels.
//
// What this does not give: the messages after the hello are not MACed or
// encrypted, so a job's network must still be one nobody can sniff or
// inject into (docs/reliability.md, "Ports").
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace psld::protocol {

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kProofBytes = 32;  // HMAC-SHA256
using Nonce = std::array<uint8_t, kNonceBytes>;
using Proof = std::array<uint8_t, kProofBytes>;

// A fresh nonce from the operating system's CSPRNG (libsodium's randombytes).
Nonce make_nonce();

// Which end of a connection a proof comes from.
enum class Side : uint8_t { kDialer = 1, kAcceptor = 2 };

// What a proof is about: the conversation ("member": a member joining the
// coordinator; "data": a worker or server dialing a server), the side, the
// two nonces and the claims the proof binds (e.g. role and rank).
struct ProofInput {
  std::string_view conversation;
  Side side = Side::kDialer;
  const Nonce* acceptor_nonce = nullptr;
  const Nonce* dialer_nonce = nullptr;
  std::span<const uint8_t> claims;
};

Proof prove(const std::string& secret, const ProofInput& input);
// Constant time.
bool proofs_equal(const Proof& a, const Proof& b);

// A random secret for one job (`psld launch` without one): 32 bytes from
// the CSPRNG as 64 hex digits.
std::string make_secret();

}  // namespace psld::protocol
