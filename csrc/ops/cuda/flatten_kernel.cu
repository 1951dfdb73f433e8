// CUDA kernels: multi-tensor copy (flatten/unflatten), many tensors per launch.
//
// The pieces travel in the kernel's parameters (a table of src, dst and the
// piece's offset in the concatenation of all pieces; up to kTablePieces, about
// 1360 with CUDA >= 12.1's 32 KB parameter space, per launch), so a launch
// needs no host-to-device copy, no allocation and no host sync, and can be
// captured in a CUDA graph. The grid strides over tiles of kTileBytes of the
// concatenation; each tile finds its first piece by binary search over the
// offsets (the whole block reads the same entries: constant-cache
// broadcasts) and copies every piece it overlaps, many small tensors in one
// tile. A piece is copied with 16-byte vectors where source and destination
// are equally aligned, else element by element, several loads in flight.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace ddpx::cuda {
namespace {

#if CUDART_VERSION >= 12010
constexpr int kParamBytes = 32764;  // kernel parameter limit since CUDA 12.1 (Volta and newer)
#else
constexpr int kParamBytes = 4096;
#endif

struct TableEntry {
  const void* src;
  void* dst;
  int64_t start;  // offset of the piece in this launch's concatenation, in elements
};
constexpr int kTablePieces = (kParamBytes - 64) / static_cast<int>(sizeof(TableEntry));

struct Table {
  int64_t total;  // elements of all pieces
  int count;
  TableEntry pieces[kTablePieces];
};
static_assert(sizeof(Table) <= kParamBytes, "the table must fit the kernel parameters");

constexpr int64_t kTileBytes = 16384;  // 64 bytes per thread and tile
constexpr int kUnroll = 4;             // 16-byte vectors in flight per thread

// Copies scale the value in fp32 for fp32/fp16/bf16 and in fp64 for fp64, like
// torch's `t * scale` and the CPU kernel (one rounded multiply, never fused).
template <typename T>
struct Copy {
  __device__ __forceinline__ T operator()(T v) const { return v; }
};
struct ScaleFloat {
  float s;
  __device__ __forceinline__ uint32_t operator()(uint32_t v) const {
    return __float_as_uint(__fmul_rn(__uint_as_float(v), s));
  }
};
struct ScaleDouble {
  double s;
  __device__ __forceinline__ uint64_t operator()(uint64_t v) const {
    return static_cast<uint64_t>(__double_as_longlong(__dmul_rn(__longlong_as_double(static_cast<long long>(v)), s)));
  }
};
struct ScaleHalf {
  float s;
  __device__ __forceinline__ uint16_t operator()(uint16_t v) const {
    return __half_as_ushort(__float2half_rn(__fmul_rn(__half2float(__ushort_as_half(v)), s)));
  }
};
struct ScaleBFloat16 {
  float s;
  __device__ __forceinline__ uint16_t operator()(uint16_t v) const {
    return __bfloat16_as_ushort(__float2bfloat16_rn(__fmul_rn(__bfloat162float(__ushort_as_bfloat16(v)), s)));
  }
};

// The whole block copies dst[i] = op(src[i]) for i < n.
template <typename T, typename Op>
__device__ __forceinline__ void copy_segment(const T* __restrict__ src, T* __restrict__ dst, int64_t n, Op op) {
  constexpr int kVec = 16 / sizeof(T);
  const uintptr_t s = reinterpret_cast<uintptr_t>(src), d = reinterpret_cast<uintptr_t>(dst);
  const int tid = threadIdx.x;
  if ((s - d) % 16 == 0) {  // equally aligned: scalar head, 16-byte body, scalar tail
    int64_t head = static_cast<int64_t>((16 - d % 16) % 16) / static_cast<int64_t>(sizeof(T));
    head = head < n ? head : n;
    if (tid < head) dst[tid] = op(src[tid]);
    const int64_t vecs = (n - head) / kVec;
    const T* sv = src + head;
    T* dv = dst + head;
    for (int64_t v0 = 0; v0 < vecs; v0 += static_cast<int64_t>(kThreads) * kUnroll) {
      T a[kUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * kThreads + tid;
        if (v < vecs) VecIO<T, kVec>::load(sv + v * kVec, a[u]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * kThreads + tid;
        if (v < vecs) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) a[u][j] = op(a[u][j]);
          VecIO<T, kVec>::store(dv + v * kVec, a[u]);
        }
      }
    }
    const int64_t tail = head + vecs * kVec;
    if (tid < n - tail) dst[tail + tid] = op(src[tail + tid]);
    return;
  }
  constexpr int kScalars = kUnroll * kVec / 2;  // elements in flight per thread
  for (int64_t i0 = 0; i0 < n; i0 += static_cast<int64_t>(kThreads) * kScalars) {
    T a[kScalars];
#pragma unroll
    for (int u = 0; u < kScalars; ++u) {
      const int64_t i = i0 + u * kThreads + tid;
      if (i < n) a[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kScalars; ++u) {
      const int64_t i = i0 + u * kThreads + tid;
      if (i < n) dst[i] = op(a[u]);
    }
  }
}

template <typename T, typename Op>
__global__ void __launch_bounds__(kThreads) multi_copy_kernel(const __grid_constant__ Table table, Op op) {
  constexpr int64_t kTile = kTileBytes / static_cast<int64_t>(sizeof(T));
  const int64_t tiles = ceil_div(table.total, kTile);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t e0 = t * kTile;
    const int64_t e1 = e0 + kTile < table.total ? e0 + kTile : table.total;
    int lo = 0, hi = table.count - 1;  // the last piece starting at or before e0
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (table.pieces[mid].start <= e0) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    for (int p = lo; p < table.count && table.pieces[p].start < e1; ++p) {
      const TableEntry& piece = table.pieces[p];
      const int64_t end = p + 1 < table.count ? table.pieces[p + 1].start : table.total;
      const int64_t a = (e0 > piece.start ? e0 : piece.start) - piece.start;
      const int64_t b = (e1 < end ? e1 : end) - piece.start;
      copy_segment(static_cast<const T*>(piece.src) + a, static_cast<T*>(piece.dst) + a, b - a, op);
    }
  }
}

// One launch per kTablePieces pieces (empty pieces skipped).
template <typename T, typename Op>
cudaError_t launch_tables(const CopyPiece* pieces, int64_t count, Op op, cudaStream_t stream) {
  constexpr auto kernel = multi_copy_kernel<T, Op>;
  constexpr int64_t kTile = kTileBytes / static_cast<int64_t>(sizeof(T));
  Table table;
  int64_t p = 0;
  while (p < count) {
    table.count = 0;
    table.total = 0;
    for (; p < count && table.count < kTablePieces; ++p) {
      if (pieces[p].numel <= 0) continue;
      table.pieces[table.count++] = {pieces[p].src, pieces[p].dst, table.total};
      table.total += pieces[p].numel;
    }
    if (table.count == 0) break;
    kernel<<<launch_grid<kernel>(ceil_div(table.total, kTile), 1), kThreads, 0, stream>>>(table, op);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t multi_copy(const CopyPiece* pieces, int64_t count, int elem_size, cudaStream_t stream) {
  switch (elem_size) {
    case 1: return launch_tables<uint8_t>(pieces, count, Copy<uint8_t>{}, stream);
    case 2: return launch_tables<uint16_t>(pieces, count, Copy<uint16_t>{}, stream);
    case 4: return launch_tables<uint32_t>(pieces, count, Copy<uint32_t>{}, stream);
    case 8: return launch_tables<uint64_t>(pieces, count, Copy<uint64_t>{}, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t multi_scaled_copy(const CopyPiece* pieces, int64_t count, ElemType type, double scale,
                              cudaStream_t stream) {
  const float s = static_cast<float>(scale);
  switch (type) {
    case ElemType::kFloat32: return launch_tables<uint32_t>(pieces, count, ScaleFloat{s}, stream);
    case ElemType::kFloat64: return launch_tables<uint64_t>(pieces, count, ScaleDouble{scale}, stream);
    case ElemType::kFloat16: return launch_tables<uint16_t>(pieces, count, ScaleHalf{s}, stream);
    case ElemType::kBFloat16: return launch_tables<uint16_t>(pieces, count, ScaleBFloat16{s}, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace ddpx::cuda
