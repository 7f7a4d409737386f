// Control messages (lib/protocol/protocol.h): every message any process
// reads from a connection goes through protocol::decode first. A message that
// decodes must encode to the very bytes it came from (one encoding per
// message); one that does not is DataLoss. Only encode, decode and the
// Message variant are used, so the harness follows the protocol's changes.
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "lib/placement/placement.h"
#include "lib/protocol/protocol.h"
#include "tests/fuzz/fuzz.h"

namespace psld::fuzz {
namespace {

template <size_t... I>
void defaults(std::index_sequence<I...>, std::vector<Seed>& out) {
  (out.push_back({"default_" + std::to_string(I),
                  protocol::encode(protocol::Message(std::in_place_index<I>))}),
   ...);
}

}  // namespace

std::vector<Seed> seeds() {
  using namespace protocol;
  const std::vector<uint8_t> address = {'1', '2', '7', '.', '0', '.', '0', '.', '1', ':', '9'};
  auto placement = Placement::initial({{0, 1.0}, {1, 2.0}}, 4);
  auto change = placement->add_server({2, 1.0});
  const std::vector<uint8_t> delta = change->delta.serialize();

  Hello hello;
  hello.role = Role::kServer;
  hello.rank_hint = 1;
  hello.address = address;
  hello.pid = 4242;
  hello.host = "node-1";
  LoadReport server_load;
  server_load.rank = 1;
  server_load.epoch = 2;
  server_load.window = 7;
  server_load.window_ns = 100'000'000;
  server_load.parts = 2;
  server_load.bytes_in = 1 << 20;
  server_load.arcs = {{0, 10, 20, 30, 4}, {1ull << 63, 1, 2, 3, 1}};
  LoadReport worker_load;
  worker_load.role = Role::kWorker;
  worker_load.peers = {{0, 4096, 2, 1000, 5000}, {1, 8192, 3, 2000, 9000}};
  PushMeta push{7, 3, DType::kFloat16, 42, 5, 1024, 2, kPushThenPull | kPushMapped, 8, 0.01};
  const std::vector<uint64_t> rounds = {3, 3, 4, 9, 9, 1};

  const std::vector<std::pair<std::string, Message>> messages = {
      {"hello", hello},
      {"welcome", Welcome{Role::kWorker, 2, 4, 3, 1, 1 << 20}},
      {"reject", Reject{"job is full"}},
      {"server_list", ServerList{{{0, address}, {1, address}}}},
      {"placement_chunk", PlacementChunk{0, 0, 1, placement->serialize()}},
      {"register_tensor", RegisterTensor{9, "layer1.weight", DType::kBFloat16, 4096, true}},
      {"tensor_info", TensorInfo{9, "layer1.weight", 1, DType::kFloat32, 4096, 1024}},
      {"barrier_enter", BarrierEnter{5}},
      {"barrier_release", BarrierRelease{5}},
      {"heartbeat", Heartbeat{77}},
      {"job_failed", JobFailed{"server 2 died"}},
      {"shutdown", Shutdown{}},
      {"load_report_server", server_load},
      {"load_report_worker", worker_load},
      {"grant", Grant{16, 1 << 16, {1, 2, 3, 4}}},
      {"tensor_key", TensorKey{3, 1, {5, 6, 7}, 128, kTensorAnswersBatched}},
      {"answer_slots", AnswerSlots{4, 262144, {5, 6, 7}}},
      {"push_meta", push},
      {"pull_request", PullRequest{4, DType::kFloat32, 512, 42, 6, 2}},
      {"credit", Credit{{1, 2, 3}, {7, 8}}},
      {"moved", protocol::Moved{4, 42, 3}},
      {"error", Error{4, 9, static_cast<uint8_t>(StatusCode::kMoved), "not mine"}},
      {"ack", Ack{3, kAckMapped}},
      {"epoch_change", EpochChange{EpochStep::kPrepare, 1, 100, delta, 0}},
      {"epoch_abort", EpochChange{EpochStep::kAbort, 2, 100, delta, 2}},
      {"epoch_vote", EpochVote{1, 100, true, 99}},
      {"state_request", StateRequest{11, 42, 100, DType::kFloat32, 1024, {9, 9, 9}}},
      {"state_offer", StateOffer{42, 100, DType::kFloat16, 512}},
      {"transfer_done", TransferDone{1, 100, 2}},
      {"epoch_final", EpochFinal{1, 100}},
      {"worker_progress", WorkerProgress{6, pack_rounds(rounds)}},
      {"low_watermark", LowWatermark{6, pack_rounds(rounds)}},
      {"checkpoint_seal", CheckpointSeal{100}},
      {"checkpoint_sealed", CheckpointSealed{100, 4096, 3, std::string(64, '0'), ""}},
      {"checkpoint_failed", CheckpointSealed{100, 0, 0, "", "No space left on device"}},
      {"join_waiting", JoinWaiting{3, 1, {0, 5, 6}, {1, 2}}},
      {"replica_open", ReplicaOpen{4, 42, DType::kFloat32, 1024, 1}},
      {"replica_grant", ReplicaGrant{4, 42, {7, 7}}},
      {"replica_ack", ReplicaAck{5, 100}},
      {"replica_synced", ReplicaSynced{2}},
      {"epoch_failover", EpochChange{EpochStep::kFailover, 3, 0, delta, 1}},
      {"epoch_cancel", EpochChange{EpochStep::kCancel, 3, 12, {}, 1}},
      {"push_batch", PushBatch{9,
                               2,
                               3,
                               {{10, 11, DType::kFloat32, kPushThenPull, 42, 5, 4096, 0, 0},
                                {12, 0, DType::kFloat16, 0, 43, 5, 1024, 4096, 0.01}}}},
      {"push_batch_in_place",
       PushBatch{0,
                 kNoSlot,
                 3,
                 {{13, 14, DType::kFloat32, kPushThenPull | kPushMapped, 44, 6, 4096, 0, 0}}}},
  };
  std::vector<Seed> out;
  for (const auto& [name, m] : messages)
    out.push_back({name, encode(m)});
  // And every type with its default fields (not all of them decode: a
  // Welcome needs chunk_bytes > 0), so that a type added to Message has a
  // seed without an edit here.
  defaults(std::make_index_sequence<std::variant_size_v<Message>>(), out);
  return out;
}

}  // namespace psld::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace psld;
  const std::span<const uint8_t> in(data, size);
  Result<protocol::Message> m = protocol::decode(in);
  if (!m.ok()) {
    PSLD_FUZZ_CHECK(m.status().code() == StatusCode::kDataLoss);
    return 0;
  }
  PSLD_FUZZ_CHECK(!protocol::message_name(*m).empty());
  PSLD_FUZZ_CHECK(psld::fuzz::same_bytes(protocol::encode(*m), in));
  return 0;
}
