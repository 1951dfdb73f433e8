// CUDA kernels: blockwise int8 quantize (+ error feedback) and the fused
// dequantize-and-sum over ranks. Same formulas and fp32 roundings as
// csrc/ops/cpu/int8_kernel.cpp (each multiply, divide, add and subtract its own
// _rn op, as the CPU code does them), so results match the CPU bit for bit.
//
// Both kernels are block-structured: a group of G lanes of one warp owns one
// quantization block at a time (no per-element division, the block's scale
// read or written once). Each lane holds kPerLane of the block's elements in
// registers, as kPerLane / kVec units of kVec consecutive elements moved with
// one vector access (kVec = 4 or 16 where the pointers are aligned, else 1),
// so a block of up to 32 * kPerLane elements is read from memory once.
#include <cuda_runtime.h>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace ddpx::cuda {
namespace {

constexpr int kPerLane = 32;

// The unit of kVec elements at i of a block of len elements: a vector load
// when whole, element by element (zeros past the end) at the block's end.
template <int kVec, typename T>
__device__ __forceinline__ void load_unit(const T* p, int64_t i, int64_t len, T (&v)[kVec]) {
  if (i + kVec <= len) {
    VecIO<T, kVec>::load(p + i, v);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = i + j < len ? p[i + j] : T(0);
  }
}

template <int kVec, typename T>
__device__ __forceinline__ void store_unit(T* p, int64_t i, int64_t len, const T (&v)[kVec]) {
  if (i + kVec <= len) {
    VecIO<T, kVec>::store(p + i, v);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (i + j < len) p[i + j] = v[j];
    }
  }
}

// v = x (+ error) for the unit at i.
template <int kVec, bool kError>
__device__ __forceinline__ void load_v(const float* xb, const float* eb, int64_t i, int64_t len, float (&v)[kVec]) {
  load_unit<kVec>(xb, i, len, v);
  if constexpr (kError) {
    float e[kVec];
    load_unit<kVec>(eb, i, len, e);
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = __fadd_rn(v[j], e[j]);
  }
}

template <int kVec>
__device__ __forceinline__ int unit_max(int amax, const float (&v)[kVec]) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) amax = max(amax, abs_bits(v[j]));
  return amax;
}

// q and the residual of one unit; scale is finite (zero handled here).
template <int kVec, bool kError>
__device__ __forceinline__ void quantize_unit(const float (&v)[kVec], float scale, int8_t* qb, float* eb, int64_t i,
                                              int64_t len) {
  int8_t q[kVec];
  float e[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    if (scale == 0.0f) {  // all zero (or too tiny to scale): q 0, error keeps v
      q[j] = 0;
      e[j] = v[j];
    } else {
      float r = rintf(__fdiv_rn(v[j], scale));  // round half to even, |r| <= 127.x: exact
      r = fminf(fmaxf(r, -127.0f), 127.0f);
      q[j] = static_cast<int8_t>(static_cast<int>(r));
      e[j] = __fsub_rn(v[j], __fmul_rn(r, scale));
    }
  }
  store_unit<kVec>(qb, i, len, q);
  if constexpr (kError) store_unit<kVec>(eb, i, len, e);
}

template <int G, int kVec, bool kError>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const float* __restrict__ x, float* __restrict__ err, int8_t* __restrict__ q,
                    float* __restrict__ scales, int64_t n, int64_t block, int64_t nblocks) {
  constexpr int kUnits = kPerLane / kVec, kGroups = kThreads / G, kSlab = G * kPerLane;
  const int group = threadIdx.x / G, lane = threadIdx.x % G;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kGroups; first < nblocks;
       first += static_cast<int64_t>(gridDim.x) * kGroups) {
    const int64_t b = first + group;
    const int64_t lo = b * block;
    const int64_t len = b < nblocks ? (block < n - lo ? block : n - lo) : 0;
    const float* xb = x + lo;
    float* eb = kError ? err + lo : nullptr;
    int8_t* qb = q + lo;

    // Pass 1: max|v| (as int bits; also flags NaN/Inf) over the block, its
    // first slab kept in registers.
    float cache[kUnits][kVec];
    int amax = 0;
#pragma unroll
    for (int k = 0; k < kUnits; ++k) {
      const int64_t i = static_cast<int64_t>(lane + k * G) * kVec;
      if (i < len) {
        load_v<kVec, kError>(xb, eb, i, len, cache[k]);
        amax = unit_max(amax, cache[k]);
      }
    }
    for (int64_t i = static_cast<int64_t>(kSlab) + lane * kVec; i < len; i += G * kVec) {
      float v[kVec];
      load_v<kVec, kError>(xb, eb, i, len, v);
      amax = unit_max(amax, v);
    }
    amax = group_max<G>(amax);
    if (len <= 0) continue;

    if (amax >= kNonFiniteAbsBits) {  // NaN/Inf: NaN scale, q 0, error untouched
      if (lane == 0) scales[b] = nan_float();
      const int8_t zeros[kVec] = {};
      for (int64_t i = static_cast<int64_t>(lane) * kVec; i < len; i += G * kVec) store_unit<kVec>(qb, i, len, zeros);
      continue;
    }
    const float scale = __fdiv_rn(__int_as_float(amax), 127.0f);
    if (lane == 0) scales[b] = scale;
    // Pass 2: q and the residual, from registers, then the rest of the block.
#pragma unroll
    for (int k = 0; k < kUnits; ++k) {
      const int64_t i = static_cast<int64_t>(lane + k * G) * kVec;
      if (i < len) quantize_unit<kVec, kError>(cache[k], scale, qb, eb, i, len);
    }
    for (int64_t i = static_cast<int64_t>(kSlab) + lane * kVec; i < len; i += G * kVec) {
      float v[kVec];
      load_v<kVec, kError>(xb, eb, i, len, v);
      quantize_unit<kVec, kError>(v, scale, qb, eb, i, len);
    }
  }
}

// out = (accumulate ? out : 0) + alpha * (q[0] * s[0] + q[1] * s[1] + ...),
// rows added in order r = 0, 1, ... (the CPU's order); each rank's row is read
// once, the block's slab of sums stays in registers over the rows.
template <int G, int kVec>
__global__ void __launch_bounds__(kThreads)
    dequant_kernel(float* __restrict__ out, const int8_t* __restrict__ q, int64_t q_row_stride,
                   const float* __restrict__ scales, int64_t s_row_stride, int64_t rows, int64_t n, int64_t block,
                   int64_t nblocks, float alpha, bool accumulate) {
  constexpr int kUnits = kPerLane / kVec, kGroups = kThreads / G, kSlab = G * kPerLane;
  const int group = threadIdx.x / G, lane = threadIdx.x % G;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kGroups + group; b < nblocks;
       b += static_cast<int64_t>(gridDim.x) * kGroups) {
    const int64_t lo = b * block;
    const int64_t len = block < n - lo ? block : n - lo;
    for (int64_t slab = 0; slab < len; slab += kSlab) {
      const int64_t slab_len = len - slab;
      float* ob = out + lo + slab;
      float acc[kUnits][kVec];
#pragma unroll 2  // two ranks' loads in flight together; the adds stay in row order
      for (int64_t r = 0; r < rows; ++r) {
        const float s = scales[r * s_row_stride + b];
        const int8_t* qb = q + r * q_row_stride + lo + slab;
#pragma unroll
        for (int k = 0; k < kUnits; ++k) {
          const int64_t i = static_cast<int64_t>(lane + k * G) * kVec;
          if (i < slab_len) {
            int8_t v[kVec];
            load_unit<kVec>(qb, i, slab_len, v);
#pragma unroll
            for (int j = 0; j < kVec; ++j) {
              const float d = __fmul_rn(static_cast<float>(v[j]), s);
              acc[k][j] = r == 0 ? d : __fadd_rn(acc[k][j], d);
            }
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kUnits; ++k) {
        const int64_t i = static_cast<int64_t>(lane + k * G) * kVec;
        if (i < slab_len) {
          float o[kVec];
          if (accumulate) load_unit<kVec>(ob, i, slab_len, o);
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const float add = __fmul_rn(alpha, acc[k][j]);
            o[j] = accumulate ? __fadd_rn(o[j], add) : add;
          }
          store_unit<kVec>(ob, i, slab_len, o);
        }
      }
    }
  }
}

}  // namespace

cudaError_t int8_quantize(const float* x, float* error, int8_t* q, float* scales, int64_t n, int64_t block,
                          cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t nblocks = ceil_div(n, block);
  // float4 loads and char4 stores when every block starts aligned.
  const bool vec = block % 4 == 0 && aligned_to(16, x) && (!error || aligned_to(16, error)) && aligned_to(4, q);
  dispatch_lanes(lanes_for(block, kPerLane), [&](auto lanes) {
    constexpr int kG = decltype(lanes)::value;
    const int64_t groups = kThreads / kG;
    if (vec && error) {
      launch<quantize_kernel<kG, 4, true>>(nblocks, groups, stream, x, error, q, scales, n, block, nblocks);
    } else if (vec) {
      launch<quantize_kernel<kG, 4, false>>(nblocks, groups, stream, x, error, q, scales, n, block, nblocks);
    } else if (error) {
      launch<quantize_kernel<kG, 1, true>>(nblocks, groups, stream, x, error, q, scales, n, block, nblocks);
    } else {
      launch<quantize_kernel<kG, 1, false>>(nblocks, groups, stream, x, error, q, scales, n, block, nblocks);
    }
  });
  return cudaGetLastError();
}

cudaError_t int8_dequant_accumulate(float* out, const int8_t* q, int64_t q_row_stride, const float* scales,
                                    int64_t s_row_stride, int64_t rows, int64_t n, int64_t block, float alpha,
                                    bool accumulate, cudaStream_t stream) {
  if (n == 0 || rows == 0) return cudaSuccess;
  const int64_t nblocks = ceil_div(n, block);
  // Every row's block starts must be aligned for the q vectors, every block's
  // start in out for the float4 stores.
  auto rows_aligned = [&](int64_t bytes) {
    return block % bytes == 0 && aligned_to(bytes, q) && (rows == 1 || q_row_stride % bytes == 0);
  };
  const bool out_vec = block % 4 == 0 && aligned_to(16, out);
  const int vec = out_vec && rows_aligned(16) ? 16 : out_vec && rows_aligned(4) ? 4 : 1;
  dispatch_lanes(lanes_for(block, kPerLane), [&](auto lanes) {
    constexpr int kG = decltype(lanes)::value;
    const int64_t groups = kThreads / kG;
    auto run = [&](auto vec_tag) {
      constexpr int kVec = decltype(vec_tag)::value;
      launch<dequant_kernel<kG, kVec>>(nblocks, groups, stream, out, q, q_row_stride, scales, s_row_stride, rows, n,
                                       block, nblocks, alpha, accumulate);
    };
    if (vec == 16) {
      run(std::integral_constant<int, 16>{});
    } else if (vec == 4) {
      run(std::integral_constant<int, 4>{});
    } else {
      run(std::integral_constant<int, 1>{});
    }
  });
  return cudaGetLastError();
}

}  // namespace ddpx::cuda
