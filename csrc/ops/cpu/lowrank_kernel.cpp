// CPU kernels of the low-rank passes (see csrc/ops/lowrank.cpp): one streaming
// pass over M and E per call, the row and Q^T staying in cache.
// Every sum has a fixed order (8 lanes, then the lanes in order), so the AVX2
// clone and the portable build give the same bits.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "ops/cpu/simd.h"
#include "ops/common.h"

namespace ddpx::cpu {
namespace {

// sum_c p[c] * qt[c][j..j+8) for c < r, from 0 in order: one row of P Q^T.
template <int R>
DDPX_INLINE f32x8 approx8(const float* __restrict__ p, const float* __restrict__ qt, int64_t k, int64_t j,
                          int64_t r) {
  const int64_t rr = R > 0 ? R : r;
  f32x8 a = {};
  for (int64_t c = 0; c < rr; ++c) a += p[c] * load8(qt + c * k + j);
  return a;
}

template <int R>
DDPX_INLINE float approx1(const float* __restrict__ p, const float* __restrict__ qt, int64_t k, int64_t j,
                          int64_t r) {
  const int64_t rr = R > 0 ? R : r;
  float a = 0.0f;
  for (int64_t c = 0; c < rr; ++c) a += p[c] * qt[c * k + j];
  return a;
}

// Dot products of x [k] with the NC rows of qg, NC independent accumulators
// in one pass over x (one at a time would wait on every add's latency). With
// FULL, x = (g + x) - p_prev Q^T (the row of the step's full sum) is computed
// and stored first, in the same pass. Each sum: 8 lanes over j, then the lanes
// in order, then the tail in order.
template <int NC, int R, bool FULL>
DDPX_INLINE void dot_rows(const float* __restrict__ g, float* __restrict__ x, const float* __restrict__ p_prev,
                          const float* __restrict__ qt, int64_t r, const float* __restrict__ qg,
                          float* __restrict__ p, int64_t k) {
  const int64_t k8 = k - k % 8;
  f32x8 acc[NC] = {};
  for (int64_t j = 0; j < k8; j += 8) {
    f32x8 v;
    if constexpr (FULL) {
      v = (load8(g + j) + load8(x + j)) - approx8<R>(p_prev, qt, k, j, r);
      store8(x + j, v);
    } else {
      v = load8(x + j);
    }
    for (int c = 0; c < NC; ++c) acc[c] += v * load8(qg + c * k + j);
  }
  if constexpr (FULL) {
    for (int64_t j = k8; j < k; ++j) x[j] = (g[j] + x[j]) - approx1<R>(p_prev, qt, k, j, r);
  }
  for (int c = 0; c < NC; ++c) {
    float s = 0.0f;
    for (int l = 0; l < 8; ++l) s += acc[c][l];
    for (int64_t j = k8; j < k; ++j) s += x[j] * qg[c * k + j];
    p[c] = s;
  }
}

template <int R, bool FULL>
DDPX_INLINE void dot_group(const float* g, float* x, const float* p_prev, const float* qt, int64_t r,
                           const float* qg, float* p, int64_t k, int64_t nc) {
  switch (nc) {
    case 4: dot_rows<4, R, FULL>(g, x, p_prev, qt, r, qg, p, k); break;
    case 3: dot_rows<3, R, FULL>(g, x, p_prev, qt, r, qg, p, k); break;
    case 2: dot_rows<2, R, FULL>(g, x, p_prev, qt, r, qg, p, k); break;
    default: dot_rows<1, R, FULL>(g, x, p_prev, qt, r, qg, p, k); break;
  }
}

// err = (row + err) - p_prev Q^T; p[c] = sum_j err[j] * qt[c][j] for c < r,
// four c at a time (the first four in the same pass).
template <int R>
DDPX_INLINE void project_row_r(const float* row, float* err, const float* p_prev, const float* qt, float* p,
                               int64_t k, int64_t r) {
  const int64_t rr = R > 0 ? R : r;
  dot_group<R, true>(row, err, p_prev, qt, rr, qt, p, k, std::min<int64_t>(4, rr));
  for (int64_t c = 4; c < rr; c += 4)
    dot_group<R, false>(nullptr, err, nullptr, qt, rr, qt + c * k, p + c, k, std::min<int64_t>(4, rr - c));
}

DDPX_CPU_CLONES void project_row(const float* row, float* err, const float* p_prev, const float* qt, float* p,
                                 int64_t k, int64_t r) {
  switch (r) {  // the usual ranks unrolled
    case 1: project_row_r<1>(row, err, p_prev, qt, p, k, r); break;
    case 2: project_row_r<2>(row, err, p_prev, qt, p, k, r); break;
    case 4: project_row_r<4>(row, err, p_prev, qt, p, k, r); break;
    default: project_row_r<0>(row, err, p_prev, qt, p, k, r); break;
  }
}

// row = sum_c p[c] * qt[c] (from 0, c in order). One write pass.
template <int R>
DDPX_INLINE void reconstruct_row_r(float* __restrict__ row, const float* __restrict__ p,
                                   const float* __restrict__ qt, int64_t k, int64_t r) {
  const int64_t k8 = k - k % 8;
  for (int64_t j = 0; j < k8; j += 8) store8(row + j, approx8<R>(p, qt, k, j, r));
  for (int64_t j = k8; j < k; ++j) row[j] = approx1<R>(p, qt, k, j, r);
}

DDPX_CPU_CLONES void reconstruct_row(float* row, const float* p, const float* qt, int64_t k, int64_t r) {
  switch (r) {
    case 1: reconstruct_row_r<1>(row, p, qt, k, r); break;
    case 2: reconstruct_row_r<2>(row, p, qt, k, r); break;
    case 4: reconstruct_row_r<4>(row, p, qt, k, r); break;
    default: reconstruct_row_r<0>(row, p, qt, k, r); break;
  }
}

// qt[c][j] = sum_i p[i][c] * m[i][j] for columns j0 <= j < j1 (j0 a multiple
// of 8), the sum over i in order from 0. Four rows per visit of qt, which
// stays in L1 while the rows stream.
// One stream read alone does not keep enough misses in flight to reach DRAM
// bandwidth: prefetching the rows 8 ahead (a cache line of each per 16 columns)
// doubled this pass from DRAM on the Zen 5 here (ddpx bench kernels: 32-46% of
// memcpy -> 76-99%).
constexpr int64_t kAheadRows = 8;

template <int R>
DDPX_INLINE void transpose_project_cols_r(const float* __restrict__ m, const float* __restrict__ p,
                                          float* __restrict__ qt, int64_t n, int64_t k, int64_t r, int64_t j0,
                                          int64_t j1) {
  const int64_t rr = R > 0 ? R : r;
  const int64_t j8 = j0 + (j1 - j0) / 8 * 8;
  for (int64_t c = 0; c < rr; ++c)
    for (int64_t j = j0; j < j1; ++j) qt[c * k + j] = 0.0f;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float *m0 = m + i * k, *m1 = m0 + k, *m2 = m1 + k, *m3 = m2 + k;
    const float* pi = p + i * rr;
    const int64_t ahead = i + kAheadRows + 4 <= n ? kAheadRows * k : 0;
    for (int64_t j = j0; j < j8; j += 8) {
      if (ahead && ((j - j0) & 15) == 0) {
        __builtin_prefetch(m0 + ahead + j); __builtin_prefetch(m1 + ahead + j);
        __builtin_prefetch(m2 + ahead + j); __builtin_prefetch(m3 + ahead + j);
      }
      const f32x8 v0 = load8(m0 + j), v1 = load8(m1 + j), v2 = load8(m2 + j), v3 = load8(m3 + j);
      for (int64_t c = 0; c < rr; ++c) {
        f32x8 acc = load8(qt + c * k + j);
        acc += pi[c] * v0;
        acc += pi[rr + c] * v1;
        acc += pi[2 * rr + c] * v2;
        acc += pi[3 * rr + c] * v3;
        store8(qt + c * k + j, acc);
      }
    }
    for (int64_t j = j8; j < j1; ++j)
      for (int64_t c = 0; c < rr; ++c) {
        float acc = qt[c * k + j];
        acc += pi[c] * m0[j];
        acc += pi[rr + c] * m1[j];
        acc += pi[2 * rr + c] * m2[j];
        acc += pi[3 * rr + c] * m3[j];
        qt[c * k + j] = acc;
      }
  }
  for (; i < n; ++i) {
    const float* mi = m + i * k;
    for (int64_t j = j0; j < j8; j += 8) {
      const f32x8 v = load8(mi + j);
      for (int64_t c = 0; c < rr; ++c) store8(qt + c * k + j, load8(qt + c * k + j) + p[i * rr + c] * v);
    }
    for (int64_t j = j8; j < j1; ++j)
      for (int64_t c = 0; c < rr; ++c) qt[c * k + j] += p[i * rr + c] * mi[j];
  }
}

DDPX_CPU_CLONES void transpose_project_cols(const float* m, const float* p, float* qt, int64_t n, int64_t k,
                                            int64_t r, int64_t j0, int64_t j1) {
  switch (r) {
    case 1: transpose_project_cols_r<1>(m, p, qt, n, k, r, j0, j1); break;
    case 2: transpose_project_cols_r<2>(m, p, qt, n, k, r, j0, j1); break;
    case 4: transpose_project_cols_r<4>(m, p, qt, n, k, r, j0, j1); break;
    default: transpose_project_cols_r<0>(m, p, qt, n, k, r, j0, j1); break;
  }
}

int64_t grain_rows(int64_t k) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(k, 1)); }

void lowrank_project_(const at::Tensor& m, at::Tensor& error, const at::Tensor& p_prev, const at::Tensor& qt,
                      at::Tensor& p) {
  ops::detail::check_lowrank("lowrank_project_", m, &error, p, qt, &p_prev);
  const int64_t n = m.size(0), k = m.size(1), r = qt.size(0);
  const float* mp = m.const_data_ptr<float>();
  float* ep = error.mutable_data_ptr<float>();
  const float* pprev = p_prev.const_data_ptr<float>();
  const float* qp = qt.const_data_ptr<float>();
  float* pp = p.mutable_data_ptr<float>();
  at::parallel_for(0, n, grain_rows(k), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) project_row(mp + i * k, ep + i * k, pprev + i * r, qp, pp + i * r, k, r);
  });
}

// Columns split among threads: every column's sum runs over the rows in order,
// so any split (any thread count) gives the same bits.
void lowrank_transpose_project_(const at::Tensor& m, const at::Tensor& p, at::Tensor& qt) {
  ops::detail::check_lowrank("lowrank_transpose_project_", m, nullptr, p, qt);
  const int64_t n = m.size(0), k = m.size(1), r = qt.size(0);
  const float* mp = m.const_data_ptr<float>();
  const float* pp = p.const_data_ptr<float>();
  float* qp = qt.mutable_data_ptr<float>();
  constexpr int64_t kStrip = 1024;  // columns per pass over the rows: r x 1024 of qt (16 KB at rank 4) stay in L1
  const int64_t groups = (k + 7) / 8;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(8 * n, 1));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t j0 = 8 * g0; j0 < std::min(8 * g1, k); j0 += kStrip)
      transpose_project_cols(mp, pp, qp, n, k, r, j0, std::min({j0 + kStrip, 8 * g1, k}));
  });
}

void lowrank_reconstruct_(at::Tensor& m, const at::Tensor& p, const at::Tensor& qt) {
  ops::detail::check_lowrank("lowrank_reconstruct_", m, nullptr, p, qt);
  const int64_t n = m.size(0), k = m.size(1), r = qt.size(0);
  float* mp = m.mutable_data_ptr<float>();
  const float* pp = p.const_data_ptr<float>();
  const float* qp = qt.const_data_ptr<float>();
  at::parallel_for(0, n, grain_rows(k), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) reconstruct_row(mp + i * k, pp + i * r, qp, k, r);
  });
}

}  // namespace
}  // namespace ddpx::cpu

TORCH_LIBRARY_IMPL(ddpx, CPU, m) {
  m.impl("lowrank_project_", &ddpx::cpu::lowrank_project_);
  m.impl("lowrank_transpose_project_", &ddpx::cpu::lowrank_transpose_project_);
  m.impl("lowrank_reconstruct_", &ddpx::cpu::lowrank_reconstruct_);
}
