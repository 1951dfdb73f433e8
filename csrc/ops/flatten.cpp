// Multi-tensor flatten/unflatten: many small tensors <-> one flat buffer in a
// single call (the building block of fused bucketed collectives).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops/common.h"
#include "ops/ops.h"

namespace ddpx::ops {
namespace detail {

static void check_scale_dtype(const char* op, at::ScalarType dtype, double scale) {
  TORCH_CHECK_TYPE(scale == 1.0 || at::isFloatingType(dtype), "ddpx.ops.", op, ": scale=", scale,
                   " needs floating tensors, got ", dtype_name(dtype));
}

int64_t check_flatten(at::TensorList tensors, double scale, const at::Tensor& out) {
  const char* op = "flatten";
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_TYPE(t.scalar_type() == out.scalar_type(), "ddpx.ops.flatten: tensors[", i, "] must be ",
                     dtype_name(out.scalar_type()), " like the others, got ", dtype_name(t.scalar_type()));
    TORCH_CHECK_VALUE(t.device() == out.device(), "ddpx.ops.flatten: tensors[", i, "] is on ", t.device(),
                      " but out is on ", out.device());
    total += t.numel();
  }
  check_scale_dtype(op, out.scalar_type(), scale);
  check_contiguous_output(op, "out", out);
  TORCH_CHECK_VALUE(out.numel() >= total, "ddpx.ops.flatten: out has ", out.numel(),
                    " elements but the tensors hold ", total);
  return total;
}

int64_t check_unflatten(const at::Tensor& flat, at::TensorList tensors, double scale) {
  const char* op = "unflatten_";
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_TYPE(t.scalar_type() == flat.scalar_type(), "ddpx.ops.unflatten_: tensors[", i, "] must be ",
                     dtype_name(flat.scalar_type()), " like flat, got ", dtype_name(t.scalar_type()));
    TORCH_CHECK_VALUE(t.device() == flat.device(), "ddpx.ops.unflatten_: tensors[", i, "] is on ", t.device(),
                      " but flat is on ", flat.device());
    TORCH_CHECK_VALUE(t.is_contiguous(), "ddpx.ops.unflatten_: tensors[", i,
                      "] is written in place and must be contiguous (got strides ", t.strides(), ")");
    total += t.numel();
  }
  check_scale_dtype(op, flat.scalar_type(), scale);
  TORCH_CHECK_VALUE(flat.numel() >= total, "ddpx.ops.unflatten_: flat has ", flat.numel(),
                    " elements but the tensors need ", total);
  return total;
}

}  // namespace detail

at::Tensor flatten(at::TensorList tensors, double scale) {
  int64_t total = 0;
  for (const at::Tensor& t : tensors) total += t.numel();
  at::TensorOptions options = tensors.empty() ? at::TensorOptions().dtype(at::kFloat) : tensors[0].options();
  at::Tensor out = at::empty({total}, options);
  return flatten_out(tensors, scale, out);
}

at::Tensor& flatten_out(at::TensorList tensors, double scale, at::Tensor& out) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::flatten_out", "")
                       .typed<void(at::TensorList, double, at::Tensor&)>();
  op.call(tensors, scale, out);
  return out;
}

void unflatten_(const at::Tensor& flat, at::TensorList tensors, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::unflatten_", "")
                       .typed<void(const at::Tensor&, at::TensorList, double)>();
  op.call(flat, tensors, scale);
}

}  // namespace ddpx::ops

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  // out.numel() may exceed the tensors' total (a padded bucket); the rest is left as is.
  m.def("flatten_out(Tensor[] tensors, float scale, Tensor(a!) out) -> ()");
  // flat.numel() may exceed the tensors' total; the rest is ignored.
  m.def("unflatten_(Tensor flat, Tensor(a!)[] tensors, float scale=1.0) -> ()");
}
