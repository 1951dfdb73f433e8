// CPU kernels: 1-bit sign packing with one mean|v| scale per chunk (+ error
// feedback), and the fused unpack-and-sum over ranks.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>

#include "cpu/simd.h"
#include "ops/common.h"

namespace ddpx::cpu {
namespace {

constexpr int64_t kGrainElems = 1 << 16;
constexpr int64_t kTile = 1024;  // multiple of 8: tiles start on byte boundaries
// Independent partial sums for mean|v|: a fixed summation order the compiler
// may vectorize without -ffast-math.
constexpr int kLanes = 16;

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

    float acc[kLanes] = {};
    int32_t amax_lane[kLanes] = {};
    const int64_t full = len - len % kLanes;
    for (int64_t i = 0; i < full; i += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        const float v = kError ? xc[i + j] + ec[i + j] : xc[i + j];
        const int32_t a = abs_bits(v);
        amax_lane[j] = a > amax_lane[j] ? a : amax_lane[j];
        acc[j] += bits_float(static_cast<uint32_t>(a));
      }
    }
    for (int64_t i = full; i < len; ++i) {
      const float v = kError ? xc[i] + ec[i] : xc[i];
      const int32_t a = abs_bits(v);
      amax_lane[i - full] = a > amax_lane[i - full] ? a : amax_lane[i - full];
      acc[i - full] += bits_float(static_cast<uint32_t>(a));
    }
    int32_t amax = 0;
    for (int j = 0; j < kLanes; ++j) amax = amax_lane[j] > amax ? amax_lane[j] : amax;
    for (int width = kLanes / 2; width > 0; width /= 2) {
      for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
    }
    const bool finite = amax < kNonFiniteAbsBits;
    const float scale = finite ? acc[0] / static_cast<float>(len) : bits_float(0x7fc00000u);
    scales[c] = scale;

    const int64_t full_bytes = len / 8;
    for (int64_t k = 0; k < full_bytes; ++k) {
      uint32_t byte = 0;
      for (int j = 0; j < 8; ++j) {
        const int64_t i = k * 8 + j;
        const float v = kError ? xc[i] + ec[i] : xc[i];
        byte |= static_cast<uint32_t>(v >= 0.0f) << j;
      }
      bc[k] = static_cast<uint8_t>(byte);
    }
    if (len % 8) {
      uint32_t byte = 0;
      for (int64_t i = full_bytes * 8; i < len; ++i) {
        const float v = kError ? xc[i] + ec[i] : xc[i];
        byte |= static_cast<uint32_t>(v >= 0.0f) << (i % 8);
      }
      bc[full_bytes] = static_cast<uint8_t>(byte);
    }
    if (kError && finite) {
      for (int64_t i = 0; i < len; ++i) {
        const float v = xc[i] + ec[i];
        ec[i] = v - sign_scale(v >= 0.0f, scale);
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

DDPX_CPU_CLONES void unpack_chunks(float* out, const uint8_t* bits, int64_t b_row_stride, const float* scales,
                                   int64_t s_row_stride, int64_t rows, int64_t n, int64_t chunk, float alpha,
                                   bool accumulate, int64_t c0, int64_t c1) {
  float tmp[kTile];
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t chunk_end = std::min(n, (c + 1) * chunk);
    for (int64_t lo = c * chunk; lo < chunk_end; lo += kTile) {
      const int64_t len = std::min(kTile, chunk_end - lo);
      const int64_t nbytes = (len + 7) / 8;  // tmp has room: kTile % 8 == 0
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* br = bits + r * b_row_stride + lo / 8;
        const float s = scales[r * s_row_stride + c];
        for (int64_t k = 0; k < nbytes; ++k) {
          const float* sign = kSigns.v[br[k]];
          float* t = tmp + k * 8;
          if (r == 0) {
            for (int j = 0; j < 8; ++j) t[j] = sign[j] * s;
          } else {
            for (int j = 0; j < 8; ++j) t[j] = t[j] + sign[j] * s;
          }
        }
      }
      float* o = out + lo;
      if (accumulate) {
        for (int64_t i = 0; i < len; ++i) o[i] = o[i] + alpha * tmp[i];
      } else {
        for (int64_t i = 0; i < len; ++i) o[i] = alpha * tmp[i];
      }
    }
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

}  // namespace
}  // namespace ddpx::cpu

TORCH_LIBRARY_IMPL(ddpx, CPU, m) {
  m.impl("onebit_pack_out", &ddpx::cpu::onebit_pack_out);
  m.impl("onebit_unpack_accumulate_", &ddpx::cpu::onebit_unpack_accumulate_);
}
