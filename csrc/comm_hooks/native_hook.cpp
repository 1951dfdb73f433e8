// The native hook's shared machinery: algorithm registry, FIFO executor, layouts
// fetched from the Python state, counters, and the plain fp32 average.
#include "comm_hooks/native_hook.h"

#include <ATen/record_function.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <pthread.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <chrono>

namespace py = pybind11;

namespace ddpx::comm_hooks {

// ---------------------------------------------------------------- registry
namespace {
std::unordered_map<std::string, AlgorithmFactory>& algorithms() {
  static std::unordered_map<std::string, AlgorithmFactory> registry;
  return registry;
}
// Every registration, a kind registered twice included: ddpx.comm_hooks.check_native_kinds
// refuses that (the map above keeps one of them) and any kind no Python state names.
std::vector<std::string>& registered_kinds() {
  static std::vector<std::string> kinds;
  return kinds;
}
}  // namespace

bool register_algorithm(const std::string& kind, AlgorithmFactory factory) {
  registered_kinds().push_back(kind);
  algorithms()[kind] = std::move(factory);
  return true;
}

std::vector<std::string> algorithm_kinds() { return registered_kinds(); }

// ------------------------------------------------------------ SerialExecutor
namespace {
// How often an idle executor checks that its process group still exists.
constexpr auto kIdleCheck = std::chrono::seconds(1);
}  // namespace

SerialExecutor::SerialExecutor(std::string name, std::function<bool()> alive)
    : name_(std::move(name)), alive_(std::move(alive)) {}

SerialExecutor::~SerialExecutor() { stop(); }

void SerialExecutor::stop() {
  std::thread thread;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    thread = std::move(thread_);
  }
  cv_.notify_all();
  if (!thread.joinable()) return;
  if (thread.get_id() == std::this_thread::get_id()) {
    thread.detach();  // the last job released the hook: the thread ends after it
    return;
  }
  // A job may wait for the GIL (a new bucket layout): never join holding it.
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release nogil;
    thread.join();
  } else {
    thread.join();
  }
}

void SerialExecutor::submit(std::function<void()> job) {
  std::thread finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!stop_, name_, ": this comm hook was closed; register a new one with ddpx.comm_hooks.register()");
    if (!running_) {
      finished = std::move(thread_);  // one that ended idle: already out of loop()
      running_ = true;
      thread_ = std::thread([this] { loop(); });
    }
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
  if (finished.joinable()) finished.join();
}

void SerialExecutor::loop() {
  pthread_setname_np(pthread_self(), name_.substr(0, 15).c_str());  // Linux: at most 15 characters
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (!cv_.wait_for(lock, kIdleCheck, [this] { return stop_ || !jobs_.empty(); })) {
      lock.unlock();
      const bool alive = !alive_ || alive_();
      lock.lock();
      if (!alive && jobs_.empty() && !stop_) {
        running_ = false;  // the next submit starts a new thread
        return;
      }
      continue;
    }
    if (jobs_.empty()) {  // stopping and drained
      running_ = false;
      return;
    }
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    job();
    job = nullptr;  // release what it holds before waiting again
    lock.lock();
  }
}

// ----------------------------------------------------------------- helpers
const at::Tensor& Layout::tensor(const std::string& name) const {
  auto it = tensors.find(name);
  TORCH_CHECK(it != tensors.end(), "ddpx native comm hook: the bucket layout has no tensor '", name, "'");
  return it->second;
}

int64_t Layout::integer(const std::string& name) const {
  auto it = ints.find(name);
  TORCH_CHECK(it != ints.end(), "ddpx native comm hook: the bucket layout has no integer '", name, "'");
  return it->second;
}

std::vector<at::Tensor> run_views(const at::Tensor& buf, const std::vector<Run>& runs) {
  std::vector<at::Tensor> views;
  views.reserve(runs.size());
  for (const auto& r : runs) views.push_back(buf.narrow(0, r.offset, r.numel));
  return views;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> piece_views(const at::Tensor& bytes, int64_t piece,
                                                           int64_t plain_chunk, int64_t blocks,
                                                           at::ScalarType payload) {
  at::Tensor m = bytes.view({-1, piece});
  const int64_t e4 = 4 * plain_chunk, b4 = 4 * blocks;
  return {m.slice(1, 0, e4).view(at::kFloat), m.slice(1, e4, e4 + b4).view(at::kFloat),
          m.slice(1, e4 + b4, piece).view(payload)};
}

int64_t ring_allreduce_bytes(int64_t nbytes, int64_t world) { return 2 * (world - 1) * nbytes / world; }

namespace {
std::vector<Run> read_runs(const py::handle& runs) {
  std::vector<Run> out;
  for (auto item : runs) {
    auto t = item.cast<py::tuple>();
    out.push_back({t[0].cast<int64_t>(), t[1].cast<int64_t>(), t[2].cast<int64_t>()});
  }
  return out;
}

// Every int and tensor attribute of a Python layout (or piece) object, by name.
void read_attributes(const py::handle& obj, Layout& out) {
  for (auto item : obj.attr("__dict__").cast<py::dict>()) {
    const auto name = item.first.cast<std::string>();
    py::handle value = item.second;
    if (THPVariable_Check(value.ptr())) {
      out.tensors[name] = value.cast<at::Tensor>();
    } else if (py::isinstance<py::int_>(value) && !py::isinstance<py::bool_>(value)) {
      out.ints[name] = value.cast<int64_t>();
    }
  }
}

// A Python BucketLayout: runs, attributes, pieces (with the layout's n_comp and
// n_plain) and, for scope=inter_node, the stage-2 layout whose pieces are its own.
std::shared_ptr<Layout> read_layout(const py::handle& lay) {
  auto out = std::make_shared<Layout>();
  out->comp = read_runs(lay.attr("comp_runs"));
  out->plain = read_runs(lay.attr("plain_runs"));
  out->n_comp = lay.attr("n_comp").cast<int64_t>();
  out->n_plain = lay.attr("n_plain").cast<int64_t>();
  read_attributes(lay, *out);
  py::object inner = py::getattr(lay, "inner", py::none());
  if (!inner.is_none()) {
    auto in = read_layout(inner);
    out->pieces = in->pieces;
    out->inner = std::move(in);
  } else if (py::hasattr(lay, "pieces")) {
    for (auto item : lay.attr("pieces")) {
      auto pc = std::make_shared<Layout>();
      pc->n_comp = out->n_comp;
      pc->n_plain = out->n_plain;
      read_attributes(item, *pc);
      out->pieces.push_back(std::move(pc));
    }
  }
  return out;
}
}  // namespace

// -------------------------------------------------------------- HookRunner
namespace {
// Whether `pg` is still registered with torch.distributed (destroy_process_group unregisters it).
std::function<bool()> registered(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  if (!pg) return nullptr;
  return [raw = pg.get(), name = pg->getGroupName()] {
    try {
      return c10d::resolve_process_group(name).get() == raw;
    } catch (const std::exception&) {
      return false;
    }
  };
}
}  // namespace

HookRunner::HookRunner(c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::intrusive_ptr<c10d::ProcessGroup> executor_pg,
                       py::object state, const std::string& kind)
    : pg_(std::move(pg)),
      executor_pg_(std::move(executor_pg)),
      state_(std::move(state)),
      executor_("ddpx-" + kind, registered(executor_pg_)) {
  world_ = state_.attr("world_size").cast<int64_t>();
  rank_ = state_.attr("rank").cast<int64_t>();
  counters_ = state_.attr("counters").cast<at::Tensor>();
  warmup_ = int_option("warmup_steps", 0);
  auto it = algorithms().find(kind);
  TORCH_CHECK(it != algorithms().end(), "ddpx native comm hook: no native algorithm '", kind, "'");
  algorithm_ = it->second(*this);
}

HookRunner::~HookRunner() {
  executor_.stop();  // first: its jobs use the state
  // The Python state may only be released under the GIL, and not at all once
  // the interpreter is gone.
  if (Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    state_ = py::object();
  } else {
    state_.release();
  }
}

void HookRunner::close() { executor_.stop(); }

c10d::ProcessGroup& HookRunner::executor_group() {
  TORCH_CHECK(executor_pg_, "ddpx native comm hook: this hook was registered without an executor group");
  return *executor_pg_;
}

namespace {
// Option `name` of the Python state's checked options (`state.opts`), or None where its
// method has no such option.
py::object option(const py::object& state, const char* name) {
  py::dict opts = state.attr("opts");
  return opts.contains(name) ? py::object(opts[name]) : py::object(py::none());
}
}  // namespace

int64_t HookRunner::int_option(const char* name) const {
  py::object v = option(state_, name);
  TORCH_CHECK(!v.is_none(), "ddpx native comm hook: the state's method has no option '", name, "'");
  return v.cast<int64_t>();
}

int64_t HookRunner::int_option(const char* name, int64_t fallback) const {
  py::object v = option(state_, name);
  return v.is_none() ? fallback : v.cast<int64_t>();
}

double HookRunner::float_option(const char* name, double fallback) const {
  py::object v = option(state_, name);
  return v.is_none() ? fallback : v.cast<double>();
}

std::string HookRunner::str_option(const char* name) const { return py::str(option(state_, name)); }

void HookRunner::count(int64_t bucket_numel, int64_t wire_bytes, bool last) {
  int64_t* c = counters_.data_ptr<int64_t>();
  c[0] += 4 * bucket_numel;
  c[1] += wire_bytes;
  c[3] += 1;
  if (last) c[2] += 1;
}

bool HookRunner::warming_up() const { return counters_.data_ptr<int64_t>()[2] < warmup_; }

std::shared_ptr<const Layout> HookRunner::layout(c10d::GradBucket& bucket) {
  const auto params = bucket.getParameters();
  const size_t index = bucket.getIndex();
  std::vector<const c10::TensorImpl*> signature;
  signature.reserve(params.size());
  for (const auto& p : params) signature.push_back(p.unsafeGetTensorImpl());
  {
    std::lock_guard<std::mutex> lock(layouts_mu_);
    auto it = layouts_.find(index);
    if (it != layouts_.end() && it->second->signature == signature) return it->second;
  }
  // A bucket not seen before: the Python state builds (and owns) its layout.
  py::gil_scoped_acquire gil;
  py::list plist;
  for (const auto& p : params) plist.append(py::cast(p));
  auto out = read_layout(state_.attr("layout")(index, plist));
  out->signature = std::move(signature);
  std::lock_guard<std::mutex> lock(layouts_mu_);
  layouts_[index] = out;
  return out;
}

FuturePtr HookRunner::run(c10d::GradBucket& bucket) {
  if (warming_up()) return allreduce_average(bucket);
  return algorithm_->run(*this, bucket);
}

FuturePtr HookRunner::allreduce_average(c10d::GradBucket& bucket) {
  at::Tensor buf = bucket.getBuffer();
  count(buf.numel(), ring_allreduce_bytes(buf.numel() * buf.element_size(), world_), bucket.isLast());
  buf.mul_(1.0 / static_cast<double>(world_));
  std::vector<at::Tensor> tensors{buf};
  auto fut = pg_->allreduce(tensors)->getFuture();
  return fut->then(
      [buf](c10::ivalue::Future& done) {
        done.value();  // re-raises a failed collective
        return c10::IValue(buf);
      },
      c10::TensorType::get());
}

FuturePtr HookRunner::submit(const at::Tensor& buf, std::function<void()> work) {
  return submit_deferred(buf, [buf, work = std::move(work)](const FuturePtr& fut) {
    work();
    fut->markCompleted(c10::IValue(buf));
  });
}

FuturePtr HookRunner::submit_deferred(const at::Tensor& buf, std::function<void(const FuturePtr&)> work) {
  const c10::Device device = buf.device();
  std::vector<c10::Device> devices;
  std::shared_ptr<c10::Event> ready;
  if (device.type() != c10::DeviceType::CPU) {  // the bucket was produced on the caller's stream
    devices.push_back(device);
    c10::impl::VirtualGuardImpl impl(device.type());
    ready = std::make_shared<c10::Event>(device.type());
    ready->record(impl.getStream(device));
  }
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(), devices);
  executor_.submit([this, fut, ready, device, work = std::move(work)]() {
    try {
      if (ready) {
        c10::impl::VirtualGuardImpl impl(device.type());
        // One stream for every job, as the Python executor: torch keeps a cuBLAS workspace
        // per (handle, stream), 32 MiB each on sm90, so a pool stream per job (32 of
        // them in turn) held about 1 GiB for PowerSGD's matmuls.
        if (!side_stream_ || side_stream_->device() != device) side_stream_ = impl.getStreamFromGlobalPool(device);
        c10::StreamGuard guard(*side_stream_);
        ready->block(impl.getStream(device));
        work(fut);  // completing a future records readiness on this stream
      } else {
        work(fut);
      }
    } catch (...) {  // surfaces in loss.backward() on this rank
      if (!fut->completed()) fut->setError(std::current_exception());
    }
  });
  return fut;
}

FuturePtr NativeHook::runHook(c10d::GradBucket& bucket) { return state_->run(bucket); }

int64_t TwoPhaseAlgorithm::wire_bytes(HookRunner& runner, const Layout& lay) const {
  int64_t total = 0;
  for (const auto& pc : lay.pieces) total += 2 * (runner.world() - 1) * pc->integer("piece");
  return total;
}

FuturePtr TwoPhaseAlgorithm::run(HookRunner& runner, c10d::GradBucket& bucket) {
  at::Tensor buf = bucket.getBuffer();
  auto lay = runner.layout(bucket);
  TORCH_CHECK(!lay->pieces.empty(), "ddpx native comm hook: the bucket layout has no pieces");
  const bool last = bucket.isLast();
  runner.count(buf.numel(), wire_bytes(runner, *lay), last);
  return runner.submit_deferred(buf, [this, &runner, buf, lay, last](const FuturePtr& fut) {
    const size_t n = lay->pieces.size();
    for (size_t i = 0; i < n; ++i) step(runner, Job{buf, lay, lay->pieces[i].get(), nullptr, fut}, last && i + 1 == n);
  });
}

void TwoPhaseAlgorithm::fail(Job& job, std::exception_ptr error) {
  if (!job.fut->completed()) job.fut->setError(std::move(error));
}

void TwoPhaseAlgorithm::step(HookRunner& runner, Job started, bool last) {
  std::unique_ptr<Job> advancing = std::move(advancing_);
  std::deque<Job> finishing = std::move(finishing_);
  finishing_.clear();
  try {
    RECORD_USER_SCOPE("ddpx::encode");  // profiler ranges, as in the Python hook: a flag test when none runs
    started.work = start_phase1(runner, started.buf, *started.lay, *started.pc);
  } catch (...) {  // fail every bucket in flight: they surface in loss.backward()
    if (advancing) fail(*advancing, std::current_exception());
    for (auto& job : finishing) fail(job, std::current_exception());
    throw;
  }
  std::vector<Job*> to_advance;
  if (advancing) to_advance.push_back(advancing.get());
  if (last) to_advance.push_back(&started);
  for (Job* job : to_advance) {
    try {
      RECORD_USER_SCOPE("ddpx::collective");
      job->work = start_phase2(runner, job->buf, *job->lay, *job->pc, *job->work);
    } catch (...) {
      fail(*job, std::current_exception());
      continue;
    }
    finishing.push_back(std::move(*job));
  }
  if (!last) advancing_ = std::make_unique<Job>(std::move(started));
  const size_t keep = last ? 0 : 1;  // the second collective just started: finished by the next step
  while (finishing.size() > keep) {
    Job job = std::move(finishing.front());
    finishing.pop_front();
    try {
      RECORD_USER_SCOPE("ddpx::decode");
      finish(runner, job.buf, *job.lay, *job.pc, *job.work);
    } catch (...) {
      fail(job, std::current_exception());
      continue;
    }
    if (job.pc->integer("last") && !job.fut->completed()) job.fut->markCompleted(c10::IValue(job.buf));
  }
  finishing_ = std::move(finishing);
}

}  // namespace ddpx::comm_hooks
