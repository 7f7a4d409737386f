#include "lib/protocol/protocol.h"

#include <gtest/gtest.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include <random>

#include "transports/transport.h"

namespace psld::protocol {
namespace {

Nonce nonce_of(uint8_t seed) {
  Nonce n;
  for (size_t i = 0; i < n.size(); ++i)
    n[i] = static_cast<uint8_t>(seed + 7 * i);
  return n;
}

Proof proof_of(uint8_t seed) {
  Proof p;
  for (size_t i = 0; i < p.size(); ++i)
    p[i] = static_cast<uint8_t>(seed ^ (13 * i));
  return p;
}

// One filled-in example of every message type.
std::vector<Message> examples() {
  return {
      Challenge{nonce_of(1)},
      Hello{Role::kServer, 3, nonce_of(2), proof_of(3), {1, 2, 3}, 777, "node-7"},
      Welcome{Role::kWorker, 2, 4, 3, 1, 4 << 20, 300, proof_of(4)},
      Reject{"wrong secret"},
      ServerList{{{0, {9, 9}}, {1, {8}}, {2, {}}}},
      PlacementChunk{5, 1, 3, {1, 2, 3, 4}},
      RegisterTensor{7, "fc1.weight", DType::kBFloat16, 123456, true},
      TensorInfo{7, "fc1.weight", 12, DType::kFloat16, 123456, 4 << 20, 300},
      BarrierEnter{3},
      BarrierRelease{3},
      Heartbeat{99},
      JobFailed{"worker 2 stopped answering"},
      Shutdown{},
      LoadReport{Role::kServer,
                 2,
                 7,
                 41,
                 100000000,
                 1,
                 3,
                 1 << 20,
                 2 << 20,
                 5000,
                 100,
                 900,
                 12,
                 3,
                 {{0x10, 1, 2, 3, 4}, {0x20, 5, 6, 7, 8}},
                 {{1, 9, 10, 11, 12}}},
      PeerHello{Role::kWorker, 3, nonce_of(5)},
      Grant{16, 4 << 20, {5, 6, 7}, proof_of(6)},
      TensorKey{4, 12, {1, 1, 2, 3, 5, 8}, 4096, kTensorAnswersBatched},
      PushMeta{17, 3, DType::kBFloat16, make_key(12, 4), 100, 4096, 2, kPushThenPull, 18},
      PullRequest{19, DType::kFloat16, 2048, make_key(12, 4), 100, 2},
      PushBatch{21,
                5,
                3,
                {{22, 23, DType::kFloat32, kPushThenPull, make_key(12, 5), 100, 4096, 0, 0.5},
                 {24, 0, DType::kBFloat16, 0, make_key(13, 0), 7, 64, 4096, 0}}},
      AnswerSlots{4, 262144, {9, 8, 7}},
      Credit{{1, 2, 3, 15}, {7, 8}},
      Moved{17, make_key(12, 4), 3},
      Error{17, 0, static_cast<uint8_t>(StatusCode::kOutOfRange), "slot 99 out of range"},
      Ack{4, kAckMapped},
      EpochChange{EpochStep::kAbort, 3, 120, {1, 2, 3}, 4},
      EpochVote{3, 120, true, 99},
      StateRequest{5, make_key(12, 4), 120, DType::kFloat16, 2048, {4, 5}},
      StateOffer{make_key(12, 4), 120, DType::kBFloat16, 2048},
      TransferDone{3, 120, 2},
      EpochFinal{3, 120},
      WorkerProgress{12, {{1, 118}, {5, 60}}},
      LowWatermark{12, {{1, 117}, {5, 59}, {6, 117}}},
      PeerProof{proof_of(7)},
      CheckpointSeal{300},
      CheckpointSealed{300, 1 << 20, 17, std::string(64, 'a'), ""},
      JoinWaiting{2, 3, {1, 3}, {0, 2, 4}},
      ReplicaOpen{8, make_key(12, 4), DType::kFloat32, 4096, 3},
      ReplicaGrant{8, make_key(12, 4), {1, 2, 3}},
      ReplicaAck{9, 120},
      ReplicaSynced{4},
  };
}

bool same(const Message& a, const Message& b) {
  return encode(a) == encode(b);
}

TEST(Protocol, EveryMessageRoundTrips) {
  auto all = examples();
  ASSERT_EQ(all.size(), std::variant_size_v<Message>) << "add an example for every message";
  for (const Message& m : all) {
    auto bytes = encode(m);
    auto back = decode(bytes);
    ASSERT_TRUE(back.ok()) << message_name(m) << ": " << back.status().to_string();
    EXPECT_EQ(back->index(), m.index());
    EXPECT_TRUE(same(*back, m)) << message_name(m);
  }
}

// encode_to() into one buffer reused for every message, larger ones first
// and then smaller, gives encode()'s bytes.
TEST(Protocol, EncodingIntoAReusedBufferGivesTheSameBytes) {
  auto all = examples();
  all.push_back(PushBatch{
      1, 0, 1,
      std::vector<BatchEntry>(kMaxBatchEntries, BatchEntry{2, 3, DType::kFloat32, kPushThenPull, 7,
                                                           4, 4096, 64, 0.5})});
  std::vector<uint8_t> buffer;
  for (int pass = 0; pass < 2; ++pass) {
    for (const Message& m : all) {
      encode_to(m, buffer);
      EXPECT_EQ(buffer, encode(m)) << message_name(m) << ", pass " << pass;
    }
    std::reverse(all.begin(), all.end());
  }
}

TEST(Protocol, FieldsSurviveTheTrip) {
  auto back = decode(encode(
      PushMeta{17, 3, DType::kBFloat16, make_key(12, 4), 100, 4096, 2, kPushThenPull, 18, 0.0625}));
  ASSERT_TRUE(back.ok());
  const auto& p = std::get<PushMeta>(*back);
  EXPECT_EQ(p.tag, 17u);
  EXPECT_EQ(p.slot, 3u);
  EXPECT_EQ(p.dtype, DType::kBFloat16);
  EXPECT_EQ(p.key, make_key(12, 4));
  EXPECT_EQ(p.round, 100u);
  EXPECT_EQ(p.bytes, 4096u);
  EXPECT_EQ(p.epoch, 2u);
  EXPECT_EQ(p.flags, kPushThenPull);
  EXPECT_EQ(p.pull_tag, 18u);
  EXPECT_EQ(p.lr, 0.0625);
  auto h = decode(encode(Hello{Role::kServer, -1, {}, {}, {}, 1, "h"}));
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(std::get<Hello>(*h).rank_hint, -1);
}

TEST(Protocol, AnInPlacePushMustAskForItsPull) {
  // Read in place only while the worker waits for the result: a plain push
  // completes at once, and the worker could overwrite what is still unread.
  const PushMeta ok{17,
                    kNoSlot,
                    DType::kFloat32,
                    make_key(12, 4),
                    100,
                    4096,
                    2,
                    static_cast<uint8_t>(kPushThenPull | kPushMapped),
                    18};
  auto back = decode(encode(ok));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(std::get<PushMeta>(*back).flags, kPushThenPull | kPushMapped);
  PushMeta plain = ok;
  plain.flags = kPushMapped;
  EXPECT_FALSE(decode(encode(plain)).ok());
  EXPECT_FALSE(decode(encode(Ack{3, 2})).ok()) << "an unknown Ack flag";
}

TEST(Protocol, ABatchIsInOneSlotOrAllInPlace) {
  const BatchEntry in_slot{2, 3, DType::kFloat32, kPushThenPull, make_key(1, 0), 4, 4096, 64, 0};
  const BatchEntry in_place{
      5, 6, DType::kFloat32, kPushThenPull | kPushMapped, make_key(2, 0), 4, 4096, 0, 0};
  auto decodes = [](const PushBatch& b) { return decode(encode(b)).ok(); };
  EXPECT_TRUE(decodes(PushBatch{1, 0, 1, {in_slot, in_slot}}));
  EXPECT_TRUE(decodes(PushBatch{0, kNoSlot, 1, {in_place, in_place}}));
  auto back = decode(encode(PushBatch{1, 7, 9, {in_slot}}));
  ASSERT_TRUE(back.ok());
  const PushMeta m = entry_meta(std::get<PushBatch>(*back), 0);
  EXPECT_EQ(m.tag, 2u);
  EXPECT_EQ(m.pull_tag, 3u);
  EXPECT_EQ(m.slot, 7u);
  EXPECT_EQ(m.epoch, 9u);
  EXPECT_EQ(m.bytes, 4096u);
  EXPECT_EQ(m.flags, kPushThenPull);
  // Mixed, or in place with a slot or a write, or a slot without one.
  EXPECT_FALSE(decodes(PushBatch{1, 0, 1, {in_slot, in_place}}));
  EXPECT_FALSE(decodes(PushBatch{0, kNoSlot, 1, {in_slot}}));
  EXPECT_FALSE(decodes(PushBatch{1, kNoSlot, 1, {in_place}}));
  EXPECT_FALSE(decodes(PushBatch{0, 3, 1, {in_slot}}));
  // In place, an entry has no offset and must ask for its pull.
  BatchEntry shifted = in_place;
  shifted.offset = 64;
  EXPECT_FALSE(decodes(PushBatch{0, kNoSlot, 1, {shifted}}));
  BatchEntry plain = in_place;
  plain.flags = kPushMapped;
  EXPECT_FALSE(decodes(PushBatch{0, kNoSlot, 1, {plain}}));
  // Empty, too many, a bad flag, a bad learning rate.
  EXPECT_FALSE(decodes(PushBatch{1, 0, 1, {}}));
  EXPECT_TRUE(decodes(PushBatch{1, 0, 1, std::vector<BatchEntry>(kMaxBatchEntries, in_slot)}));
  EXPECT_LE(encode(PushBatch{1, 0, 1, std::vector<BatchEntry>(kMaxBatchEntries, in_slot)}).size(),
            transport::kMaxMessageBytes);
  EXPECT_FALSE(decodes(PushBatch{1, 0, 1, std::vector<BatchEntry>(kMaxBatchEntries + 1, in_slot)}));
  BatchEntry flagged = in_slot;
  flagged.flags = 64;
  EXPECT_FALSE(decodes(PushBatch{1, 0, 1, {flagged}}));
  BatchEntry nan = in_slot;
  nan.lr = std::nan("");
  EXPECT_FALSE(decodes(PushBatch{1, 0, 1, {nan}}));
  // A bad dtype in any entry (here the last of three).
  for (uint8_t dtype : {0, 4, 255}) {
    BatchEntry odd = in_slot;
    odd.dtype = static_cast<DType>(dtype);
    EXPECT_FALSE(decodes(PushBatch{1, 0, 1, {in_slot, in_slot, odd}})) << int{dtype};
  }
}

TEST(Protocol, AnswerSlotsAndTensorFlagsAreChecked) {
  auto decodes = [](const Message& m) { return decode(encode(m)).ok(); };
  EXPECT_TRUE(decodes(AnswerSlots{4, 262144, {1, 2}}));
  EXPECT_FALSE(decodes(AnswerSlots{0, 262144, {1, 2}}));             // no slot
  EXPECT_FALSE(decodes(AnswerSlots{4, kAnswerDataOffset, {1, 2}}));  // no room for data
  EXPECT_FALSE(decodes(AnswerSlots{4, (uint64_t{1} << 30) + 1, {1, 2}}));
  EXPECT_FALSE(decodes(AnswerSlots{static_cast<uint32_t>(kMaxListEntries + 1), 262144, {1}}));
  EXPECT_TRUE(decodes(TensorKey{1, 2, {3}, 0, kTensorAnswersBatched}));
  EXPECT_FALSE(decodes(TensorKey{1, 2, {3}, 0, 2}));
  // A batch's table always fits before its data.
  EXPECT_LE(sizeof(AnswerHeader) + kMaxAnswerEntries * sizeof(AnswerEntry), kAnswerDataOffset);
  EXPECT_EQ(sizeof(AnswerEntry), 12u);
}

TEST(Protocol, EveryTruncationIsRejected) {
  for (const Message& m : examples()) {
    auto bytes = encode(m);
    for (size_t n = 0; n < bytes.size(); ++n) {
      auto r = decode(std::span<const uint8_t>(bytes.data(), n));
      EXPECT_FALSE(r.ok()) << message_name(m) << " truncated to " << n << " bytes";
      if (!r.ok()) {
        EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
      }
    }
  }
}

TEST(Protocol, TrailingBytesAreRejected) {
  for (const Message& m : examples()) {
    auto bytes = encode(m);
    bytes.push_back(0);
    EXPECT_FALSE(decode(bytes).ok()) << message_name(m);
  }
}

TEST(Protocol, WrongVersionAndUnknownTypeAreRejected) {
  auto bytes = encode(Heartbeat{1});
  bytes[2] = 99;  // version
  auto r = decode(bytes);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("version"), std::string::npos);
  bytes = encode(Heartbeat{1});
  bytes[0] = 0xee;
  bytes[1] = 0xee;
  EXPECT_FALSE(decode(bytes).ok());
}

TEST(Protocol, BadEnumsAndHugeCountsAreRejected) {
  auto hello = encode(Hello{Role::kWorker, 0, {}, {}, {}, 0, ""});
  hello[4] = 9;  // role
  EXPECT_FALSE(decode(hello).ok());

  auto reg = encode(RegisterTensor{1, "t", DType::kFloat32, 4, false});
  reg.back() = 2;  // has_init must be 0 or 1
  EXPECT_FALSE(decode(reg).ok());

  auto push = encode(PushMeta{1, 1, DType::kFloat32, 1, 1, 1, 1, 0, 0});
  push[push.size() - 13] = 0x80;  // unknown flag bit (before pull_tag and lr)
  EXPECT_FALSE(decode(push).ok());
  // A learning rate must be a finite number >= 0.
  for (double lr : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    EXPECT_FALSE(decode(encode(PushMeta{1, 1, DType::kFloat32, 1, 1, 1, 1, 0, 0, lr})).ok()) << lr;
  }

  // A credit list that claims 4096 entries but carries none must not allocate them.
  auto credit = encode(Credit{{}, {}});
  credit[4] = 0x00;
  credit[5] = 0x10;  // 4096
  EXPECT_FALSE(decode(credit).ok());

  // An empty tensor name is not a name.
  EXPECT_FALSE(decode(encode(RegisterTensor{1, "", DType::kFloat32, 4, false})).ok());

  // An epoch step that does not exist, and a state offer for round 0 (there
  // is no round -1 to ship).
  auto change = encode(EpochChange{EpochStep::kCommit, 1, 2, {}, 0});
  change[4] = 3;
  EXPECT_TRUE(decode(change).ok());  // failover
  change[4] = 4;
  EXPECT_TRUE(decode(change).ok());  // cancel
  change[4] = 5;
  EXPECT_FALSE(decode(change).ok());
  EXPECT_FALSE(decode(encode(StateOffer{1, 0, DType::kFloat32, 4})).ok());
  // A replica's tag is even (its slots notify tag and tag + 1), its copy 1
  // to 3 arrays.
  EXPECT_TRUE(decode(encode(ReplicaOpen{2, 1, DType::kFloat32, 4, 3})).ok());
  EXPECT_FALSE(decode(encode(ReplicaOpen{3, 1, DType::kFloat32, 4, 1})).ok());
  EXPECT_FALSE(decode(encode(ReplicaOpen{2, 1, DType::kFloat32, 4, 0})).ok());
  EXPECT_FALSE(decode(encode(ReplicaOpen{2, 1, DType::kFloat32, 4, 4})).ok());

  // Missing ranks: ascending, no repeats, at most kMaxMissingListed.
  EXPECT_TRUE(decode(encode(JoinWaiting{0, 0, {0, 1}, {}})).ok());
  EXPECT_FALSE(decode(encode(JoinWaiting{0, 0, {1, 1}, {}})).ok());
  EXPECT_FALSE(decode(encode(JoinWaiting{0, 0, {}, {3, 2}})).ok());
  std::vector<uint32_t> many(kMaxMissingListed + 1);
  std::iota(many.begin(), many.end(), 0u);
  EXPECT_FALSE(decode(encode(JoinWaiting{0, 0, many, {}})).ok());
  many.pop_back();
  EXPECT_TRUE(decode(encode(JoinWaiting{0, 0, {}, many})).ok());
}

// The steps that name a lost server: each keeps its name and every field.
TEST(Protocol, EpochStepsAboutALostServerKeepTheirFields) {
  const std::vector<std::pair<EpochChange, std::string_view>> cases = {
      {{EpochStep::kFailover, 4, 0, {7}, 1}, "failover"},
      {{EpochStep::kCancel, 5, 40, {}, 2}, "cancel"},
      {{EpochStep::kAbort, 9, 120, {7}, 3}, "abort"},
  };
  for (const auto& [sent, name] : cases) {
    auto back = decode(encode(sent));
    ASSERT_TRUE(back.ok()) << name;
    const auto& e = std::get<EpochChange>(*back);
    EXPECT_EQ(e.step, sent.step);
    EXPECT_EQ(epoch_step_name(e.step), name);
    EXPECT_EQ(e.epoch, sent.epoch) << name;
    EXPECT_EQ(e.switch_round, sent.switch_round) << name;
    EXPECT_EQ(e.delta, sent.delta) << name;
    EXPECT_EQ(e.lost_server, sent.lost_server) << name;
  }
}

TEST(Protocol, ATransferDoneCountsItsLateKeys) {
  auto done = decode(encode(TransferDone{9, 120, 5}));
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(std::get<TransferDone>(*done).late_keys, 5u);
}

TEST(Protocol, RoundsPerTensorPackIntoBoundedRanges) {
  // Exact while they fit: neighbours of the same round share a range.
  const std::vector<uint64_t> few = {7, 7, 3, 7, 9, 9};
  const auto packed = pack_rounds(few);
  ASSERT_EQ(packed.size(), 4u);
  for (TensorId t = 1; t <= few.size(); ++t)
    EXPECT_EQ(round_of(packed, 6, t), few[t - 1]) << "tensor " << t;
  EXPECT_EQ(round_of(packed, 6, 7), 0u) << "a tensor the ranges do not cover";
  EXPECT_EQ(round_of(packed, 6, 0), 0u);
  // Too many distinct rounds: bounded, and never above any tensor's round.
  std::vector<uint64_t> many(5000);
  for (size_t i = 0; i < many.size(); ++i)
    many[i] = 1000 + (i * 7919) % 613;
  const auto coarse = pack_rounds(many);
  EXPECT_LE(coarse.size(), kMaxRoundRanges);
  for (TensorId t = 1; t <= many.size(); ++t)
    ASSERT_LE(round_of(coarse, 5000, t), many[t - 1]) << "tensor " << t;
  auto back = decode(encode(LowWatermark{5000, coarse}));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(std::get<LowWatermark>(*back).low.size(), coarse.size());
  // Ranges that do not start at tensor 1, go backwards or past `tensors`.
  EXPECT_FALSE(decode(encode(LowWatermark{5, {{2, 10}}})).ok());
  EXPECT_FALSE(decode(encode(LowWatermark{5, {{1, 10}, {4, 3}, {3, 9}}})).ok());
  EXPECT_FALSE(decode(encode(WorkerProgress{5, {{1, 10}, {6, 3}}})).ok());
  EXPECT_FALSE(decode(encode(WorkerProgress{5, {}})).ok());
  EXPECT_FALSE(decode(encode(WorkerProgress{0, {{1, 3}}})).ok());
}

TEST(Protocol, RandomBytesNeverCrash) {
  std::mt19937_64 rng(7);
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint8_t> b(rng() % 64);
    for (auto& x : b)
      x = static_cast<uint8_t>(rng());
    if (b.size() >= 4 && (i & 1)) {  // often a valid header, so bodies get fuzzed too
      b[0] = static_cast<uint8_t>(1 + rng() % 36);
      b[1] = 0;
      b[2] = kVersion;
      b[3] = 0;
    }
    auto r = decode(b);
    if (r.ok()) {
      ++accepted;
      EXPECT_EQ(encode(*r), b) << "an accepted message must re-encode to the same bytes";
    }
  }
  SUCCEED() << accepted << " random buffers happened to be valid";
}

TEST(Auth, NoncesAndSecretsAreFresh) {
  EXPECT_NE(make_nonce(), make_nonce());
  EXPECT_NE(make_nonce(), Nonce{});
  const std::string a = make_secret(), b = make_secret();
  EXPECT_EQ(a.size(), 64u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(a, b);
}

TEST(Auth, AProofDependsOnEverythingItCovers) {
  const Nonce c = nonce_of(1), n = nonce_of(2);
  const uint8_t claims[] = {1, 2, 3};
  const ProofInput base{"data", Side::kDialer, &c, &n, claims};
  const Proof p = prove("s3cret", base);
  EXPECT_TRUE(proofs_equal(p, prove("s3cret", base)));
  ProofInput other = base;
  EXPECT_FALSE(proofs_equal(p, prove("s3cres", base)));
  EXPECT_FALSE(proofs_equal(p, prove("", base)));
  other.side = Side::kAcceptor;  // a proof reflected back to its sender
  EXPECT_FALSE(proofs_equal(p, prove("s3cret", other)));
  other = base;
  other.conversation = "member";
  EXPECT_FALSE(proofs_equal(p, prove("s3cret", other)));
  const Nonce c2 = nonce_of(3);
  other = base;
  other.acceptor_nonce = &c2;  // a replay on a new connection
  EXPECT_FALSE(proofs_equal(p, prove("s3cret", other)));
  other = base;
  other.dialer_nonce = &c2;
  EXPECT_FALSE(proofs_equal(p, prove("s3cret", other)));
  const uint8_t claims2[] = {1, 2, 4};
  other = base;
  other.claims = claims2;
  EXPECT_FALSE(proofs_equal(p, prove("s3cret", other)));
  // Lengths are framed: moving a byte between fields changes the proof.
  const uint8_t shorter[] = {1, 2};
  other = base;
  other.claims = shorter;
  EXPECT_FALSE(proofs_equal(p, prove("s3cret", other)));
}

TEST(Auth, TheMemberHandshakeBindsRoleRankAndTheWelcome) {
  const Nonce challenge = make_nonce();
  Hello hello{Role::kServer, 2, make_nonce(), {}, {9, 9}, 1, "h"};
  hello.proof = hello_proof("s3cret", challenge, hello);
  EXPECT_TRUE(proofs_equal(hello.proof, hello_proof("s3cret", challenge, hello)));
  Hello tampered = hello;
  tampered.rank_hint = 1;
  EXPECT_FALSE(proofs_equal(hello.proof, hello_proof("s3cret", challenge, tampered)));
  EXPECT_FALSE(proofs_equal(hello.proof, hello_proof("s3cret", make_nonce(), hello)));

  Welcome welcome{Role::kServer, 2, 4, 3, 0, 1 << 20, {}};
  welcome.proof = welcome_proof("s3cret", challenge, hello, welcome);
  EXPECT_TRUE(proofs_equal(welcome.proof, welcome_proof("s3cret", challenge, hello, welcome)));
  Welcome changed = welcome;
  changed.num_workers = 5;
  EXPECT_FALSE(proofs_equal(welcome.proof, welcome_proof("s3cret", challenge, hello, changed)));
  EXPECT_FALSE(proofs_equal(welcome.proof, welcome_proof("other", challenge, hello, welcome)));
  // A Welcome answers one hello: another member's (same challenge) fails.
  Hello another = hello;
  another.nonce = make_nonce();
  EXPECT_FALSE(proofs_equal(welcome.proof, welcome_proof("s3cret", challenge, another, welcome)));
}

TEST(Auth, ThePeerHandshakeRoundTripsAndRefusesStrangers) {
  PeerDial dial(Role::kWorker, 3);
  EXPECT_NE(dial.hello.nonce, Nonce{});
  const Challenge challenge{make_nonce()};
  auto answer = dial.answer("s3cret", challenge);
  ASSERT_TRUE(answer.has_value());
  EXPECT_FALSE(dial.answer("s3cret", challenge).has_value()) << "one challenge per connection";
  // What the server checks.
  EXPECT_TRUE(proofs_equal(answer->proof, peer_proof("s3cret", challenge.nonce, dial.hello)));
  EXPECT_FALSE(proofs_equal(answer->proof, peer_proof("wrong", challenge.nonce, dial.hello)));
  // A recorded PeerProof replayed against a fresh challenge fails.
  EXPECT_FALSE(proofs_equal(answer->proof, peer_proof("s3cret", make_nonce(), dial.hello)));

  Grant grant{16, 4096, {1, 2, 3}, {}};
  grant.proof = grant_proof("s3cret", challenge.nonce, dial.hello, grant);
  EXPECT_TRUE(dial.proves("s3cret", grant));
  EXPECT_FALSE(dial.proves("wrong", grant));
  Grant swapped = grant;
  swapped.slots_key = {1, 2, 4};  // another region's key under the same proof
  EXPECT_FALSE(dial.proves("s3cret", swapped));
  // The server's proof is not the worker's reflected.
  Grant reflected = grant;
  reflected.proof = answer->proof;
  EXPECT_FALSE(dial.proves("s3cret", reflected));
  // Without a challenge answered, no grant proves anything.
  PeerDial fresh(Role::kWorker, 3);
  EXPECT_FALSE(fresh.proves("s3cret", grant));
}

}  // namespace
}  // namespace psld::protocol
