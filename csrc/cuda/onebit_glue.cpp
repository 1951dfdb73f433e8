// CUDA registrations of onebit_pack_out / onebit_unpack_accumulate_ (kernels in onebit.cu).
#include <torch/library.h>

#include "cuda/glue.h"
#include "cuda/kernels.h"
#include "ops/common.h"

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

}  // namespace
}  // namespace ddpx::cuda

TORCH_LIBRARY_IMPL(ddpx, CUDA, m) {
  m.impl("onebit_pack_out", &ddpx::cuda::onebit_pack_out);
  m.impl("onebit_unpack_accumulate_", &ddpx::cuda::onebit_unpack_accumulate_);
}
