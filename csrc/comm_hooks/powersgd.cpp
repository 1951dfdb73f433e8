// Native twin of ddpx/comm_hooks/powersgd.py: rank-r PowerSGD with error feedback and
// warm start, pipelined across buckets by TwoPhaseAlgorithm. Same layout
// objects, same tensors, same calls (one batched QR per matrix shape of a piece),
// same results. The "error" memory holds
// the last step's full sum M and "p" its P; the error M - P Q^T is applied
// lazily by the next step's lowrank_project_.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <limits>
#include <optional>

#include "comm_hooks/native_hook.h"
#include "ops/ops.h"

namespace ddpx::comm_hooks {
namespace {

class PowerSGD final : public TwoPhaseAlgorithm {
 public:
  explicit PowerSGD(HookRunner& runner) : seed_(runner.int_option("seed")) {}

 private:
  // Views of one compressed matrix's memory in the layout's buffers (PowerSGDState's pc.views).
  struct Mat {
    int64_t key, offset, n, m;
    at::Tensor error, p, p_prev, qt, q;
  };
  // The piece's matrices of one shape, side by side (pc.batch_views): P's [b, n, r],
  // Q's [b, m, r], Q^T's [b, r, m], finite flags [b].
  struct Batch {
    at::Tensor p, q, qt, finite;
  };
  // What the executor keeps per piece: views made once, and phase 2's flags on their way to the host.
  struct PieceState {
    std::vector<Mat> mats;
    std::vector<Batch> batches;
    at::Tensor finite, finite_host;
    std::optional<c10::Event> finite_ready;
    const void* grads_of = nullptr;  // the bucket buffer `grads` are views of
    std::vector<at::Tensor> grads;
  };

  // The seeded start of a parameter's Q, as PowerSGDState._draw_q.
  void draw_q(int64_t key, at::Tensor q) const {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed_ * 1000003 + key));
    q.copy_(at::randn({q.numel()}, gen, q.options().device(at::kCPU)).view(q.sizes()));
  }

  // The piece's views (made on first use; the piece's layout owns them, so they go with it).
  static PieceState& state(const Layout& lay, const Layout& pc) {
    if (!pc.cache) {
      auto st = std::make_shared<PieceState>();
      const at::Tensor &pbuf = lay.tensor("pbuf"), &qbuf = lay.tensor("q"), &qt_buf = lay.tensor("qt");
      const at::Tensor &error_buf = lay.tensor("error"), &p_prev = lay.tensor("p_prev");
      const at::Tensor& table = pc.tensor("matrices");  // int64 [k, 8]
      const int64_t* t = table.const_data_ptr<int64_t>();
      for (int64_t i = 0; i < table.size(0); ++i) {
        const int64_t* row = t + 8 * i;  // key, offset, n, m, r, p_offset, q_offset, packed_offset
        const int64_t n = row[2], m = row[3], r = row[4];
        st->mats.push_back({row[0], row[1], n, m, error_buf.narrow(0, row[7], n * m).view({n, m}),
                            pbuf.narrow(0, lay.n_plain + row[5], n * r).view({n, r}),
                            p_prev.narrow(0, row[5], n * r).view({n, r}), qt_buf.narrow(0, row[6], m * r).view({r, m}),
                            qbuf.narrow(0, row[6], m * r).view({m, r})});
      }
      st->finite = pc.tensor("finite");
      st->finite_host = pc.tensor("finite_host");
      const at::Tensor& batches = pc.tensor("batches");  // int64 [g, 2]: first row, count
      const int64_t* b = batches.const_data_ptr<int64_t>();
      for (int64_t i = 0; i < batches.size(0); ++i) {
        const int64_t* row = t + 8 * b[2 * i];
        const int64_t count = b[2 * i + 1], n = row[2], m = row[3], r = row[4];
        st->batches.push_back({pbuf.narrow(0, lay.n_plain + row[5], count * n * r).view({count, n, r}),
                               qbuf.narrow(0, row[6], count * m * r).view({count, m, r}),
                               qt_buf.narrow(0, row[6], count * m * r).view({count, r, m}),
                               st->finite.narrow(0, b[2 * i], count)});
      }
      pc.cache = st;
    }
    return *std::static_pointer_cast<PieceState>(pc.cache);
  }

  // The piece's gradient matrices: views of the bucket, made again only when DDP hands over a new buffer.
  static const std::vector<at::Tensor>& grads(PieceState& st, const at::Tensor& buf) {
    if (st.grads_of != buf.const_data_ptr()) {
      st.grads.clear();
      for (const Mat& x : st.mats) st.grads.push_back(buf.narrow(0, x.offset, x.n * x.m).view({x.n, x.m}));
      st.grads_of = buf.const_data_ptr();
    }
    return st.grads;
  }

  int64_t wire_bytes(HookRunner& runner, const Layout& lay) const override {
    int64_t total = 0;
    for (const auto& pc : lay.pieces)
      total += ring_allreduce_bytes(4 * pc->tensor("pbuf").numel(), runner.world()) +
               ring_allreduce_bytes(4 * pc->tensor("q").numel(), runner.world());
    return total;
  }

  // M = G + error feedback, P = M Q for every matrix of the piece (with the exempt values
  // in the first piece), in one allreduce.
  WorkPtr start_phase1(HookRunner& runner, const at::Tensor& buf, const Layout& lay, const Layout& pc) override {
    if (pc.integer("first")) {
      at::Tensor plain = lay.tensor("pbuf").narrow(0, 0, lay.n_plain);
      ddpx::ops::flatten_out(run_views(buf, lay.plain), 1.0 / static_cast<double>(runner.world()), plain);
    }
    PieceState& st = state(lay, pc);
    for (Batch& b : st.batches) b.qt.copy_(b.q.transpose(1, 2));
    const auto& g = grads(st, buf);
    for (size_t i = 0; i < st.mats.size(); ++i) {
      Mat& x = st.mats[i];
      ddpx::ops::lowrank_project_(g[i], x.error, x.p_prev, x.qt, x.p);  // error = (G + error) - P' Q'^T = M; P = M Q
    }
    std::vector<at::Tensor> tensors{pc.tensor("pbuf")};
    return runner.executor_group().allreduce(tensors);
  }

  // Orthogonalize the piece's P's, a batch per shape; Q = M^T P, all in one allreduce.
  // Which P's were finite is noted for finish() without waiting for the device.
  WorkPtr start_phase2(HookRunner& runner, const at::Tensor& buf, const Layout& lay, const Layout& pc,
                       c10d::Work& reduce_p) override {
    reduce_p.wait();
    PieceState& st = state(lay, pc);
    for (Batch& b : st.batches) {
      at::all_out(b.finite, at::isfinite(b.p).flatten(1), 1);  // p is identical on every rank: so is the decision
      b.p.copy_(std::get<0>(at::linalg_qr(b.p)));                // a non-finite P comes out non-finite: see finish()
    }
    if (st.finite.device().is_cuda()) {
      st.finite_host.copy_(st.finite, /*non_blocking=*/true);
      c10::impl::VirtualGuardImpl impl(st.finite.device().type());
      st.finite_ready.emplace(st.finite.device().type());
      st.finite_ready->record(impl.getStream(st.finite.device()));
    } else if (!st.finite.is_cpu()) {
      st.finite_host.copy_(st.finite);
    }
    for (Mat& x : st.mats) ddpx::ops::lowrank_transpose_project_(x.error, x.p, x.qt);  // Q^T = P^T M, row by row
    for (Batch& b : st.batches) b.q.copy_(b.qt.transpose(1, 2));
    std::vector<at::Tensor> tensors{pc.tensor("q")};
    return runner.executor_group().allreduce(tensors);
  }

  // P Q^T into the bucket, P kept for the next step; the exempt values back into the bucket.
  void finish(HookRunner& runner, const at::Tensor& buf, const Layout& lay, const Layout& pc,
              c10d::Work& reduce_q) override {
    reduce_q.wait();
    PieceState& st = state(lay, pc);
    pc.tensor("q").mul_(1.0 / static_cast<double>(runner.world()));
    for (Batch& b : st.batches) b.qt.copy_(b.q.transpose(1, 2));
    if (st.finite_ready) {
      st.finite_ready->synchronize();  // long done, as a rule: phase 2's flags, not the whole stream
      st.finite_ready.reset();
    }
    const bool all_finite = st.finite_host.all().item<bool>();  // host memory: no device sync
    const bool* finite = st.finite_host.const_data_ptr<bool>();
    const auto& g = grads(st, buf);
    for (size_t i = 0; i < st.mats.size(); ++i) {
      Mat& x = st.mats[i];
      at::Tensor grad = g[i];
      if (all_finite || finite[i]) {
        ddpx::ops::lowrank_reconstruct_(grad, x.p, x.qt);
      } else {  // a skipped step: back to the previous error, M - G (NaN/Inf elements restart at 0)
        x.error.sub_(grad).nan_to_num_(0.0, 0.0, 0.0);
        grad.fill_(std::numeric_limits<float>::quiet_NaN());
        draw_q(x.key, x.q);
      }
    }
    pc.tensor("p_prev").copy_(pc.tensor("p"));
    if (!all_finite)
      for (size_t i = 0; i < st.mats.size(); ++i)
        if (!finite[i]) st.mats[i].p_prev.zero_();
    if (pc.integer("first")) ddpx::ops::unflatten_(lay.tensor("pbuf").narrow(0, 0, lay.n_plain), run_views(buf, lay.plain));
  }

  int64_t seed_;
};

}  // namespace
DDPX_REGISTER_NATIVE_HOOK("powersgd", PowerSGD);
}  // namespace ddpx::comm_hooks
