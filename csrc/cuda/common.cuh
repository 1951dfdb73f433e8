// Device helpers shared by the ddpx CUDA kernels (plain CUDA, no torch).
// Arithmetic that must match the CPU kernels bit for bit uses the _rn
// intrinsics: they are never fused into FMAs and ignore --use_fast_math.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace ddpx::cuda {

constexpr int kThreads = 256;
constexpr int kMaxGrid = 65535;
// Elements per thread kept in registers between a block's two passes.
constexpr int kCache = 8;
constexpr int kNonFiniteAbsBits = 0x7f800000;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int grid_for(int64_t items, int64_t per_cta) {
  const int64_t g = ceil_div(items, per_cta);
  return static_cast<int>(g < kMaxGrid ? (g > 0 ? g : 1) : kMaxGrid);
}

// Threads per quantization block: a power of two in [lo, 256] with at most
// kCache elements per thread when the block is small enough.
inline int group_size(int64_t block, int lo) {
  int g = lo;
  while (g < kThreads && static_cast<int64_t>(g) * kCache < block) g *= 2;
  return g;
}

__device__ __forceinline__ int64_t ceil_div_device(int64_t a, int64_t b) { return (a + b - 1) / b; }

// |f| as int bits: integer order is float order, NaN > Inf > finite.
__device__ __forceinline__ int abs_bits(float f) { return __float_as_int(f) & 0x7fffffff; }

struct MaxOp {
  __device__ __forceinline__ int operator()(int a, int b) const { return a > b ? a : b; }
};
struct AddOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
};

// Reduce over aligned groups of G threads (G a power of two <= kThreads).
// Every thread of the CTA must call it (it may __syncthreads); every thread
// of a group gets the group's result.
template <int G, typename T, typename Op>
__device__ __forceinline__ T group_reduce(T v, Op op, T* smem) {
  constexpr int kWidth = G < 32 ? G : 32;
#pragma unroll
  for (int off = kWidth / 2; off > 0; off /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  if constexpr (G > 32) {
    constexpr int kWarps = G / 32;
    if (threadIdx.x % 32 == 0) smem[threadIdx.x / 32] = v;
    __syncthreads();
    const int first = (threadIdx.x / G) * kWarps;
    T r = smem[first];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) r = op(r, smem[first + w]);
    __syncthreads();  // smem is reused by the next call
    v = r;
  }
  return v;
}

// Calls launch(std::integral_constant<int, G>) for the runtime group size g,
// instantiating only the sizes >= kMin.
template <int kMin, typename F>
void dispatch_group(int g, F&& launch) {
  switch (g) {
    case 1: if constexpr (kMin <= 1) launch(std::integral_constant<int, 1>{}); break;
    case 2: if constexpr (kMin <= 2) launch(std::integral_constant<int, 2>{}); break;
    case 4: if constexpr (kMin <= 4) launch(std::integral_constant<int, 4>{}); break;
    case 8: if constexpr (kMin <= 8) launch(std::integral_constant<int, 8>{}); break;
    case 16: launch(std::integral_constant<int, 16>{}); break;
    case 32: launch(std::integral_constant<int, 32>{}); break;
    case 64: launch(std::integral_constant<int, 64>{}); break;
    case 128: launch(std::integral_constant<int, 128>{}); break;
    default: launch(std::integral_constant<int, 256>{}); break;
  }
}

}  // namespace ddpx::cuda
