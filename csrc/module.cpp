// The ddpx._C Python module. Importing it registers the ddpx:: torch ops
// (TORCH_LIBRARY in csrc/ops) and exposes the native comm-hook bindings.
#include "comm_hooks/bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ddpx C++/CUDA core: fused compression kernels and native DDP comm hooks";
#ifdef DDPX_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  ddpx::comm_hooks::bind(m);
}
