// Native twin of ddpx/hooks/int8.py: blockwise int8, all-to-all + local fp32
// average + requantize + all-gather, worker and server error feedback.
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
    core.count(buf.numel(), 2 * (core.world() - 1) * lay->integer("piece"), bucket.isLast());
    return core.submit(buf, [this, &core, buf, lay] { reduce(core, buf, *lay); });
  }

 private:
  void reduce(HookCore& core, const at::Tensor& buf, const Layout& lay) const {
    const int64_t world = core.world(), rank = core.rank();
    const int64_t c = lay.integer("chunk"), piece = lay.integer("piece");
    const int64_t plain_chunk = lay.integer("plain_chunk"), blocks = lay.integer("blocks");
    const double inv = 1.0 / static_cast<double>(world);
    const auto comp_views = run_views(buf, lay.comp);
    const auto plain_views = run_views(buf, lay.plain);
    at::Tensor comp = lay.tensor("comp"), plain_buf = lay.tensor("plain"), reduced = lay.tensor("reduced");
    at::Tensor send = lay.tensor("send"), recv = lay.tensor("recv");
    at::Tensor send2 = lay.tensor("send2"), recv2 = lay.tensor("recv2");
    const at::Tensor& worker_error = lay.tensor("worker_error");
    const at::Tensor& server_error = lay.tensor("server_error");
    auto views = [&](const at::Tensor& bytes) { return piece_views(bytes, piece, plain_chunk, blocks, at::kChar); };

    // phase 1: quantize each destination's chunk into its piece, exchange
    ddpx::ops::flatten_out(comp_views, 1.0, comp);
    ddpx::ops::flatten_out(plain_views, 1.0, plain_buf);
    {
      auto [plain, scales, q] = views(send);
      plain.copy_(plain_buf.view({world, plain_chunk}));
      for (int64_t r = 0; r < world; ++r) {
        at::Tensor qr = q[r], sr = scales[r];
        ddpx::ops::int8_quantize_out(comp.narrow(0, r * c, c), block_, worker_error.narrow(0, r * c, c), qr, sr);
      }
    }
    std::vector<int64_t> equal_splits;
    core.worker_group().alltoall_base(recv, send, equal_splits, equal_splits)->wait();
    // local fp32 average of this rank's chunk, server error feedback, requantize
    {
      auto [plain, scales, q] = views(recv);
      auto [plain2, scales2, q2] = views(send2);
      at::Tensor p2 = plain2[0], s2 = scales2[0], qq2 = q2[0];
      at::sum_out(p2, plain, {0}).mul_(inv);
      ddpx::ops::int8_dequant_accumulate_(reduced, q, scales, block_, inv, false);
      ddpx::ops::int8_quantize_out(reduced, block_, server_error.narrow(0, rank * c, c), qq2, s2);
    }
    // phase 2: everyone gets every averaged chunk
    core.worker_group()._allgather_base(recv2, send2)->wait();
    {
      auto [plain, scales, q] = views(recv2);
      for (int64_t r = 0; r < world; ++r) {
        at::Tensor out = comp.narrow(0, r * c, c);
        ddpx::ops::int8_dequant_accumulate_(out, q[r], scales[r], block_, 1.0, false);
      }
      plain_buf.view({world, plain_chunk}).copy_(plain);
    }
    ddpx::ops::unflatten_(comp, comp_views);
    ddpx::ops::unflatten_(plain_buf, plain_views);
  }

  int64_t block_;
};

}  // namespace
DDPX_REGISTER_NATIVE_HOOK("int8", Int8);
}  // namespace ddpx::hooks
