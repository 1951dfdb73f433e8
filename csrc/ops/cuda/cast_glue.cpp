// CUDA registrations of scale_cast_out / cast_scale_copy_ (kernels in cast_kernel.cu).
#include <torch/library.h>

#include "ops/cuda/glue.h"
#include "ops/cuda/kernels.h"
#include "ops/common.h"

namespace ddpx::cuda {
namespace {

void scale_cast_out(const at::Tensor& x_in, double scale, at::Tensor& out) {
  ops::detail::check_scale_cast(x_in, out);
  const c10::DeviceGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  auto* op = static_cast<uint16_t*>(out.mutable_data_ptr());
  const float s = static_cast<float>(scale);
  const cudaStream_t stream = current_stream(x);
  check_launch(out.scalar_type() == at::kHalf
                   ? scale_cast_fp16(x.const_data_ptr<float>(), op, s, x.numel(), stream)
                   : scale_cast_bf16(x.const_data_ptr<float>(), op, s, x.numel(), stream),
               "scale_cast");
}

void cast_scale_copy_(at::Tensor& dst, const at::Tensor& src_in, double scale) {
  ops::detail::check_cast_scale_copy(dst, src_in);
  const c10::DeviceGuard guard(dst.device());
  const at::Tensor src = src_in.contiguous();
  const auto* sp = static_cast<const uint16_t*>(src.const_data_ptr());
  const float s = static_cast<float>(scale);
  const cudaStream_t stream = current_stream(dst);
  check_launch(src.scalar_type() == at::kHalf
                   ? cast_fp16_scale(sp, dst.mutable_data_ptr<float>(), s, dst.numel(), stream)
                   : cast_bf16_scale(sp, dst.mutable_data_ptr<float>(), s, dst.numel(), stream),
               "cast_scale_copy_");
}

}  // namespace
}  // namespace ddpx::cuda

TORCH_LIBRARY_IMPL(ddpx, CUDA, m) {
  m.impl("scale_cast_out", &ddpx::cuda::scale_cast_out);
  m.impl("cast_scale_copy_", &ddpx::cuda::cast_scale_copy_);
}
