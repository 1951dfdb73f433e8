// Launchers of the plain-CUDA kernels (csrc/ops/cuda/*.cu). No torch types, so the
// .cu files compile with nvcc alone (scripts/check_cuda.sh); the *_glue.cpp
// files check arguments, pick the current stream and call these. fp16/bf16
// data travels as raw uint16_t. Each launcher returns cudaGetLastError().
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace ddpx::cuda {

cudaError_t scale_cast_fp16(const float* x, uint16_t* out, float scale, int64_t n, cudaStream_t stream);
cudaError_t scale_cast_bf16(const float* x, uint16_t* out, float scale, int64_t n, cudaStream_t stream);
cudaError_t cast_fp16_scale(const uint16_t* src, float* dst, float scale, int64_t n, cudaStream_t stream);
cudaError_t cast_bf16_scale(const uint16_t* src, float* dst, float scale, int64_t n, cudaStream_t stream);

// error may be null (no error feedback).
cudaError_t int8_quantize(const float* x, float* error, int8_t* q, float* scales, int64_t n, int64_t block,
                          cudaStream_t stream);
cudaError_t int8_dequant_accumulate(float* out, const int8_t* q, int64_t q_row_stride, const float* scales,
                                    int64_t s_row_stride, int64_t rows, int64_t n, int64_t block, float alpha,
                                    bool accumulate, cudaStream_t stream);

cudaError_t onebit_pack(const float* x, float* error, uint8_t* bits, float* scales, int64_t n, int64_t chunk,
                        cudaStream_t stream);
cudaError_t onebit_unpack_accumulate(float* out, const uint8_t* bits, int64_t b_row_stride, const float* scales,
                                     int64_t s_row_stride, int64_t rows, int64_t n, int64_t chunk, float alpha,
                                     bool accumulate, cudaStream_t stream);
// 1-bit phase 2: v = alpha * sum_r decoded rows, then onebit_pack(v) with error
// feedback into error (n elements, rows >= 1).
cudaError_t onebit_average_repack_rows(const uint8_t* bits, int64_t b_row_stride, const float* scales,
                                       int64_t s_row_stride, int64_t rows, float alpha, float* error,
                                       uint8_t* out_bits, float* out_scales, int64_t n, int64_t chunk,
                                       cudaStream_t stream);

// Multi-tensor copy: dst[p][i] = src[p][i] (* scale) for every piece p.
enum class ElemType { kFloat32, kFloat64, kFloat16, kBFloat16 };
struct CopyPiece {
  const void* src;
  void* dst;
  int64_t numel;
};
// Plain copy of elements of elem_size bytes (1, 2, 4 or 8).
cudaError_t multi_copy(const CopyPiece* pieces, int64_t count, int elem_size, cudaStream_t stream);
// Scaled copy (floating types; fp16/bf16 computed in fp32 like torch).
cudaError_t multi_scaled_copy(const CopyPiece* pieces, int64_t count, ElemType type, double scale,
                              cudaStream_t stream);

}  // namespace ddpx::cuda
