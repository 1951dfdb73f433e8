// Native twin of ddpx/comm_hooks/scope.py (InterNode): scope=inter_node for every hook.
// Stage 1: exact fp32 reduce-scatter of the bucket inside the node (powersgd: allreduce);
// stage 2: the hook's own two-phase algorithm on this rank's shard among the ranks of
// the same local rank across nodes, run by a HookRunner of its own on the Python plan's
// `inner` state; stage 3: exact all-gather inside the node (of stage 2's codes, each
// rank decoding every shard; the exempt values in fp32). Pipelined piece by piece by
// TwoPhaseAlgorithm, like the hooks themselves; same layouts, same calls, same results
// as the Python path.
#include <unordered_map>

#include "comm_hooks/native_hook.h"
#include "ops/ops.h"

namespace py = pybind11;

namespace ddpx::comm_hooks {
namespace {

c10::intrusive_ptr<c10d::ProcessGroup> group_of(const py::handle& obj) {
  return c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(obj.cast<c10d::ProcessGroup*>());
}

class InterNode final : public TwoPhaseAlgorithm {
 public:
  explicit InterNode(HookRunner& runner) {
    py::object plan = runner.state().attr("scope_plan")();
    py::object topo = plan.attr("topo");
    local_world_ = topo.attr("local_world").cast<int64_t>();
    local_rank_ = topo.attr("local_rank").cast<int64_t>();
    world_ = local_world_ * topo.attr("nodes").cast<int64_t>();
    local_ = group_of(plan.attr("local_group"));
    cross_ = group_of(plan.attr("cross_group"));
    inner_runner_ = std::make_unique<HookRunner>(cross_, cross_, plan.attr("inner"),
                                                 plan.attr("inner_kind").cast<std::string>());
    inner_ = dynamic_cast<TwoPhaseAlgorithm*>(&inner_runner_->algorithm());
    TORCH_CHECK(inner_, "ddpx native comm hook: scope=inter_node needs a two-phase stage-2 algorithm");
  }

  // A bucket with nothing to compress (no inner layout) still runs through the pipeline,
  // whose last bucket drains it; its collective is the exempt values' allreduce.
  WorkPtr start_phase1(HookRunner&, const at::Tensor& buf, const Layout& lay, const Layout& pc) override {
    if (pc.integer("first")) stage_in(buf, lay);
    if (!lay.inner) return plain_work_.at(&lay);
    return inner_->start_phase1(*inner_runner_, shard(buf, lay), *lay.inner, pc);
  }

  WorkPtr start_phase2(HookRunner&, const at::Tensor& buf, const Layout& lay, const Layout& pc,
                       c10d::Work& first) override {
    if (!lay.inner) return WorkPtr::reclaim_copy(&first);
    return inner_->start_phase2(*inner_runner_, shard(buf, lay), *lay.inner, pc, first);
  }

  void finish(HookRunner&, const at::Tensor& buf, const Layout& lay, const Layout& pc, c10d::Work& second) override {
    if (lay.inner) {
      inner_->finish(*inner_runner_, shard(buf, lay), *lay.inner, pc, second);
      if (!lay.integer("whole")) share(lay, pc);
    }
    if (pc.integer("last")) stage_out(buf, lay);
  }

  // Across nodes only, as InterNode.wire_bytes.
  int64_t wire_bytes(HookRunner&, const Layout& lay) const override {
    int64_t cross = lay.inner ? inner_->wire_bytes(*inner_runner_, *lay.inner) : 0;
    if (!lay.integer("whole")) cross += ring_allreduce_bytes(4 * lay.tensor("shard_plain").numel(), inner_runner_->world());
    return cross;
  }

 private:
  static at::Tensor shard(const at::Tensor& buf, const Layout& lay) {
    return lay.integer("whole") ? buf : lay.tensor("shard_comp");
  }

  void stage_in(const at::Tensor& buf, const Layout& lay) {
    if (lay.integer("whole")) {
      buf.mul_(1.0 / static_cast<double>(local_world_));
      std::vector<at::Tensor> t{buf};
      local_->allreduce(t)->wait();
      return;
    }
    at::Tensor comp = lay.tensor("comp"), plain = lay.tensor("plain");
    if (lay.n_comp) {
      at::Tensor head = comp.narrow(0, 0, lay.n_comp);
      ddpx::ops::flatten_out(run_views(buf, lay.comp), 1.0 / static_cast<double>(local_world_), head);
      comp.narrow(0, lay.n_comp, comp.numel() - lay.n_comp).zero_();  // the last stage 3 wrote there
      reduce_scatter(comp, lay.tensor("comp_in"));
    }
    if (lay.n_plain) {
      at::Tensor head = plain.narrow(0, 0, lay.n_plain);
      ddpx::ops::flatten_out(run_views(buf, lay.plain), 1.0 / static_cast<double>(world_), head);
      reduce_scatter(plain, lay.tensor("plain_in"));
      std::vector<at::Tensor> t{lay.tensor("shard_plain")};
      plain_work_[&lay] = cross_->allreduce(t);
    }
  }

  void stage_out(const at::Tensor& buf, const Layout& lay) {
    if (lay.integer("whole")) return;
    at::Tensor comp = lay.tensor("comp"), plain = lay.tensor("plain");
    if (lay.n_comp) {  // every shard is in comp already (share, piece by piece)
      ddpx::ops::unflatten_(comp.narrow(0, 0, lay.n_comp), run_views(buf, lay.comp));
    }
    if (lay.n_plain) {
      auto it = plain_work_.find(&lay);
      TORCH_CHECK(it != plain_work_.end(), "ddpx inter_node: a bucket finished before its stage 1");
      WorkPtr work = std::move(it->second);
      plain_work_.erase(it);
      work->wait();
      all_gather(plain);
      ddpx::ops::unflatten_(plain.narrow(0, 0, lay.n_plain), run_views(buf, lay.plain));
    }
  }

  // As InterNode._reduce_scatter: one all-to-all of the rows, the other local ranks'
  // copies of this rank's row added in local-rank order (gloo's reduce-scatter is an
  // allreduce of everything).
  void reduce_scatter(at::Tensor rows, at::Tensor recv) {
    const int64_t n = rows.numel() / local_world_;
    std::vector<int64_t> equal_splits;
    local_->alltoall_base(recv, rows, equal_splits, equal_splits)->wait();
    at::Tensor mine = rows.narrow(0, local_rank_ * n, n);
    for (int64_t j = 0; j < local_world_; ++j) {
      if (j != local_rank_) mine.add_(recv.narrow(0, j * n, n));
    }
  }

  // As InterNode._share: stage 3 of the piece's compressed values. Each local rank's
  // stage-2 result message is broadcast inside the node and decoded into its shard of
  // comp by every rank, as its owner did (the bits of an all-gather of the decoded shards).
  void share(const Layout& lay, const Layout& pc) {
    at::Tensor result = pc.tensor("result"), own = pc.tensor("own_result"), comp = lay.tensor("comp");
    const int64_t n = comp.numel() / local_world_;
    own.copy_(result);  // the broadcasts before ours land in result
    for (int64_t j = 0; j < local_world_; ++j) {  // finish decodes result: one broadcast at a time
      std::vector<at::Tensor> t{j == local_rank_ ? own : result};
      c10d::BroadcastOptions opts;
      opts.rootRank = j;
      WorkPtr work = local_->broadcast(t, opts);
      work->wait();
      if (j != local_rank_) inner_->finish(*inner_runner_, comp.narrow(0, j * n, n), *lay.inner, pc, *work);
    }
  }

  // As InterNode._all_gather: one in-place broadcast per row.
  void all_gather(const at::Tensor& rows) {
    const int64_t n = rows.numel() / local_world_;
    std::vector<WorkPtr> works;
    for (int64_t j = 0; j < local_world_; ++j) {
      std::vector<at::Tensor> t{rows.narrow(0, j * n, n)};
      c10d::BroadcastOptions opts;
      opts.rootRank = j;
      works.push_back(local_->broadcast(t, opts));
    }
    for (auto& w : works) w->wait();
  }

  int64_t local_world_, local_rank_, world_;
  c10::intrusive_ptr<c10d::ProcessGroup> local_, cross_;
  std::unique_ptr<HookRunner> inner_runner_;
  TwoPhaseAlgorithm* inner_;  // inner_runner_'s algorithm
  // the exempt values' cross-node allreduce per bucket in flight; executor thread only
  std::unordered_map<const Layout*, WorkPtr> plain_work_;
};

}  // namespace
DDPX_REGISTER_NATIVE_HOOK("inter_node", InterNode);
}  // namespace ddpx::comm_hooks
