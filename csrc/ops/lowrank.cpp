// Low-rank (PowerSGD) passes over a gradient matrix M [n, k] and its memory E,
// with Q^T [r, k], P [n, r] and the previous step's P, P' [n, r]. E holds the
// previous step's full sum, so its error is E - P' Q^T (subtracted lazily: no
// pass writes the error on its own):
//   lowrank_project_:           E = (M + E) - P' Q^T; P = E Q  (one pass over M and E)
//   lowrank_transpose_project_: Q^T = P^T E                    (one pass over E)
//   lowrank_reconstruct_:       M = P Q^T                      (one write pass)
// The CPU kernels (csrc/ops/cpu/lowrank_kernel.cpp) stream M row by row; other
// devices use the composite ATen version below (cuBLAS does these well).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/matmul.h>
#include <torch/library.h>

#include "ops/common.h"
#include "ops/ops.h"

namespace ddpx::ops {
namespace detail {

void check_lowrank(const char* op, const at::Tensor& m, const at::Tensor* error, const at::Tensor& p,
                   const at::Tensor& qt, const at::Tensor* p_prev) {
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"m", &m}, {"error", error}, {"p", &p},
                         {"qt", &qt}, {"p_prev", p_prev}}) {
    if (t == nullptr) continue;
    check_dtype(op, name, *t, at::kFloat);
    check_same_device(op, name, *t, m);
    TORCH_CHECK_VALUE(t->dim() == 2, "ddpx.ops.", op, ": ", name, " must be 2-D, got ", t->dim(), "-D");
    check_contiguous_output(op, name, *t);
  }
  TORCH_CHECK_VALUE(error == nullptr || error->sizes() == m.sizes(), "ddpx.ops.", op, ": error must have m's shape ",
                    m.sizes(), ", got ", error->sizes());
  TORCH_CHECK_VALUE(p.size(0) == m.size(0) && qt.size(1) == m.size(1) && p.size(1) == qt.size(0), "ddpx.ops.",
                    op, ": shapes must be m [n, k], p [n, r], qt [r, k]; got m ", m.sizes(), ", p ", p.sizes(),
                    ", qt ", qt.sizes());
  TORCH_CHECK_VALUE(p_prev == nullptr || p_prev->sizes() == p.sizes(), "ddpx.ops.", op,
                    ": p_prev must have p's shape ", p.sizes(), ", got ", p_prev->sizes());
}

}  // namespace detail

namespace {

void lowrank_project_composite(const at::Tensor& m, at::Tensor& error, const at::Tensor& p_prev,
                               const at::Tensor& qt, at::Tensor& p) {
  detail::check_lowrank("lowrank_project_", m, &error, p, qt, &p_prev);
  error.add_(m).addmm_(p_prev, qt, /*beta=*/1.0, /*alpha=*/-1.0);
  at::matmul_out(p, error, qt.t());
}

void lowrank_transpose_project_composite(const at::Tensor& m, const at::Tensor& p, at::Tensor& qt) {
  detail::check_lowrank("lowrank_transpose_project_", m, nullptr, p, qt);
  at::matmul_out(qt, p.t(), m);
}

void lowrank_reconstruct_composite(at::Tensor& m, const at::Tensor& p, const at::Tensor& qt) {
  detail::check_lowrank("lowrank_reconstruct_", m, nullptr, p, qt);
  at::matmul_out(m, p, qt);
}

}  // namespace

void lowrank_project_(const at::Tensor& m, at::Tensor& error, const at::Tensor& p_prev, const at::Tensor& qt,
                      at::Tensor& p) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("ddpx::lowrank_project_", "")
          .typed<void(const at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&)>();
  op.call(m, error, p_prev, qt, p);
}

void lowrank_transpose_project_(const at::Tensor& m, const at::Tensor& p, at::Tensor& qt) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::lowrank_transpose_project_", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&)>();
  op.call(m, p, qt);
}

void lowrank_reconstruct_(at::Tensor& m, const at::Tensor& p, const at::Tensor& qt) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::lowrank_reconstruct_", "")
                       .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  op.call(m, p, qt);
}

}  // namespace ddpx::ops

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  m.def("lowrank_project_(Tensor m, Tensor(a!) error, Tensor p_prev, Tensor qt, Tensor(b!) p) -> ()");
  m.def("lowrank_transpose_project_(Tensor m, Tensor p, Tensor(a!) qt) -> ()");
  m.def("lowrank_reconstruct_(Tensor(a!) m, Tensor p, Tensor qt) -> ()");
}

TORCH_LIBRARY_IMPL(ddpx, CompositeExplicitAutograd, m) {
  m.impl("lowrank_project_", &ddpx::ops::lowrank_project_composite);
  m.impl("lowrank_transpose_project_", &ddpx::ops::lowrank_transpose_project_composite);
  m.impl("lowrank_reconstruct_", &ddpx::ops::lowrank_reconstruct_composite);
}
