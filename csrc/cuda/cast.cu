// CUDA kernels: fp32 * scale -> fp16/bf16 and fp16/bf16 -> fp32 * scale,
// round-to-nearest-even (NaN stays NaN, overflow -> Inf) like torch's .to().
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace ddpx::cuda {
namespace {

struct ToHalf {
  __device__ __forceinline__ uint16_t operator()(float v) const { return __half_as_ushort(__float2half_rn(v)); }
};
struct ToBFloat16 {
  __device__ __forceinline__ uint16_t operator()(float v) const {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};
struct FromHalf {
  __device__ __forceinline__ float operator()(uint16_t h) const { return __half2float(__ushort_as_half(h)); }
};
struct FromBFloat16 {
  __device__ __forceinline__ float operator()(uint16_t h) const {
    return __bfloat162float(__ushort_as_bfloat16(h));
  }
};

template <typename Convert>
__global__ void __launch_bounds__(kThreads)
    to_16bit_kernel(const float* __restrict__ x, uint16_t* __restrict__ out, float scale, int64_t n) {
  const Convert convert;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    out[i] = convert(__fmul_rn(x[i], scale));
  }
}

template <typename Convert>
__global__ void __launch_bounds__(kThreads)
    from_16bit_kernel(const uint16_t* __restrict__ src, float* __restrict__ dst, float scale, int64_t n) {
  const Convert convert;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    dst[i] = __fmul_rn(convert(src[i]), scale);
  }
}

}  // namespace

cudaError_t scale_cast_fp16(const float* x, uint16_t* out, float scale, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  to_16bit_kernel<ToHalf><<<grid_for(n, kThreads), kThreads, 0, stream>>>(x, out, scale, n);
  return cudaGetLastError();
}

cudaError_t scale_cast_bf16(const float* x, uint16_t* out, float scale, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  to_16bit_kernel<ToBFloat16><<<grid_for(n, kThreads), kThreads, 0, stream>>>(x, out, scale, n);
  return cudaGetLastError();
}

cudaError_t cast_fp16_scale(const uint16_t* src, float* dst, float scale, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  from_16bit_kernel<FromHalf><<<grid_for(n, kThreads), kThreads, 0, stream>>>(src, dst, scale, n);
  return cudaGetLastError();
}

cudaError_t cast_bf16_scale(const uint16_t* src, float* dst, float scale, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  from_16bit_kernel<FromBFloat16><<<grid_for(n, kThreads), kThreads, 0, stream>>>(src, dst, scale, n);
  return cudaGetLastError();
}

}  // namespace ddpx::cuda
