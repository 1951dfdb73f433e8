// scale_cast: (x * scale) -> fp16/bf16 (the "divide by world size" fused into
// the cast before sending); cast_scale_copy_: the return path, fp16/bf16 ->
// fp32 times scale, written straight into the gradient buffer.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops/common.h"
#include "ops/ops.h"

namespace ddpx::ops {
namespace detail {

void check_scale_cast(const at::Tensor& x, const at::Tensor& out) {
  check_dtype("scale_cast", "x", x, at::kFloat);
  check_half_dtype("scale_cast", "out", out);
  check_same_device("scale_cast", "out", out, x);
  check_numel("scale_cast", "out", out, x.numel());
  check_contiguous_output("scale_cast", "out", out);
}

void check_cast_scale_copy(const at::Tensor& dst, const at::Tensor& src) {
  check_dtype("cast_scale_copy_", "dst", dst, at::kFloat);
  check_half_dtype("cast_scale_copy_", "src", src);
  check_same_device("cast_scale_copy_", "src", src, dst);
  check_numel("cast_scale_copy_", "src", src, dst.numel());
  check_contiguous_output("cast_scale_copy_", "dst", dst);
}

}  // namespace detail

namespace {

at::Tensor scale_cast_alloc(const at::Tensor& x, double scale, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16,
                   "ddpx.ops.scale_cast: dtype must be torch.float16 or torch.bfloat16, got ",
                   detail::dtype_name(dtype));
  at::Tensor out = at::empty({x.numel()}, x.options().dtype(dtype));
  scale_cast_out(x, scale, out);
  return out;
}

}  // namespace

at::Tensor scale_cast(const at::Tensor& x, double scale, at::ScalarType dtype) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::scale_cast", "")
                       .typed<at::Tensor(const at::Tensor&, double, at::ScalarType)>();
  return op.call(x, scale, dtype);
}

at::Tensor& scale_cast_out(const at::Tensor& x, double scale, at::Tensor& out) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::scale_cast_out", "")
                       .typed<void(const at::Tensor&, double, at::Tensor&)>();
  op.call(x, scale, out);
  return out;
}

at::Tensor& cast_scale_copy_(at::Tensor& dst, const at::Tensor& src, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::cast_scale_copy_", "")
                       .typed<void(at::Tensor&, const at::Tensor&, double)>();
  op.call(dst, src, scale);
  return dst;
}

}  // namespace ddpx::ops

// Every op file adds its schemas to the `ddpx` namespace; device kernels are
// registered in csrc/ops/cpu and csrc/ops/cuda.
TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  m.def("scale_cast(Tensor x, float scale, ScalarType dtype) -> Tensor");
  m.def("scale_cast_out(Tensor x, float scale, Tensor(a!) out) -> ()");
  m.def("cast_scale_copy_(Tensor(a!) dst, Tensor src, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(ddpx, CompositeImplicitAutograd, m) {
  m.impl("scale_cast", &ddpx::ops::scale_cast_alloc);
}
