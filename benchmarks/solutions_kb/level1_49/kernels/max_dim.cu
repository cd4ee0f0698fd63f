// torch.max(x, dim)[0] (no keepdim; NaN propagates) over one dimension of a contiguous float32 tensor viewed as
// (outer, R, inner): y[o, j] = reduce_r x[o, r, j].
//
// inner > 1: a warp covers 32 consecutive j (coalesced row segments); the block's
//   8 warps split the R axis and are combined through shared memory.
// inner == 1: each row is contiguous; a block walks it and reduces with shuffles.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace {

constexpr int kTX = 32;
constexpr int kTY = 8;
constexpr int kRowThreads = 256;

__device__ __forceinline__ float comb(float a, float v) { return (v > a || v != v) ? v : a; }

__global__ void __launch_bounds__(kTX * kTY)
max_dim_strided_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t outer,
                      int64_t R, int64_t inner, float scale) {
  __shared__ float part[kTY][kTX + 1];
  const int64_t inner_tiles = (inner + kTX - 1) / kTX;
  const int64_t tiles = outer * inner_tiles;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t o = t / inner_tiles;
    const int64_t j = (t - o * inner_tiles) * kTX + threadIdx.x;
    float acc = -INFINITY;
    if (j < inner) {
      const float* p = x + o * R * inner + j;
      for (int64_t r = threadIdx.y; r < R; r += kTY) acc = comb(acc, p[r * inner]);
    }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0) {
      float a = part[0][threadIdx.x];
#pragma unroll
      for (int k = 1; k < kTY; ++k) a = comb(a, part[k][threadIdx.x]);
      const float acc2 = a;
      {
        const float acc = acc2;
        if (j < inner) y[o * inner + j] = acc;
      }
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kRowThreads)
max_dim_rows_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t rows, int64_t R,
                   float scale) {
  __shared__ float red[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* p = x + row * R;
    float a = -INFINITY;
    for (int64_t i = threadIdx.x; i < R; i += blockDim.x) a = comb(a, p[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = comb(a, __shfl_xor_sync(0xffffffffu, a, o));
    __syncthreads();
    if (lane == 0) red[warp] = a;
    __syncthreads();
    if (warp == 0) {
      a = lane < nwarps ? red[lane] : -INFINITY;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) a = comb(a, __shfl_xor_sync(0xffffffffu, a, o));
      const float acc = a;
      if (lane == 0) y[row] = acc;
    }
  }
}

unsigned capped_grid(int64_t blocks) {
  return static_cast<unsigned>(blocks < (1 << 30) ? (blocks > 0 ? blocks : 1) : (1 << 30));
}

}  // namespace

extern "C" void max_dim_launch(const float* x, float* y, int64_t outer, int64_t R,
                              int64_t inner, cudaStream_t stream) {
  if (outer <= 0 || inner <= 0) return;
  const float scale = R > 0 ? static_cast<float>(1.0 / static_cast<double>(R)) : 0.0f;
  if (inner == 1) {
    max_dim_rows_kernel<<<capped_grid(outer), kRowThreads, 0, stream>>>(x, y, outer, R, scale);
  } else {
    const int64_t tiles = outer * ((inner + kTX - 1) / kTX);
    max_dim_strided_kernel<<<capped_grid(tiles), dim3(kTX, kTY), 0, stream>>>(x, y, outer, R,
                                                                           inner, scale);
  }
}
