// Argument checks shared by every device's kernels, so CPU and CUDA reject bad
// input with the same Python exception type and message:
//   TORCH_CHECK_TYPE  -> TypeError  (wrong dtype)
//   TORCH_CHECK_VALUE -> ValueError (sizes, contiguity of in-place outputs, devices)
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

#include <string>

namespace ddpx::ops::detail {

// The Python spelling ("torch.float32"), so messages match what users typed.
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(t);
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline void check_dtype(const char* op, const char* arg, const at::Tensor& t, at::ScalarType want) {
  TORCH_CHECK_TYPE(t.scalar_type() == want, "ddpx.ops.", op, ": ", arg, " must be ", dtype_name(want),
                   ", got ", dtype_name(t.scalar_type()));
}

inline void check_half_dtype(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, "ddpx.ops.", op, ": ",
                   arg, " must be torch.float16 or torch.bfloat16, got ", dtype_name(t.scalar_type()));
}

// In-place outputs are written through raw pointers: a strided view would be
// silently corrupted, so refuse it instead of copying.
inline void check_contiguous_output(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_contiguous(), "ddpx.ops.", op, ": ", arg,
                    " is written in place and must be contiguous (got strides ", t.strides(),
                    "); pass a contiguous tensor, e.g. t.contiguous()");
}

inline void check_numel(const char* op, const char* arg, const at::Tensor& t, int64_t want) {
  TORCH_CHECK_VALUE(t.numel() == want, "ddpx.ops.", op, ": ", arg, " must have ", want,
                    " elements, got ", t.numel());
}

inline void check_same_device(const char* op, const char* arg, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "ddpx.ops.", op, ": ", arg, " is on ", t.device(),
                    " but the other tensors are on ", ref.device());
}

inline void check_positive(const char* op, const char* arg, int64_t v) {
  TORCH_CHECK_VALUE(v > 0, "ddpx.ops.", op, ": ", arg, " must be positive, got ", v);
}

inline void check_chunk_size(const char* op, int64_t chunk) {
  check_positive(op, "chunk_size", chunk);
  TORCH_CHECK_VALUE(chunk % 8 == 0, "ddpx.ops.", op, ": chunk_size must be a multiple of 8 (bits are packed ",
                    "8 per byte), got ", chunk);
}

// A [R, m] view of the rows received from R ranks: 1-D means one row. Rows may
// have any stride (views into one receive buffer); the last dim must be dense,
// otherwise a contiguous copy is made.
inline at::Tensor as_rows(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK_VALUE(t.dim() == 1 || t.dim() == 2, "ddpx.ops.", op, ": ", arg,
                    " must be 1-D or 2-D [ranks, n], got shape ", t.sizes());
  at::Tensor rows = t.dim() == 1 ? t.unsqueeze(0) : t;
  if (rows.size(1) > 1 && rows.stride(1) != 1) rows = rows.contiguous();
  return rows;
}

// Argument checks per op; the kernels call them first.
void check_scale_cast(const at::Tensor& x, const at::Tensor& out);
void check_cast_scale_copy(const at::Tensor& dst, const at::Tensor& src);
void check_int8_quantize(const at::Tensor& x, int64_t block_size, const std::optional<at::Tensor>& error,
                         const at::Tensor& q, const at::Tensor& scales);
// Returns (q, scales) as [R, m] row views.
std::pair<at::Tensor, at::Tensor> check_int8_dequant(const at::Tensor& out, const at::Tensor& q,
                                                     const at::Tensor& scales, int64_t block_size);
void check_onebit_pack(const at::Tensor& x, int64_t chunk_size, const std::optional<at::Tensor>& error,
                       const at::Tensor& bits, const at::Tensor& scales);
std::pair<at::Tensor, at::Tensor> check_onebit_unpack(const at::Tensor& out, const at::Tensor& bits,
                                                      const at::Tensor& scales, int64_t chunk_size);
// Returns the total element count.
int64_t check_flatten(at::TensorList tensors, double scale, const at::Tensor& out);
int64_t check_unflatten(const at::Tensor& flat, at::TensorList tensors, double scale);
// The low-rank passes: m [n, k], p [n, r], qt [r, k]; error (like m) and p_prev
// (like p) where the op takes them.
void check_lowrank(const char* op, const at::Tensor& m, const at::Tensor* error, const at::Tensor& p,
                   const at::Tensor& qt, const at::Tensor* p_prev = nullptr);

}  // namespace ddpx::ops::detail
