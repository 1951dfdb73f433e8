// Native twin of ddpx/comm_hooks/halfprec.py: fp16/bf16 allreduce, scaled before the
// cast, exempt parameters averaged in fp32 in a second allreduce.
#include "comm_hooks/native_hook.h"
#include "ops/ops.h"

namespace ddpx::comm_hooks {
namespace {

class Cast final : public NativeAlgorithm {
 public:
  explicit Cast(HookRunner& runner) : inv_(1.0 / static_cast<double>(runner.world())) {}

  FuturePtr run(HookRunner& runner, c10d::GradBucket& bucket) override {
    at::Tensor buf = bucket.getBuffer();
    auto lay = runner.layout(bucket);
    const at::Tensor& wire = lay->tensor("wire");
    const at::Tensor& plain = lay->tensor("plain");
    runner.count(buf.numel(), ring_allreduce_bytes(2 * lay->n_comp + 4 * lay->n_plain, runner.world()),
                 bucket.isLast());
    c10::List<FuturePtr> futs(c10::FutureType::create(c10::AnyType::get()));
    if (lay->n_comp) {
      for (const auto& r : lay->comp) {
        at::Tensor out = wire.narrow(0, r.packed, r.numel);
        ddpx::ops::scale_cast_out(buf.narrow(0, r.offset, r.numel), inv_, out);
      }
      std::vector<at::Tensor> t{wire};
      futs.push_back(runner.group().allreduce(t)->getFuture());
    }
    if (lay->n_plain) {
      at::Tensor out = plain;
      ddpx::ops::flatten_out(run_views(buf, lay->plain), inv_, out);
      std::vector<at::Tensor> t{plain};
      futs.push_back(runner.group().allreduce(t)->getFuture());
    }
    return c10::collectAll(futs)->then(
        [buf, lay](c10::ivalue::Future& done) {
          done.value();  // re-raises a failed collective
          const at::Tensor& wire = lay->tensor("wire");
          for (const auto& r : lay->comp) {
            at::Tensor dst = buf.narrow(0, r.offset, r.numel);
            ddpx::ops::cast_scale_copy_(dst, wire.narrow(0, r.packed, r.numel), 1.0);
          }
          if (lay->n_plain) ddpx::ops::unflatten_(lay->tensor("plain"), run_views(buf, lay->plain));
          return c10::IValue(buf);
        },
        c10::TensorType::get());
  }

 private:
  double inv_;
};

// The compressed values alone in the two-phase shape, as HalfPrecisionState's phase
// functions: stage 2 of scope=inter_node (inter_node.cpp). One allreduce.
class CastPhases final : public TwoPhaseAlgorithm {
 public:
  explicit CastPhases(HookRunner& runner) : inv_(1.0 / static_cast<double>(runner.world())) {}

  WorkPtr start_phase1(HookRunner& runner, const at::Tensor& buf, const Layout& lay, const Layout&) override {
    const at::Tensor& wire = lay.tensor("wire");
    for (const auto& r : lay.comp) {
      at::Tensor out = wire.narrow(0, r.packed, r.numel);
      ddpx::ops::scale_cast_out(buf.narrow(0, r.offset, r.numel), inv_, out);
    }
    std::vector<at::Tensor> t{wire};
    return runner.executor_group().allreduce(t);
  }

  WorkPtr start_phase2(HookRunner&, const at::Tensor&, const Layout&, const Layout&, c10d::Work& reduce) override {
    return WorkPtr::reclaim_copy(&reduce);  // no second collective
  }

  void finish(HookRunner&, const at::Tensor& buf, const Layout& lay, const Layout&, c10d::Work& reduce) override {
    reduce.wait();
    const at::Tensor& wire = lay.tensor("wire");
    for (const auto& r : lay.comp) {
      at::Tensor dst = buf.narrow(0, r.offset, r.numel);
      ddpx::ops::cast_scale_copy_(dst, wire.narrow(0, r.packed, r.numel), 1.0);
    }
  }

  int64_t wire_bytes(HookRunner& runner, const Layout& lay) const override {
    return ring_allreduce_bytes(2 * lay.n_comp, runner.world());
  }

 private:
  double inv_;
};

}  // namespace
DDPX_REGISTER_NATIVE_HOOK("cast", Cast);
DDPX_REGISTER_NATIVE_HOOK("cast_phases", CastPhases);
}  // namespace ddpx::comm_hooks
