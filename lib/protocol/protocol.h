// lib/protocol/protocol.h — the control messages psld's processes exchange.
//
// Every message travels as a transport control message (Connection::send,
// at most transport::kMaxMessageBytes): a 4-byte header {u16 type, u16
// version} and a little-endian body. decode() validates everything (type,
// version, every length and count against the buffer and against the
// protocol's limits), so a malformed or hostile message is an error value,
// never a crash or a huge allocation.
//
// Conversations:
//   member -> coordinator : Hello (after the coordinator's Challenge)
//   coordinator -> member : Welcome | Reject, then ServerList, PlacementMsg
//                           (Hello and Welcome prove the job secret: auth.h)
//   worker -> coordinator : RegisterTensor      -> TensorInfo (also to servers) | Error
//   any -> coordinator    : BarrierEnter        -> BarrierRelease (to all)
//   any <-> coordinator   : Heartbeat; coordinator -> all: JobFailed, Shutdown
//   worker, server -> coordinator : LoadReport, every stats interval
//   worker, server -> server: PeerHello -> Challenge -> PeerProof -> Grant
//                           (landing slots for a worker; both ends prove
//                           the job secret: auth.h)
//   worker -> server      : TensorKey (where pulls land), PushMeta (+ a write
//                           into a slot, notify = tag), PushBatch (many small
//                           pushes: one write into one slot, or all in place),
//                           PullRequest
//   server -> worker      : Credit (freed slots, accepted plain pushes), Moved,
//                           Error; pulls arrive as writes into the worker's
//                           tensor, notify = tag
//   coordinator -> servers: EpochChange(prepare) -> EpochVote; then
//                           EpochChange(commit) to every member (docs/design.md §7)
//   old owner -> new owner: StateOffer (a key reached the switch and nobody
//                           asked for it yet)
//   new owner -> old owner: StateRequest -> a write of the key's state into
//                           the new owner's region, notify = tag
//   old owner -> coordinator: TransferDone, once every key it loses shipped;
//                           coordinator -> servers: EpochFinal once every old
//                           owner said so (the transfer can no longer be undone)
//   coordinator -> all    : EpochChange(abort) when a server that was only
//                           gaining keys died before EpochFinal
//                           (docs/migration.md)
//   coordinator -> servers: EpochChange(cancel) when a replicated server died
//                           during the vote, then EpochChange(failover) to
//                           every member (docs/replication.md)
//   worker -> coordinator : WorkerProgress, with every LoadReport;
//                           coordinator -> servers: LowWatermark, when it
//                           advances (old runs of ownership can be freed)
//   primary -> backup     : ReplicaOpen -> ReplicaGrant (a key's two replica
//                           slots); then per state change a write into a slot,
//                           notify = slot tag, answered with ReplicaAck
//   server -> coordinator : ReplicaSynced, once every key it holds has a copy
//                           at its backup of the newest epoch;
//                           coordinator -> all: EpochChange(failover) when a
//                           replicated server died (docs/replication.md)
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "lib/protocol/auth.h"
#include "psld/keys.h"
#include "psld/status.h"
#include "psld/worker.h"

namespace psld::protocol {

// 2: EpochChange carries a step and a lost server; TransferDone, EpochFinal
// and StateOffer. 3: WorkerProgress and LowWatermark. 4: TensorKey.offset,
// Ack.flags, kPushMapped. 5: PushMeta.lr. 6: HMAC proofs and CSPRNG nonces
// (Challenge, Hello, Welcome, Grant), PeerHello (was WorkerHello) and PeerProof.
// 7: checkpoints (CheckpointSeal, CheckpointSealed, Welcome.resume_round,
// TensorInfo.round). 8: JoinWaiting. 9: replication (ReplicaOpen,
// ReplicaGrant, ReplicaAck, ReplicaSynced, EpochStep::kFailover). 10: PushBatch,
// AnswerSlots, TensorKey.flags, Credit from a worker, batched answers.
// 11: EpochStep::kCancel. 12: a replication copy may travel as two writes
// (its body, kCopyBody in the notification, and its header); copy tags are 4
// apart.
inline constexpr uint16_t kVersion = 12;

// A member's psld::Role and a tensor's psld::DType travel as one byte each,
// their enum values (protocol.cc checks them); psld::Role::kAuto never does.
// "fp32", "fp16", "bf16".
std::string_view dtype_name(DType dtype);
uint32_t dtype_bytes(DType dtype);

// Limits that bound what a peer can make us allocate.
inline constexpr size_t kMaxNameBytes = 256;
inline constexpr size_t kMaxBlobBytes = 1024;  // addresses, remote keys
inline constexpr size_t kMaxReasonBytes = 1024;
inline constexpr size_t kMaxListEntries = 4096;

enum class Type : uint16_t {
  kChallenge = 1,
  kHello = 2,
  kWelcome = 3,
  kReject = 4,
  kServerList = 5,
  kPlacementChunk = 6,
  kRegisterTensor = 7,
  kTensorInfo = 8,
  kBarrierEnter = 9,
  kBarrierRelease = 10,
  kHeartbeat = 11,
  kJobFailed = 12,
  kShutdown = 13,
  kLoadReport = 14,
  kPeerHello = 20,
  kGrant = 21,
  kTensorKey = 22,
  kPushMeta = 23,
  kPullRequest = 24,
  kCredit = 25,
  kMoved = 26,
  kError = 27,
  kAck = 28,
  kEpochChange = 29,
  kEpochVote = 30,
  kStateRequest = 31,
  kStateOffer = 32,
  kTransferDone = 33,
  kEpochFinal = 34,
  kWorkerProgress = 35,
  kLowWatermark = 36,
  kPeerProof = 37,
  kCheckpointSeal = 38,
  kCheckpointSealed = 39,
  kJoinWaiting = 40,
  kReplicaOpen = 41,
  kReplicaGrant = 42,
  kReplicaAck = 43,
  kReplicaSynced = 44,
  kPushBatch = 45,
  kAnswerSlots = 46,
};

// The acceptor's nonce: the coordinator sends it as soon as a member
// connects; a server, in answer to a PeerHello.
struct Challenge {
  Nonce nonce{};
};

struct Hello {
  Role role = Role::kWorker;
  int32_t rank_hint = -1;        // -1: the coordinator assigns
  Nonce nonce{};                 // the member's, for the coordinator's proof in Welcome
  Proof proof{};                 // hello_proof()
  std::vector<uint8_t> address;  // where this member listens (servers), else empty
  uint32_t pid = 0;
  std::string host;
};

struct Welcome {
  Role role = Role::kWorker;
  uint32_t rank = 0;
  uint32_t num_workers = 0;
  uint32_t num_servers = 0;
  uint32_t num_standby = 0;
  uint64_t chunk_bytes = 0;
  // The job resumes from the checkpoint of this round (checkpoint.resume;
  // the coordinator chose and verified it); 0: a fresh start.
  uint64_t resume_round = 0;
  Proof proof{};  // welcome_proof(): the coordinator knows the secret too
};

struct Reject {
  std::string reason;
};

struct ServerEntry {
  uint32_t rank = 0;  // the server's ServerId in placements
  std::vector<uint8_t> address;
};
struct ServerList {
  std::vector<ServerEntry> servers;
};

// A serialized Placement, split in pieces that fit a control message;
// the receiver concatenates pieces [0, count) and deserializes.
struct PlacementChunk {
  uint64_t epoch = 0;
  uint32_t index = 0;
  uint32_t count = 0;
  std::vector<uint8_t> bytes;
};

struct RegisterTensor {
  uint64_t request = 0;  // echoed in TensorInfo / Error
  std::string name;
  DType dtype = DType::kFloat32;
  uint64_t bytes = 0;
  bool has_init = false;  // this worker will push an initial value
};

struct TensorInfo {
  uint64_t request = 0;
  std::string name;
  TensorId id = 0;
  DType dtype = DType::kFloat32;
  uint64_t bytes = 0;
  uint64_t chunk_bytes = 0;
  // A resumed job: the tensor's state is that after this round (its next
  // push is of round + 1, and no initial value is pushed); 0: fresh.
  uint64_t round = 0;
};

struct BarrierEnter {
  uint64_t barrier = 0;
};
struct BarrierRelease {
  uint64_t barrier = 0;
};

struct Heartbeat {
  uint64_t sequence = 0;
};

struct JobFailed {
  std::string reason;
};

struct Shutdown {};

// Load statistics (docs/design.md §5). One window of a server's (per arc of the
// placement, identified by the arc's first hash `lo` in `epoch`) or a
// worker's (per server) measurements. A window whose entries do not fit one
// control message travels in `parts` messages with the same `window`; the
// totals are in every part, the entries are split between them.
inline constexpr size_t kMaxLoadEntries = 160;  // arcs + peers per part: fits kMaxMessageBytes
struct ArcLoad {
  uint64_t lo = 0;  // first hash of the arc
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  uint64_t busy_ns = 0;  // reduce and update (CPU) time spent on the arc's keys
  uint32_t requests = 0;
};
struct PeerLoad {
  uint32_t server = 0;
  uint64_t bytes = 0;    // pushed to that server
  uint32_t answers = 0;  // chunks answered (pulls, push_pulls)
  uint64_t mean_ns = 0;  // time from issuing a chunk to its answer
  uint64_t p99_ns = 0;
};
struct LoadReport {
  Role role = Role::kServer;
  uint32_t rank = 0;
  uint64_t epoch = 0;      // the placement the arcs belong to
  uint64_t window = 0;     // sequence number of the window, from 0
  uint64_t window_ns = 0;  // its length
  uint32_t part = 0;
  uint32_t parts = 1;
  // Totals of the window (servers; a worker's are its own pushes and pulls).
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  uint64_t busy_ns = 0;       // servers: wall time with a request in service (LoadRecorder)
  uint64_t queue_p50_ns = 0;  // delay from arrival to processing
  uint64_t queue_p99_ns = 0;
  uint64_t rounds = 0;        // rounds (or async updates) applied
  uint64_t lost_samples = 0;  // samples the ring overwrote before they were read
  std::vector<ArcLoad> arcs;
  std::vector<PeerLoad> peers;
};

// The first message on a connection to a server's data port, from a worker
// or from another server (migration), which then answers the server's
// Challenge with PeerProof. Nothing else is accepted before that.
struct PeerHello {
  Role role = Role::kWorker;  // kWorker or kServer
  uint32_t rank = 0;
  Nonce nonce{};
};

struct PeerProof {
  Proof proof{};  // peer_proof()
};

// The server's answer to a good PeerProof: landing slots for a worker, none
// (0, 0, empty) for a server.
struct Grant {
  uint32_t num_slots = 0;
  uint64_t slot_bytes = 0;
  std::vector<uint8_t> slots_key;  // remote key of the slot region
  Proof proof{};                   // grant_proof(): the server knows the secret too
};

// TensorKey.flags: the tensor is in host memory, so the server may answer
// its small pulls in batches (AnswerSlots) that the worker copies out.
inline constexpr uint8_t kTensorAnswersBatched = 1;

struct TensorKey {
  uint64_t request = 0;  // acknowledged with Ack
  TensorId tensor = 0;
  std::vector<uint8_t> key;  // remote key of the memory the worker's tensor is in
  uint64_t offset = 0;       // of the tensor in that memory (Worker::allocate carves)
  uint8_t flags = 0;
};

// Where a server may write batches of answers to this worker's pulls
// (docs/runtime.md, "Batches"): `num_slots` slots of `slot_bytes` in the
// region `key`. A batch is one write into a free slot with notify
// kAnswerBatch | slot: an AnswerHeader, `count` AnswerEntry records, and
// each pull's bytes at its entry's offset. The worker copies them into its
// tensors and gives the slot back with a Credit (worker -> server: slots
// are answer slots).
inline constexpr uint32_t kAnswerBatch = 0x80000000u;  // worker tags stay below it
inline constexpr size_t kMaxAnswerEntries = 128;
inline constexpr uint32_t kAnswerMagic = 0x42534c50;  // "PLSB"
struct AnswerHeader {
  uint32_t magic = kAnswerMagic;
  uint32_t count = 0;
};
struct AnswerEntry {
  uint32_t tag = 0;  // the pull's
  uint32_t offset = 0;
  uint32_t bytes = 0;
};
// Where a batch's bytes may start: after the largest table.
inline constexpr uint64_t kAnswerDataOffset = 2048;
static_assert(sizeof(AnswerHeader) + kMaxAnswerEntries * sizeof(AnswerEntry) <= kAnswerDataOffset);

struct AnswerSlots {
  uint32_t num_slots = 0;
  uint64_t slot_bytes = 0;
  std::vector<uint8_t> key;  // remote key of the slots, back to back
};

// Flags of a push.
inline constexpr uint8_t kPushInit = 1;      // sets the initial value (round 0)
inline constexpr uint8_t kPushThenPull = 2;  // push_pull: write the result back, tag = pull_tag
// No write follows: the server reads the chunk in place from the worker's
// tensor, which it maps (Ack kAckMapped). Only with kPushThenPull: the worker
// leaves the tensor alone until the pull landed, so the server may read it
// whenever the round lets it. `slot` is kNoSlot.
inline constexpr uint8_t kPushMapped = 4;
inline constexpr uint32_t kNoSlot = 0xffffffff;

struct PushMeta {
  uint32_t tag = 0;  // the write's notify value
  uint32_t slot = 0;
  DType dtype = DType::kFloat32;
  Key key = 0;
  uint64_t round = 0;
  uint64_t bytes = 0;
  uint64_t epoch = 0;  // the worker's placement epoch
  uint8_t flags = 0;
  uint32_t pull_tag = 0;
  // server.mode=optimizer: the learning rate of the update this push is
  // part of (Worker::set_learning_rate); 0: the server's optimizer.lr.
  double lr = 0;
};

// Many small pushes to one server in one message (docs/runtime.md,
// "Batches"): either their bytes are in one landing slot, written by one
// write whose notify value is `tag`, each entry's at its `offset`; or every
// entry is read in place (kPushMapped on every entry, `slot` kNoSlot, `tag`
// 0, offsets 0). The server takes each entry as the PushMeta it stands for
// (same tag, pull_tag, flags and lr, the batch's slot and epoch); the slot
// is free again once every entry let go of it.
inline constexpr size_t kMaxBatchEntries = 128;  // 42 bytes each: fits kMaxMessageBytes

struct BatchEntry {
  uint32_t tag = 0;
  uint32_t pull_tag = 0;
  DType dtype = DType::kFloat32;
  uint8_t flags = 0;
  Key key = 0;
  uint64_t round = 0;
  uint32_t bytes = 0;
  uint32_t offset = 0;  // in the slot
  double lr = 0;
};

struct PushBatch {
  uint32_t tag = 0;  // the write's notify value; 0 in place
  uint32_t slot = kNoSlot;
  uint64_t epoch = 0;  // the worker's placement epoch
  std::vector<BatchEntry> entries;
};

// The PushMeta that entry `i` of `batch` stands for.
PushMeta entry_meta(const PushBatch& batch, size_t i);

struct PullRequest {
  uint32_t tag = 0;
  DType dtype = DType::kFloat32;
  uint64_t bytes = 0;  // of this chunk
  Key key = 0;
  uint64_t round = 0;
  uint64_t epoch = 0;
};

struct Credit {
  std::vector<uint32_t> slots;
  // Tags of plain pushes the server took (reduced, or kept for a later
  // round): a plain push completes then, not when its write left, so that a
  // push the server answers Moved can still be sent again from the tensor.
  std::vector<uint32_t> accepted;
};

struct Moved {
  uint32_t tag = 0;
  Key key = 0;
  uint64_t epoch = 0;  // the server's epoch, in which it does not own key
};

struct Error {
  uint32_t tag = 0;  // 0: not about one request
  uint64_t request = 0;
  uint8_t code = 0;  // a StatusCode
  std::string message;
};

// Confirms a request that has no other answer (TensorKey).
// Ack of a TensorKey: the server maps the tensor's memory (shared memory on
// one host) and takes push_pulls of it in place (kPushMapped).
inline constexpr uint8_t kAckMapped = 1;

struct Ack {
  uint64_t request = 0;
  uint8_t flags = 0;
};
// A placement epoch switch (docs/design.md §7). Rounds >= switch_round of every
// key are served under epoch `epoch` (the previous epoch with `delta`
// applied), earlier rounds under the epochs before. `prepare` goes to the
// servers, which from then on refuse rounds >= switch_round of keys they
// lose and vote; `commit` goes to everyone once every server voted yes.
//
// `abort` is committed without a vote, servers first: server `lost_server`,
// which never owned keys outside a transfer that is not final, died; this
// epoch (same switch_round as the newest) gives every range it was gaining
// back to the owner it had before that transfer and removes it.
// Nothing moves between live servers, so no server can have taken a round
// this epoch takes away. Every member drops its connections to the lost
// server for good; workers send what it never answered to the owners again.
//
// `failover` (replication.factor 2) is committed like an abort, servers
// first: server `lost_server` died, and this epoch gives every range it owned
// to its backup, which holds the state of its last durable round
// (docs/replication.md). It takes the place of the epochs before it for
// every round (same switch_round). Workers send what the lost server never
// answered to the new owners, which take a round they already applied as
// answered.
inline constexpr size_t kMaxDeltaBytes = 7168;
//
// `cancel` goes to the servers only: the prepare of `epoch` is withdrawn
// (replication.factor 2: server `lost_server` died while the switch was
// voted on). Nothing moved, and no worker knew of it; each server drops
// the prepared epoch and serves as before, and the failover epoch that
// follows at once takes the number the cancelled one had.
enum class EpochStep : uint8_t {
  kPrepare = 0,
  kCommit = 1,
  kAbort = 2,
  kFailover = 3,
  kCancel = 4
};
std::string_view epoch_step_name(EpochStep step);
struct EpochChange {
  EpochStep step = EpochStep::kPrepare;
  uint64_t epoch = 0;
  uint64_t switch_round = 0;
  std::vector<uint8_t> delta;  // PlacementDelta::serialize()
  uint32_t lost_server = 0;    // abort only
};
// A server's answer to a prepare: no when it already took a round >=
// switch_round of a key it would lose; max_round is the highest round it has
// seen of any key, so the next try can switch later.
struct EpochVote {
  uint64_t epoch = 0;
  uint64_t switch_round = 0;
  bool yes = false;
  uint64_t max_round = 0;
};
// A key's new owner asks its previous owner for the key's state as of round
// switch_round - 1 (a 16-byte header {u64 version, u64 0}, then parameter and
// the optimizer's two moments in fp32), to be written into `region` with
// notify = tag.
struct StateRequest {
  uint32_t tag = 0;
  Key key = 0;
  uint64_t switch_round = 0;
  DType dtype = DType::kFloat32;
  uint64_t bytes = 0;  // of the chunk, in dtype
  std::vector<uint8_t> region;
};

// An old owner tells a key's new owner that the key reached the switch
// (round switch_round - 1 is applied) and nobody asked for its state yet:
// the new owner answers with a StateRequest as if a request of the key had
// arrived. Without it a key that no worker touches after the switch (or one
// a worker touches only after another gated key moved on) would never ship,
// and the transfer would never end.
struct StateOffer {
  Key key = 0;
  uint64_t switch_round = 0;
  DType dtype = DType::kFloat32;
  uint64_t bytes = 0;  // of the chunk, in dtype
};
// An old owner to the coordinator: every key it holds that leaves it at
// switch_round has been shipped (the one-sided write completed), or, with
// late_keys > 0, the switch arrived here two heartbeat timeouts ago and that
// many keys have not reached it yet: they ship when they do. The coordinator
// waits for these only where the transfer can be aborted.
struct TransferDone {
  uint64_t epoch = 0;
  uint64_t switch_round = 0;
  uint64_t late_keys = 0;
};
// The coordinator to every server: every old owner reported TransferDone for
// the transfer at switch_round, in which a server that had never owned keys
// gained some. That server held their rounds >= switch_round (no update, no
// pull answered, no plain push accepted) so that the transfer could still be
// aborted; from now on it serves them, and its death fails the job.
struct EpochFinal {
  uint64_t epoch = 0;
  uint64_t switch_round = 0;
};

// Rounds per tensor, as ranges of tensor ids: an entry covers the tensors
// from first_tensor up to the next entry's first_tensor - 1, the last one up
// to the message's `tensors`. At most kMaxRoundRanges entries (3 KiB).
struct TensorRounds {
  uint32_t first_tensor = 1;
  uint64_t round = 0;
};
inline constexpr size_t kMaxRoundRanges = 256;
// A worker's promise, sent with its load reports: it will never again send
// a request (push or pull) naming a round of tensor t below the round `low`
// gives t. That is the lower of the tensor's current round (the one a pull
// names; a push names the next) and the rounds of its operations not
// completed yet, so it never goes down; 0 for a tensor it has not
// registered. `tensors`: the highest tensor id it registered.
struct WorkerProgress {
  uint32_t tensors = 0;
  std::vector<TensorRounds> low;
};
// The coordinator to every server: no worker will send a request naming a
// round of tensor t (<= tensors) below the round `low` gives t, and no
// switch at or below that round can be undone any more (none is being
// voted on, no transfer that an abort could give back is open). A run of
// ownership of a key of t that ended at such a switch round and shipped its
// state is needed by nobody: the server frees it (docs/migration.md,
// "Freeing old runs").
struct LowWatermark {
  uint32_t tensors = 0;
  std::vector<TensorRounds> low;
};

// Checkpoints (docs/checkpoint.md). The coordinator to every server, once
// every worker went past `round` of every tensor (so every key applied it):
// finish the file of that round (each server wrote its keys' states into it
// as it applied the round) and report it.
struct CheckpointSeal {
  uint64_t round = 0;
};
// A server's answer: its file of `round` is complete on disk (renamed into
// place), with this size, record count and BLAKE2b; or `error` says why it
// could not be written (the checkpoint is then skipped, the job goes on).
struct CheckpointSealed {
  uint64_t round = 0;
  uint64_t bytes = 0;
  uint64_t records = 0;
  std::string blake2b;  // 64 hex digits
  std::string error;
};

// The coordinator to every admitted member while the job has not started,
// whenever who has joined changed (at most every half heartbeat interval):
// how many workers and servers (standby included) joined, and the lowest
// ranks still missing, so that a member that gives up waiting can say whom
// it waited for.
inline constexpr size_t kMaxMissingListed = 16;
struct JoinWaiting {
  uint32_t workers_joined = 0;
  uint32_t servers_joined = 0;
  std::vector<uint32_t> missing_workers;  // ascending, at most kMaxMissingListed
  std::vector<uint32_t> missing_servers;
  bool operator==(const JoinWaiting&) const = default;
};

// Replication (docs/replication.md). A primary asks its backup for a key's
// replica slots: two regions of kStateHeader + 3 * elements * 4 bytes each
// (the layout a StateRequest's write has, with only `arrays` of the three
// arrays), written in turn, so that a write
// torn by the primary's death never touches the last complete copy.
struct ReplicaOpen {
  uint32_t tag = 0;  // the primary's, even, echoed in ReplicaGrant; slot s's writes notify tag + s
  Key key = 0;
  DType dtype = DType::kFloat32;
  uint64_t bytes = 0;  // of the chunk, in dtype
  uint8_t arrays = 1;  // fp32 arrays per copy, 1 to 3: the parameter and the moments kept
};
struct ReplicaGrant {
  uint32_t tag = 0;
  Key key = 0;
  std::vector<uint8_t> region;  // remote key of both slots, back to back
};
// The backup has the copy the write with notify `tag` + slot carried: the
// key's state as of `version` is durable.
struct ReplicaAck {
  uint32_t tag = 0;
  uint64_t version = 0;
};
// Every key this server holds has a copy at its backup in `epoch`: its loss
// loses nothing.
struct ReplicaSynced {
  uint64_t epoch = 0;
};

using Message =
    std::variant<Challenge, Hello, Welcome, Reject, ServerList, PlacementChunk, RegisterTensor,
                 TensorInfo, BarrierEnter, BarrierRelease, Heartbeat, JobFailed, Shutdown,
                 LoadReport, PeerHello, Grant, TensorKey, PushMeta, PullRequest, Credit, Moved,
                 Error, Ack, EpochChange, EpochVote, StateRequest, StateOffer, TransferDone,
                 EpochFinal, WorkerProgress, LowWatermark, PeerProof, CheckpointSeal,
                 CheckpointSealed, JoinWaiting, ReplicaOpen, ReplicaGrant, ReplicaAck,
                 ReplicaSynced, PushBatch, AnswerSlots>;

// Rounds of tensors 1..n (by_tensor[t - 1]) as at most kMaxRoundRanges
// ranges: exact where neighbours share a round or there are few tensors,
// else each range takes the lowest round of the tensors it covers.
std::vector<TensorRounds> pack_rounds(std::span<const uint64_t> by_tensor);
// The round `ranges` (of a message covering tensors 1..tensors) gives
// tensor t; 0 for a tensor it does not cover.
uint64_t round_of(std::span<const TensorRounds> ranges, uint32_t tensors, TensorId t);

std::vector<uint8_t> encode(const Message& message);
// As encode(), into `out`, whose capacity is kept: no allocation once it has
// grown to the messages a sender sends.
void encode_to(const Message& message, std::vector<uint8_t>& out);
// DataLoss with what was wrong for anything malformed.
Result<Message> decode(std::span<const uint8_t> bytes);

// The name of a message's type, for logs and errors.
std::string_view message_name(const Message& message);

// Whom a job that has not started waits for, of num_workers workers and
// num_servers servers (standby included): "workers 2 and 3 and server 1
// (2 of 4 workers and 2 of 3 servers joined)"; "" when nobody is missing.
std::string waiting_for(const JoinWaiting& w, uint32_t num_workers, uint32_t num_servers);

// The proofs of the two handshakes (auth.h). Each binds both nonces and the
// message it travels in (its encoding with the proof zeroed): a member's
// role, rank and address, the coordinator's Welcome, a peer's role and rank,
// a server's grant with its slot key.
//   member:  Challenge(c) -> Hello(n, hello_proof) -> Welcome(welcome_proof)
//   data:    PeerHello(n) -> Challenge(c) -> PeerProof(peer_proof) -> Grant(grant_proof)
Proof hello_proof(const std::string& secret, const Nonce& challenge, const Hello& hello);
Proof welcome_proof(const std::string& secret, const Nonce& challenge, const Hello& hello,
                    const Welcome& welcome);
Proof peer_proof(const std::string& secret, const Nonce& challenge, const PeerHello& hello);
Proof grant_proof(const std::string& secret, const Nonce& challenge, const PeerHello& hello,
                  const Grant& grant);

// The dialing end of the data handshake, for one connection.
struct PeerDial {
  PeerHello hello;  // sent first; its nonce is fresh
  std::optional<Nonce> challenge;

  PeerDial(Role role, uint32_t rank);
  // The PeerProof that answers c; nullopt if a challenge was answered already.
  std::optional<PeerProof> answer(const std::string& secret, const Challenge& c);
  // Whether g proves that the server knows the secret and answers our hello.
  bool proves(const std::string& secret, const Grant& g) const;
};

}  // namespace psld::protocol
