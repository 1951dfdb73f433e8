// CPU kernels: multi-tensor flatten/unflatten (times an optional scale).
// Contiguous tensors are copied in one parallel loop over all their elements;
// strided sources go through at::Tensor::copy_ / at::mul_out into their slot.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/mul.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ops/common.h"

namespace ddpx::cpu {
namespace {

constexpr int64_t kGrainElems = 1 << 16;

// One contiguous tensor's slot in the flat buffer.
struct Piece {
  char* dst;
  const char* src;
  int64_t begin;  // offset of this piece in the concatenation of all pieces
  int64_t numel;
};

template <typename T>
void scaled_copy(T* dst, const T* src, int64_t n, double scale) {
  using opmath_t = at::opmath_type<T>;
  const auto s = static_cast<opmath_t>(scale);
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<opmath_t>(src[i]) * s);
}

// Copies every piece (times scale), splitting the elements evenly over threads.
void copy_pieces(const std::vector<Piece>& pieces, int64_t total, at::ScalarType dtype, double scale) {
  if (total == 0) return;
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  at::parallel_for(0, total, kGrainElems, [&](int64_t e0, int64_t e1) {
    auto it = std::upper_bound(pieces.begin(), pieces.end(), e0,
                               [](int64_t e, const Piece& p) { return e < p.begin; });
    for (auto p = it - 1; p != pieces.end() && p->begin < e1; ++p) {
      const int64_t lo = std::max(e0, p->begin) - p->begin;
      const int64_t hi = std::min(e1, p->begin + p->numel) - p->begin;
      if (hi <= lo) continue;
      if (scale == 1.0) {
        std::memcpy(p->dst + lo * item, p->src + lo * item, (hi - lo) * item);
      } else {
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "ddpx_flatten", [&] {
          scaled_copy(reinterpret_cast<scalar_t*>(p->dst) + lo, reinterpret_cast<const scalar_t*>(p->src) + lo,
                      hi - lo, scale);
        });
      }
    }
  });
}

void flatten_out(at::TensorList tensors, double scale, at::Tensor& out) {
  ops::detail::check_flatten(tensors, scale, out);
  const int64_t item = static_cast<int64_t>(out.element_size());
  char* base = static_cast<char*>(out.data_ptr());
  std::vector<Piece> pieces;
  int64_t offset = 0, total = 0;
  for (const at::Tensor& t : tensors) {
    const int64_t n = t.numel();
    if (n > 0 && t.is_contiguous()) {
      pieces.push_back({base + offset * item, static_cast<const char*>(t.const_data_ptr()), total, n});
      total += n;
    } else if (n > 0) {
      at::Tensor slot = out.narrow(0, offset, n).view(t.sizes());
      if (scale == 1.0) {
        slot.copy_(t);
      } else {
        at::mul_out(slot, t, scale);
      }
    }
    offset += n;
  }
  copy_pieces(pieces, total, out.scalar_type(), scale);
}

void unflatten_(const at::Tensor& flat_in, at::TensorList tensors, double scale) {
  ops::detail::check_unflatten(flat_in, tensors, scale);
  const at::Tensor flat = flat_in.contiguous();
  const int64_t item = static_cast<int64_t>(flat.element_size());
  const char* base = static_cast<const char*>(flat.const_data_ptr());
  std::vector<Piece> pieces;
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    const int64_t n = t.numel();
    if (n > 0) pieces.push_back({static_cast<char*>(t.data_ptr()), base + offset * item, offset, n});
    offset += n;
  }
  copy_pieces(pieces, offset, flat.scalar_type(), scale);
}

}  // namespace
}  // namespace ddpx::cpu

TORCH_LIBRARY_IMPL(ddpx, CPU, m) {
  m.impl("flatten_out", &ddpx::cpu::flatten_out);
  m.impl("unflatten_", &ddpx::cpu::unflatten_);
}
