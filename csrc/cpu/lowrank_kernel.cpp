// CPU kernels of the low-rank passes (see csrc/ops/lowrank.cpp): one streaming
// pass over M (and E) per call, row by row, the row and Q^T staying in cache.
// Every sum has a fixed order (8 lanes, then the lanes in order), so the AVX2
// clone and the portable build give the same bits.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu/simd.h"
#include "ops/common.h"

namespace ddpx::ops::detail {
void check_lowrank(const char* op, const at::Tensor& m, const at::Tensor& error, const at::Tensor& p,
                   const at::Tensor& qt);
}

namespace ddpx::cpu {
namespace {

// row += err; then p[c] = sum_j row[j] * qt[c][j] for c < r.
DDPX_CPU_CLONES void project_row(float* row, const float* err, const float* qt, float* p, int64_t k, int64_t r) {
  for (int64_t j = 0; j < k; ++j) row[j] += err[j];
  const int64_t k8 = k - k % 8;
  for (int64_t c = 0; c < r; ++c) {
    const float* q = qt + c * k;
    f32x8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t j = 0; j < k8; j += 8) acc += load8(row + j) * load8(q + j);
    float s = 0.0f;
    for (int l = 0; l < 8; ++l) s += acc[l];
    for (int64_t j = k8; j < k; ++j) s += row[j] * q[j];
    p[c] = s;
  }
}

// a[j] = sum_c p[c] * qt[c][j]; err = row - a; row = a.
DDPX_CPU_CLONES void reconstruct_row(float* row, float* err, const float* p, const float* qt, float* a, int64_t k,
                                     int64_t r) {
  for (int64_t j = 0; j < k; ++j) a[j] = 0.0f;
  for (int64_t c = 0; c < r; ++c) {
    const float pc = p[c];
    const float* q = qt + c * k;
    for (int64_t j = 0; j < k; ++j) a[j] += pc * q[j];
  }
  for (int64_t j = 0; j < k; ++j) {
    err[j] = row[j] - a[j];
    row[j] = a[j];
  }
}

int64_t grain_rows(int64_t k) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(k, 1)); }

void lowrank_project_(at::Tensor& m, const at::Tensor& error, const at::Tensor& qt, at::Tensor& p) {
  ops::detail::check_lowrank("lowrank_project_", m, error, p, qt);
  const int64_t n = m.size(0), k = m.size(1), r = qt.size(0);
  float* mp = m.mutable_data_ptr<float>();
  const float* ep = error.const_data_ptr<float>();
  const float* qp = qt.const_data_ptr<float>();
  float* pp = p.mutable_data_ptr<float>();
  at::parallel_for(0, n, grain_rows(k), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) project_row(mp + i * k, ep + i * k, qp, pp + i * r, k, r);
  });
}

void lowrank_reconstruct_(at::Tensor& m, at::Tensor& error, const at::Tensor& p, const at::Tensor& qt) {
  ops::detail::check_lowrank("lowrank_reconstruct_", m, error, p, qt);
  const int64_t n = m.size(0), k = m.size(1), r = qt.size(0);
  float* mp = m.mutable_data_ptr<float>();
  float* ep = error.mutable_data_ptr<float>();
  const float* pp = p.const_data_ptr<float>();
  const float* qp = qt.const_data_ptr<float>();
  at::parallel_for(0, n, grain_rows(k), [&](int64_t i0, int64_t i1) {
    std::vector<float> a(k);  // one row of P Q^T
    for (int64_t i = i0; i < i1; ++i) reconstruct_row(mp + i * k, ep + i * k, pp + i * r, qp, a.data(), k, r);
  });
}

}  // namespace
}  // namespace ddpx::cpu

TORCH_LIBRARY_IMPL(ddpx, CPU, m) {
  m.impl("lowrank_project_", &ddpx::cpu::lowrank_project_);
  m.impl("lowrank_reconstruct_", &ddpx::cpu::lowrank_reconstruct_);
}
