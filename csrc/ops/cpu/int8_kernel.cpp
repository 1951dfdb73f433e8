// CPU kernels: blockwise int8 quantize (+ error feedback) and the fused
// dequantize-and-sum over ranks. One pass over memory: each block is read once
// from RAM for its max and again from L1 for the quantization.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "ops/cpu/simd.h"
#include "ops/common.h"

namespace ddpx::cpu {
namespace {

// Elements per parallel task: big enough to amortize the thread hand-off.
constexpr int64_t kGrainElems = 1 << 16;
constexpr int64_t kStep = 64;  // elements per prefetch step

#if DDPX_AVX2_STEPS
// Pass 2 for kStep elements: q = clamp(round(v / scale)), err = v - q * scale.
// gcc vectorizes the portable loop below but narrows int32 to int8 with long
// shuffle chains (3.3 G elements/s from L1 on the Zen 5 here); saturating packs
// take three instructions per 32 elements (9.3 G/s). The same operations on the
// same values in the same order, so the same bits as the portable loop.
template <bool kError>
DDPX_TARGET_AVX2 void quantize_step_avx2(const float* x, float* err, int8_t* q, float scale) {
  static_assert(kStep == 64, "two 32-element packs per step");
  const __m256 s = _mm256_set1_ps(scale), magic = _mm256_set1_ps(kRoundMagic);  // round_half_even
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' 128-bit lane split
  __m256i ints[8];
  for (int j = 0; j < 8; ++j) {
    __m256 v = _mm256_loadu_ps(x + 8 * j);
    if (kError) v = _mm256_add_ps(v, _mm256_loadu_ps(err + 8 * j));
    __m256 r = _mm256_sub_ps(_mm256_add_ps(_mm256_div_ps(v, s), magic), magic);
    r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
    if (kError) _mm256_storeu_ps(err + 8 * j, _mm256_sub_ps(v, _mm256_mul_ps(r, s)));
    ints[j] = _mm256_cvttps_epi32(r);
  }
  for (int j = 0; j < 8; j += 4) {
    const __m256i a = _mm256_packs_epi32(ints[j], ints[j + 1]);
    const __m256i b = _mm256_packs_epi32(ints[j + 2], ints[j + 3]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * j),
                        _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), order));
  }
}
#endif

template <bool kError>
DDPX_INLINE void quantize_blocks(const float* x, float* err, int8_t* q, float* scales, int64_t n, int64_t block,
                                 bool avx2, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * block;
    const int64_t len = std::min(block, n - lo);
    if (len <= 0) break;  // never (b < nblocks); tells gcc the fills below are sane
    const float* xb = x + lo;
    float* eb = kError ? err + lo : nullptr;
    int8_t* qb = q + lo;

    // Pass 1: max|v| as integer bits (also flags NaN/Inf).
    i32x8 max_lo = {}, max_hi = {};
    const int64_t full = len - len % 16;
    for (int64_t i = 0; i < full; i += 16) {
      f32x8 v_lo = load8(xb + i), v_hi = load8(xb + i + 8);
      if (kError) {
        v_lo = v_lo + load8(eb + i);
        v_hi = v_hi + load8(eb + i + 8);
      }
      max_lo = max8(max_lo, abs_bits8(v_lo));
      max_hi = max8(max_hi, abs_bits8(v_hi));
    }
    int32_t amax = hmax8(max8(max_lo, max_hi));
    for (int64_t i = full; i < len; ++i) {
      const int32_t a = abs_bits(kError ? xb[i] + eb[i] : xb[i]);
      amax = a > amax ? a : amax;
    }
    if (amax >= kNonFiniteAbsBits) {  // NaN/Inf: NaN scale, error untouched
      scales[b] = bits_float(0x7fc00000u);
      std::fill(qb, qb + len, int8_t{0});
      continue;
    }
    const float scale = bits_float(static_cast<uint32_t>(amax)) / 127.0f;
    scales[b] = scale;
    if (scale == 0.0f) {  // all zero (or too tiny to scale): q = 0, error keeps v
      std::fill(qb, qb + len, int8_t{0});
      if (kError) {
        for (int64_t i = 0; i < len; ++i) eb[i] = xb[i] + eb[i];
      }
      continue;
    }
    // Pass 2, from L1, while the next block streams in.
    const int64_t next_len = std::max<int64_t>(0, std::min(block, n - lo - block));
    for (int64_t i0 = 0; i0 < len; i0 += kStep) {
      const int64_t m = std::min(kStep, len - i0);
      if (i0 < next_len) {
        const int64_t ahead = std::min(kStep, next_len - i0) * 4;
        prefetch_lines(xb + block + i0, ahead);
        if (kError) prefetch_lines(eb + block + i0, ahead);
      }
#if DDPX_AVX2_STEPS
      if (avx2 && m == kStep) {
        quantize_step_avx2<kError>(xb + i0, kError ? eb + i0 : nullptr, qb + i0, scale);
        continue;
      }
#endif
      for (int64_t i = i0; i < i0 + m; ++i) {
        const float v = kError ? xb[i] + eb[i] : xb[i];
        float r = round_half_even(v / scale);
        r = r < -127.0f ? -127.0f : r;
        r = r > 127.0f ? 127.0f : r;
        qb[i] = static_cast<int8_t>(static_cast<int32_t>(r));
        if (kError) eb[i] = v - r * scale;
      }
    }
  }
}

DDPX_CPU_CLONES void quantize_blocks_error(const float* x, float* err, int8_t* q, float* scales, int64_t n,
                                           int64_t block, bool avx2, int64_t b0, int64_t b1) {
  quantize_blocks<true>(x, err, q, scales, n, block, avx2, b0, b1);
}

DDPX_CPU_CLONES void quantize_blocks_plain(const float* x, int8_t* q, float* scales, int64_t n, int64_t block,
                                           bool avx2, int64_t b0, int64_t b1) {
  quantize_blocks<false>(x, nullptr, q, scales, n, block, avx2, b0, b1);
}

void int8_quantize_out(const at::Tensor& x_in, int64_t block, const std::optional<at::Tensor>& error, at::Tensor& q,
                       at::Tensor& scales) {
  ops::detail::check_int8_quantize(x_in, block, error, q, scales);
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.numel();
  if (n == 0) return;
  const float* xp = x.const_data_ptr<float>();
  float* ep = error ? error->mutable_data_ptr<float>() : nullptr;
  int8_t* qp = q.mutable_data_ptr<int8_t>();
  float* sp = scales.mutable_data_ptr<float>();
  const int64_t nblocks = ops::detail::ceil_div(n, block);
  const int64_t grain = std::max<int64_t>(1, kGrainElems / block);
  const bool avx2 = cpu_has_avx2();
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    if (ep) {
      quantize_blocks_error(xp, ep, qp, sp, n, block, avx2, b0, b1);
    } else {
      quantize_blocks_plain(xp, qp, sp, n, block, avx2, b0, b1);
    }
  });
}

// out = (accumulate ? out : 0) + alpha * (q[0] * s[0] + q[1] * s[1] + ...),
// rows added in order, 64 elements at a time.
DDPX_CPU_CLONES void dequant_blocks(float* out, const int8_t* q, int64_t q_row_stride, const float* scales,
                                    int64_t s_row_stride, int64_t rows, int64_t n, int64_t block, float alpha,
                                    bool accumulate, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t block_end = std::min(n, (b + 1) * block);
    int64_t lo = b * block;
    for (; lo + kStep <= block_end; lo += kStep) {
      float acc[kStep];
      {
        const int8_t* qr = q + lo;
        const float s = scales[b];
        for (int i = 0; i < kStep; ++i) acc[i] = static_cast<float>(qr[i]) * s;
      }
      for (int64_t r = 1; r < rows; ++r) {
        const int8_t* qr = q + r * q_row_stride + lo;
        const float s = scales[r * s_row_stride + b];
        for (int i = 0; i < kStep; ++i) acc[i] = acc[i] + static_cast<float>(qr[i]) * s;
      }
      float* o = out + lo;
      if (accumulate) {
        for (int i = 0; i < kStep; ++i) o[i] = o[i] + alpha * acc[i];
      } else {
        for (int i = 0; i < kStep; ++i) o[i] = alpha * acc[i];
      }
    }
    for (int64_t i = lo; i < block_end; ++i) {  // the block's last partial step
      float sum = 0.0f;
      for (int64_t r = 0; r < rows; ++r) {
        const float d = static_cast<float>(q[r * q_row_stride + i]) * scales[r * s_row_stride + b];
        sum = r == 0 ? d : sum + d;
      }
      out[i] = accumulate ? out[i] + alpha * sum : alpha * sum;
    }
  }
}

void int8_dequant_accumulate_(at::Tensor& out, const at::Tensor& q_in, const at::Tensor& scales_in, int64_t block,
                              double alpha, bool accumulate) {
  auto [q, scales] = ops::detail::check_int8_dequant(out, q_in, scales_in, block);
  const int64_t n = out.numel();
  if (n == 0) return;
  const int64_t rows = q.size(0);
  if (rows == 0) {  // nothing received: a sum over zero ranks
    if (!accumulate) out.zero_();
    return;
  }
  float* op = out.mutable_data_ptr<float>();
  const int8_t* qp = q.const_data_ptr<int8_t>();
  const float* sp = scales.const_data_ptr<float>();
  const int64_t qs = q.stride(0), ss = scales.stride(0);
  const int64_t nblocks = ops::detail::ceil_div(n, block);
  const int64_t grain = std::max<int64_t>(1, kGrainElems / (block * rows));
  const float a = static_cast<float>(alpha);
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    dequant_blocks(op, qp, qs, sp, ss, rows, n, block, a, accumulate, b0, b1);
  });
}

}  // namespace
}  // namespace ddpx::cpu

TORCH_LIBRARY_IMPL(ddpx, CPU, m) {
  m.impl("int8_quantize_out", &ddpx::cpu::int8_quantize_out);
  m.impl("int8_dequant_accumulate_", &ddpx::cpu::int8_dequant_accumulate_);
}
