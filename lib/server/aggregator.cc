// lib/server/aggregator.cc — see aggregator.h.
#include "lib/server/aggregator.h"

#include <bit>
#include <cstring>

namespace psld {

namespace kn = psld::kernels;

Status ComputeLane::ensure(Array<float>& a, size_t n) const {
  if (a) return Status::Ok();
  PSLD_ASSIGN_OR_RETURN(a, make_array<float>(n));
  return Status::Ok();
}

Status ComputeLane::copy(void* dst, const void* src, size_t bytes) const {
  if (device_ != nullptr) return device_->copy(dst, src, bytes, lane_);
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

Result<const void*> ComputeLane::stage(const void* host, size_t bytes) {
  if (device_ == nullptr) return host;
  if (stage_bytes_ < bytes) {
    PSLD_RETURN_IF_ERROR(device_->synchronize(lane_));  // nothing reads the old one any more
    stage_.reset();
    stage_bytes_ = 0;
    PSLD_ASSIGN_OR_RETURN(stage_, make_array<uint8_t>(bytes));
    stage_bytes_ = bytes;
  }
  PSLD_RETURN_IF_ERROR(device_->copy(stage_.get(), host, bytes, lane_));
  return static_cast<const void*>(stage_.get());
}

Aggregator::Aggregator(const AggregatorOptions& options, DType dtype, uint64_t bytes)
    : options_(options),
      dtype_(dtype),
      bytes_(bytes),
      elements_(bytes / protocol::dtype_bytes(dtype)),
      pushed_(options.num_workers, false),
      last_round_(options.num_workers, 0),
      applied_(options.num_workers, 0),
      seen_(options.num_workers) {}

Status Aggregator::allocate(const ComputeLane& lane) {
  PSLD_ASSIGN_OR_RETURN(param_, lane.make_array<float>(elements_));
  PSLD_ASSIGN_OR_RETURN(acc_, lane.make_array<float>(elements_));
  if (dtype_ != DType::kFloat32) {
    PSLD_ASSIGN_OR_RETURN(out16_, lane.make_array<uint16_t>(elements_));
  }
  if (ServerDevice* dev = lane.device(); dev != nullptr) {
    PSLD_ASSIGN_OR_RETURN(void* out, dev->allocate_host(bytes_));
    std::memset(out, 0, bytes_);
    out_host_ = HostBuffer(static_cast<uint8_t*>(out), HostFree{dev});
  }
  return Status::Ok();
}

void* Aggregator::output() const {
  if (out_host_) return out_host_.get();
  if (dtype_ == DType::kFloat32) return param_.get();
  return out16_.get();
}

Aggregator::Admission Aggregator::admit(uint32_t worker, uint64_t round) const {
  if (round <= version_) return Admission::kApplied;
  if (round > version_ + 1) return Admission::kLater;
  if (pushed_[worker]) return Admission::kTwice;
  return Admission::kNow;
}

Status Aggregator::accumulate(ComputeLane& lane, const void* host) {
  PSLD_ASSIGN_OR_RETURN(const void* src, lane.stage(host, bytes_));
  const bool first = pushes_ == 0;
  float* acc = acc_.get();
  const size_t n = elements_;
  Status st;
  switch (dtype_) {
    case DType::kFloat32: {
      const auto* x = static_cast<const float*>(src);
      st = first ? lane.copy(acc, x, bytes_) : lane.run([=](MemoryKind where, void* stream) {
        return kn::reduce_f32(where, acc, x, n, stream);
      });
      break;
    }
    case DType::kFloat16: {
      const auto* x = static_cast<const uint16_t*>(src);
      st = lane.run([=](MemoryKind where, void* stream) {
        return first ? kn::f16_to_f32(where, acc, x, n, stream)
                     : kn::reduce_f16(where, acc, x, n, stream);
      });
      break;
    }
    case DType::kBFloat16: {
      const auto* x = static_cast<const uint16_t*>(src);
      st = lane.run([=](MemoryKind where, void* stream) {
        return first ? kn::bf16_to_f32(where, acc, x, n, stream)
                     : kn::reduce_bf16(where, acc, x, n, stream);
      });
      break;
    }
  }
  if (st.ok()) st = lane.finish();
  PSLD_RETURN_IF_ERROR(st.with_context("reducing a push"));
  ++pushes_;
  return Status::Ok();
}

Status Aggregator::reduce(ComputeLane& lane, uint32_t worker, uint64_t round, const void* src,
                          double lr) {
  if (options_.sync == SyncMode::kBsp) {
    if (pushes_ == 0 || worker < round_lr_worker_) {
      round_lr_ = lr;
      round_lr_worker_ = worker;
    }
    PSLD_RETURN_IF_ERROR(accumulate(lane, src));
    pushed_[worker] = true;
    return Status::Ok();
  }
  // Async and bounded staleness: every push is an update of its own.
  round_lr_ = lr;
  pushes_ = 0;
  PSLD_RETURN_IF_ERROR(accumulate(lane, src));
  last_round_[worker] = std::max(last_round_[worker], round);
  ++applied_[worker];
  mark_seen(worker, round);
  return Status::Ok();
}

void Aggregator::mark_seen(uint32_t worker, uint64_t round) {
  Seen& s = seen_[worker];
  if (round <= s.low) return;
  uint64_t gap = round - s.low - 1;  // the bit of `round`
  if (gap >= 64) {
    // Further ahead than the window: it moves on (see applied()).
    const uint64_t shift = gap - 63;
    s.ahead = shift >= 64 ? 0 : s.ahead >> shift;
    s.low += shift;
    gap = 63;
  }
  s.ahead |= uint64_t{1} << gap;
  // Every round just above low is in: low moves up past them.
  while (s.ahead & 1) {
    s.ahead >>= 1;
    ++s.low;
  }
}

bool Aggregator::applied(uint32_t worker, uint64_t round) const {
  if (worker >= seen_.size()) return false;
  const Seen& s = seen_[worker];
  if (round <= s.low) return true;
  const uint64_t gap = round - s.low - 1;
  return gap < 64 && ((s.ahead >> gap) & 1) != 0;
}

void Aggregator::save_seen(uint8_t* out) const {
  if (seen_bytes() == 0) return;  // BSP
  for (const Seen& s : seen_) {
    const uint64_t words[2] = {s.low, s.ahead};
    std::memcpy(out, words, sizeof(words));
    out += sizeof(words);
  }
}

void Aggregator::restore_seen(const uint8_t* in) {
  if (seen_bytes() == 0) return;  // BSP
  for (size_t w = 0; w < seen_.size(); ++w) {
    uint64_t words[2];
    std::memcpy(words, in, sizeof(words));
    in += sizeof(words);
    seen_[w] = Seen{words[0], words[1]};
    // The newest round in (the highest bit set is round low + bit_width):
    // what bounded staleness waits on.
    last_round_[w] = words[0] + static_cast<uint64_t>(std::bit_width(words[1]));
  }
}

Status Aggregator::set_initial(ComputeLane& lane, const void* src) {
  pushes_ = 0;
  Status st = accumulate(lane, src);
  if (st.ok()) st = lane.copy(param_.get(), acc_.get(), elements_ * sizeof(float));
  if (st.ok()) st = publish(lane);
  pushes_ = 0;
  return st;
}

Status Aggregator::publish(ComputeLane& lane) {
  const float* param = param_.get();
  uint16_t* out16 = out16_.get();
  const size_t n = elements_;
  if (dtype_ == DType::kFloat16) {
    PSLD_RETURN_IF_ERROR(lane.run([=](MemoryKind where, void* stream) {
      return kn::f32_to_f16(where, out16, param, n, stream);
    }));
  }
  if (dtype_ == DType::kBFloat16) {
    PSLD_RETURN_IF_ERROR(lane.run([=](MemoryKind where, void* stream) {
      return kn::f32_to_bf16(where, out16, param, n, stream);
    }));
  }
  if (!out_host_) return Status::Ok();
  const void* out = dtype_ == DType::kFloat32 ? static_cast<const void*>(param) : out16;
  PSLD_RETURN_IF_ERROR(lane.copy(out_host_.get(), out, bytes_));
  return lane.finish();
}

Status Aggregator::apply(ComputeLane& lane) {
  const bool bsp = options_.sync == SyncMode::kBsp;
  float* param = param_.get();
  const float* acc = acc_.get();
  const size_t n = elements_;
  Status st;
  if (options_.mode == ServerMode::kSum) {
    if (bsp) {
      // The round's sum. The service applies only once no pull write reads
      // the parameter, and the next round's first push overwrites acc whole.
      if (swap_) {
        std::swap(param_, acc_);
      } else {
        st = lane.copy(param, acc, n * sizeof(float));
      }
    } else {
      st = lane.run([=](MemoryKind where, void* stream) {
        return kn::reduce_f32(where, param, acc, n, stream);  // the running total
      });
    }
  } else {
    const OptimizerOptions& o = options_.optimizer;
    const float lr = static_cast<float>(round_lr_ > 0 ? round_lr_ : o.lr);
    switch (o.kind) {
      case OptimizerKind::kSgd: {
        const kn::SgdParams p{lr, o.weight_decay};
        st = lane.run([=](MemoryKind where, void* stream) {
          return kn::sgd_f32(where, param, acc, n, p, stream);
        });
        break;
      }
      case OptimizerKind::kMomentum: {
        st = lane.ensure(first_moment_, n);
        if (!st.ok()) break;
        float* m = first_moment_.get();
        const kn::MomentumParams p{lr,         o.momentum,   o.dampening, o.weight_decay,
                                   o.nesterov, version_ == 0};
        st = lane.run([=](MemoryKind where, void* stream) {
          return kn::momentum_f32(where, param, m, acc, n, p, stream);
        });
        break;
      }
      case OptimizerKind::kAdam:
      case OptimizerKind::kAdamW: {
        st = lane.ensure(first_moment_, n);
        if (st.ok()) st = lane.ensure(second_moment_, n);
        if (!st.ok()) break;
        float* m = first_moment_.get();
        float* v = second_moment_.get();
        const kn::AdamParams p{lr,          o.beta1,        o.beta2,
                               o.eps,       o.weight_decay, o.kind == OptimizerKind::kAdamW,
                               version_ + 1};
        st = lane.run([=](MemoryKind where, void* stream) {
          return kn::adam_f32(where, param, m, v, acc, n, p, stream);
        });
        break;
      }
    }
  }
  if (st.ok()) st = publish(lane);
  PSLD_RETURN_IF_ERROR(st);
  ++version_;
  pushes_ = 0;
  std::fill(pushed_.begin(), pushed_.end(), false);
  return Status::Ok();
}

bool Aggregator::pull_ready(uint64_t round) const {
  switch (options_.sync) {
    case SyncMode::kBsp:
      return version_ >= round;
    case SyncMode::kAsync:
      return true;
    case SyncMode::kStaleness: {
      // Every worker's pushes up to round - staleness must be in.
      const uint64_t slowest = *std::min_element(last_round_.begin(), last_round_.end());
      return slowest + options_.staleness >= round;
    }
  }
  return true;
}

bool Aggregator::applied_before(uint64_t switch_round, uint64_t run_start) const {
  if (options_.sync == SyncMode::kBsp) return version_ >= switch_round - 1;
  // Async and staleness: every worker's pushes of this run's rounds up to the
  // switch are applied (counted: pushes may be applied out of round order).
  const uint64_t first = std::max<uint64_t>(run_start, 1);
  const uint64_t want = switch_round > first ? switch_round - first : 0;
  return std::all_of(applied_.begin(), applied_.end(), [&](uint64_t a) { return a >= want; });
}

Status Aggregator::save(ComputeLane& lane, float* out, size_t arrays) const {
  const size_t bytes = elements_ * sizeof(float);
  Status st = lane.copy(out, param_.get(), bytes);
  // The moments in order, each copied or, where the optimizer keeps none,
  // zeros; only the first `arrays` arrays.
  const float* moments[2] = {first_moment_.get(), second_moment_.get()};
  for (size_t m = 0; m + 1 < arrays && m < 2; ++m) {
    float* to = out + (m + 1) * elements_;
    if (moments[m] == nullptr) {
      std::memset(to, 0, bytes);
    } else if (st.ok()) {
      st = lane.copy(to, moments[m], bytes);
    }
  }
  if (st.ok()) st = lane.finish();
  return st;
}

Status Aggregator::restore(ComputeLane& lane, const float* in, uint64_t version,
                           uint64_t last_round) {
  const size_t arrays = state_arrays();
  const bool with_m = arrays >= 2, with_v = arrays == 3;
  const size_t bytes = elements_ * sizeof(float);
  Status st = lane.copy(param_.get(), in, bytes);
  if (st.ok() && with_m) st = lane.ensure(first_moment_, elements_);
  if (st.ok() && with_m) st = lane.copy(first_moment_.get(), in + elements_, bytes);
  if (st.ok() && with_v) st = lane.ensure(second_moment_, elements_);
  if (st.ok() && with_v) st = lane.copy(second_moment_.get(), in + 2 * elements_, bytes);
  if (st.ok()) st = publish(lane);  // waits for the copies out of `in`
  // BSP: version is the round, the switch round - 1. Async: the updates
  // applied, which Adam's bias correction counts.
  version_ = version;
  std::fill(last_round_.begin(), last_round_.end(), last_round);
  std::fill(seen_.begin(), seen_.end(), Seen{last_round, 0});
  return st;
}

}  // namespace psld
