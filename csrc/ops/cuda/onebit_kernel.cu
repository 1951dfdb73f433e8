// CUDA kernels: 1-bit sign packing with one mean|v| scale per chunk (+ error
// feedback), the fused unpack-and-sum over ranks, and the 1-bit hook's phase 2
// (average, add the server error, pack) in one pass. Same ops in the same
// order as csrc/ops/cpu/onebit_kernel.cpp, each its own _rn op, so bits, scales
// and residuals match the CPU bit for bit -- the mean|v| included:
//
// The CPU sums |v| of a chunk in 16 fixed lanes (lane j: elements j, j + 16,
// j + 32, ... in order) and then adds the lanes pairwise (j += j + 8, then
// + 4, + 2, + 1). Here a chunk belongs to one warp; at step k lane l holds
// element 32 k + l, so CPU lane j's elements at step k are those of lanes j
// and j + 16, in that order: lane j adds its own |v|, then lane j + 16's
// (a shuffle), and keeps the CPU's order exactly; the pairwise step is four
// more shuffles. Loads are 4-byte scalars, coalesced (a warp reads 128
// contiguous bytes per step), which this layout needs.
#include <cuda_runtime.h>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace ddpx::cuda {
namespace {

constexpr int kLanes = 16;  // the CPU's fixed summation lanes (csrc/ops/cpu/onebit_kernel.cpp)
static_assert(kWarp == 2 * kLanes, "a warp holds two elements of each CPU lane per step");

// decoded = bit ? +s : -s (the CPU's +-1 * s, the same value).
__device__ __forceinline__ float sign_value(uint8_t byte, int bit, float s) { return (byte >> bit) & 1u ? s : -s; }

// The values a chunk packs: x itself...
struct PlainSource {
  const float* x;
  // cache[k] = x[lo + lane + 32 k] for the elements of the chunk in the cache.
  template <int K>
  __device__ __forceinline__ void fill(float (&cache)[K], int64_t, int64_t lo, int64_t len, int lane) const {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t i = lane + static_cast<int64_t>(k) * kWarp;
      cache[k] = i < len ? x[lo + i] : 0.0f;
    }
  }
  __device__ __forceinline__ float value(int64_t, int64_t e) const { return x[e]; }
};

// ... or the average of R ranks' packed rows: alpha * (dec[0] + dec[1] + ...),
// rows in order, as onebit_unpack_accumulate_ computes it.
struct DecodeSource {
  const uint8_t* bits;
  int64_t b_row_stride;
  const float* scales;
  int64_t s_row_stride;
  int64_t rows;
  float alpha;

  template <int K>
  __device__ __forceinline__ void fill(float (&cache)[K], int64_t c, int64_t lo, int64_t len, int lane) const {
#pragma unroll
    for (int k = 0; k < K; ++k) cache[k] = 0.0f;
    if (len <= 0) return;  // a group past the last chunk: no scales to read
    for (int64_t r = 0; r < rows; ++r) {  // rows outside: each scale read once per chunk
      const float s = scales[r * s_row_stride + c];
      const uint8_t* br = bits + r * b_row_stride;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t e = lo + lane + static_cast<int64_t>(k) * kWarp;
        if (e < lo + len) {
          const float d = sign_value(br[e >> 3], static_cast<int>(e & 7), s);
          cache[k] = r == 0 ? d : __fadd_rn(cache[k], d);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) cache[k] = __fmul_rn(alpha, cache[k]);
  }
  __device__ __forceinline__ float value(int64_t c, int64_t e) const {
    float sum = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const float d = sign_value(bits[r * b_row_stride + (e >> 3)], static_cast<int>(e & 7), scales[r * s_row_stride + c]);
      sum = r == 0 ? d : __fadd_rn(sum, d);
    }
    return __fmul_rn(alpha, sum);
  }
};

// Lane j < 16 adds |v| of its element and then of lane j + 16's: CPU lane j's
// next two elements, in order. Every lane of the warp must call it.
__device__ __forceinline__ float add_pair(float sum, float v, bool in, int lane) {
  const float a = in ? fabsf(v) : 0.0f;  // + 0 leaves a sum of |v| unchanged
  const float upper = __shfl_down_sync(0xffffffffu, a, kLanes);
  return lane < kLanes ? __fadd_rn(__fadd_rn(sum, a), upper) : sum;
}

// One warp per chunk, K values per lane kept in registers between the two
// passes (chunks of up to 32 K elements are read once; the rest of a larger
// chunk is read again in pass 2).
template <int K, bool kError, typename Source>
__global__ void __launch_bounds__(kThreads)
    pack_kernel(Source src, float* __restrict__ err, uint8_t* __restrict__ bits, float* __restrict__ scales,
                int64_t n, int64_t chunk, int64_t nchunks) {
  constexpr int kGroups = kThreads / kWarp;
  const int group = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t steps = ceil_div(chunk, kWarp);
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kGroups + group; c < nchunks;
       c += static_cast<int64_t>(gridDim.x) * kGroups) {  // the same trips for the whole warp
    const int64_t lo = c * chunk;
    const int64_t len = chunk < n - lo ? chunk : n - lo;
    float* ec = kError ? err + lo : nullptr;

    // Pass 1: v = source (+ error); max|v| bits (NaN/Inf check) and the CPU
    // lanes' sums of |v|, in element order.
    float cache[K];
    src.fill(cache, c, lo, len, lane);
    int amax = 0;
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t i = lane + static_cast<int64_t>(k) * kWarp;
      const bool in = i < len;
      if (in) {
        if (kError) cache[k] = __fadd_rn(cache[k], ec[i]);
        amax = max(amax, abs_bits(cache[k]));
      }
      sum = add_pair(sum, cache[k], in, lane);
    }
    for (int64_t k = K; k < steps; ++k) {
      const int64_t i = lane + k * kWarp;
      const bool in = i < len;
      float v = 0.0f;
      if (in) {
        v = src.value(c, lo + i);
        if (kError) v = __fadd_rn(v, ec[i]);
        amax = max(amax, abs_bits(v));
      }
      sum = add_pair(sum, v, in, lane);
    }
    amax = group_max<kWarp>(amax);
#pragma unroll
    for (int width = kLanes / 2; width > 0; width /= 2) {  // lanes 0..15: the CPU's pairwise step
      sum = __fadd_rn(sum, __shfl_down_sync(0xffffffffu, sum, width, kLanes));
    }
    sum = __shfl_sync(0xffffffffu, sum, 0);  // lane 0 holds the CPU's acc[0]
    const bool finite = amax < kNonFiniteAbsBits;
    const float scale = finite ? __fdiv_rn(sum, static_cast<float>(len)) : nan_float();
    if (lane == 0) scales[c] = scale;

    // Pass 2: at step k lane l holds element 32 k + l, so each aligned run of
    // 8 lanes owns one byte and a warp ballot packs the signs (padding bits 0).
    auto emit = [&](float v, int64_t i) {
      const bool in = i < len;
      const unsigned mask = __ballot_sync(0xffffffffu, in && v >= 0.0f);
      if (in && lane % 8 == 0) bits[(lo + i) >> 3] = static_cast<uint8_t>(mask >> lane);
      if (kError && in && finite) ec[i] = __fsub_rn(v, v >= 0.0f ? scale : -scale);
    };
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (k < steps) emit(cache[k], lane + static_cast<int64_t>(k) * kWarp);
    }
    for (int64_t k = K; k < steps; ++k) {
      const int64_t i = lane + k * kWarp;
      float v = 0.0f;
      if (i < len) {
        v = src.value(c, lo + i);
        if (kError) v = __fadd_rn(v, ec[i]);
      }
      emit(v, i);
    }
  }
}

// out = (accumulate ? out : 0) + alpha * (dec[0] + dec[1] + ...), rows in
// order. A group of G lanes owns one chunk; each lane decodes kBytes bytes
// (8 kBytes elements) of every row into registers, reading each rank's row
// and scale once, then writes its elements (2 float4 per byte when aligned).
constexpr int kBytesPerLane = 4;

template <int G, bool kVecOut>
__global__ void __launch_bounds__(kThreads)
    unpack_kernel(float* __restrict__ out, const uint8_t* __restrict__ bits, int64_t b_row_stride,
                  const float* __restrict__ scales, int64_t s_row_stride, int64_t rows, int64_t n, int64_t chunk,
                  int64_t nchunks, float alpha, bool accumulate) {
  constexpr int kGroups = kThreads / G, kSlab = G * kBytesPerLane * 8;
  const int group = threadIdx.x / G, lane = threadIdx.x % G;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kGroups + group; c < nchunks;
       c += static_cast<int64_t>(gridDim.x) * kGroups) {
    const int64_t lo = c * chunk;
    const int64_t len = chunk < n - lo ? chunk : n - lo;
    for (int64_t slab = 0; slab < len; slab += kSlab) {
      const int64_t slab_len = len - slab;
      const int64_t first_byte = (lo + slab) >> 3;
      float acc[kBytesPerLane][8];
#pragma unroll 2  // two ranks' loads in flight together; the adds stay in row order
      for (int64_t r = 0; r < rows; ++r) {
        const float s = scales[r * s_row_stride + c];
        const uint8_t* br = bits + r * b_row_stride + first_byte;
#pragma unroll
        for (int k = 0; k < kBytesPerLane; ++k) {
          const int u = lane + k * G;
          if (static_cast<int64_t>(u) * 8 < slab_len) {
            const uint8_t byte = br[u];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              const float d = sign_value(byte, j, s);
              acc[k][j] = r == 0 ? d : __fadd_rn(acc[k][j], d);
            }
          }
        }
      }
      float* ob = out + lo + slab;
#pragma unroll
      for (int k = 0; k < kBytesPerLane; ++k) {
        const int64_t i = static_cast<int64_t>(lane + k * G) * 8;
        if (i >= slab_len) continue;
        const bool whole = kVecOut && i + 8 <= slab_len;
        float o[8];
        if (accumulate) {
          if (whole) {
            VecIO<float, 8>::load(ob + i, o);
          } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) o[j] = i + j < slab_len ? ob[i + j] : 0.0f;
          }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float add = __fmul_rn(alpha, acc[k][j]);
          o[j] = accumulate ? __fadd_rn(o[j], add) : add;
        }
        if (whole) {
          VecIO<float, 8>::store(ob + i, o);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (i + j < slab_len) ob[i + j] = o[j];
          }
        }
      }
    }
  }
}

// Chunks of up to 128 elements (the hooks' default) in 4 registers per lane,
// up to 1024 in 32.
template <bool kError, typename Source>
void launch_pack(Source src, float* error, uint8_t* bits, float* scales, int64_t n, int64_t chunk,
                 cudaStream_t stream) {
  const int64_t nchunks = ceil_div(n, chunk);
  const int64_t groups = kThreads / kWarp;
  if (chunk <= 4 * kWarp) {
    launch<pack_kernel<4, kError, Source>>(nchunks, groups, stream, src, error, bits, scales, n, chunk, nchunks);
  } else {
    launch<pack_kernel<32, kError, Source>>(nchunks, groups, stream, src, error, bits, scales, n, chunk, nchunks);
  }
}

}  // namespace

cudaError_t onebit_pack(const float* x, float* error, uint8_t* bits, float* scales, int64_t n, int64_t chunk,
                        cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (error) {
    launch_pack<true>(PlainSource{x}, error, bits, scales, n, chunk, stream);
  } else {
    launch_pack<false>(PlainSource{x}, nullptr, bits, scales, n, chunk, stream);
  }
  return cudaGetLastError();
}

cudaError_t onebit_average_repack_rows(const uint8_t* bits, int64_t b_row_stride, const float* scales,
                                       int64_t s_row_stride, int64_t rows, float alpha, float* error,
                                       uint8_t* out_bits, float* out_scales, int64_t n, int64_t chunk,
                                       cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  launch_pack<true>(DecodeSource{bits, b_row_stride, scales, s_row_stride, rows, alpha}, error, out_bits, out_scales,
                    n, chunk, stream);
  return cudaGetLastError();
}

cudaError_t onebit_unpack_accumulate(float* out, const uint8_t* bits, int64_t b_row_stride, const float* scales,
                                     int64_t s_row_stride, int64_t rows, int64_t n, int64_t chunk, float alpha,
                                     bool accumulate, cudaStream_t stream) {
  if (n == 0 || rows == 0) return cudaSuccess;
  const int64_t nchunks = ceil_div(n, chunk);
  const bool vec_out = aligned_to(16, out);  // chunks start on multiples of 8 elements: 32 bytes
  dispatch_lanes(lanes_for(chunk, 8 * kBytesPerLane), [&](auto lanes) {
    constexpr int kG = decltype(lanes)::value;
    const int64_t groups = kThreads / kG;
    if (vec_out) {
      launch<unpack_kernel<kG, true>>(nchunks, groups, stream, out, bits, b_row_stride, scales, s_row_stride, rows,
                                      n, chunk, nchunks, alpha, accumulate);
    } else {
      launch<unpack_kernel<kG, false>>(nchunks, groups, stream, out, bits, b_row_stride, scales, s_row_stride, rows,
                                       n, chunk, nchunks, alpha, accumulate);
    }
  });
  return cudaGetLastError();
}

}  // namespace ddpx::cuda
