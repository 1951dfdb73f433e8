// Blockwise int8 quantization with optional error feedback, and the fused
// dequantize-and-sum of several ranks' blocks.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops/common.h"
#include "ops/ops.h"

namespace ddpx::ops {
namespace detail {

void check_int8_quantize(const at::Tensor& x, int64_t block_size, const std::optional<at::Tensor>& error,
                         const at::Tensor& q, const at::Tensor& scales) {
  const char* op = "int8_quantize";
  check_positive(op, "block_size", block_size);
  check_dtype(op, "x", x, at::kFloat);
  check_dtype(op, "out_q", q, at::kChar);
  check_dtype(op, "out_scales", scales, at::kFloat);
  check_numel(op, "out_q", q, x.numel());
  check_numel(op, "out_scales", scales, ceil_div(x.numel(), block_size));
  check_contiguous_output(op, "out_q", q);
  check_contiguous_output(op, "out_scales", scales);
  check_same_device(op, "out_q", q, x);
  check_same_device(op, "out_scales", scales, x);
  if (error) {
    check_dtype(op, "error", *error, at::kFloat);
    check_numel(op, "error", *error, x.numel());
    check_contiguous_output(op, "error", *error);
    check_same_device(op, "error", *error, x);
  }
}

std::pair<at::Tensor, at::Tensor> check_int8_dequant(const at::Tensor& out, const at::Tensor& q,
                                                     const at::Tensor& scales, int64_t block_size) {
  const char* op = "int8_dequant_accumulate_";
  check_positive(op, "block_size", block_size);
  check_dtype(op, "out", out, at::kFloat);
  check_dtype(op, "q", q, at::kChar);
  check_dtype(op, "scales", scales, at::kFloat);
  check_contiguous_output(op, "out", out);
  check_same_device(op, "q", q, out);
  check_same_device(op, "scales", scales, out);
  at::Tensor q_rows = as_rows(q, op, "q");
  at::Tensor s_rows = as_rows(scales, op, "scales");
  const int64_t n = out.numel();
  TORCH_CHECK_VALUE(q_rows.size(1) == n, "ddpx.ops.", op, ": q rows must have out.numel() = ", n,
                    " elements, got ", q_rows.size(1));
  TORCH_CHECK_VALUE(s_rows.size(1) == ceil_div(n, block_size), "ddpx.ops.", op, ": scales rows must have ceil(",
                    n, " / ", block_size, ") = ", ceil_div(n, block_size), " elements, got ", s_rows.size(1));
  TORCH_CHECK_VALUE(s_rows.size(0) == q_rows.size(0), "ddpx.ops.", op, ": q has ", q_rows.size(0),
                    " rows but scales has ", s_rows.size(0));
  return {q_rows, s_rows};
}

}  // namespace detail

namespace {

std::tuple<at::Tensor, at::Tensor> int8_quantize_alloc(const at::Tensor& x, int64_t block,
                                                       const std::optional<at::Tensor>& error) {
  detail::check_positive("int8_quantize", "block_size", block);
  at::Tensor q = at::empty({x.numel()}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({detail::ceil_div(x.numel(), block)}, x.options().dtype(at::kFloat));
  int8_quantize_out(x, block, error, q, scales);
  return {q, scales};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> int8_quantize(const at::Tensor& x, int64_t block,
                                                 const std::optional<at::Tensor>& error) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::int8_quantize", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t,
                                                                 const std::optional<at::Tensor>&)>();
  return op.call(x, block, error);
}

void int8_quantize_out(const at::Tensor& x, int64_t block, const std::optional<at::Tensor>& error, at::Tensor& q,
                       at::Tensor& scales) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("ddpx::int8_quantize_out", "")
          .typed<void(const at::Tensor&, int64_t, const std::optional<at::Tensor>&, at::Tensor&, at::Tensor&)>();
  op.call(x, block, error, q, scales);
}

at::Tensor& int8_dequant_accumulate_(at::Tensor& out, const at::Tensor& q, const at::Tensor& scales, int64_t block,
                                     double alpha, bool accumulate) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("ddpx::int8_dequant_accumulate_", "")
          .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double, bool)>();
  op.call(out, q, scales, block, alpha, accumulate);
  return out;
}

}  // namespace ddpx::ops

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  m.def("int8_quantize(Tensor x, int block_size, Tensor(a!)? error=None) -> (Tensor, Tensor)");
  m.def("int8_quantize_out(Tensor x, int block_size, Tensor(a!)? error, Tensor(b!) q, Tensor(c!) scales) -> ()");
  m.def(
      "int8_dequant_accumulate_(Tensor(a!) out, Tensor q, Tensor scales, int block_size, float alpha=1.0, "
      "bool accumulate=False) -> ()");
}

TORCH_LIBRARY_IMPL(ddpx, CompositeImplicitAutograd, m) {
  m.impl("int8_quantize", &ddpx::ops::int8_quantize_alloc);
}
