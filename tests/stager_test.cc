// The Stager (transports/stager.h) against a fake copy engine whose copies
// finish only when the test says so, and a transfer whose completions the
// test holds: the chunking, the order of both stages, the overlap of a copy
// with the previous chunk's transfer, the bound on buffers and the error
// paths are all checked without a GPU. The last test runs the CUDA engine on
// a real device and skips with "no CUDA device" elsewhere.
#include "transports/stager.h"

#include <gtest/gtest.h>

#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "gpu/cuda_copy_engine.h"
#include "kernels/cuda/cuda_kernels.h"

namespace psld::transport {
namespace {

// Copies run when released (or at once with auto_complete); every call is
// logged as "copy L" / "done L" per lane.
class FakeCopyEngine : public CopyEngine {
 public:
  explicit FakeCopyEngine(size_t lanes) : pending_(lanes) {}
  size_t lanes() const override { return pending_.size(); }
  Result<void*> allocate_host(size_t bytes) override {
    ++allocations;
    host_bytes = bytes;
    return static_cast<void*>(new uint8_t[bytes]);
  }
  void free_host(void* p) override {
    ++frees;
    delete[] static_cast<uint8_t*>(p);
  }
  Status copy_async(void* dst, const void* src, size_t bytes, size_t lane) override {
    if (fail_copy_at >= 0 && copies_issued == static_cast<size_t>(fail_copy_at)) {
      return Unavailable("injected copy failure");
    }
    EXPECT_TRUE(pending_.at(lane).empty()) << "two copies queued on one lane";
    pending_.at(lane).push_back({dst, src, bytes});
    ++copies_issued;
    log.push_back("copy " + std::to_string(lane));
    return Status::Ok();
  }
  Result<bool> lane_idle(size_t lane) override {
    if (fail_idle_lane == static_cast<int>(lane) && !pending_[lane].empty()) {
      pending_[lane].clear();
      return Unavailable("injected fault on the stream");
    }
    if (auto_complete) complete(lane);
    return pending_[lane].empty();
  }
  // Runs the copy queued on `lane`.
  void complete(size_t lane) {
    for (const Copy& c : pending_[lane]) {
      std::memcpy(c.dst, c.src, c.bytes);
      log.push_back("done " + std::to_string(lane));
    }
    pending_[lane].clear();
  }
  bool busy(size_t lane) const { return !pending_[lane].empty(); }

  bool auto_complete = false;
  int fail_copy_at = -1;
  int fail_idle_lane = -1;
  size_t copies_issued = 0;
  size_t allocations = 0, frees = 0, host_bytes = 0;
  std::vector<std::string> log;

 private:
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
  };
  std::vector<std::vector<Copy>> pending_;
};

// The network side: records each chunk, holds its completion until the test
// releases it, and (for sends) keeps what the chunk held when it was sent.
struct FakeNetwork {
  struct Pending {
    StagedChunk chunk;
    Completion done;
  };
  ChunkTransfer transfer(FakeCopyEngine* engine, bool receive,
                         const std::vector<uint8_t>* source = nullptr) {
    return [this, engine, receive, source](const StagedChunk& c, Completion done) -> Status {
      if (fail_at >= 0 && started == static_cast<size_t>(fail_at)) {
        ++started;
        return Unavailable("injected transfer failure");
      }
      ++started;
      if (engine != nullptr) {
        EXPECT_FALSE(engine->busy(c.buffer)) << "transfer of a buffer a copy is still using";
        engine->log.push_back("xfer " + std::to_string(c.index));
      }
      if (receive) {
        std::memcpy(c.host.data(), source->data() + c.offset, c.host.size());
      } else {
        sent.resize(std::max<size_t>(sent.size(), c.offset + c.host.size()));
        std::memcpy(sent.data() + c.offset, c.host.data(), c.host.size());
      }
      chunks.push_back(c);
      if (auto_complete) {
        done(Status::Ok());
      } else {
        pending.push_back({c, std::move(done)});
      }
      return Status::Ok();
    };
  }
  void complete_oldest(Status s = Status::Ok()) {
    ASSERT_FALSE(pending.empty());
    Pending p = std::move(pending.front());
    pending.pop_front();
    p.done(std::move(s));
  }

  bool auto_complete = false;
  int fail_at = -1;
  size_t started = 0;
  std::vector<StagedChunk> chunks;
  std::deque<Pending> pending;
  std::vector<uint8_t> sent;
};

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = static_cast<uint8_t>(i * 31 + seed + (i >> 8));
  return v;
}

TEST(Stager, RejectsBadOptions) {
  FakeCopyEngine engine(2);
  EXPECT_EQ(Stager::create(engine, {0, 2}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Stager::create(engine, {64, 0}).status().code(), StatusCode::kInvalidArgument);
  auto r = Stager::create(engine, {64, 3});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << "3 buffers need 3 lanes";
  EXPECT_EQ(engine.allocations, 0u);
}

TEST(Stager, BounceMemoryIsBuffersTimesChunkAndFreedOnce) {
  FakeCopyEngine engine(4);
  {
    auto s = Stager::create(engine, {1000, 3});
    ASSERT_TRUE(s.ok());
    EXPECT_EQ((*s)->host_buffer().size(), 3000u);
    EXPECT_EQ(engine.host_bytes, 3000u);
  }
  EXPECT_EQ(engine.allocations, 1u);
  EXPECT_EQ(engine.frees, 1u);
}

TEST(Stager, SendOverlapsTheNextCopyWithTheCurrentTransferAndReusesBuffersOnlyWhenFree) {
  FakeCopyEngine engine(2);
  auto stager = Stager::create(engine, {100, 2});
  ASSERT_TRUE(stager.ok());
  Stager& s = **stager;
  const std::vector<uint8_t> device = pattern(350, 1);  // 4 chunks, the last 50 bytes
  FakeNetwork net;
  ASSERT_TRUE(s.start_send(device.data(), device.size(), net.transfer(&engine, false)).ok());
  EXPECT_EQ(s.start_send(device.data(), 1, net.transfer(&engine, false)).code(),
            StatusCode::kFailedPrecondition);

  // Both buffers fill at once; nothing goes out before its copy is done.
  EXPECT_EQ(*s.poll(), false);
  EXPECT_EQ(engine.log, (std::vector<std::string>{"copy 0", "copy 1"}));
  EXPECT_TRUE(net.chunks.empty());

  // Chunk 1's copy finishing first does not let it overtake chunk 0.
  engine.complete(1);
  EXPECT_EQ(*s.poll(), false);
  EXPECT_TRUE(net.chunks.empty()) << "transfers leave in chunk order";

  engine.complete(0);
  EXPECT_EQ(*s.poll(), false);
  ASSERT_EQ(net.chunks.size(), 2u);
  EXPECT_EQ(net.chunks[0].index, 0u);
  EXPECT_EQ(net.chunks[1].index, 1u);
  // Chunk 2 needs buffer 0, which chunk 0's transfer still uses.
  EXPECT_EQ(engine.copies_issued, 2u);

  net.complete_oldest();  // chunk 0 left buffer 0
  EXPECT_EQ(*s.poll(), false);
  EXPECT_EQ(engine.copies_issued, 3u);
  // The overlap: chunk 2's copy runs while chunk 1 is on the wire.
  EXPECT_TRUE(engine.busy(0));
  EXPECT_EQ(net.pending.size(), 1u);
  EXPECT_EQ(net.pending.front().chunk.index, 1u);

  engine.complete(0);
  EXPECT_EQ(*s.poll(), false);
  EXPECT_EQ(net.chunks.size(), 3u);
  net.complete_oldest();  // chunk 1
  EXPECT_EQ(*s.poll(), false);
  engine.complete(1);
  EXPECT_EQ(*s.poll(), false);
  ASSERT_EQ(net.chunks.size(), 4u);
  EXPECT_EQ(net.chunks[3].host.size(), 50u) << "the last chunk is the remainder";
  EXPECT_EQ(net.chunks[3].buffer, 1u);
  EXPECT_EQ(net.chunks[3].buffer_offset, 100u);
  net.complete_oldest();
  EXPECT_EQ(*s.poll(), false);
  net.complete_oldest();
  EXPECT_EQ(*s.poll(), true);
  EXPECT_FALSE(s.busy());
  EXPECT_EQ(net.sent, device);
  EXPECT_EQ(engine.log,
            (std::vector<std::string>{"copy 0", "copy 1", "done 1", "done 0", "xfer 0", "xfer 1",
                                      "copy 0", "done 0", "xfer 2", "copy 1", "done 1", "xfer 3"}));
}

TEST(Stager, ReceiveCopiesEachFilledChunkToTheDeviceInOrder) {
  FakeCopyEngine engine(3);
  auto stager = Stager::create(engine, {64, 3});
  ASSERT_TRUE(stager.ok());
  const std::vector<uint8_t> wire = pattern(64 * 7 + 5, 9);
  std::vector<uint8_t> device(wire.size(), 0);
  FakeNetwork net;
  ASSERT_TRUE((*stager)
                  ->start_receive(device.data(), device.size(), net.transfer(&engine, true, &wire))
                  .ok());
  EXPECT_EQ(*(*stager)->poll(), false);
  EXPECT_EQ(net.chunks.size(), 3u) << "three buffers: three receives in flight, no more";
  // The third chunk arrives first; it is copied out only after the first two.
  std::swap(net.pending[0], net.pending[2]);
  net.complete_oldest();
  EXPECT_EQ(*(*stager)->poll(), false);
  EXPECT_EQ(engine.copies_issued, 0u);
  net.complete_oldest();
  net.complete_oldest();
  EXPECT_EQ(*(*stager)->poll(), false);
  EXPECT_EQ(engine.copies_issued, 3u);
  // From here on everything completes as soon as it is asked.
  engine.auto_complete = true;
  net.auto_complete = true;
  ASSERT_TRUE((*stager)->drain([] {}).ok());
  EXPECT_EQ(device, wire);
  EXPECT_EQ(net.chunks.size(), 8u);
  for (size_t i = 0; i < net.chunks.size(); ++i) {
    EXPECT_EQ(net.chunks[i].index, i);
    EXPECT_EQ(net.chunks[i].buffer, i % 3);
  }
}

TEST(Stager, EmptyRangeFinishesAtOnceAndTheStagerIsReusable) {
  FakeCopyEngine engine(2);
  engine.auto_complete = true;
  auto stager = Stager::create(engine, {16, 2});
  ASSERT_TRUE(stager.ok());
  FakeNetwork net;
  net.auto_complete = true;
  ASSERT_TRUE((*stager)->start_send(nullptr, 0, net.transfer(nullptr, false)).ok());
  EXPECT_EQ(*(*stager)->poll(), true);
  EXPECT_TRUE(net.chunks.empty());
  const std::vector<uint8_t> device = pattern(40, 3);
  ASSERT_TRUE(
      (*stager)->start_send(device.data(), device.size(), net.transfer(nullptr, false)).ok());
  ASSERT_TRUE((*stager)->drain([] {}).ok());
  EXPECT_EQ(net.sent, device);
}

TEST(Stager, AFailedTransferStopsNewWorkAndIsReportedOnceTheRestDrained) {
  FakeCopyEngine engine(2);
  engine.auto_complete = true;
  auto stager = Stager::create(engine, {10, 2});
  ASSERT_TRUE(stager.ok());
  const std::vector<uint8_t> device = pattern(100, 5);
  FakeNetwork net;
  ASSERT_TRUE(
      (*stager)->start_send(device.data(), device.size(), net.transfer(&engine, false)).ok());
  EXPECT_EQ(*(*stager)->poll(), false);
  ASSERT_EQ(net.pending.size(), 2u);
  net.complete_oldest(Unavailable("peer went away"));
  // Chunk 1 is still on the wire: its buffer may not be released yet.
  EXPECT_EQ(*(*stager)->poll(), false);
  EXPECT_TRUE((*stager)->busy());
  const size_t copies = engine.copies_issued;
  net.complete_oldest();
  Result<bool> r = (*stager)->poll();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("peer went away"), std::string::npos);
  EXPECT_NE(r.status().message().find("chunk 0"), std::string::npos) << r.status().message();
  EXPECT_EQ(engine.copies_issued, copies) << "no new copy after the failure";
  EXPECT_FALSE((*stager)->busy());
}

TEST(Stager, ATransferRefusedAtOnceOrAFailedCopyIsAnError) {
  FakeCopyEngine engine(2);
  engine.auto_complete = true;
  auto stager = Stager::create(engine, {10, 2});
  ASSERT_TRUE(stager.ok());
  const std::vector<uint8_t> device = pattern(60, 2);
  {
    FakeNetwork net;
    net.auto_complete = true;
    net.fail_at = 2;
    ASSERT_TRUE(
        (*stager)->start_send(device.data(), device.size(), net.transfer(nullptr, false)).ok());
    Status s = (*stager)->drain([] {});
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
    EXPECT_NE(s.message().find("chunk 2"), std::string::npos) << s.message();
  }
  {
    FakeNetwork net;
    net.auto_complete = true;
    engine.fail_copy_at = static_cast<int>(engine.copies_issued) + 1;
    ASSERT_TRUE(
        (*stager)->start_send(device.data(), device.size(), net.transfer(nullptr, false)).ok());
    Status s = (*stager)->drain([] {});
    EXPECT_NE(s.message().find("injected copy failure"), std::string::npos) << s.to_string();
    engine.fail_copy_at = -1;
  }
  {
    FakeNetwork net;
    net.auto_complete = true;
    engine.auto_complete = false;
    engine.fail_idle_lane = 1;
    std::vector<uint8_t> out(60);
    ASSERT_TRUE((*stager)
                    ->start_receive(out.data(), out.size(), net.transfer(nullptr, true, &device))
                    .ok());
    Status s = (*stager)->drain([&] { engine.complete(0); });
    EXPECT_NE(s.message().find("injected fault on the stream"), std::string::npos) << s.to_string();
  }
}

// On a GPU: a device range out through the stager and back in, through the
// CUDA engine (streams, pinned memory, cudaMemcpyAsync).
TEST(StagerCuda, DeviceRangeRoundTripsThroughPinnedBuffers) {
  Result<std::unique_ptr<CopyEngine>> engine = create_cuda_copy_engine(2);
  if (!engine.ok()) GTEST_SKIP() << engine.status().message();  // "no CUDA device: ..."
  const kernels::KernelStatus device_ok = kernels::cuda::device_status();
  if (!device_ok.ok()) GTEST_SKIP() << "no CUDA device: " << device_ok.message;
  constexpr size_t kBytes = (size_t{20} << 20) + 333;
  const std::vector<uint8_t> data = pattern(kBytes, 4);
  void* dev = nullptr;
  ASSERT_TRUE(kernels::cuda::device_alloc(kBytes, &dev).ok());
  ASSERT_TRUE(kernels::cuda::copy(dev, data.data(), kBytes).ok());
  auto stager = Stager::create(**engine, {size_t{4} << 20, 2});
  ASSERT_TRUE(stager.ok()) << stager.status().to_string();
  FakeNetwork out;
  out.auto_complete = true;
  ASSERT_TRUE((*stager)->start_send(dev, kBytes, out.transfer(nullptr, false)).ok());
  ASSERT_TRUE((*stager)->drain([] {}).ok());
  EXPECT_TRUE(out.sent == data) << "device -> host staging changed the bytes";

  const std::vector<uint8_t> incoming = pattern(kBytes, 77);
  FakeNetwork in;
  in.auto_complete = true;
  ASSERT_TRUE((*stager)->start_receive(dev, kBytes, in.transfer(nullptr, true, &incoming)).ok());
  ASSERT_TRUE((*stager)->drain([] {}).ok());
  std::vector<uint8_t> back(kBytes);
  ASSERT_TRUE(kernels::cuda::copy(back.data(), dev, kBytes).ok());
  EXPECT_TRUE(back == incoming) << "host -> device staging changed the bytes";
  stager->reset();
  EXPECT_TRUE(kernels::cuda::device_free(dev).ok());
}

}  // namespace
}  // namespace psld::transport
