// The `ddpx` torch-op namespace. Each csrc/ops/<op>.cpp adds its schemas with
// TORCH_LIBRARY_FRAGMENT; device kernels live in csrc/cpu and csrc/cuda.
#include <torch/library.h>

TORCH_LIBRARY(ddpx, m) {
  (void)m;
}
