// Sum over one dimension of a contiguous tensor viewed as (outer, R, inner):
// y[o, 0, j] = sum_r x[o, r, j] (keepdim layout is the same as (outer, inner)).
//
// inner > 1: a warp covers 32 consecutive j, so every load of a reduction step
//   is one coalesced 128-byte row segment; the block's 8 warps split the R axis
//   and are combined through shared memory.
// inner == 1 (reducing the last dim): each row is contiguous, so a block walks
//   it with (where aligned) 16-byte loads and reduces with warp shuffles.
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kTX = 32;  // threads along inner (one warp)
constexpr int kTY = 8;   // warps splitting the reduced axis
constexpr int kMaxRowThreads = 256;

__global__ void __launch_bounds__(kTX * kTY)
sum_strided_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t outer,
                   int64_t R, int64_t inner) {
  __shared__ float part[kTY][kTX + 1];
  const int64_t inner_tiles = (inner + kTX - 1) / kTX;
  const int64_t tiles = outer * inner_tiles;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t o = t / inner_tiles;
    const int64_t j = (t - o * inner_tiles) * kTX + threadIdx.x;
    float acc = 0.0f;
    if (j < inner) {
      const float* p = x + o * R * inner + j;
      // Four independent chains keep four loads in flight per thread; a single
      // running sum would serialise on load latency.
      float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
      int64_t r = threadIdx.y;
      for (; r + 3 * kTY < R; r += 4 * kTY) {
        a0 += p[r * inner];
        a1 += p[(r + kTY) * inner];
        a2 += p[(r + 2 * kTY) * inner];
        a3 += p[(r + 3 * kTY) * inner];
      }
      for (; r < R; r += kTY) a0 += p[r * inner];
      acc = (a0 + a1) + (a2 + a3);
    }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0) {
      float s = 0.0f;
#pragma unroll
      for (int k = 0; k < kTY; ++k) s += part[k][threadIdx.x];
      if (j < inner) y[o * inner + j] = s;
    }
    // part is rewritten by the next tile.
    __syncthreads();
  }
}

template <bool VEC>
__global__ void __launch_bounds__(kMaxRowThreads)
sum_rows_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t rows, int64_t R) {
  __shared__ float red[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* p = x + row * R;
    float s = 0.0f;
    if constexpr (VEC) {
      const float4* p4 = reinterpret_cast<const float4*>(p);
      for (int64_t i = threadIdx.x; i < R / 4; i += blockDim.x) {
        const float4 v = p4[i];
        s += (v.x + v.y) + (v.z + v.w);
      }
    } else {
      for (int64_t i = threadIdx.x; i < R; i += blockDim.x) s += p[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    __syncthreads();  // red may still be read for the previous row
    if (lane == 0) red[warp] = s;
    __syncthreads();
    if (warp == 0) {
      s = lane < nwarps ? red[lane] : 0.0f;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) y[row] = s;
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

unsigned capped_grid(int64_t blocks) {
  return static_cast<unsigned>(blocks < (1 << 30) ? (blocks > 0 ? blocks : 1) : (1 << 30));
}

}  // namespace

extern "C" void sum_dim_launch(const float* x, float* y, int64_t outer, int64_t R,
                               int64_t inner, cudaStream_t stream) {
  if (outer <= 0 || inner <= 0) return;
  if (inner == 1) {
    const bool vec = (R % 4 == 0) && aligned16(x);
    const int64_t work = vec ? R / 4 : R;
    // Short rows get a smaller block so most threads still have an element.
    int threads = 32;
    while (threads < kMaxRowThreads && threads < work) threads *= 2;
    if (vec) {
      sum_rows_kernel<true><<<capped_grid(outer), threads, 0, stream>>>(x, y, outer, R);
    } else {
      sum_rows_kernel<false><<<capped_grid(outer), threads, 0, stream>>>(x, y, outer, R);
    }
  } else {
    const int64_t tiles = outer * ((inner + kTX - 1) / kTX);
    sum_strided_kernel<<<capped_grid(tiles), dim3(kTX, kTY), 0, stream>>>(x, y, outer, R,
                                                                         inner);
  }
}
