// CUDA registrations of flatten_out / unflatten_ (multi-tensor kernel in flatten_kernel.cu).
#include <ATen/ops/mul.h>
#include <torch/library.h>

#include <vector>

#include "ops/cuda/glue.h"
#include "ops/cuda/kernels.h"
#include "ops/common.h"

namespace ddpx::cuda {
namespace {

void copy_pieces(const std::vector<CopyPiece>& pieces, at::ScalarType dtype, double scale, cudaStream_t stream,
                 const char* op) {
  if (pieces.empty()) return;
  const int64_t count = static_cast<int64_t>(pieces.size());
  if (scale == 1.0) {
    check_launch(multi_copy(pieces.data(), count, static_cast<int>(c10::elementSize(dtype)), stream), op);
    return;
  }
  ElemType type = ElemType::kFloat32;
  switch (dtype) {
    case at::kFloat: type = ElemType::kFloat32; break;
    case at::kDouble: type = ElemType::kFloat64; break;
    case at::kHalf: type = ElemType::kFloat16; break;
    case at::kBFloat16: type = ElemType::kBFloat16; break;
    default:
      TORCH_CHECK_TYPE(false, "ddpx.ops.", op, ": scaled copies on CUDA support float32/float64/float16/bfloat16, got ",
                       ops::detail::dtype_name(dtype));
  }
  check_launch(multi_scaled_copy(pieces.data(), count, type, scale, stream), op);
}

// Element sizes the plain-copy kernel moves natively; others go through copy_.
bool native_size(const at::Tensor& t) {
  const size_t s = t.element_size();
  return s == 1 || s == 2 || s == 4 || s == 8;
}

void flatten_out(at::TensorList tensors, double scale, at::Tensor& out) {
  ops::detail::check_flatten(tensors, scale, out);
  const c10::DeviceGuard guard(out.device());
  const int64_t item = static_cast<int64_t>(out.element_size());
  char* base = static_cast<char*>(out.data_ptr());
  std::vector<CopyPiece> pieces;
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    const int64_t n = t.numel();
    if (n > 0 && t.is_contiguous() && (native_size(t) || scale != 1.0)) {
      pieces.push_back({t.const_data_ptr(), base + offset * item, n});
    } else if (n > 0) {  // strided: torch's copy kernels handle any layout
      at::Tensor slot = out.narrow(0, offset, n).view(t.sizes());
      if (scale == 1.0) {
        slot.copy_(t);
      } else {
        at::mul_out(slot, t, scale);
      }
    }
    offset += n;
  }
  copy_pieces(pieces, out.scalar_type(), scale, current_stream(out), "flatten");
}

void unflatten_(const at::Tensor& flat_in, at::TensorList tensors, double scale) {
  ops::detail::check_unflatten(flat_in, tensors, scale);
  const c10::DeviceGuard guard(flat_in.device());
  const at::Tensor flat = flat_in.contiguous();
  const int64_t item = static_cast<int64_t>(flat.element_size());
  const char* base = static_cast<const char*>(flat.const_data_ptr());
  std::vector<CopyPiece> pieces;
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    const int64_t n = t.numel();
    if (n > 0 && (native_size(t) || scale != 1.0)) {
      pieces.push_back({base + offset * item, t.data_ptr(), n});
    } else if (n > 0) {
      at::Tensor(t).view(-1).copy_(flat.narrow(0, offset, n));
    }
    offset += n;
  }
  copy_pieces(pieces, flat.scalar_type(), scale, current_stream(flat), "unflatten_");
}

}  // namespace
}  // namespace ddpx::cuda

TORCH_LIBRARY_IMPL(ddpx, CUDA, m) {
  m.impl("flatten_out", &ddpx::cuda::flatten_out);
  m.impl("unflatten_", &ddpx::cuda::unflatten_);
}
