// Helpers for the CPU kernels: the loops are written so gcc/clang vectorize
// them (-O3; no fast-math, so results stay bit-exact), and the hot ones are
// compiled twice with DDPX_CPU_CLONES -- an AVX2 clone picked at load time on
// CPUs that have it, and the portable baseline.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__APPLE__)
// No "fma" in the clone: a fused multiply-add would round differently from the
// torch reference (and from the CUDA kernels, which use explicit __fmul/__fsub).
#define DDPX_CPU_CLONES __attribute__((target_clones("avx2", "default")))
// Hand-written AVX2 steps, for what gcc does not vectorize well; called only
// where cpu_has_avx2() says so.
#define DDPX_AVX2_STEPS 1
#define DDPX_TARGET_AVX2 __attribute__((target("avx2")))
#include <immintrin.h>
#else
#define DDPX_CPU_CLONES
#define DDPX_AVX2_STEPS 0
#endif

#define DDPX_INLINE inline __attribute__((always_inline))

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ddpx::cpu {

DDPX_INLINE uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

DDPX_INLINE float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// |f| as an integer: for non-negative floats integer order is float order, and
// NaN > Inf > every finite value, so one integer max finds the block's max|v|
// and whether the block holds any NaN/Inf.
constexpr int32_t kNonFiniteAbsBits = 0x7f800000;

DDPX_INLINE int32_t abs_bits(float f) { return static_cast<int32_t>(float_bits(f) & 0x7fffffffu); }

inline bool cpu_has_avx2() {
#if DDPX_AVX2_STEPS
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));
  return has;
#else
  return false;
#endif
}

// round-half-to-even for |y| < 2^22 under the default rounding mode: adding
// 1.5 * 2^23 leaves no fraction bits, so the FPU rounds y to an integer.
constexpr float kRoundMagic = 12582912.0f;
DDPX_INLINE float round_half_even(float y) { return (y + kRoundMagic) - kRoundMagic; }

// 8-lane vectors (GCC/clang vector extensions): explicit lanes where the
// order of a float sum matters, lowered to AVX2 or pairs of SSE registers.
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int8_t i8x8 __attribute__((vector_size(8)));

DDPX_INLINE f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

DDPX_INLINE void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }

DDPX_INLINE i32x8 abs_bits8(f32x8 v) {
  i32x8 u;
  std::memcpy(&u, &v, sizeof u);
  return u & 0x7fffffff;
}

DDPX_INLINE f32x8 bits_float8(i32x8 u) {
  f32x8 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

DDPX_INLINE i32x8 max8(i32x8 a, i32x8 b) { return a > b ? a : b; }

DDPX_INLINE int32_t hmax8(i32x8 a) {
  int32_t m = a[0];
  for (int j = 1; j < 8; ++j) m = a[j] > m ? a[j] : m;
  return m;
}

// Bit j of the result is (v[j] >= 0) for j < 8 (NaN -> 0).
DDPX_INLINE uint8_t sign_byte(const float* v) {
#if defined(__SSE2__)
  const __m128 zero = _mm_setzero_ps();
  const int lo = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(v), zero));
  const int hi = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(v + 4), zero));
  return static_cast<uint8_t>(lo | (hi << 4));
#else
  uint32_t byte = 0;
  for (int j = 0; j < 8; ++j) byte |= static_cast<uint32_t>(v[j] >= 0.0f) << j;
  return static_cast<uint8_t>(byte);
#endif
}

// Pull the next block into the cache while the current one is being computed
// on, so the DRAM stream does not stall between a block's two passes.
DDPX_INLINE void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

}  // namespace ddpx::cpu
