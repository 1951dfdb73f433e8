// CUDA registrations of int8_quantize_out / int8_dequant_accumulate_ (kernels in int8_kernel.cu).
#include <torch/library.h>

#include "ops/cuda/glue.h"
#include "ops/cuda/kernels.h"
#include "ops/common.h"

namespace ddpx::cuda {
namespace {

void int8_quantize_out(const at::Tensor& x_in, int64_t block, const std::optional<at::Tensor>& error, at::Tensor& q,
                       at::Tensor& scales) {
  ops::detail::check_int8_quantize(x_in, block, error, q, scales);
  const c10::DeviceGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  float* ep = error ? error->mutable_data_ptr<float>() : nullptr;
  check_launch(int8_quantize(x.const_data_ptr<float>(), ep, q.mutable_data_ptr<int8_t>(),
                             scales.mutable_data_ptr<float>(), x.numel(), block, current_stream(x)),
               "int8_quantize");
}

void int8_dequant_accumulate_(at::Tensor& out, const at::Tensor& q_in, const at::Tensor& scales_in, int64_t block,
                              double alpha, bool accumulate) {
  auto [q, scales] = ops::detail::check_int8_dequant(out, q_in, scales_in, block);
  const c10::DeviceGuard guard(out.device());
  if (out.numel() > 0 && q.size(0) == 0) {  // a sum over zero ranks
    if (!accumulate) out.zero_();
    return;
  }
  check_launch(int8_dequant_accumulate(out.mutable_data_ptr<float>(), q.const_data_ptr<int8_t>(), q.stride(0),
                                       scales.const_data_ptr<float>(), scales.stride(0), q.size(0), out.numel(),
                                       block, static_cast<float>(alpha), accumulate, current_stream(out)),
               "int8_dequant_accumulate_");
}

}  // namespace
}  // namespace ddpx::cuda

TORCH_LIBRARY_IMPL(ddpx, CUDA, m) {
  m.impl("int8_quantize_out", &ddpx::cuda::int8_quantize_out);
  m.impl("int8_dequant_accumulate_", &ddpx::cuda::int8_dequant_accumulate_);
}
