// Native twin of ddpx/hooks/onebit.py: 1-bit signs with one scale per chunk,
// all-to-all + local fp32 average + re-pack + all-gather, worker and server
// error feedback. Same layout objects, same tensors, same results.
#include "hooks/native_hook.h"
#include "ops/ops.h"

namespace ddpx::hooks {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

class Onebit final : public NativeAlgorithm {
 public:
  explicit Onebit(HookCore& core) : chunk_(core.int_option("chunk_size", 128)) {}

  FuturePtr run(HookCore& core, c10d::GradBucket& bucket) override {
    at::Tensor buf = bucket.getBuffer();
    auto lay = core.layout(bucket);
    core.count(buf.numel(), 2 * (core.world() - 1) * lay->integer("piece"), bucket.isLast());
    return core.submit(buf, [this, &core, buf, lay] { reduce(core, buf, *lay); });
  }

 private:
  // (plain fp32 [R, plain_chunk], scales fp32 [R, ceil(m / chunk)], bits uint8 [R, ceil(m / 8)]) views
  // of R rank messages [plain | scales | bits] whose segments hold m compressed elements.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> views(const at::Tensor& bytes, const Layout& lay, int64_t m) const {
    const int64_t piece = lay.integer("piece"), e4 = 4 * lay.integer("plain_chunk");
    const int64_t b4 = 4 * lay.integer("chunks");
    at::Tensor rows = bytes.view({-1, piece});
    at::Tensor plain = rows.narrow(1, 0, e4).view(at::kFloat);
    at::Tensor scales = rows.narrow(1, e4, 4 * ceil_div(m, chunk_)).view(at::kFloat);
    at::Tensor bits = rows.narrow(1, e4 + b4, ceil_div(m, 8));
    return {plain, scales, bits};
  }

  void reduce(HookCore& core, const at::Tensor& buf, const Layout& lay) const {
    const int64_t world = core.world(), rank = core.rank();
    const int64_t s = lay.integer("seg"), n_comp = lay.n_comp;
    const double inv = 1.0 / static_cast<double>(world);
    auto length = [&](int64_t r) { return std::max<int64_t>(0, std::min(s, n_comp - r * s)); };
    // the compressed values: the bucket itself where they are one contiguous stretch of
    // it in packing order (direct_offset >= 0); else, where every compressed parameter
    // is whole chunks, straight from/into the bucket span by span (`spans`: rank, bucket
    // offset, numel, segment offset); else the packed `comp` buffer
    const int64_t direct = lay.integer("direct_offset");
    const at::Tensor& spans_t = lay.tensor("spans");
    const int64_t n_spans = spans_t.size(0);
    const int64_t* spans = spans_t.const_data_ptr<int64_t>();
    const bool packed = direct < 0 && n_spans == 0;
    std::vector<at::Tensor> comp_views;
    if (packed) {
      const at::Tensor& order = lay.tensor("comp_order");
      const int64_t* o = order.const_data_ptr<int64_t>();
      for (int64_t i = 0; i < order.size(0); ++i) comp_views.push_back(buf.narrow(0, o[2 * i], o[2 * i + 1]));
    }
    const auto plain_views = run_views(buf, lay.plain);
    at::Tensor comp = direct >= 0 ? buf.narrow(0, direct, n_comp) : lay.tensor("comp");
    at::Tensor plain_buf = lay.tensor("plain"), reduced = lay.tensor("reduced");
    const at::Tensor &send = lay.tensor("send"), &recv = lay.tensor("recv");
    const at::Tensor &send2 = lay.tensor("send2"), &recv2 = lay.tensor("recv2");
    const at::Tensor& worker_error = lay.tensor("worker_error");
    const at::Tensor& server_error = lay.tensor("server_error");
    const int64_t plain_chunk = lay.integer("plain_chunk");

    // phase 1: pack each destination's segment into its piece, exchange
    if (packed) ddpx::ops::flatten_out(comp_views, 1.0, comp);
    ddpx::ops::flatten_out(plain_views, 1.0, plain_buf);
    std::get<0>(views(send, lay, 0)).copy_(plain_buf.view({world, plain_chunk}));
    if (n_spans) {
      for (int64_t i = 0; i < n_spans; ++i) {
        const int64_t r = spans[4 * i], boff = spans[4 * i + 1], n = spans[4 * i + 2], soff = spans[4 * i + 3];
        auto [plain, scales, bits] = views(send, lay, length(r));
        at::Tensor br = bits[r].narrow(0, soff / 8, n / 8), sr = scales[r].narrow(0, soff / chunk_, n / chunk_);
        ddpx::ops::onebit_pack_out(buf.narrow(0, boff, n), chunk_, worker_error.narrow(0, r * s + soff, n), br, sr);
      }
    } else {
      for (int64_t r = 0; r < world; ++r) {
        const int64_t m = length(r);
        auto [plain, scales, bits] = views(send, lay, m);
        at::Tensor br = bits[r], sr = scales[r];
        ddpx::ops::onebit_pack_out(comp.narrow(0, r * s, m), chunk_, worker_error.narrow(0, r * s, m), br, sr);
      }
    }
    std::vector<int64_t> equal_splits;
    at::Tensor recv_t = recv, send_t = send;
    core.worker_group().alltoall_base(recv_t, send_t, equal_splits, equal_splits)->wait();
    // local fp32 average of this rank's segment, server error feedback, re-pack
    {
      const int64_t m = length(rank);
      auto [plain, scales, bits] = views(recv, lay, m);
      auto [plain2, scales2, bits2] = views(send2, lay, m);
      at::Tensor p2 = plain2[0], s2 = scales2[0], b2 = bits2[0];
      at::sum_out(p2, plain, {0}).mul_(inv);
      at::Tensor mine = reduced.narrow(0, 0, m);
      ddpx::ops::onebit_unpack_accumulate_(mine, bits, scales, chunk_, inv, false);
      ddpx::ops::onebit_pack_out(mine, chunk_, server_error.narrow(0, rank * s, m), b2, s2);
    }
    // phase 2: everyone gets every averaged segment
    at::Tensor recv2_t = recv2, send2_t = send2;
    core.worker_group()._allgather_base(recv2_t, send2_t)->wait();
    if (n_spans) {
      for (int64_t i = 0; i < n_spans; ++i) {
        const int64_t r = spans[4 * i], boff = spans[4 * i + 1], n = spans[4 * i + 2], soff = spans[4 * i + 3];
        auto [plain, scales, bits] = views(recv2, lay, length(r));
        at::Tensor out = buf.narrow(0, boff, n);
        ddpx::ops::onebit_unpack_accumulate_(out, bits[r].narrow(0, soff / 8, n / 8),
                                             scales[r].narrow(0, soff / chunk_, n / chunk_), chunk_, 1.0, false);
      }
    } else {
      for (int64_t r = 0; r < world; ++r) {
        const int64_t m = length(r);
        auto [plain, scales, bits] = views(recv2, lay, m);
        at::Tensor out = comp.narrow(0, r * s, m);
        ddpx::ops::onebit_unpack_accumulate_(out, bits[r], scales[r], chunk_, 1.0, false);
      }
    }
    plain_buf.view({world, plain_chunk}).copy_(std::get<0>(views(recv2, lay, 0)));
    if (packed) ddpx::ops::unflatten_(comp, comp_views);
    ddpx::ops::unflatten_(plain_buf, plain_views);
  }

  int64_t chunk_;
};

}  // namespace
DDPX_REGISTER_NATIVE_HOOK("onebit", Onebit);
}  // namespace ddpx::hooks
