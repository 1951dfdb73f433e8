// CPU kernels: fp32 * scale -> fp16/bf16, and fp16/bf16 -> fp32 * scale.
// Round-to-nearest-even like torch's .to(); NaN stays NaN, overflow -> Inf.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops/cpu/simd.h"
#include "ops/common.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define DDPX_HAVE_F16C_PATH 1
#endif

namespace ddpx::cpu {
namespace {

constexpr int64_t kGrainElems = 1 << 16;

DDPX_CPU_CLONES void to_bf16(const float* x, uint16_t* out, float scale, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = c10::detail::round_to_nearest_even(x[i] * scale);
}

DDPX_CPU_CLONES void from_bf16(const uint16_t* src, float* dst, float scale, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bits_float(static_cast<uint32_t>(src[i]) << 16) * scale;
}

DDPX_CPU_CLONES void to_fp16_portable(const float* x, uint16_t* out, float scale, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = c10::detail::fp16_ieee_from_fp32_value(x[i] * scale);
}

DDPX_CPU_CLONES void from_fp16_portable(const uint16_t* src, float* dst, float scale, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::detail::fp16_ieee_to_fp32_value(src[i]) * scale;
}

#ifdef DDPX_HAVE_F16C_PATH
// The F16C instructions convert exactly (round-to-nearest-even), like the
// portable bit-twiddling version, 8 lanes at a time.
__attribute__((target("avx2,f16c"))) void to_fp16_f16c(const float* x, uint16_t* out, float scale, int64_t n) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), s);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) out[i] = c10::detail::fp16_ieee_from_fp32_value(x[i] * scale);
}

__attribute__((target("avx2,f16c"))) void from_fp16_f16c(const uint16_t* src, float* dst, float scale, int64_t n) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(v, s));
  }
  for (; i < n; ++i) dst[i] = c10::detail::fp16_ieee_to_fp32_value(src[i]) * scale;
}

bool cpu_has_f16c() {
  __builtin_cpu_init();  // static initializers may run before libgcc's own CPU probe
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
const bool kHasF16C = cpu_has_f16c();
#endif

void to_fp16(const float* x, uint16_t* out, float scale, int64_t n) {
#ifdef DDPX_HAVE_F16C_PATH
  if (kHasF16C) return to_fp16_f16c(x, out, scale, n);
#endif
  to_fp16_portable(x, out, scale, n);
}

void from_fp16(const uint16_t* src, float* dst, float scale, int64_t n) {
#ifdef DDPX_HAVE_F16C_PATH
  if (kHasF16C) return from_fp16_f16c(src, dst, scale, n);
#endif
  from_fp16_portable(src, dst, scale, n);
}

void scale_cast_out(const at::Tensor& x_in, double scale, at::Tensor& out) {
  ops::detail::check_scale_cast(x_in, out);
  const at::Tensor x = x_in.contiguous();
  const float* xp = x.const_data_ptr<float>();
  auto* op = static_cast<uint16_t*>(out.mutable_data_ptr());
  const float s = static_cast<float>(scale);
  const bool half = out.scalar_type() == at::kHalf;
  at::parallel_for(0, x.numel(), kGrainElems, [&](int64_t i0, int64_t i1) {
    if (half) {
      to_fp16(xp + i0, op + i0, s, i1 - i0);
    } else {
      to_bf16(xp + i0, op + i0, s, i1 - i0);
    }
  });
}

void cast_scale_copy_(at::Tensor& dst, const at::Tensor& src_in, double scale) {
  ops::detail::check_cast_scale_copy(dst, src_in);
  const at::Tensor src = src_in.contiguous();
  const auto* sp = static_cast<const uint16_t*>(src.const_data_ptr());
  float* dp = dst.mutable_data_ptr<float>();
  const float s = static_cast<float>(scale);
  const bool half = src.scalar_type() == at::kHalf;
  at::parallel_for(0, dst.numel(), kGrainElems, [&](int64_t i0, int64_t i1) {
    if (half) {
      from_fp16(sp + i0, dp + i0, s, i1 - i0);
    } else {
      from_bf16(sp + i0, dp + i0, s, i1 - i0);
    }
  });
}

}  // namespace
}  // namespace ddpx::cpu

TORCH_LIBRARY_IMPL(ddpx, CPU, m) {
  m.impl("scale_cast_out", &ddpx::cpu::scale_cast_out);
  m.impl("cast_scale_copy_", &ddpx::cpu::cast_scale_copy_);
}
