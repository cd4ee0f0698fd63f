// torch.log_softmax(x, dim) over the last dimension of a contiguous 2-D (rows, n) float32 tensor.
// One block per row (grid-stride over rows). Pass 1 keeps an online (max, sum of
// exp(x - max)) pair per thread, merged across the block; pass 2 writes the output.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace {

constexpr int kThreads = 1024;

// Merge two online-softmax states (m, s): s is the sum of exp(x - m).
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    s = s2;
    return;
  }
  if (m2 > m) {
    s = s * expf(m - m2) + s2;
    m = m2;
  } else {
    s = s + s2 * expf(m2 - m);
  }
}

__global__ void __launch_bounds__(kThreads)
log_softmax_rows_kernel(const float* __restrict__ x, float* __restrict__ y_out, int64_t rows, int64_t n) {
  __shared__ float sm[32];
  __shared__ float ss[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* xr = x + row * n;
    float* y = y_out + row * n;
    float m = -INFINITY, s = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const float v = xr[i];
      if (v > m) {
        s = (m == -INFINITY ? 0.0f : s * expf(m - v)) + 1.0f;
        m = v;
      } else {
        s += expf(v - m);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
      const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
      merge(m, s, m2, s2);
    }
    __syncthreads();  // sm/ss may still be read for the previous row
    if (lane == 0) {
      sm[warp] = m;
      ss[warp] = s;
    }
    __syncthreads();
    m = -INFINITY;
    s = 0.0f;
    for (int w = 0; w < nwarps; ++w) merge(m, s, sm[w], ss[w]);
    const float shift = m + logf(s);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const float v = xr[i];
      y[i] = v - shift;
    }
  }
}

}  // namespace

extern "C" void log_softmax_rows_launch(const float* x, float* y, int64_t rows, int64_t n,
                              cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return;
  const int64_t grid = rows < (1 << 30) ? rows : (1 << 30);
  log_softmax_rows_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(x, y, rows, n);
}
