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
#else
#define DDPX_CPU_CLONES
#endif

#define DDPX_INLINE inline __attribute__((always_inline))

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

// round-half-to-even for |y| < 2^22 under the default rounding mode: adding
// 1.5 * 2^23 leaves no fraction bits, so the FPU rounds y to an integer.
DDPX_INLINE float round_half_even(float y) {
  constexpr float kMagic = 12582912.0f;
  return (y + kMagic) - kMagic;
}

}  // namespace ddpx::cpu
