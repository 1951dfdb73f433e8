// CUDA kernels: fp32 * scale -> fp16/bf16 and fp16/bf16 -> fp32 * scale,
// round-to-nearest-even (NaN stays NaN, overflow -> Inf) like torch's .to().
// Same ops as csrc/ops/cpu/cast_kernel.cpp: one rounded multiply (__fmul_rn, never
// fused), then the exact or round-to-nearest-even conversion.
//
// Layout of the work: [0, head) scalar, then vectors of kVec elements (16-byte
// loads and stores on both sides), then a scalar tail; when the two pointers
// can never be 16-byte aligned at the same element, everything is scalar.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace ddpx::cuda {
namespace {

struct ToHalf {
  float s;
  __device__ __forceinline__ uint16_t operator()(float v) const {
    return __half_as_ushort(__float2half_rn(__fmul_rn(v, s)));
  }
};
struct ToBFloat16 {
  float s;
  __device__ __forceinline__ uint16_t operator()(float v) const {
    return __bfloat16_as_ushort(__float2bfloat16_rn(__fmul_rn(v, s)));
  }
};
struct FromHalf {
  float s;
  __device__ __forceinline__ float operator()(uint16_t h) const { return __fmul_rn(__half2float(__ushort_as_half(h)), s); }
};
struct FromBFloat16 {
  float s;
  __device__ __forceinline__ float operator()(uint16_t h) const {
    return __fmul_rn(__bfloat162float(__ushort_as_bfloat16(h)), s);
  }
};

// y[i] = op(x[i]). head < 0: all scalar; else head (< kVec) scalar elements,
// then whole vectors of kVec from `head` on (both pointers 16-byte aligned
// there), then the scalar tail.
template <int kVec, typename In, typename Out, typename Op>
__global__ void __launch_bounds__(kThreads)
    map_kernel(const In* __restrict__ x, Out* __restrict__ y, int64_t n, int64_t head, Op op) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  if (head < 0) {
    for (int64_t i = tid; i < n; i += stride) y[i] = op(x[i]);
    return;
  }
  const int64_t vecs = (n - head) / kVec;
  const int64_t tail = head + vecs * kVec;
  if (tid < head) y[tid] = op(x[tid]);
  if (tid < n - tail) y[tail + tid] = op(x[tail + tid]);
  const In* xv = x + head;
  Out* yv = y + head;
  for (int64_t v = tid; v < vecs; v += stride) {
    In a[kVec];
    Out b[kVec];
    VecIO<In, kVec>::load(xv + v * kVec, a);
#pragma unroll
    for (int j = 0; j < kVec; ++j) b[j] = op(a[j]);
    VecIO<Out, kVec>::store(yv + v * kVec, b);
  }
}

// Elements to skip so that both x + head and y + head are 16-byte aligned, or
// -1 when no such head exists (the misaligned, all-scalar case).
template <typename In, typename Out>
int64_t aligned_head(const In* x, const Out* y, int64_t n, int max_head) {
  for (int h = 0; h < max_head && h <= n; ++h) {
    if (aligned_to(16, x + h) && aligned_to(16, y + h)) return h;
  }
  return -1;
}

// kVec: 8 (32 bytes of fp32 or 16 of 16-bit per thread and trip) for the
// narrowing cast, 16 for the widening one, so each thread has 32 bytes of
// loads in flight.
template <int kVec, typename In, typename Out, typename Op>
cudaError_t launch_map(const In* x, Out* y, int64_t n, Op op, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t head = aligned_head(x, y, n, kVec);
  constexpr auto kernel = map_kernel<kVec, In, Out, Op>;
  const int64_t items = head < 0 ? n : (n - head) / kVec + 1;
  kernel<<<launch_grid<kernel>(items, kThreads), kThreads, 0, stream>>>(x, y, n, head, op);
  return cudaGetLastError();
}

}  // namespace

cudaError_t scale_cast_fp16(const float* x, uint16_t* out, float scale, int64_t n, cudaStream_t stream) {
  return launch_map<8>(x, out, n, ToHalf{scale}, stream);
}

cudaError_t scale_cast_bf16(const float* x, uint16_t* out, float scale, int64_t n, cudaStream_t stream) {
  return launch_map<8>(x, out, n, ToBFloat16{scale}, stream);
}

cudaError_t cast_fp16_scale(const uint16_t* src, float* dst, float scale, int64_t n, cudaStream_t stream) {
  return launch_map<16>(src, dst, n, FromHalf{scale}, stream);
}

cudaError_t cast_bf16_scale(const uint16_t* src, float* dst, float scale, int64_t n, cudaStream_t stream) {
  return launch_map<16>(src, dst, n, FromBFloat16{scale}, stream);
}

}  // namespace ddpx::cuda
