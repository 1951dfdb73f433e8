// Shared bits of the CUDA glue (csrc/ops/cuda/*_glue.cpp): the current stream of a
// tensor's device and launch-error reporting. Uses only device-generic c10
// APIs, so the glue also compiles against CPU torch headers (a syntax check).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <cuda_runtime_api.h>

namespace ddpx::cuda {

// torch's current CUDA stream on the tensor's device (what
// at::cuda::getCurrentCUDAStream returns), as a raw cudaStream_t.
inline cudaStream_t current_stream(const at::Tensor& t) {
  const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  return static_cast<cudaStream_t>(impl.getStream(t.device()).native_handle());
}

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "ddpx.ops.", op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace ddpx::cuda
