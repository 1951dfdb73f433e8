// Native DDP comm hooks: the ddpx algorithms run in C++ on the reducer, with
// no Python and no GIL per bucket.
//
// The Python state object (ddpx/comm_hooks/state.py) stays the owner of everything:
// options, the counters tensor, per-bucket layouts and their buffers (error
// feedback memory included). The native hook asks it for a bucket's layout
// only when DDP hands over a bucket it has not seen (first iterations and the
// bucket rebuild), then keeps references to the layout's tensors, so
// state_dict() and stats() see what the native hook wrote.
//
// Adding an algorithm = one csrc/comm_hooks/<name>.cpp defining a NativeAlgorithm and
// DDPX_REGISTER_NATIVE_HOOK("<kind>", Class); the method's descriptor names the kind
// (Method.native, ddpx/comm_hooks/registry.py), and ddpx.comm_hooks refuses a build whose
// kinds differ (check_native_kinds).
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/extension.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace ddpx::comm_hooks {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// A run of consecutive parameters of one class in the bucket.
struct Run {
  int64_t offset;  // in the bucket
  int64_t numel;
  int64_t packed;  // in the class's packed buffer
};

// C++ view of a ddpx.comm_hooks.state.BucketLayout: the runs, plus every int and
// tensor attribute the Python hook's build_layout() set, by attribute name.
struct Layout {
  std::vector<const c10::TensorImpl*> signature;  // the bucket's parameters
  std::vector<Run> comp, plain;
  int64_t n_comp = 0, n_plain = 0;
  std::unordered_map<std::string, at::Tensor> tensors;
  std::unordered_map<std::string, int64_t> ints;
  // The pieces the bucket is coded, sent and decoded in (the Python layout's
  // `pieces`, ddpx/comm_hooks/twophase.py): their own ints and tensors; n_comp and
  // n_plain are the bucket's. Empty for single-phase hooks.
  std::vector<std::shared_ptr<const Layout>> pieces;
  // scope=inter_node (ddpx/comm_hooks/scope.py): the stage-2 layout, whose pieces are
  // `pieces`; null otherwise.
  std::shared_ptr<const Layout> inner;
  // An algorithm's own data for this layout or piece (e.g. views of its buffers), made
  // on first use by the executor thread and gone with the layout.
  mutable std::shared_ptr<void> cache;

  const at::Tensor& tensor(const std::string& name) const;
  int64_t integer(const std::string& name) const;
};

// Slices of the bucket, one per run, as contiguous 1-D views.
std::vector<at::Tensor> run_views(const at::Tensor& buf, const std::vector<Run>& runs);

// (plain fp32 [R, plain_chunk], scales fp32 [R, blocks], payload [R, rest]) views
// of a byte buffer of R rank messages laid out [plain | scales | payload], each
// `piece` bytes (the two-phase hooks' wire format).
std::tuple<at::Tensor, at::Tensor, at::Tensor> piece_views(const at::Tensor& bytes, int64_t piece,
                                                           int64_t plain_chunk, int64_t blocks,
                                                           at::ScalarType payload);

int64_t ring_allreduce_bytes(int64_t nbytes, int64_t world);

// The two-phase hooks' spans (`spans`, int64 [k, 4]: rank, bucket offset, numel,
// offset in the rank's segment): compressed values coded straight from, and
// decoded straight into, the bucket. f(rank, bucket offset, numel, segment offset).
inline bool has_spans(const Layout& lay) { return lay.tensor("spans").size(0) > 0; }
template <typename F>
void for_each_span(const Layout& lay, F f) {
  const at::Tensor& spans = lay.tensor("spans");
  const int64_t* sp = spans.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < spans.size(0); ++i) f(sp[4 * i], sp[4 * i + 1], sp[4 * i + 2], sp[4 * i + 3]);
}

// Runs jobs one after another on one thread, in submission order, so every
// rank issues the multi-phase collectives in DDP's bucket order. The thread
// (named `name`, as ddpx.comm_hooks.executor.SerialExecutor's) ends on stop() (the
// hook's close(), its destruction) and when, idle, it finds `alive()` false
// (the process group destroyed); a later submit starts a new one.
class SerialExecutor {
 public:
  SerialExecutor(std::string name, std::function<bool()> alive);
  ~SerialExecutor();
  void submit(std::function<void()> job);
  // Runs the jobs already queued, ends the thread and waits for it; submit fails after.
  void stop();

 private:
  void loop();
  std::string name_;
  std::function<bool()> alive_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  bool running_ = false;  // the thread is in loop(); false once it decided to end
  std::thread thread_;
};

class HookRunner;

// One compression algorithm (the C++ twin of a Python HookState.run_bucket).
class NativeAlgorithm {
 public:
  virtual ~NativeAlgorithm() = default;
  virtual FuturePtr run(HookRunner& runner, c10d::GradBucket& bucket) = 0;
};

// A hook with two dependent collectives per bucket (int8 and onebit: all-to-all,
// local average, all-gather; powersgd: allreduce P, orthogonalize, allreduce Q),
// pipelined piece by piece (a bucket's layout is cut into `pieces`) as
// ddpx/comm_hooks/twophase.py does: the step of piece i starts piece i's first
// collective, advances piece i-1 (starting its second) and finishes piece i-2,
// across the pieces of a bucket and on into the next bucket; the last piece of
// the last bucket finishes everything. A bucket's future completes with its last
// piece. Collective order, the same on every rank: C1 0, C1 1, C2 0, C1 2, C2 1,
// ..., C2 last.
class TwoPhaseAlgorithm : public NativeAlgorithm {
 public:
  FuturePtr run(HookRunner& runner, c10d::GradBucket& bucket) final;

  // Public so that scope=inter_node (inter_node.cpp) can run them as its stage 2.
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;
  // Code piece `pc` of the bucket; return its first collective, started.
  virtual WorkPtr start_phase1(HookRunner& runner, const at::Tensor& buf, const Layout& lay, const Layout& pc) = 0;
  // Wait for the piece's first collective, compute; return the second, started.
  virtual WorkPtr start_phase2(HookRunner& runner, const at::Tensor& buf, const Layout& lay, const Layout& pc,
                               c10d::Work& first) = 0;
  // Wait for the piece's second collective, write its result into the bucket.
  virtual void finish(HookRunner& runner, const at::Tensor& buf, const Layout& lay, const Layout& pc,
                      c10d::Work& second) = 0;
  // Bytes this rank sends per step for the bucket (stats()): by default each
  // piece's all-to-all + all-gather message of R rows, (R-1)/R of it twice.
  virtual int64_t wire_bytes(HookRunner& runner, const Layout& lay) const;

 private:
  struct Job {
    at::Tensor buf;
    std::shared_ptr<const Layout> lay;
    const Layout* pc;  // one of lay->pieces
    WorkPtr work;      // the collective in flight
    FuturePtr fut;     // the bucket's
  };
  void step(HookRunner& runner, Job started, bool last);
  static void fail(Job& job, std::exception_ptr error);
  // touched only by the executor thread
  std::unique_ptr<Job> advancing_;  // first collective started
  std::deque<Job> finishing_;       // second collective started
};

using AlgorithmFactory = std::function<std::unique_ptr<NativeAlgorithm>(HookRunner&)>;
bool register_algorithm(const std::string& kind, AlgorithmFactory factory);
std::vector<std::string> algorithm_kinds();  // one entry per registration

#define DDPX_REGISTER_NATIVE_HOOK(kind, cls)                                                      \
  static const bool ddpx_native_hook_registered_##cls = ::ddpx::comm_hooks::register_algorithm( \
      kind, [](::ddpx::comm_hooks::HookRunner& runner) { return std::make_unique<cls>(runner); })

// Runs one native hook's NativeAlgorithm on each bucket (NativeHook::runHook;
// scope=inter_node keeps one more for its stage 2) and holds what every native
// hook shares: the group, the Python state and its options, counters and
// layouts, and the FIFO executor.
class HookRunner {
 public:
  // `executor_pg` (may be null for single-phase hooks) is the private group of
  // the executor's collectives; see ddpx/comm_hooks/executor.py (executor_group) for why.
  HookRunner(c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::intrusive_ptr<c10d::ProcessGroup> executor_pg,
             pybind11::object state, const std::string& kind);
  ~HookRunner();
  // Ends the executor thread (ddpx.comm_hooks.state.HookState.close()); the hook must not run again.
  void close();

  FuturePtr run(c10d::GradBucket& bucket);

  // The bucket's layout, built by the Python state the first time it is seen.
  std::shared_ptr<const Layout> layout(c10d::GradBucket& bucket);
  // Adds to the shared counters [raw_bytes, wire_bytes, steps, buckets].
  void count(int64_t bucket_numel, int64_t wire_bytes, bool last);
  bool warming_up() const;
  // Plain fp32 average in place (the allreduce hook and every warm-up step).
  FuturePtr allreduce_average(c10d::GradBucket& bucket);
  // Runs `work` on the FIFO executor (on a side stream that waits for the
  // bucket, on accelerators); the future completes with the bucket.
  FuturePtr submit(const at::Tensor& buf, std::function<void()> work);
  // Like submit, but `work` completes the future itself, possibly from a later
  // job (software pipelining across buckets).
  FuturePtr submit_deferred(const at::Tensor& buf, std::function<void(const FuturePtr&)> work);
  // An option of the Python state, from its checked options dict `state.opts` (read once,
  // at construction time). Without a fallback the method must have it: its Option default
  // (ddpx/comm_hooks/options.py) is the only default.
  int64_t int_option(const char* name) const;
  int64_t int_option(const char* name, int64_t fallback) const;
  double float_option(const char* name, double fallback) const;
  std::string str_option(const char* name) const;

  c10d::ProcessGroup& group() { return *pg_; }
  // The Python state (use under the GIL) and the algorithm running it.
  const pybind11::object& state() const { return state_; }
  NativeAlgorithm& algorithm() { return *algorithm_; }
  c10d::ProcessGroup& executor_group();
  int64_t world() const { return world_; }
  int64_t rank() const { return rank_; }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> pg_, executor_pg_;
  pybind11::object state_;  // the Python HookState; touched only under the GIL
  int64_t world_, rank_;
  int64_t warmup_ = 0;
  at::Tensor counters_;  // int64 [raw_bytes, wire_bytes, steps, buckets], owned by the Python state
  std::mutex layouts_mu_;
  std::unordered_map<size_t, std::shared_ptr<const Layout>> layouts_;
  std::unique_ptr<NativeAlgorithm> algorithm_;
  std::optional<c10::Stream> side_stream_;  // the executor's stream on accelerators (executor thread only)
  SerialExecutor executor_;  // last member: stopped first on destruction
};

class NativeHook : public c10d::CppCommHookInterface<std::shared_ptr<HookRunner>> {
 public:
  using c10d::CppCommHookInterface<std::shared_ptr<HookRunner>>::CppCommHookInterface;
  FuturePtr runHook(c10d::GradBucket& bucket) override;
};

}  // namespace ddpx::comm_hooks
