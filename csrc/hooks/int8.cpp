// Native twin of ddpx/hooks/int8.py: blockwise int8, all-to-all + local fp32
// average + requantize + all-gather, worker and server error feedback,
// pipelined across buckets in the same fixed order as the Python hook
// (A2A 0, A2A 1, AG 0, A2A 2, AG 1, ..., AG last).
#include <deque>

#include "hooks/native_hook.h"
#include "ops/ops.h"

namespace ddpx::hooks {
namespace {

class Int8 final : public NativeAlgorithm {
 public:
  explicit Int8(HookCore& core) : block_(core.int_option("block_size", 256)) {}

  FuturePtr run(HookCore& core, c10d::GradBucket& bucket) override {
    at::Tensor buf = bucket.getBuffer();
    auto lay = core.layout(bucket);
    const bool last = bucket.isLast();
    core.count(buf.numel(), 2 * (core.world() - 1) * lay->integer("piece"), last);
    return core.submit_deferred(buf, [this, &core, buf, lay, last](const FuturePtr& fut) {
      // worker job, as Int8State._pipeline: start this bucket; reduce the previous one
      // and start its all-gather; decode the one before (the last job: everything left)
      std::unique_ptr<Pending> reducing = std::move(reducing_);
      std::deque<Pending> decoding = std::move(decoding_);
      decoding_.clear();
      Pending started{buf, lay, nullptr, fut};
      try {
        started.work = start(core, buf, *lay);
      } catch (...) {
        if (reducing) reducing->fut->setError(std::current_exception());
        for (auto& job : decoding) job.fut->setError(std::current_exception());
        throw;
      }
      if (reducing && reduce(core, *reducing)) decoding.push_back(std::move(*reducing));
      if (last) {
        if (reduce(core, started)) decoding.push_back(std::move(started));
      } else {
        reducing_ = std::make_unique<Pending>(std::move(started));
      }
      const size_t keep = last ? 0 : 1;  // the all-gather just started: decoded by the next job
      while (decoding.size() > keep) {
        decode(core, decoding.front());
        decoding.pop_front();
      }
      decoding_ = std::move(decoding);
    });
  }

 private:
  struct Pending {
    at::Tensor buf;
    std::shared_ptr<const Layout> lay;
    c10::intrusive_ptr<c10d::Work> work;
    FuturePtr fut;
  };

  struct Sizes {
    int64_t c, piece, plain_chunk, blocks;
    explicit Sizes(const Layout& lay)
        : c(lay.integer("chunk")),
          piece(lay.integer("piece")),
          plain_chunk(lay.integer("plain_chunk")),
          blocks(lay.integer("blocks")) {}
  };

  // Phase 1: quantize each destination's chunk into its piece; start the exchange.
  c10::intrusive_ptr<c10d::Work> start(HookCore& core, const at::Tensor& buf, const Layout& lay) const {
    const int64_t world = core.world();
    const Sizes z(lay);
    at::Tensor comp = lay.tensor("comp"), plain_buf = lay.tensor("plain");
    at::Tensor send = lay.tensor("send"), recv = lay.tensor("recv");
    const at::Tensor& worker_error = lay.tensor("worker_error");
    ddpx::ops::flatten_out(run_views(buf, lay.comp), 1.0, comp);
    ddpx::ops::flatten_out(run_views(buf, lay.plain), 1.0, plain_buf);
    auto [plain, scales, q] = piece_views(send, z.piece, z.plain_chunk, z.blocks, at::kChar);
    plain.copy_(plain_buf.view({world, z.plain_chunk}));
    for (int64_t r = 0; r < world; ++r) {
      at::Tensor qr = q[r], sr = scales[r];
      ddpx::ops::int8_quantize_out(comp.narrow(0, r * z.c, z.c), block_, worker_error.narrow(0, r * z.c, z.c), qr,
                                   sr);
    }
    std::vector<int64_t> equal_splits;
    return core.worker_group().alltoall_base(recv, send, equal_splits, equal_splits);
  }

  // Phase 2 start: average this rank's chunk, requantize, start the all-gather
  // (p.work becomes it). False after an error, which the future carries.
  bool reduce(HookCore& core, Pending& p) const {
    try {
      const Layout& lay = *p.lay;
      const int64_t world = core.world(), rank = core.rank();
      const Sizes z(lay);
      const double inv = 1.0 / static_cast<double>(world);
      at::Tensor reduced = lay.tensor("reduced");
      at::Tensor recv = lay.tensor("recv"), send2 = lay.tensor("send2"), recv2 = lay.tensor("recv2");
      const at::Tensor& server_error = lay.tensor("server_error");
      p.work->wait();
      auto [plain, scales, q] = piece_views(recv, z.piece, z.plain_chunk, z.blocks, at::kChar);
      auto [plain2, scales2, q2] = piece_views(send2, z.piece, z.plain_chunk, z.blocks, at::kChar);
      at::Tensor p2 = plain2[0], s2 = scales2[0], qq2 = q2[0];
      at::sum_out(p2, plain, {0}).mul_(inv);
      ddpx::ops::int8_dequant_accumulate_(reduced, q, scales, block_, inv, false);
      ddpx::ops::int8_quantize_out(reduced, block_, server_error.narrow(0, rank * z.c, z.c), qq2, s2);
      p.work = core.worker_group()._allgather_base(recv2, send2);
    } catch (...) {  // surfaces in loss.backward() on this rank
      p.fut->setError(std::current_exception());
      return false;
    }
    return true;
  }

  // Phase 2 end: wait for the all-gather, decode every chunk into the bucket.
  void decode(HookCore& core, const Pending& p) const {
    try {
      const Layout& lay = *p.lay;
      const int64_t world = core.world();
      const Sizes z(lay);
      at::Tensor comp = lay.tensor("comp"), plain_buf = lay.tensor("plain"), recv2 = lay.tensor("recv2");
      p.work->wait();
      auto [plain, scales, q] = piece_views(recv2, z.piece, z.plain_chunk, z.blocks, at::kChar);
      for (int64_t r = 0; r < world; ++r) {
        at::Tensor out = comp.narrow(0, r * z.c, z.c);
        ddpx::ops::int8_dequant_accumulate_(out, q[r], scales[r], block_, 1.0, false);
      }
      plain_buf.view({world, z.plain_chunk}).copy_(plain);
      ddpx::ops::unflatten_(comp, run_views(p.buf, lay.comp));
      ddpx::ops::unflatten_(plain_buf, run_views(p.buf, lay.plain));
    } catch (...) {  // surfaces in loss.backward() on this rank
      p.fut->setError(std::current_exception());
      return;
    }
    p.fut->markCompleted(c10::IValue(p.buf));
  }

  // touched only by the worker thread
  std::unique_ptr<Pending> reducing_;  // all-to-all started, not yet reduced
  std::deque<Pending> decoding_;       // all-gather started, not yet decoded
  int64_t block_;
};

}  // namespace
DDPX_REGISTER_NATIVE_HOOK("int8", Int8);
}  // namespace ddpx::hooks
