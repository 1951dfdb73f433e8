// Native twin of ddpx/hooks/powersgd.py: rank-r PowerSGD with error feedback and
// warm start. Same layout objects, same tensors, same ATen calls, same results.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "hooks/native_hook.h"
#include "ops/ops.h"

namespace ddpx::hooks {
namespace {

class PowerSGD final : public NativeAlgorithm {
 public:
  explicit PowerSGD(HookCore& core) : seed_(core.int_option("seed", 0)) {}

  FuturePtr run(HookCore& core, c10d::GradBucket& bucket) override {
    at::Tensor buf = bucket.getBuffer();
    auto lay = core.layout(bucket);
    const int64_t world = core.world();
    core.count(buf.numel(),
               ring_allreduce_bytes(4 * lay->tensor("pbuf").numel(), world) +
                   ring_allreduce_bytes(4 * lay->tensor("q").numel(), world),
               bucket.isLast());
    return core.submit(buf, [this, &core, buf, lay] { reduce(core, buf, *lay); });
  }

 private:
  // The seeded start of a parameter's Q, as PowerSGDState._draw_q.
  void draw_q(int64_t key, at::Tensor q) const {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed_ * 1000003 + key));
    q.copy_(at::randn({q.numel()}, gen, q.options()).view(q.sizes()));
  }

  void reduce(HookCore& core, const at::Tensor& buf, const Layout& lay) const {
    const double inv = 1.0 / static_cast<double>(core.world());
    at::Tensor pbuf = lay.tensor("pbuf"), qbuf = lay.tensor("q");
    const at::Tensor& error_buf = lay.tensor("error");
    const at::Tensor& table = lay.tensor("matrices");  // int64 [k, 8]
    const int64_t* t = table.const_data_ptr<int64_t>();
    const int64_t k = table.size(0);
    const auto plain_views = run_views(buf, lay.plain);
    ddpx::ops::flatten_out(plain_views, inv, pbuf);
    struct Mat {
      int64_t key;
      at::Tensor mat, error, p, q;
    };
    const at::Tensor& qt_buf = lay.tensor("qt");  // one matrix's Q^T (r x m), as the Python hook
    auto qt_of = [&](const Mat& x) { return qt_buf.narrow(0, 0, x.q.numel()).view({x.q.size(1), x.q.size(0)}); };
    std::vector<Mat> mats;
    mats.reserve(k);
    for (int64_t i = 0; i < k; ++i) {
      const int64_t* row = t + 8 * i;  // key, offset, n, m, r, p_offset, q_offset, packed_offset
      const int64_t key = row[0], off = row[1], n = row[2], m = row[3], r = row[4];
      Mat x{key, buf.narrow(0, off, n * m).view({n, m}), error_buf.narrow(0, row[7], n * m).view({n, m}),
            pbuf.narrow(0, lay.n_plain + row[5], n * r).view({n, r}), qbuf.narrow(0, row[6], m * r).view({m, r})};
      at::Tensor qt = qt_of(x);
      qt.copy_(x.q.t());
      ddpx::ops::lowrank_project_(x.mat, x.error, qt, x.p);  // M += error; P = M Q, one pass over M
      mats.push_back(std::move(x));
    }
    {
      std::vector<at::Tensor> tensors{pbuf};
      core.worker_group().allreduce(tensors)->wait();
    }
    std::vector<bool> finite(mats.size());
    for (size_t i = 0; i < mats.size(); ++i) {
      Mat& x = mats[i];
      finite[i] = at::isfinite(x.p).all().item<bool>();  // p is identical on every rank
      if (finite[i]) x.p.copy_(std::get<0>(at::linalg_qr(x.p)));
      at::Tensor qt = qt_of(x);
      at::matmul_out(qt, x.p.t(), x.mat);  // (P^T M)^T: reads M row by row, unlike M^T P
      x.q.copy_(qt.t());
    }
    {
      std::vector<at::Tensor> tensors{qbuf};
      core.worker_group().allreduce(tensors)->wait();
    }
    qbuf.mul_(inv);
    for (size_t i = 0; i < mats.size(); ++i) {
      Mat& x = mats[i];
      if (finite[i]) {
        at::Tensor qt = qt_of(x);
        qt.copy_(x.q.t());
        ddpx::ops::lowrank_reconstruct_(x.mat, x.error, x.p, qt);  // error = M - P Q^T; M = P Q^T, one pass
      } else {
        x.mat.fill_(std::numeric_limits<float>::quiet_NaN());
        draw_q(x.key, x.q);
      }
    }
    ddpx::ops::unflatten_(pbuf, plain_views);
  }

  int64_t seed_;
};

}  // namespace
DDPX_REGISTER_NATIVE_HOOK("powersgd", PowerSGD);
}  // namespace ddpx::hooks
