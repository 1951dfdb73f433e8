// CUDA kernels: blockwise int8 quantize (+ error feedback) and the fused
// dequantize-and-sum over ranks. Same formulas and fp32 roundings as
// csrc/cpu/int8_kernel.cpp, so results match the CPU bit for bit.
#include <cuda_runtime.h>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace ddpx::cuda {
namespace {

__device__ __forceinline__ float load_v(const float* x, const float* err, int64_t i, bool with_error) {
  return with_error ? __fadd_rn(x[i], err[i]) : x[i];
}

// One group of G threads per quantization block; values stay in registers
// between the max pass and the quantize pass (for blocks <= G * kCache).
template <int G, bool kError>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const float* __restrict__ x, float* __restrict__ err, int8_t* __restrict__ q,
                    float* __restrict__ scales, int64_t n, int64_t block, int64_t nblocks) {
  __shared__ int smem[kThreads / 32];
  constexpr int kGroups = kThreads / G;
  const int group = threadIdx.x / G, lane = threadIdx.x % G;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kGroups; first < nblocks;
       first += static_cast<int64_t>(gridDim.x) * kGroups) {
    const int64_t b = first + group;
    const int64_t lo = b * block;
    const int64_t len = b < nblocks ? (block < n - lo ? block : n - lo) : 0;
    const float* xb = x + lo;
    float* eb = kError ? err + lo : nullptr;
    int8_t* qb = q + lo;

    float cache[kCache];
    int amax = 0;
#pragma unroll
    for (int k = 0; k < kCache; ++k) {
      const int64_t i = lane + static_cast<int64_t>(k) * G;
      cache[k] = 0.0f;
      if (i < len) {
        cache[k] = load_v(xb, eb, i, kError);
        amax = max(amax, abs_bits(cache[k]));
      }
    }
    for (int64_t i = lane + static_cast<int64_t>(kCache) * G; i < len; i += G) {
      amax = max(amax, abs_bits(load_v(xb, eb, i, kError)));
    }
    amax = group_reduce<G>(amax, MaxOp{}, smem);
    if (len == 0) continue;

    if (amax >= kNonFiniteAbsBits) {  // NaN/Inf: NaN scale, q 0, error untouched
      if (lane == 0) scales[b] = __int_as_float(0x7fc00000);
      for (int64_t i = lane; i < len; i += G) qb[i] = 0;
      continue;
    }
    const float scale = __fdiv_rn(__int_as_float(amax), 127.0f);
    if (lane == 0) scales[b] = scale;
    auto quantize = [&](float v, int64_t i) {
      if (scale == 0.0f) {  // all zero (or too tiny to scale): q 0, error keeps v
        qb[i] = 0;
        if (kError) eb[i] = v;
        return;
      }
      float r = rintf(__fdiv_rn(v, scale));  // round half to even
      r = fminf(fmaxf(r, -127.0f), 127.0f);
      qb[i] = static_cast<int8_t>(static_cast<int>(r));
      if (kError) eb[i] = __fsub_rn(v, __fmul_rn(r, scale));
    };
#pragma unroll
    for (int k = 0; k < kCache; ++k) {
      const int64_t i = lane + static_cast<int64_t>(k) * G;
      if (i < len) quantize(cache[k], i);
    }
    for (int64_t i = lane + static_cast<int64_t>(kCache) * G; i < len; i += G) {
      quantize(load_v(xb, eb, i, kError), i);
    }
  }
}

// One thread per element; rows summed in order r = 0, 1, ... like the CPU.
template <typename Index>
__global__ void __launch_bounds__(kThreads)
    dequant_kernel(float* __restrict__ out, const int8_t* __restrict__ q, int64_t q_row_stride,
                   const float* __restrict__ scales, int64_t s_row_stride, int64_t rows, Index n, Index block,
                   float alpha, bool accumulate) {
  for (Index i = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<Index>(gridDim.x) * kThreads) {
    const Index b = i / block;
    float sum = __fmul_rn(static_cast<float>(q[i]), scales[b]);
    for (int64_t r = 1; r < rows; ++r) {
      sum = __fadd_rn(sum, __fmul_rn(static_cast<float>(q[r * q_row_stride + i]), scales[r * s_row_stride + b]));
    }
    const float add = __fmul_rn(alpha, sum);
    out[i] = accumulate ? __fadd_rn(out[i], add) : add;
  }
}

}  // namespace

cudaError_t int8_quantize(const float* x, float* error, int8_t* q, float* scales, int64_t n, int64_t block,
                          cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t nblocks = ceil_div(n, block);
  const int g = group_size(block, 1);
  dispatch_group<1>(g, [&](auto group) {
    constexpr int kG = decltype(group)::value;
    const int grid = grid_for(nblocks, kThreads / kG);
    if (error) {
      quantize_kernel<kG, true><<<grid, kThreads, 0, stream>>>(x, error, q, scales, n, block, nblocks);
    } else {
      quantize_kernel<kG, false><<<grid, kThreads, 0, stream>>>(x, nullptr, q, scales, n, block, nblocks);
    }
  });
  return cudaGetLastError();
}

cudaError_t int8_dequant_accumulate(float* out, const int8_t* q, int64_t q_row_stride, const float* scales,
                                    int64_t s_row_stride, int64_t rows, int64_t n, int64_t block, float alpha,
                                    bool accumulate, cudaStream_t stream) {
  if (n == 0 || rows == 0) return cudaSuccess;
  const int grid = grid_for(n, kThreads);
  if (n <= INT32_MAX) {  // 32-bit index math: the i / block per element is much cheaper
    dequant_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(out, q, q_row_stride, scales, s_row_stride, rows,
                                                           static_cast<uint32_t>(n),
                                                           static_cast<uint32_t>(block < n ? block : n), alpha,
                                                           accumulate);
  } else {
    dequant_kernel<int64_t><<<grid, kThreads, 0, stream>>>(out, q, q_row_stride, scales, s_row_stride, rows, n,
                                                          block, alpha, accumulate);
  }
  return cudaGetLastError();
}

}  // namespace ddpx::cuda
