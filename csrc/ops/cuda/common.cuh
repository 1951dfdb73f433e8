// Device helpers shared by the ddpx CUDA kernels (plain CUDA, no torch).
//
// Exactness: the kernels must give the CPU kernels' bits. The CPU code does
// every multiply and add as its own rounded op (no FMA: csrc/ops/cpu/simd.h), so
// arithmetic here uses the _rn intrinsics, which nvcc never contracts into an
// FMA and which ignore --use_fast_math; every comment "same ops as the CPU"
// relies on that.
//
// Speed: the kernels are memory-bound. They read and write 16-byte vectors
// where the pointers allow (VecIO below; the launcher checks alignment and
// picks the scalar instantiation otherwise), and run a grid-stride loop over a
// grid sized to fill every SM once (launch_grid), so a large input does not
// pay for thousands of short-lived blocks and a 4 MiB bucket still uses the
// whole chip.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

namespace ddpx::cuda {

constexpr int kThreads = 256;
constexpr int kNonFiniteAbsBits = 0x7f800000;
constexpr int kWarp = 32;

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Streaming multiprocessors of the current device, cached per device.
inline int sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  if (dev >= kMaxDevices) dev = kMaxDevices - 1;
  int sms = cache[dev].load(std::memory_order_relaxed);
  if (sms == 0) {
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms < 1) sms = 1;
    cache[dev].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

// Grid for a grid-stride `kernel` over `items` work items, `per_cta` per block
// and loop trip: as many blocks as the items need, at most as many as fit on
// the device at once (this kernel's occupancy, queried once per kernel).
template <auto kernel>
int launch_grid(int64_t items, int64_t per_cta) {
  static std::atomic<int> resident{0};
  int per_sm = resident.load(std::memory_order_relaxed);
  if (per_sm == 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess || per_sm < 1) {
      per_sm = 1;
    }
    resident.store(per_sm, std::memory_order_relaxed);
  }
  const int64_t full = static_cast<int64_t>(per_sm) * sm_count();
  const int64_t need = ceil_div(items, per_cta);
  return static_cast<int>(need < full ? (need > 0 ? need : 1) : full);
}

// kernel<<<launch_grid, kThreads, 0, stream>>>(args...).
template <auto kernel, typename... Args>
void launch(int64_t items, int64_t per_cta, cudaStream_t stream, Args... args) {
  kernel<<<launch_grid<kernel>(items, per_cta), kThreads, 0, stream>>>(args...);
}

// True when every pointer is a multiple of `bytes`.
template <typename... P>
inline bool aligned_to(int64_t bytes, const P*... ptrs) {
  return ((reinterpret_cast<uintptr_t>(ptrs) % static_cast<uintptr_t>(bytes) == 0) && ...);
}

// |f| as int bits: integer order is float order, NaN > Inf > finite.
__device__ __forceinline__ int abs_bits(float f) { return __float_as_int(f) & 0x7fffffff; }

__device__ __forceinline__ float nan_float() { return __int_as_float(0x7fc00000); }

// N consecutive elements of T moved with the widest accesses (16, 8 or 4
// bytes) that divide N * sizeof(T); the caller guarantees that alignment of p.
template <typename T, int N>
struct VecIO {
  static constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
  using Word = std::conditional_t<kBytes % 16 == 0, uint4,
               std::conditional_t<kBytes % 8 == 0, uint2, std::conditional_t<kBytes % 4 == 0, uint32_t, T>>>;
  static constexpr int kWords = kBytes / static_cast<int>(sizeof(Word));

  __device__ __forceinline__ static void load(const T* p, T (&v)[N]) {
    Word w[kWords];
#pragma unroll
    for (int j = 0; j < kWords; ++j) w[j] = reinterpret_cast<const Word*>(p)[j];
    memcpy(v, w, sizeof w);
  }
  __device__ __forceinline__ static void store(T* p, const T (&v)[N]) {
    Word w[kWords];
    memcpy(w, v, sizeof w);
#pragma unroll
    for (int j = 0; j < kWords; ++j) reinterpret_cast<Word*>(p)[j] = w[j];
  }
};

// Max (int) over aligned groups of G lanes of one warp (G a power of two <= 32):
// every lane of a group gets the group's result. The whole warp must call it.
template <int G>
__device__ __forceinline__ int group_max(int v) {
#pragma unroll
  for (int off = G / 2; off > 0; off /= 2) {
    const int o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  return v;
}

// Lanes per quantization block: the smallest power of two G <= 32 with
// G * per_lane >= block (a block of <= 32 * per_lane elements is then held
// entirely in its lanes' registers; larger ones use 32 lanes and a loop).
inline int lanes_for(int64_t block, int per_lane) {
  int g = 1;
  while (g < kWarp && static_cast<int64_t>(g) * per_lane < block) g *= 2;
  return g;
}

// Calls launch(std::integral_constant<int, G>{}) for the runtime lane count g.
template <typename F>
void dispatch_lanes(int g, F&& launch) {
  switch (g) {
    case 1: launch(std::integral_constant<int, 1>{}); break;
    case 2: launch(std::integral_constant<int, 2>{}); break;
    case 4: launch(std::integral_constant<int, 4>{}); break;
    case 8: launch(std::integral_constant<int, 8>{}); break;
    case 16: launch(std::integral_constant<int, 16>{}); break;
    default: launch(std::integral_constant<int, 32>{}); break;
  }
}

}  // namespace ddpx::cuda
