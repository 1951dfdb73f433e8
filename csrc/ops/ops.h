// C++ entry points of the ddpx fused kernels (torch ops in namespace `ddpx`).
//
// Every function goes through the c10 dispatcher, so it runs the CPU or CUDA
// kernel according to the tensors' device, exactly like torch.ops.ddpx.* from
// Python. Semantics, formats and the NaN policy are documented in ddpx/ops.py;
// in short:
//   int8:   per block of `block_size` elements, scale = max|v| / 127 (fp32),
//           q = clamp(round_half_even(v / scale), -127, 127); scale 0 for an
//           all-zero block; scale NaN for a block holding NaN/Inf.
//   onebit: per chunk, scale = mean|v|; bit i = (v_i >= 0), LSB-first in
//           uint8; decoded = bit ? +scale : -scale; scale NaN for non-finite.
//   error feedback: v = x + error, then error = v - dequant(v) in the same
//           pass (left unchanged for non-finite blocks).
// The *_out variants write into preallocated buffers (e.g. slices of a send
// buffer); outputs must be contiguous and of the documented dtype and size.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace ddpx::ops {

// out = (x * scale).to(dtype), dtype float16 or bfloat16.
at::Tensor scale_cast(const at::Tensor& x, double scale, at::ScalarType dtype);
at::Tensor& scale_cast_out(const at::Tensor& x, double scale, at::Tensor& out);

// dst (fp32, in place) = src (fp16/bf16).float() * scale.
at::Tensor& cast_scale_copy_(at::Tensor& dst, const at::Tensor& src, double scale);

// Returns (q int8 [n], scales fp32 [ceil(n / block)]); updates `error` in place.
std::tuple<at::Tensor, at::Tensor> int8_quantize(const at::Tensor& x, int64_t block,
                                                 const std::optional<at::Tensor>& error = std::nullopt);
void int8_quantize_out(const at::Tensor& x, int64_t block, const std::optional<at::Tensor>& error, at::Tensor& q,
                       at::Tensor& scales);

// out = (accumulate ? out : 0) + alpha * sum_r q[r] * scales[r, block]; q int8
// [R, n] and scales fp32 [R, ceil(n / block)] (1-D means R = 1, rows may be strided).
at::Tensor& int8_dequant_accumulate_(at::Tensor& out, const at::Tensor& q, const at::Tensor& scales, int64_t block,
                                     double alpha = 1.0, bool accumulate = false);

// Returns (bits uint8 [ceil(n / 8)], scales fp32 [ceil(n / chunk)]); chunk % 8 == 0.
std::tuple<at::Tensor, at::Tensor> onebit_pack(const at::Tensor& x, int64_t chunk,
                                               const std::optional<at::Tensor>& error = std::nullopt);
void onebit_pack_out(const at::Tensor& x, int64_t chunk, const std::optional<at::Tensor>& error, at::Tensor& bits,
                     at::Tensor& scales);

// out (fp32, n = out.numel()) = (accumulate ? out : 0) + alpha * sum_r decoded[r].
at::Tensor& onebit_unpack_accumulate_(at::Tensor& out, const at::Tensor& bits, const at::Tensor& scales,
                                      int64_t chunk, double alpha = 1.0, bool accumulate = false);

// 1-bit phase 2 in one pass: v = alpha * sum_r decoded[r] (n = error.numel()), then
// onebit_pack_out(v, chunk, error, out_bits, out_scales); bit-identical to those two ops.
void onebit_average_repack(const at::Tensor& bits, const at::Tensor& scales, int64_t chunk, double alpha,
                           at::Tensor& error, at::Tensor& out_bits, at::Tensor& out_scales);

// Concatenate (times scale) same-dtype tensors of any shape/strides into one flat buffer.
at::Tensor flatten(at::TensorList tensors, double scale = 1.0);
at::Tensor& flatten_out(at::TensorList tensors, double scale, at::Tensor& out);

// Copy consecutive slices of flat (times scale) back into contiguous tensors.
void unflatten_(const at::Tensor& flat, at::TensorList tensors, double scale = 1.0);

// PowerSGD's passes over a gradient matrix m [n, k] and its memory error [n, k]
// (the previous step's full sum), with p, p_prev [n, r] and qt [r, k] (Q
// transposed), all fp32 and contiguous:
// lowrank_project_: error = (m + error) - p_prev qt; p = error qt^T.
void lowrank_project_(const at::Tensor& m, at::Tensor& error, const at::Tensor& p_prev, const at::Tensor& qt,
                      at::Tensor& p);
// lowrank_transpose_project_: qt = p^T m (Q = M^T P, written transposed).
void lowrank_transpose_project_(const at::Tensor& m, const at::Tensor& p, at::Tensor& qt);
// lowrank_reconstruct_: m = p qt.
void lowrank_reconstruct_(at::Tensor& m, const at::Tensor& p, const at::Tensor& qt);

}  // namespace ddpx::ops
