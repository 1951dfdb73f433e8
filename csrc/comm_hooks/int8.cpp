// Native twin of ddpx/comm_hooks/int8.py: blockwise int8, all-to-all + local fp32
// average + requantize + all-gather, worker and server error feedback,
// pipelined across buckets by TwoPhaseAlgorithm in the Python hook's order.
#include "comm_hooks/native_hook.h"
#include "ops/ops.h"

namespace ddpx::comm_hooks {
namespace {

class Int8 final : public TwoPhaseAlgorithm {
 public:
  explicit Int8(HookRunner&) {}

 private:
  // The piece's sizes (ddpx/comm_hooks/int8.py, Int8State.build_layout): its per-rank chunk
  // [base, base + c) of the bucket's per-rank chunks of `stride` elements, in blocks of
  // `block` (a layout's own, as the Python state fixed it when it built the layout).
  struct Sizes {
    int64_t c, base, stride, piece, plain_chunk, blocks, block;
    bool first, last;
    explicit Sizes(const Layout& pc)
        : c(pc.integer("chunk")),
          base(pc.integer("base")),
          stride(pc.integer("stride")),
          piece(pc.integer("piece")),
          plain_chunk(pc.integer("plain_chunk")),
          blocks(pc.integer("blocks")),
          block(pc.integer("block")),
          first(pc.integer("first") != 0),
          last(pc.integer("last") != 0) {}
  };

  // (plain fp32, scales fp32, q int8) views of a buffer of rank messages.
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> views(const at::Tensor& bytes, const Sizes& z) {
    return piece_views(bytes, z.piece, z.plain_chunk, z.blocks, at::kChar);
  }

  // Phase 1: quantize each destination's chunk of the piece; start the exchange.
  WorkPtr start_phase1(HookRunner& runner, const at::Tensor& buf, const Layout& lay, const Layout& pc) override {
    const int64_t world = runner.world();
    const Sizes z(pc);
    at::Tensor comp = lay.tensor("comp"), plain_buf = lay.tensor("plain");
    at::Tensor send = pc.tensor("send"), recv = pc.tensor("recv");
    const at::Tensor& worker_error = lay.tensor("worker_error");
    auto [plain, scales, q] = views(send, z);
    if (z.first) {
      ddpx::ops::flatten_out(run_views(buf, lay.plain), 1.0, plain_buf);
      plain.copy_(plain_buf.view({world, z.plain_chunk}));
      if (!has_spans(lay)) ddpx::ops::flatten_out(run_views(buf, lay.comp), 1.0, comp);
    }
    if (has_spans(lay)) {  // straight from the bucket, as Int8State.start_phase1
      for_each_span(pc, [&](int64_t r, int64_t boff, int64_t n, int64_t soff) {
        at::Tensor qr = q[r].narrow(0, soff, n), sr = scales[r].narrow(0, soff / z.block, n / z.block);
        ddpx::ops::int8_quantize_out(buf.narrow(0, boff, n), z.block,
                                     worker_error.narrow(0, r * z.stride + z.base + soff, n), qr, sr);
      });
    } else {
      for (int64_t r = 0; r < world; ++r) {
        at::Tensor qr = q[r], sr = scales[r];
        ddpx::ops::int8_quantize_out(comp.narrow(0, r * z.stride + z.base, z.c), z.block,
                                     worker_error.narrow(0, r * z.stride + z.base, z.c), qr, sr);
      }
    }
    std::vector<int64_t> equal_splits;
    return runner.executor_group().alltoall_base(recv, send, equal_splits, equal_splits);
  }

  // Phase 2 start: average this rank's chunk of the piece in fp32, server error feedback, requantize.
  WorkPtr start_phase2(HookRunner& runner, const at::Tensor&, const Layout& lay, const Layout& pc,
                       c10d::Work& exchange) override {
    const int64_t world = runner.world(), rank = runner.rank();
    const Sizes z(pc);
    const double inv = 1.0 / static_cast<double>(world);
    at::Tensor reduced = pc.tensor("reduced");
    at::Tensor recv = pc.tensor("recv"), send2 = pc.tensor("send2"), recv2 = pc.tensor("recv2");
    const at::Tensor& server_error = lay.tensor("server_error");
    exchange.wait();
    auto [plain, scales, q] = views(recv, z);
    auto [plain2, scales2, q2] = views(send2, z);
    at::Tensor p2 = plain2[0], s2 = scales2[0], qq2 = q2[0];
    at::sum_out(p2, plain, {0}).mul_(inv);
    ddpx::ops::int8_dequant_accumulate_(reduced, q, scales, z.block, inv, false);
    ddpx::ops::int8_quantize_out(reduced, z.block, server_error.narrow(0, rank * z.stride + z.base, z.c), qq2, s2);
    return runner.executor_group()._allgather_base(recv2, send2);
  }

  // Phase 2 end: dequantize every averaged chunk of the piece into the bucket.
  void finish(HookRunner& runner, const at::Tensor& buf, const Layout& lay, const Layout& pc,
              c10d::Work& gather) override {
    const int64_t world = runner.world();
    const Sizes z(pc);
    at::Tensor comp = lay.tensor("comp"), plain_buf = lay.tensor("plain"), recv2 = pc.tensor("recv2");
    gather.wait();
    auto [plain, scales, q] = views(recv2, z);
    if (has_spans(lay)) {
      for_each_span(pc, [&](int64_t r, int64_t boff, int64_t n, int64_t soff) {
        at::Tensor out = buf.narrow(0, boff, n);
        ddpx::ops::int8_dequant_accumulate_(out, q[r].narrow(0, soff, n), scales[r].narrow(0, soff / z.block, n / z.block),
                                            z.block, 1.0, false);
      });
    } else {
      for (int64_t r = 0; r < world; ++r) {
        at::Tensor out = comp.narrow(0, r * z.stride + z.base, z.c);
        ddpx::ops::int8_dequant_accumulate_(out, q[r], scales[r], z.block, 1.0, false);
      }
      if (z.last) ddpx::ops::unflatten_(comp, run_views(buf, lay.comp));
    }
    if (z.first) {
      plain_buf.view({world, lay.integer("plain_chunk")}).copy_(plain);
      ddpx::ops::unflatten_(plain_buf, run_views(buf, lay.plain));
    }
  }
};

}  // namespace
DDPX_REGISTER_NATIVE_HOOK("int8", Int8);
}  // namespace ddpx::comm_hooks
