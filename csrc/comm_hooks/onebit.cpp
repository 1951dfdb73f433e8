// Native twin of ddpx/comm_hooks/onebit.py: 1-bit signs with one scale per chunk,
// all-to-all + local fp32 average + re-pack + all-gather, worker and server
// error feedback, pipelined across buckets by TwoPhaseAlgorithm. Same layout
// objects, same tensors, same results.
#include "comm_hooks/native_hook.h"
#include "ops/ops.h"

namespace ddpx::comm_hooks {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

class Onebit final : public TwoPhaseAlgorithm {
 public:
  explicit Onebit(HookRunner& runner) : chunk_(runner.int_option("chunk_size")) {}

 private:
  // (plain fp32 [R, plain_chunk], scales fp32 [R, ceil(m / chunk)], bits uint8 [R, ceil(m / 8)]) views
  // of R rank messages [plain | scales | bits] of piece `pc` whose segments hold m compressed elements.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> views(const at::Tensor& bytes, const Layout& pc, int64_t m) const {
    const int64_t piece = pc.integer("piece"), e4 = 4 * pc.integer("plain_chunk");
    const int64_t b4 = 4 * pc.integer("chunks");
    at::Tensor rows = bytes.view({-1, piece});
    at::Tensor plain = rows.narrow(1, 0, e4).view(at::kFloat);
    at::Tensor scales = rows.narrow(1, e4, 4 * ceil_div(m, chunk_)).view(at::kFloat);
    at::Tensor bits = rows.narrow(1, e4 + b4, ceil_div(m, 8));
    return {plain, scales, bits};
  }

  // Compressed elements of rank r's segment in piece `pc` (the last segments may be short or
  // empty): the piece covers [base, base + seg) of segments of `stride` elements.
  static int64_t length(const Layout& pc, int64_t r) {
    const int64_t stride = pc.integer("stride"), base = pc.integer("base"), s = pc.integer("seg");
    const int64_t whole = std::max<int64_t>(0, std::min(stride, pc.n_comp - r * stride));
    return std::max<int64_t>(0, std::min(s, whole - base));
  }

  // Where the compressed values live, as OnebitState._compressed: the bucket itself
  // where they are one contiguous stretch of it in packing order (direct_offset >= 0);
  // else, where every compressed parameter is whole chunks, straight from/into the
  // bucket span by span (`spans`: rank, bucket offset, numel, segment offset; `comp`
  // undefined); else the packed `comp` buffer, with `packed` the bucket slices.
  struct Compressed {
    at::Tensor comp;
    std::vector<at::Tensor> packed;
  };
  static Compressed compressed(const at::Tensor& buf, const Layout& lay) {
    const int64_t direct = lay.integer("direct_offset");
    if (direct >= 0) return {buf.narrow(0, direct, lay.n_comp), {}};
    if (has_spans(lay)) return {};
    Compressed c{lay.tensor("comp"), {}};
    const at::Tensor& order = lay.tensor("comp_order");
    const int64_t* o = order.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < order.size(0); ++i) c.packed.push_back(buf.narrow(0, o[2 * i], o[2 * i + 1]));
    return c;
  }

  // Phase 1: pack each destination's segment of the piece; start the exchange.
  WorkPtr start_phase1(HookRunner& runner, const at::Tensor& buf, const Layout& lay, const Layout& pc) override {
    const int64_t world = runner.world(), s = pc.integer("stride"), base = pc.integer("base");
    Compressed c = compressed(buf, lay);
    at::Tensor plain_buf = lay.tensor("plain"), send = pc.tensor("send"), recv = pc.tensor("recv");
    const at::Tensor& worker_error = lay.tensor("worker_error");
    if (pc.integer("first")) {
      if (!c.packed.empty()) ddpx::ops::flatten_out(c.packed, 1.0, c.comp);
      ddpx::ops::flatten_out(run_views(buf, lay.plain), 1.0, plain_buf);
      std::get<0>(views(send, pc, 0)).copy_(plain_buf.view({world, lay.integer("plain_chunk")}));
    }
    if (!c.comp.defined()) {
      for_each_span(pc, [&](int64_t r, int64_t boff, int64_t n, int64_t soff) {
        auto [plain, scales, bits] = views(send, pc, length(pc, r));
        at::Tensor br = bits[r].narrow(0, soff / 8, n / 8), sr = scales[r].narrow(0, soff / chunk_, n / chunk_);
        ddpx::ops::onebit_pack_out(buf.narrow(0, boff, n), chunk_, worker_error.narrow(0, r * s + base + soff, n), br,
                                   sr);
      });
    } else {
      for (int64_t r = 0; r < world; ++r) {
        const int64_t m = length(pc, r);
        auto [plain, scales, bits] = views(send, pc, m);
        at::Tensor br = bits[r], sr = scales[r];
        ddpx::ops::onebit_pack_out(c.comp.narrow(0, r * s + base, m), chunk_, worker_error.narrow(0, r * s + base, m),
                                   br, sr);
      }
    }
    std::vector<int64_t> equal_splits;
    return runner.executor_group().alltoall_base(recv, send, equal_splits, equal_splits);
  }

  // Phase 2 start: average this rank's segment of the piece in fp32, server error feedback, re-pack.
  WorkPtr start_phase2(HookRunner& runner, const at::Tensor&, const Layout& lay, const Layout& pc,
                       c10d::Work& exchange) override {
    const int64_t world = runner.world(), rank = runner.rank(), m = length(pc, rank);
    const double inv = 1.0 / static_cast<double>(world);
    at::Tensor recv = pc.tensor("recv");
    at::Tensor send2 = pc.tensor("send2"), recv2 = pc.tensor("recv2");
    const at::Tensor& server_error = lay.tensor("server_error");
    exchange.wait();
    auto [plain, scales, bits] = views(recv, pc, m);
    auto [plain2, scales2, bits2] = views(send2, pc, m);
    at::Tensor p2 = plain2[0], s2 = scales2[0], b2 = bits2[0];
    at::sum_out(p2, plain, {0}).mul_(inv);
    at::Tensor mine_error = server_error.narrow(0, rank * pc.integer("stride") + pc.integer("base"), m);
    ddpx::ops::onebit_average_repack(bits, scales, chunk_, inv, mine_error, b2, s2);
    return runner.executor_group()._allgather_base(recv2, send2);
  }

  // Phase 2 end: unpack every averaged segment of the piece into the bucket.
  void finish(HookRunner& runner, const at::Tensor& buf, const Layout& lay, const Layout& pc,
              c10d::Work& gather) override {
    const int64_t world = runner.world(), s = pc.integer("stride"), base = pc.integer("base");
    Compressed c = compressed(buf, lay);
    at::Tensor plain_buf = lay.tensor("plain"), recv2 = pc.tensor("recv2");
    gather.wait();
    if (!c.comp.defined()) {
      for_each_span(pc, [&](int64_t r, int64_t boff, int64_t n, int64_t soff) {
        auto [plain, scales, bits] = views(recv2, pc, length(pc, r));
        at::Tensor out = buf.narrow(0, boff, n);
        ddpx::ops::onebit_unpack_accumulate_(out, bits[r].narrow(0, soff / 8, n / 8),
                                             scales[r].narrow(0, soff / chunk_, n / chunk_), chunk_, 1.0, false);
      });
    } else {
      for (int64_t r = 0; r < world; ++r) {
        const int64_t m = length(pc, r);
        auto [plain, scales, bits] = views(recv2, pc, m);
        at::Tensor out = c.comp.narrow(0, r * s + base, m);
        ddpx::ops::onebit_unpack_accumulate_(out, bits[r], scales[r], chunk_, 1.0, false);
      }
    }
    if (pc.integer("first")) {
      plain_buf.view({world, lay.integer("plain_chunk")}).copy_(std::get<0>(views(recv2, pc, 0)));
      ddpx::ops::unflatten_(plain_buf, run_views(buf, lay.plain));
    }
    if (pc.integer("last") && !c.packed.empty()) ddpx::ops::unflatten_(c.comp, c.packed);
  }

  int64_t chunk_;
};

}  // namespace
DDPX_REGISTER_NATIVE_HOOK("onebit", Onebit);
}  // namespace ddpx::comm_hooks
