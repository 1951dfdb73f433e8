// CUDA kernels: 1-bit sign packing with one mean|v| scale per chunk (+ error
// feedback) and the fused unpack-and-sum over ranks. Bits and residuals match
// csrc/cpu/onebit_kernel.cpp exactly given the same scale; the scale's sum is
// a tree reduction here, so it may differ from the CPU's by a few ulp.
#include <cuda_runtime.h>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace ddpx::cuda {
namespace {

__device__ __forceinline__ float load_v(const float* x, const float* err, int64_t i, bool with_error) {
  return with_error ? __fadd_rn(x[i], err[i]) : x[i];
}

// One group of G threads (G >= 8, a multiple of 8) per chunk: at step k, lane
// l holds element k * G + l, so each aligned run of 8 lanes owns one byte and
// a warp ballot packs the signs.
template <int G, bool kError>
__global__ void __launch_bounds__(kThreads)
    pack_kernel(const float* __restrict__ x, float* __restrict__ err, uint8_t* __restrict__ bits,
                float* __restrict__ scales, int64_t n, int64_t chunk, int64_t nchunks) {
  static_assert(G % 8 == 0, "a byte's 8 lanes must belong to one group");
  __shared__ int smem_i[kThreads / 32];
  __shared__ float smem_f[kThreads / 32];
  constexpr int kGroups = kThreads / G;
  const int group = threadIdx.x / G, lane = threadIdx.x % G;
  const int warp_lane = threadIdx.x % 32;
  const int64_t steps = ceil_div_device(chunk, G);
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kGroups; first < nchunks;
       first += static_cast<int64_t>(gridDim.x) * kGroups) {
    const int64_t c = first + group;
    const int64_t lo = c * chunk;
    const int64_t len = c < nchunks ? (chunk < n - lo ? chunk : n - lo) : 0;
    const float* xc = x + lo;
    float* ec = kError ? err + lo : nullptr;

    float cache[kCache];
    int amax = 0;
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kCache; ++k) {
      const int64_t i = lane + static_cast<int64_t>(k) * G;
      cache[k] = 0.0f;
      if (i < len) {
        cache[k] = load_v(xc, ec, i, kError);
        amax = max(amax, abs_bits(cache[k]));
        sum = __fadd_rn(sum, fabsf(cache[k]));
      }
    }
    for (int64_t i = lane + static_cast<int64_t>(kCache) * G; i < len; i += G) {
      const float v = load_v(xc, ec, i, kError);
      amax = max(amax, abs_bits(v));
      sum = __fadd_rn(sum, fabsf(v));
    }
    amax = group_reduce<G>(amax, MaxOp{}, smem_i);
    sum = group_reduce<G>(sum, AddOp{}, smem_f);
    const bool finite = amax < kNonFiniteAbsBits;
    const float scale = finite ? __fdiv_rn(sum, static_cast<float>(len > 0 ? len : 1)) : __int_as_float(0x7fc00000);
    if (lane == 0 && len > 0) scales[c] = scale;

    // Every lane runs every step (the ballot needs the whole warp).
    auto emit = [&](float v, int64_t i) {
      const bool in = i < len;
      const unsigned mask = __ballot_sync(0xffffffffu, in && v >= 0.0f);
      if (in && warp_lane % 8 == 0) bits[(lo + i) / 8] = static_cast<uint8_t>(mask >> warp_lane);
      if (kError && in && finite) ec[i] = __fsub_rn(v, v >= 0.0f ? scale : -scale);
    };
#pragma unroll
    for (int k = 0; k < kCache; ++k) {
      if (k < steps) emit(cache[k], lane + static_cast<int64_t>(k) * G);
    }
    for (int64_t k = kCache; k < steps; ++k) {
      const int64_t i = lane + k * G;
      emit(i < len ? load_v(xc, ec, i, kError) : 0.0f, i);
    }
  }
}

template <typename Index>
__global__ void __launch_bounds__(kThreads)
    unpack_kernel(float* __restrict__ out, const uint8_t* __restrict__ bits, int64_t b_row_stride,
                  const float* __restrict__ scales, int64_t s_row_stride, int64_t rows, Index n, Index chunk,
                  float alpha, bool accumulate) {
  for (Index i = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<Index>(gridDim.x) * kThreads) {
    const Index c = i / chunk, byte = i / 8;
    const unsigned bit = i % 8;
    float s = scales[c];
    float sum = (bits[byte] >> bit) & 1u ? s : -s;
    for (int64_t r = 1; r < rows; ++r) {
      s = scales[r * s_row_stride + c];
      sum = __fadd_rn(sum, (bits[r * b_row_stride + byte] >> bit) & 1u ? s : -s);
    }
    const float add = __fmul_rn(alpha, sum);
    out[i] = accumulate ? __fadd_rn(out[i], add) : add;
  }
}

}  // namespace

cudaError_t onebit_pack(const float* x, float* error, uint8_t* bits, float* scales, int64_t n, int64_t chunk,
                        cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t nchunks = ceil_div(n, chunk);
  const int g = group_size(chunk, 8);
  auto launch = [&](auto group) {
    constexpr int kG = decltype(group)::value;
    const int grid = grid_for(nchunks, kThreads / kG);
    if (error) {
      pack_kernel<kG, true><<<grid, kThreads, 0, stream>>>(x, error, bits, scales, n, chunk, nchunks);
    } else {
      pack_kernel<kG, false><<<grid, kThreads, 0, stream>>>(x, nullptr, bits, scales, n, chunk, nchunks);
    }
  };
  dispatch_group<8>(g, launch);
  return cudaGetLastError();
}

cudaError_t onebit_unpack_accumulate(float* out, const uint8_t* bits, int64_t b_row_stride, const float* scales,
                                     int64_t s_row_stride, int64_t rows, int64_t n, int64_t chunk, float alpha,
                                     bool accumulate, cudaStream_t stream) {
  if (n == 0 || rows == 0) return cudaSuccess;
  const int grid = grid_for(n, kThreads);
  if (n <= INT32_MAX) {
    unpack_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(out, bits, b_row_stride, scales, s_row_stride, rows,
                                                          static_cast<uint32_t>(n),
                                                          static_cast<uint32_t>(chunk < n ? chunk : n), alpha,
                                                          accumulate);
  } else {
    unpack_kernel<int64_t><<<grid, kThreads, 0, stream>>>(out, bits, b_row_stride, scales, s_row_stride, rows, n,
                                                         chunk, alpha, accumulate);
  }
  return cudaGetLastError();
}

}  // namespace ddpx::cuda
