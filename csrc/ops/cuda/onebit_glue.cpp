// CUDA registrations of onebit_pack_out / onebit_unpack_accumulate_ / onebit_average_repack
// (kernels in onebit_kernel.cu).
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "ops/cuda/glue.h"
#include "ops/cuda/kernels.h"
#include "ops/common.h"
#include "ops/ops.h"

namespace ddpx::cuda {
namespace {

void onebit_pack_out(const at::Tensor& x_in, int64_t chunk, const std::optional<at::Tensor>& error,
                     at::Tensor& bits, at::Tensor& scales) {
  ops::detail::check_onebit_pack(x_in, chunk, error, bits, scales);
  const c10::DeviceGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  float* ep = error ? error->mutable_data_ptr<float>() : nullptr;
  check_launch(onebit_pack(x.const_data_ptr<float>(), ep, bits.mutable_data_ptr<uint8_t>(),
                           scales.mutable_data_ptr<float>(), x.numel(), chunk, current_stream(x)),
               "onebit_pack");
}

void onebit_unpack_accumulate_(at::Tensor& out, const at::Tensor& bits_in, const at::Tensor& scales_in,
                               int64_t chunk, double alpha, bool accumulate) {
  auto [bits, scales] = ops::detail::check_onebit_unpack(out, bits_in, scales_in, chunk);
  const c10::DeviceGuard guard(out.device());
  if (out.numel() > 0 && bits.size(0) == 0) {
    if (!accumulate) out.zero_();
    return;
  }
  check_launch(onebit_unpack_accumulate(out.mutable_data_ptr<float>(), bits.const_data_ptr<uint8_t>(),
                                        bits.stride(0), scales.const_data_ptr<float>(), scales.stride(0),
                                        bits.size(0), out.numel(), chunk, static_cast<float>(alpha), accumulate,
                                        current_stream(out)),
               "onebit_unpack_accumulate_");
}

void onebit_average_repack(const at::Tensor& bits_in, const at::Tensor& scales_in, int64_t chunk, double alpha,
                           at::Tensor& error, at::Tensor& out_bits, at::Tensor& out_scales) {
  auto [bits, scales] = ops::detail::check_onebit_unpack(error, bits_in, scales_in, chunk);
  ops::detail::check_onebit_pack(error, chunk, error, out_bits, out_scales);
  const c10::DeviceGuard guard(error.device());
  if (error.numel() > 0 && bits.size(0) == 0) {  // an average of nothing: zeros, packed (as the CPU kernel)
    ops::onebit_pack_out(at::zeros({error.numel()}, error.options()), chunk, error, out_bits, out_scales);
    return;
  }
  check_launch(onebit_average_repack_rows(bits.const_data_ptr<uint8_t>(), bits.stride(0),
                                          scales.const_data_ptr<float>(), scales.stride(0), bits.size(0),
                                          static_cast<float>(alpha),
                                          error.mutable_data_ptr<float>(), out_bits.mutable_data_ptr<uint8_t>(),
                                          out_scales.mutable_data_ptr<float>(), error.numel(), chunk,
                                          current_stream(error)),
               "onebit_average_repack");
}

}  // namespace
}  // namespace ddpx::cuda

TORCH_LIBRARY_IMPL(ddpx, CUDA, m) {
  m.impl("onebit_average_repack", &ddpx::cuda::onebit_average_repack);
  m.impl("onebit_pack_out", &ddpx::cuda::onebit_pack_out);
  m.impl("onebit_unpack_accumulate_", &ddpx::cuda::onebit_unpack_accumulate_);
}
