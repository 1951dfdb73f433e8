// CUDA kernels: multi-tensor copy (flatten/unflatten). Up to kPieces tensors
// per launch travel in the kernel's parameters (no host-to-device copy); the
// grid's y dimension picks the tensor, x strides over its elements.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace ddpx::cuda {
namespace {

constexpr int kPieces = 48;

struct Batch {
  const void* src[kPieces];
  void* dst[kPieces];
  int64_t numel[kPieces];
};

template <typename T>
struct Copy {
  __device__ __forceinline__ T operator()(T v) const { return v; }
};
// Scaled copies compute in fp32 for fp32/fp16/bf16 and in fp64 for fp64, like
// torch's `t * scale` (and the CPU kernel).
struct ScaleFloat {
  float s;
  __device__ __forceinline__ float operator()(float v) const { return __fmul_rn(v, s); }
};
struct ScaleDouble {
  double s;
  __device__ __forceinline__ double operator()(double v) const { return __dmul_rn(v, s); }
};
struct ScaleHalf {
  float s;
  __device__ __forceinline__ __half operator()(__half v) const { return __float2half_rn(__fmul_rn(__half2float(v), s)); }
};
struct ScaleBFloat16 {
  float s;
  __device__ __forceinline__ __nv_bfloat16 operator()(__nv_bfloat16 v) const {
    return __float2bfloat16_rn(__fmul_rn(__bfloat162float(v), s));
  }
};

template <typename T, typename Op>
__global__ void __launch_bounds__(kThreads) multi_copy_kernel(Batch batch, Op op) {
  const int p = blockIdx.y;
  const T* __restrict__ src = static_cast<const T*>(batch.src[p]);
  T* __restrict__ dst = static_cast<T*>(batch.dst[p]);
  const int64_t n = batch.numel[p];
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    dst[i] = op(src[i]);
  }
}

template <typename T, typename Op>
cudaError_t launch_batches(const CopyPiece* pieces, int64_t count, Op op, cudaStream_t stream) {
  for (int64_t start = 0; start < count; start += kPieces) {
    Batch batch{};
    int used = 0;
    int64_t largest = 0;
    for (int64_t p = start; p < count && used < kPieces; ++p, ++used) {
      batch.src[used] = pieces[p].src;
      batch.dst[used] = pieces[p].dst;
      batch.numel[used] = pieces[p].numel;
      largest = pieces[p].numel > largest ? pieces[p].numel : largest;
    }
    // Tensors smaller than the largest leave some CTAs idle; the grid caps the waste.
    const dim3 grid(static_cast<unsigned>(grid_for(largest, kThreads) < 1024 ? grid_for(largest, kThreads) : 1024),
                    static_cast<unsigned>(used));
    multi_copy_kernel<T, Op><<<grid, kThreads, 0, stream>>>(batch, op);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t multi_copy(const CopyPiece* pieces, int64_t count, int elem_size, cudaStream_t stream) {
  switch (elem_size) {
    case 1: return launch_batches<uint8_t>(pieces, count, Copy<uint8_t>{}, stream);
    case 2: return launch_batches<uint16_t>(pieces, count, Copy<uint16_t>{}, stream);
    case 4: return launch_batches<uint32_t>(pieces, count, Copy<uint32_t>{}, stream);
    case 8: return launch_batches<uint64_t>(pieces, count, Copy<uint64_t>{}, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t multi_scaled_copy(const CopyPiece* pieces, int64_t count, ElemType type, double scale,
                              cudaStream_t stream) {
  const float s = static_cast<float>(scale);
  switch (type) {
    case ElemType::kFloat32: return launch_batches<float>(pieces, count, ScaleFloat{s}, stream);
    case ElemType::kFloat64: return launch_batches<double>(pieces, count, ScaleDouble{scale}, stream);
    case ElemType::kFloat16: return launch_batches<__half>(pieces, count, ScaleHalf{s}, stream);
    case ElemType::kBFloat16: return launch_batches<__nv_bfloat16>(pieces, count, ScaleBFloat16{s}, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace ddpx::cuda
