// Native twin of ddpx/comm_hooks/powersgd.py: rank-r PowerSGD with error feedback and
// warm start, pipelined across buckets by TwoPhaseAlgorithm. Same layout
// objects, same tensors, same calls, same results. The "error" memory holds
// the last step's full sum M and "p" its P; the error M - P Q^T is applied
// lazily by the next step's lowrank_project_.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <unordered_map>

#include "comm_hooks/native_hook.h"
#include "ops/ops.h"

namespace ddpx::comm_hooks {
namespace {

class PowerSGD final : public TwoPhaseAlgorithm {
 public:
  explicit PowerSGD(HookCore& core) : seed_(core.int_option("seed", 0)) {}

 private:
  struct Mat {
    int64_t key;
    at::Tensor grad, error, p, p_prev, q, qt;  // qt: the layout's Q^T scratch (r x m)
  };

  // The seeded start of a parameter's Q, as PowerSGDState._draw_q.
  void draw_q(int64_t key, at::Tensor q) const {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed_ * 1000003 + key));
    q.copy_(at::randn({q.numel()}, gen, q.options()).view(q.sizes()));
  }

  // Views of every compressed matrix of piece `pc`, as PowerSGDState._matrices.
  static std::vector<Mat> matrices(const at::Tensor& buf, const Layout& lay, const Layout& pc) {
    const at::Tensor &pbuf = lay.tensor("pbuf"), &qbuf = lay.tensor("q");
    const at::Tensor &error_buf = lay.tensor("error"), &qt_buf = lay.tensor("qt"), &p_prev = lay.tensor("p_prev");
    const at::Tensor& table = pc.tensor("matrices");  // int64 [k, 8]
    const int64_t* t = table.const_data_ptr<int64_t>();
    std::vector<Mat> mats;
    mats.reserve(table.size(0));
    for (int64_t i = 0; i < table.size(0); ++i) {
      const int64_t* row = t + 8 * i;  // key, offset, n, m, r, p_offset, q_offset, packed_offset
      const int64_t key = row[0], off = row[1], n = row[2], m = row[3], r = row[4];
      mats.push_back({key, buf.narrow(0, off, n * m).view({n, m}), error_buf.narrow(0, row[7], n * m).view({n, m}),
                      pbuf.narrow(0, lay.n_plain + row[5], n * r).view({n, r}),
                      p_prev.narrow(0, row[5], n * r).view({n, r}), qbuf.narrow(0, row[6], m * r).view({m, r}),
                      qt_buf.narrow(0, 0, m * r).view({r, m})});
    }
    return mats;
  }

  int64_t wire_bytes(HookCore& core, const Layout& lay) const override {
    int64_t total = 0;
    for (const auto& pc : lay.pieces)
      total += ring_allreduce_bytes(4 * pc->tensor("pbuf").numel(), core.world()) +
               ring_allreduce_bytes(4 * pc->tensor("q").numel(), core.world());
    return total;
  }

  // M = G + error feedback, P = M Q for every matrix of the piece (with the exempt values
  // in the first piece), in one allreduce.
  WorkPtr start_phase1(HookCore& core, const at::Tensor& buf, const Layout& lay, const Layout& pc) override {
    if (pc.integer("first")) {
      at::Tensor plain = lay.tensor("pbuf").narrow(0, 0, lay.n_plain);
      ddpx::ops::flatten_out(run_views(buf, lay.plain), 1.0 / static_cast<double>(core.world()), plain);
    }
    for (Mat& x : matrices(buf, lay, pc)) {
      x.qt.copy_(x.q.t());
      ddpx::ops::lowrank_project_(x.grad, x.error, x.p_prev, x.qt, x.p);  // error = (G + error) - P' Q'^T = M; P = M Q
    }
    std::vector<at::Tensor> tensors{pc.tensor("pbuf")};
    return core.worker_group().allreduce(tensors);
  }

  // Orthogonalize every P of the piece, Q = M^T P, all in one allreduce.
  WorkPtr start_phase2(HookCore& core, const at::Tensor& buf, const Layout& lay, const Layout& pc,
                       c10d::Work& reduce_p) override {
    reduce_p.wait();
    std::vector<bool>& finite = finite_[&pc];
    finite.clear();
    for (Mat& x : matrices(buf, lay, pc)) {
      const bool ok = at::isfinite(x.p).all().item<bool>();  // p is identical on every rank
      finite.push_back(ok);
      if (ok) x.p.copy_(std::get<0>(at::linalg_qr(x.p)));
      ddpx::ops::lowrank_transpose_project_(x.error, x.p, x.qt);  // Q^T = P^T M, reading M row by row
      x.q.copy_(x.qt.t());
    }
    std::vector<at::Tensor> tensors{pc.tensor("q")};
    return core.worker_group().allreduce(tensors);
  }

  // P Q^T into the bucket, P kept for the next step; the exempt values back into the bucket.
  void finish(HookCore& core, const at::Tensor& buf, const Layout& lay, const Layout& pc,
              c10d::Work& reduce_q) override {
    reduce_q.wait();
    pc.tensor("q").mul_(1.0 / static_cast<double>(core.world()));
    auto entry = finite_.find(&pc);
    TORCH_CHECK(entry != finite_.end(), "ddpx powersgd: a piece finished before its phase 2");
    const std::vector<bool> finite = std::move(entry->second);
    finite_.erase(entry);  // no entry outlives its step, so none is left behind by DDP's bucket rebuild
    auto mats = matrices(buf, lay, pc);
    for (size_t i = 0; i < mats.size(); ++i) {
      Mat& x = mats[i];
      if (finite[i]) {
        x.qt.copy_(x.q.t());
        ddpx::ops::lowrank_reconstruct_(x.grad, x.p, x.qt);
        x.p_prev.copy_(x.p);
      } else {  // a skipped step: back to the previous error, M - G (NaN/Inf elements restart at 0)
        x.error.sub_(x.grad).nan_to_num_(0.0, 0.0, 0.0);
        x.p_prev.zero_();
        x.grad.fill_(std::numeric_limits<float>::quiet_NaN());
        draw_q(x.key, x.q);
      }
    }
    if (pc.integer("first")) ddpx::ops::unflatten_(lay.tensor("pbuf").narrow(0, 0, lay.n_plain), run_views(buf, lay.plain));
  }

  int64_t seed_;
  // per piece in flight: which matrices had a finite P (set in phase 2, taken by finish); worker thread only
  std::unordered_map<const Layout*, std::vector<bool>> finite_;
};

}  // namespace
DDPX_REGISTER_NATIVE_HOOK("powersgd", PowerSGD);
}  // namespace ddpx::comm_hooks
