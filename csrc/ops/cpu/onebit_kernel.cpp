// CPU kernels: 1-bit sign packing with one mean|v| scale per chunk (+ error
// feedback), and the fused unpack-and-sum over ranks.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <ATen/ops/zeros.h>

#include <algorithm>
#include <array>
#include <vector>

#include "ops/cpu/simd.h"
#include "ops/common.h"
#include "ops/ops.h"

namespace ddpx::cpu {
namespace {

constexpr int64_t kGrainElems = 1 << 16;
// Independent partial sums for mean|v|: a fixed summation order the compiler
// may vectorize without -ffast-math.
constexpr int kLanes = 16;
constexpr int64_t kStep = 64;  // multiple of 8: steps start on byte boundaries

DDPX_INLINE float sign_scale(bool positive, float scale) { return positive ? scale : -scale; }

template <bool kError>
DDPX_INLINE void pack_chunks(const float* x, float* err, uint8_t* bits, float* scales, int64_t n, int64_t chunk,
                             int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t lo = c * chunk;
    const int64_t len = std::min(chunk, n - lo);
    const float* xc = x + lo;
    float* ec = kError ? err + lo : nullptr;
    uint8_t* bc = bits + lo / 8;

    // Pass 1: max|v| bits (NaN/Inf check) and sum|v| in 16 fixed lanes:
    // lane j sums elements i = j (mod 16), then the lanes are added pairwise.
    i32x8 max_lo = {}, max_hi = {};
    f32x8 sum_lo = {}, sum_hi = {};
    const int64_t full = len - len % kLanes;
    for (int64_t i = 0; i < full; i += kLanes) {
      f32x8 v_lo = load8(xc + i), v_hi = load8(xc + i + 8);
      if (kError) {
        v_lo = v_lo + load8(ec + i);
        v_hi = v_hi + load8(ec + i + 8);
      }
      const i32x8 a_lo = abs_bits8(v_lo), a_hi = abs_bits8(v_hi);
      max_lo = max8(max_lo, a_lo);
      max_hi = max8(max_hi, a_hi);
      sum_lo = sum_lo + bits_float8(a_lo);
      sum_hi = sum_hi + bits_float8(a_hi);
    }
    float acc[kLanes];
    std::memcpy(acc, &sum_lo, sizeof sum_lo);
    std::memcpy(acc + 8, &sum_hi, sizeof sum_hi);
    int32_t amax = hmax8(max8(max_lo, max_hi));
    for (int64_t i = full; i < len; ++i) {
      const int32_t a = abs_bits(kError ? xc[i] + ec[i] : xc[i]);
      amax = a > amax ? a : amax;
      acc[i - full] += bits_float(static_cast<uint32_t>(a));
    }
    for (int width = kLanes / 2; width > 0; width /= 2) {
      for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
    }
    const bool finite = amax < kNonFiniteAbsBits;
    const float scale = finite ? acc[0] / static_cast<float>(len) : bits_float(0x7fc00000u);
    scales[c] = scale;

    // Pass 2, from L1, in steps of kStep elements: signs, then the residual.
    const int64_t next_len = std::max<int64_t>(0, std::min(chunk, n - lo - chunk));
    for (int64_t i0 = 0; i0 < len; i0 += kStep) {
      const int64_t m = std::min(kStep, len - i0);
      if (i0 < next_len) {
        const int64_t ahead = std::min(kStep, next_len - i0) * 4;
        prefetch_lines(xc + chunk + i0, ahead);
        if (kError) prefetch_lines(ec + chunk + i0, ahead);
      }
      float v[kStep];
      for (int64_t i = 0; i < m; ++i) v[i] = kError ? xc[i0 + i] + ec[i0 + i] : xc[i0 + i];
      uint8_t* bo = bc + i0 / 8;
      for (int64_t k = 0; k < m / 8; ++k) bo[k] = sign_byte(v + 8 * k);
      if (m % 8) {  // the chunk's (and tensor's) last, partial byte: padding bits 0
        uint32_t byte = 0;
        for (int64_t i = m - m % 8; i < m; ++i) byte |= static_cast<uint32_t>(v[i] >= 0.0f) << (i % 8);
        bo[m / 8] = static_cast<uint8_t>(byte);
      }
      if (kError && finite) {
        for (int64_t i = 0; i < m; ++i) ec[i0 + i] = v[i] - sign_scale(v[i] >= 0.0f, scale);
      }
    }
  }
}

DDPX_CPU_CLONES void pack_chunks_error(const float* x, float* err, uint8_t* bits, float* scales, int64_t n,
                                       int64_t chunk, int64_t c0, int64_t c1) {
  pack_chunks<true>(x, err, bits, scales, n, chunk, c0, c1);
}

DDPX_CPU_CLONES void pack_chunks_plain(const float* x, uint8_t* bits, float* scales, int64_t n, int64_t chunk,
                                       int64_t c0, int64_t c1) {
  pack_chunks<false>(x, nullptr, bits, scales, n, chunk, c0, c1);
}

void onebit_pack_out(const at::Tensor& x_in, int64_t chunk, const std::optional<at::Tensor>& error,
                     at::Tensor& bits, at::Tensor& scales) {
  ops::detail::check_onebit_pack(x_in, chunk, error, bits, scales);
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.numel();
  if (n == 0) return;
  const float* xp = x.const_data_ptr<float>();
  float* ep = error ? error->mutable_data_ptr<float>() : nullptr;
  uint8_t* bp = bits.mutable_data_ptr<uint8_t>();
  float* sp = scales.mutable_data_ptr<float>();
  const int64_t nchunks = ops::detail::ceil_div(n, chunk);
  const int64_t grain = std::max<int64_t>(1, kGrainElems / chunk);
  at::parallel_for(0, nchunks, grain, [&](int64_t c0, int64_t c1) {
    if (ep) {
      pack_chunks_error(xp, ep, bp, sp, n, chunk, c0, c1);
    } else {
      pack_chunks_plain(xp, bp, sp, n, chunk, c0, c1);
    }
  });
}

// kSigns[byte][j] = bit j of byte ? +1 : -1; multiplying a scale by it is exact.
struct SignTable {
  alignas(64) float v[256][8];
  SignTable() {
    for (int b = 0; b < 256; ++b)
      for (int j = 0; j < 8; ++j) v[b][j] = (b >> j) & 1 ? 1.0f : -1.0f;
  }
};
const SignTable kSigns;

// Chunk c (elements [c * chunk, chunk_end), rows >= 1) into dst[0, ...):
// dst = (accumulate ? dst : 0) + alpha * (dec[0] + dec[1] + ...), rows added in
// order; 64 elements at a time are summed in registers over all rows.
DDPX_INLINE void decode_chunk(float* dst, const uint8_t* bits, int64_t b_row_stride, const float* scales,
                              int64_t s_row_stride, int64_t rows, int64_t c, int64_t chunk, int64_t chunk_end,
                              float alpha, bool accumulate) {
  const int64_t first = c * chunk;
  int64_t lo = first;
  for (; lo + kStep <= chunk_end; lo += kStep) {
    f32x8 acc[kStep / 8];
    {
      const uint8_t* br = bits + lo / 8;
      const float s = scales[c];
      for (int k = 0; k < kStep / 8; ++k) acc[k] = load8(kSigns.v[br[k]]) * s;
    }
    for (int64_t r = 1; r < rows; ++r) {
      const uint8_t* br = bits + r * b_row_stride + lo / 8;
      const float s = scales[r * s_row_stride + c];
      for (int k = 0; k < kStep / 8; ++k) acc[k] = acc[k] + load8(kSigns.v[br[k]]) * s;
    }
    float* o = dst + (lo - first);
    for (int k = 0; k < kStep / 8; ++k) {
      const f32x8 add = alpha * acc[k];
      const f32x8 res = accumulate ? load8(o + 8 * k) + add : add;
      std::memcpy(o + 8 * k, &res, sizeof res);
    }
  }
  for (int64_t i = lo; i < chunk_end; ++i) {  // the tensor's last partial step
    float sum = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const float d = kSigns.v[bits[r * b_row_stride + i / 8]][i % 8] * scales[r * s_row_stride + c];
      sum = r == 0 ? d : sum + d;
    }
    float& o = dst[i - first];
    o = accumulate ? o + alpha * sum : alpha * sum;
  }
}

DDPX_CPU_CLONES void unpack_chunks(float* out, const uint8_t* bits, int64_t b_row_stride, const float* scales,
                                   int64_t s_row_stride, int64_t rows, int64_t n, int64_t chunk, float alpha,
                                   bool accumulate, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c) {
    decode_chunk(out + c * chunk, bits, b_row_stride, scales, s_row_stride, rows, c, chunk,
                 std::min(n, (c + 1) * chunk), alpha, accumulate);
  }
}

// Phase 2 of the 1-bit hook per chunk: decode the average into an L1-sized
// buffer and pack it with the server error from there, never writing the
// average to memory. Same arithmetic as unpack_chunks then pack_chunks.
DDPX_CPU_CLONES void average_repack_chunks(const uint8_t* bits, int64_t b_row_stride, const float* scales,
                                           int64_t s_row_stride, int64_t rows, float alpha, float* err,
                                           uint8_t* out_bits, float* out_scales, int64_t n, int64_t chunk,
                                           int64_t c0, int64_t c1) {
  std::vector<float> average(static_cast<size_t>(chunk));
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t lo = c * chunk, len = std::min(chunk, n - lo);
    decode_chunk(average.data(), bits, b_row_stride, scales, s_row_stride, rows, c, chunk, lo + len, alpha,
                 false);
    pack_chunks<true>(average.data(), err + lo, out_bits + lo / 8, out_scales + c, len, chunk, 0, 1);
  }
}

void onebit_unpack_accumulate_(at::Tensor& out, const at::Tensor& bits_in, const at::Tensor& scales_in,
                               int64_t chunk, double alpha, bool accumulate) {
  auto [bits, scales] = ops::detail::check_onebit_unpack(out, bits_in, scales_in, chunk);
  const int64_t n = out.numel();
  if (n == 0) return;
  const int64_t rows = bits.size(0);
  if (rows == 0) {
    if (!accumulate) out.zero_();
    return;
  }
  float* op = out.mutable_data_ptr<float>();
  const uint8_t* bp = bits.const_data_ptr<uint8_t>();
  const float* sp = scales.const_data_ptr<float>();
  const int64_t bs = bits.stride(0), ss = scales.stride(0);
  const int64_t nchunks = ops::detail::ceil_div(n, chunk);
  const int64_t grain = std::max<int64_t>(1, kGrainElems / (chunk * rows));
  const float a = static_cast<float>(alpha);
  at::parallel_for(0, nchunks, grain, [&](int64_t c0, int64_t c1) {
    unpack_chunks(op, bp, bs, sp, ss, rows, n, chunk, a, accumulate, c0, c1);
  });
}

void onebit_average_repack(const at::Tensor& bits_in, const at::Tensor& scales_in, int64_t chunk, double alpha,
                           at::Tensor& error, at::Tensor& out_bits, at::Tensor& out_scales) {
  auto [bits, scales] = ops::detail::check_onebit_unpack(error, bits_in, scales_in, chunk);
  ops::detail::check_onebit_pack(error, chunk, error, out_bits, out_scales);
  const int64_t n = error.numel(), rows = bits.size(0);
  if (n == 0) return;
  if (rows == 0) {  // an average of nothing: zeros, packed
    ops::onebit_pack_out(at::zeros({n}, error.options()), chunk, error, out_bits, out_scales);
    return;
  }
  const uint8_t* bp = bits.const_data_ptr<uint8_t>();
  const float* sp = scales.const_data_ptr<float>();
  float* ep = error.mutable_data_ptr<float>();
  uint8_t* obp = out_bits.mutable_data_ptr<uint8_t>();
  float* osp = out_scales.mutable_data_ptr<float>();
  const int64_t bs = bits.stride(0), ss = scales.stride(0);
  const int64_t nchunks = ops::detail::ceil_div(n, chunk);
  const int64_t grain = std::max<int64_t>(1, kGrainElems / chunk);
  const float a = static_cast<float>(alpha);
  at::parallel_for(0, nchunks, grain, [&](int64_t c0, int64_t c1) {
    average_repack_chunks(bp, bs, sp, ss, rows, a, ep, obp, osp, n, chunk, c0, c1);
  });
}

}  // namespace
}  // namespace ddpx::cpu

TORCH_LIBRARY_IMPL(ddpx, CPU, m) {
  m.impl("onebit_average_repack", &ddpx::cpu::onebit_average_repack);
  m.impl("onebit_pack_out", &ddpx::cpu::onebit_pack_out);
  m.impl("onebit_unpack_accumulate_", &ddpx::cpu::onebit_unpack_accumulate_);
}
