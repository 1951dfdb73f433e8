// The C++ twin of ddpx/hooks/{allreduce,halfprec,int8}.py: same layouts, same
// kernels, same collectives in the same order, so results are bit-identical.
#include "hooks/native_hook.h"

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "ops/ops.h"

namespace py = pybind11;

namespace ddpx::hooks {

// ------------------------------------------------------------ SerialWorker
SerialWorker::~SerialWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void SerialWorker::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void SerialWorker::loop() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping and drained
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

// ---------------------------------------------------------------- helpers
namespace {

int64_t ring_allreduce_bytes(int64_t nbytes, int64_t world) { return 2 * (world - 1) * nbytes / world; }

std::vector<Run> read_runs(const py::object& runs) {
  std::vector<Run> out;
  for (auto item : runs) {
    auto t = item.cast<py::tuple>();
    out.push_back({t[0].cast<int64_t>(), t[1].cast<int64_t>(), t[2].cast<int64_t>()});
  }
  return out;
}

std::vector<at::Tensor> run_views(const at::Tensor& buf, const std::vector<Run>& runs) {
  std::vector<at::Tensor> views;
  views.reserve(runs.size());
  for (const auto& r : runs) views.push_back(buf.narrow(0, r.offset, r.numel));
  return views;
}

// (plain fp32 [R, e], scales fp32 [R, b], q int8 [R, c]) views of a byte buffer
// of rank messages laid out [plain | scales | q] (see ddpx/hooks/int8.py).
std::tuple<at::Tensor, at::Tensor, at::Tensor> piece_views(const Layout& lay, const at::Tensor& bytes) {
  at::Tensor m = bytes.view({-1, lay.piece});
  const int64_t e4 = 4 * lay.plain_chunk, b4 = 4 * lay.blocks;
  return {m.slice(1, 0, e4).view(at::kFloat), m.slice(1, e4, e4 + b4).view(at::kFloat),
          m.slice(1, e4 + b4, lay.piece).view(at::kChar)};
}

template <typename T>
T attr_or(const py::object& obj, const char* name, T fallback) {
  py::object v = py::getattr(obj, name, py::none());
  return v.is_none() ? fallback : v.cast<T>();
}

}  // namespace

// ---------------------------------------------------------------- HookCore
HookCore::HookCore(c10::intrusive_ptr<c10d::ProcessGroup> pg, py::object state, std::string kind)
    : pg_(std::move(pg)), state_(std::move(state)), kind_(std::move(kind)) {
  TORCH_CHECK_VALUE(kind_ == "allreduce" || kind_ == "cast" || kind_ == "int8",
                    "ddpx native comm hook: unknown kind '", kind_, "'");
  world_ = state_.attr("world_size").cast<int64_t>();
  rank_ = state_.attr("rank").cast<int64_t>();
  counters_ = state_.attr("counters").cast<at::Tensor>();
  warmup_ = attr_or<int64_t>(state_, "warmup_steps", 0);
  block_ = attr_or<int64_t>(state_, "block_size", 0);
  if (kind_ == "cast") {
    std::string dtype = py::str(state_.attr("dtype"));
    dtype_ = dtype == "torch.bfloat16" ? at::kBFloat16 : at::kHalf;
  }
}

HookCore::~HookCore() {
  // The Python state may only be released under the GIL, and not at all once
  // the interpreter is gone.
  if (Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    state_ = py::object();
  } else {
    state_.release();
  }
}

void HookCore::count(int64_t bucket_numel, int64_t wire_bytes, bool last) {
  int64_t* c = counters_.data_ptr<int64_t>();
  c[0] += 4 * bucket_numel;
  c[1] += wire_bytes;
  if (last) c[2] += 1;
}

bool HookCore::warming_up() const { return counters_.data_ptr<int64_t>()[2] < warmup_; }

std::shared_ptr<Layout> HookCore::layout(c10d::GradBucket& bucket) {
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
  py::object lay = state_.attr("layout")(index, plist);
  auto out = std::make_shared<Layout>();
  out->signature = std::move(signature);
  out->comp = read_runs(lay.attr("comp_runs"));
  out->plain = read_runs(lay.attr("plain_runs"));
  out->n_comp = lay.attr("n_comp").cast<int64_t>();
  out->n_plain = lay.attr("n_plain").cast<int64_t>();
  out->chunk = attr_or<int64_t>(lay, "chunk", 0);
  out->blocks = attr_or<int64_t>(lay, "blocks", 0);
  out->plain_chunk = attr_or<int64_t>(lay, "plain_chunk", 0);
  out->piece = attr_or<int64_t>(lay, "piece", 0);
  out->wire = attr_or<at::Tensor>(lay, "wire", at::Tensor());
  out->plain_buf = attr_or<at::Tensor>(lay, "plain", at::Tensor());
  out->comp_buf = attr_or<at::Tensor>(lay, "comp", at::Tensor());
  out->reduced = attr_or<at::Tensor>(lay, "reduced", at::Tensor());
  out->worker_error = attr_or<at::Tensor>(lay, "worker_error", at::Tensor());
  out->server_error = attr_or<at::Tensor>(lay, "server_error", at::Tensor());
  out->send = attr_or<at::Tensor>(lay, "send", at::Tensor());
  out->recv = attr_or<at::Tensor>(lay, "recv", at::Tensor());
  out->send2 = attr_or<at::Tensor>(lay, "send2", at::Tensor());
  out->recv2 = attr_or<at::Tensor>(lay, "recv2", at::Tensor());
  std::lock_guard<std::mutex> lock(layouts_mu_);
  layouts_[index] = out;
  return out;
}

c10::intrusive_ptr<c10::ivalue::Future> HookCore::run(c10d::GradBucket& bucket) {
  if (kind_ == "allreduce" || warming_up()) return allreduce_average(bucket);
  if (kind_ == "cast") return run_cast(bucket);
  return run_int8(bucket);
}

c10::intrusive_ptr<c10::ivalue::Future> HookCore::allreduce_average(c10d::GradBucket& bucket) {
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

c10::intrusive_ptr<c10::ivalue::Future> HookCore::run_cast(c10d::GradBucket& bucket) {
  at::Tensor buf = bucket.getBuffer();
  auto lay = layout(bucket);
  const double inv = 1.0 / static_cast<double>(world_);
  count(buf.numel(), ring_allreduce_bytes(2 * lay->n_comp + 4 * lay->n_plain, world_), bucket.isLast());
  c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futs(c10::FutureType::create(c10::AnyType::get()));
  if (lay->n_comp) {
    for (const auto& r : lay->comp) {
      at::Tensor out = lay->wire.narrow(0, r.packed, r.numel);
      ddpx::ops::scale_cast_out(buf.narrow(0, r.offset, r.numel), inv, out);
    }
    std::vector<at::Tensor> t{lay->wire};
    futs.push_back(pg_->allreduce(t)->getFuture());
  }
  if (lay->n_plain) {
    ddpx::ops::flatten_out(run_views(buf, lay->plain), inv, lay->plain_buf);
    std::vector<at::Tensor> t{lay->plain_buf};
    futs.push_back(pg_->allreduce(t)->getFuture());
  }
  return c10::collectAll(futs)->then(
      [buf, lay](c10::ivalue::Future& done) {
        done.value();  // re-raises a failed collective
        for (const auto& r : lay->comp) {
          at::Tensor dst = buf.narrow(0, r.offset, r.numel);
          ddpx::ops::cast_scale_copy_(dst, lay->wire.narrow(0, r.packed, r.numel), 1.0);
        }
        if (lay->n_plain) ddpx::ops::unflatten_(lay->plain_buf, run_views(buf, lay->plain));
        return c10::IValue(buf);
      },
      c10::TensorType::get());
}

c10::intrusive_ptr<c10::ivalue::Future> HookCore::run_int8(c10d::GradBucket& bucket) {
  at::Tensor buf = bucket.getBuffer();
  auto lay = layout(bucket);
  count(buf.numel(), 2 * (world_ - 1) * lay->piece, bucket.isLast());
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
  worker_.submit([this, buf, lay, fut, ready, device]() {
    try {
      if (ready) {
        c10::impl::VirtualGuardImpl impl(device.type());
        c10::StreamGuard guard(impl.getStreamFromGlobalPool(device));
        ready->block(impl.getStream(device));
        reduce_int8(buf, *lay);
        fut->markCompleted(c10::IValue(buf));
      } else {
        reduce_int8(buf, *lay);
        fut->markCompleted(c10::IValue(buf));
      }
    } catch (...) {  // surfaces in loss.backward() on this rank
      fut->setError(std::current_exception());
    }
  });
  return fut;
}

void HookCore::reduce_int8(at::Tensor buf, const Layout& lay) {
  const int64_t c = lay.chunk, world = world_;
  const double inv = 1.0 / static_cast<double>(world);
  const auto comp_views = run_views(buf, lay.comp);
  const auto plain_views = run_views(buf, lay.plain);
  at::Tensor comp = lay.comp_buf, plain_buf = lay.plain_buf;
  // phase 1: quantize each destination's chunk into its piece, exchange
  ddpx::ops::flatten_out(comp_views, 1.0, comp);
  ddpx::ops::flatten_out(plain_views, 1.0, plain_buf);
  {
    auto [plain, scales, q] = piece_views(lay, lay.send);
    plain.copy_(plain_buf.view({world, lay.plain_chunk}));
    for (int64_t r = 0; r < world; ++r) {
      at::Tensor qr = q[r], sr = scales[r];
      ddpx::ops::int8_quantize_out(comp.narrow(0, r * c, c), block_, lay.worker_error.narrow(0, r * c, c), qr, sr);
    }
  }
  std::vector<int64_t> equal_splits;
  at::Tensor recv = lay.recv, send = lay.send, recv2 = lay.recv2, send2 = lay.send2;
  pg_->alltoall_base(recv, send, equal_splits, equal_splits)->wait();
  // local fp32 average of this rank's chunk, server error feedback, requantize
  {
    auto [plain, scales, q] = piece_views(lay, recv);
    auto [plain2, scales2, q2] = piece_views(lay, send2);
    at::Tensor p2 = plain2[0], s2 = scales2[0], qq2 = q2[0], reduced = lay.reduced;
    at::sum_out(p2, plain, {0}).mul_(inv);
    ddpx::ops::int8_dequant_accumulate_(reduced, q, scales, block_, inv, false);
    ddpx::ops::int8_quantize_out(reduced, block_, lay.server_error.narrow(0, rank_ * c, c), qq2, s2);
  }
  // phase 2: everyone gets every averaged chunk
  pg_->_allgather_base(recv2, send2)->wait();
  {
    auto [plain, scales, q] = piece_views(lay, recv2);
    for (int64_t r = 0; r < world; ++r) {
      at::Tensor out = comp.narrow(0, r * c, c);
      ddpx::ops::int8_dequant_accumulate_(out, q[r], scales[r], block_, 1.0, false);
    }
    plain_buf.view({world, lay.plain_chunk}).copy_(plain);
  }
  ddpx::ops::unflatten_(comp, comp_views);
  ddpx::ops::unflatten_(plain_buf, plain_views);
}

c10::intrusive_ptr<c10::ivalue::Future> NativeHook::runHook(c10d::GradBucket& bucket) { return state_->run(bucket); }

}  // namespace ddpx::hooks
