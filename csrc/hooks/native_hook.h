// Native DDP comm hooks: the ddpx algorithms run in C++ on the reducer, with
// no Python and no GIL per bucket.
//
// The Python state object (ddpx/hooks/base.py) stays the owner of everything:
// options, the counters tensor, per-bucket layouts and their buffers (error
// feedback memory included). The native hook asks it for a bucket's layout
// only when DDP hands over a bucket it has not seen (first iterations and the
// bucket rebuild), then keeps references to the layout's tensors, so
// state_dict() and stats() see what the native hook wrote.
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/extension.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace ddpx::hooks {

// A run of consecutive parameters of one class in the bucket.
struct Run {
  int64_t offset;  // in the bucket
  int64_t numel;
  int64_t packed;  // in the class's packed buffer
};

// C++ mirror of ddpx.hooks.base.BucketLayout (and the hook's buffers).
struct Layout {
  std::vector<const c10::TensorImpl*> signature;  // the bucket's parameters
  std::vector<Run> comp, plain;
  int64_t n_comp = 0, n_plain = 0;
  // int8
  int64_t chunk = 0, blocks = 0, plain_chunk = 0, piece = 0;
  // buffers, by the Python attribute names
  at::Tensor wire, plain_buf, comp_buf, reduced, worker_error, server_error, send, recv, send2, recv2;
};

// Runs jobs one after another on one thread, in submission order, so every
// rank issues the multi-phase collectives in DDP's bucket order.
class SerialWorker {
 public:
  ~SerialWorker();
  void submit(std::function<void()> job);

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::thread thread_;
};

// Everything a native hook needs; shared by the hook object and its jobs.
class HookCore {
 public:
  HookCore(c10::intrusive_ptr<c10d::ProcessGroup> pg, pybind11::object state, std::string kind);
  ~HookCore();

  c10::intrusive_ptr<c10::ivalue::Future> run(c10d::GradBucket& bucket);

 private:
  std::shared_ptr<Layout> layout(c10d::GradBucket& bucket);
  void count(int64_t bucket_numel, int64_t wire_bytes, bool last);
  bool warming_up() const;
  c10::intrusive_ptr<c10::ivalue::Future> allreduce_average(c10d::GradBucket& bucket);
  c10::intrusive_ptr<c10::ivalue::Future> run_cast(c10d::GradBucket& bucket);
  c10::intrusive_ptr<c10::ivalue::Future> run_int8(c10d::GradBucket& bucket);
  void reduce_int8(at::Tensor buf, const Layout& lay);

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  pybind11::object state_;  // the Python HookState; touched only under the GIL
  std::string kind_;
  int64_t world_, rank_;
  int64_t warmup_ = 0, block_ = 0;
  at::ScalarType dtype_ = at::kFloat;
  at::Tensor counters_;  // int64 [raw_bytes, wire_bytes, steps], owned by the Python state
  std::mutex layouts_mu_;
  std::unordered_map<size_t, std::shared_ptr<Layout>> layouts_;
  SerialWorker worker_;
};

class NativeHook : public c10d::CppCommHookInterface<std::shared_ptr<HookCore>> {
 public:
  using c10d::CppCommHookInterface<std::shared_ptr<HookCore>>::CppCommHookInterface;
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
};

}  // namespace ddpx::hooks
