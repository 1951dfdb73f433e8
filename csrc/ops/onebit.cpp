// 1-bit compression: signs of (x + error) packed LSB-first into bytes with one
// scale (mean |v|) per chunk, error feedback in the same pass; and the fused
// unpack-and-sum of several ranks' packed chunks.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops/common.h"
#include "ops/ops.h"

namespace ddpx::ops {
namespace detail {

void check_onebit_pack(const at::Tensor& x, int64_t chunk_size, const std::optional<at::Tensor>& error,
                       const at::Tensor& bits, const at::Tensor& scales) {
  const char* op = "onebit_pack";
  check_chunk_size(op, chunk_size);
  check_dtype(op, "x", x, at::kFloat);
  check_dtype(op, "out_bits", bits, at::kByte);
  check_dtype(op, "out_scales", scales, at::kFloat);
  check_numel(op, "out_bits", bits, ceil_div(x.numel(), 8));
  check_numel(op, "out_scales", scales, ceil_div(x.numel(), chunk_size));
  check_contiguous_output(op, "out_bits", bits);
  check_contiguous_output(op, "out_scales", scales);
  check_same_device(op, "out_bits", bits, x);
  check_same_device(op, "out_scales", scales, x);
  if (error) {
    check_dtype(op, "error", *error, at::kFloat);
    check_numel(op, "error", *error, x.numel());
    check_contiguous_output(op, "error", *error);
    check_same_device(op, "error", *error, x);
  }
}

std::pair<at::Tensor, at::Tensor> check_onebit_unpack(const at::Tensor& out, const at::Tensor& bits,
                                                      const at::Tensor& scales, int64_t chunk_size) {
  const char* op = "onebit_unpack_accumulate_";
  check_chunk_size(op, chunk_size);
  check_dtype(op, "out", out, at::kFloat);
  check_dtype(op, "bits", bits, at::kByte);
  check_dtype(op, "scales", scales, at::kFloat);
  check_contiguous_output(op, "out", out);
  check_same_device(op, "bits", bits, out);
  check_same_device(op, "scales", scales, out);
  at::Tensor b_rows = as_rows(bits, op, "bits");
  at::Tensor s_rows = as_rows(scales, op, "scales");
  const int64_t n = out.numel();
  TORCH_CHECK_VALUE(b_rows.size(1) == ceil_div(n, 8), "ddpx.ops.", op, ": bits rows must have ceil(", n,
                    " / 8) = ", ceil_div(n, 8), " bytes, got ", b_rows.size(1));
  TORCH_CHECK_VALUE(s_rows.size(1) == ceil_div(n, chunk_size), "ddpx.ops.", op, ": scales rows must have ceil(",
                    n, " / ", chunk_size, ") = ", ceil_div(n, chunk_size), " elements, got ", s_rows.size(1));
  TORCH_CHECK_VALUE(s_rows.size(0) == b_rows.size(0), "ddpx.ops.", op, ": bits has ", b_rows.size(0),
                    " rows but scales has ", s_rows.size(0));
  return {b_rows, s_rows};
}

}  // namespace detail

namespace {

std::tuple<at::Tensor, at::Tensor> onebit_pack_alloc(const at::Tensor& x, int64_t chunk,
                                                     const std::optional<at::Tensor>& error) {
  detail::check_chunk_size("onebit_pack", chunk);
  at::Tensor bits = at::empty({detail::ceil_div(x.numel(), 8)}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({detail::ceil_div(x.numel(), chunk)}, x.options().dtype(at::kFloat));
  onebit_pack_out(x, chunk, error, bits, scales);
  return {bits, scales};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> onebit_pack(const at::Tensor& x, int64_t chunk,
                                               const std::optional<at::Tensor>& error) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::onebit_pack", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t,
                                                                 const std::optional<at::Tensor>&)>();
  return op.call(x, chunk, error);
}

void onebit_pack_out(const at::Tensor& x, int64_t chunk, const std::optional<at::Tensor>& error, at::Tensor& bits,
                     at::Tensor& scales) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("ddpx::onebit_pack_out", "")
          .typed<void(const at::Tensor&, int64_t, const std::optional<at::Tensor>&, at::Tensor&, at::Tensor&)>();
  op.call(x, chunk, error, bits, scales);
}

at::Tensor& onebit_unpack_accumulate_(at::Tensor& out, const at::Tensor& bits, const at::Tensor& scales,
                                      int64_t chunk, double alpha, bool accumulate) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("ddpx::onebit_unpack_accumulate_", "")
          .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double, bool)>();
  op.call(out, bits, scales, chunk, alpha, accumulate);
  return out;
}

void onebit_average_repack(const at::Tensor& bits, const at::Tensor& scales, int64_t chunk, double alpha,
                           at::Tensor& error, at::Tensor& out_bits, at::Tensor& out_scales) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::onebit_average_repack", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, int64_t, double, at::Tensor&, at::Tensor&,
                                   at::Tensor&)>();
  op.call(bits, scales, chunk, alpha, error, out_bits, out_scales);
}

namespace {

// Every device without a fused kernel: the two ops it fuses, through a temporary.
void onebit_average_repack_composite(const at::Tensor& bits, const at::Tensor& scales, int64_t chunk, double alpha,
                                     at::Tensor& error, at::Tensor& out_bits, at::Tensor& out_scales) {
  at::Tensor average = at::empty({error.numel()}, error.options());
  onebit_unpack_accumulate_(average, bits, scales, chunk, alpha, false);
  onebit_pack_out(average, chunk, error, out_bits, out_scales);
}

}  // namespace
}  // namespace ddpx::ops

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  m.def(
      "onebit_average_repack(Tensor bits, Tensor scales, int chunk_size, float alpha, Tensor(a!) error, "
      "Tensor(b!) out_bits, Tensor(c!) out_scales) -> ()");
  m.def("onebit_pack(Tensor x, int chunk_size, Tensor(a!)? error=None) -> (Tensor, Tensor)");
  m.def("onebit_pack_out(Tensor x, int chunk_size, Tensor(a!)? error, Tensor(b!) bits, Tensor(c!) scales) -> ()");
  m.def(
      "onebit_unpack_accumulate_(Tensor(a!) out, Tensor bits, Tensor scales, int chunk_size, float alpha=1.0, "
      "bool accumulate=False) -> ()");
}

TORCH_LIBRARY_IMPL(ddpx, CompositeImplicitAutograd, m) {
  m.impl("onebit_pack", &ddpx::ops::onebit_pack_alloc);
}

TORCH_LIBRARY_IMPL(ddpx, CompositeExplicitAutograd, m) {
  m.impl("onebit_average_repack", &ddpx::ops::onebit_average_repack_composite);
}
