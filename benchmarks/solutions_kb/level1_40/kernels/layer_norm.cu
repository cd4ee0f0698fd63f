// LayerNorm over the trailing N = prod(normalized_shape) elements of a contiguous float32
// tensor viewed as (rows, N), with elementwise affine weight/bias of N elements.
// Rows are long (N = 4M) and few, so the statistics are split over many blocks:
//   1. ln_partial_kernel: block (c, row) sums x and x^2 over one chunk of the row
//      (float per thread, double across the block) into partial[row][c].
//   2. ln_stats_kernel: one block per row adds the chunk partials in double and
//      writes mean and 1/sqrt(var + eps) (biased variance, as torch).
//   3. ln_apply_kernel: y = (x - mean) * rstd * w + b.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace {

constexpr int kThreads = 256;
constexpr int kChunks = 256;

__device__ __forceinline__ double block_sum(double v, double* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < nwarps; ++w) total += red[w];
  return total;
}

__global__ void __launch_bounds__(kThreads)
ln_partial_kernel(const float* __restrict__ x, double* __restrict__ partial, int64_t N,
                  int64_t chunk) {
  __shared__ double red[32];
  const int64_t row = blockIdx.y;
  const int c = blockIdx.x;
  const float* xr = x + row * N;
  const int64_t begin = static_cast<int64_t>(c) * chunk;
  const int64_t end = begin + chunk < N ? begin + chunk : N;
  float s = 0.0f, q = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float v = xr[i];
    s += v;
    q = fmaf(v, v, q);
  }
  const double ts = block_sum(static_cast<double>(s), red);
  const double tq = block_sum(static_cast<double>(q), red);
  if (threadIdx.x == 0) {
    partial[(row * gridDim.x + c) * 2 + 0] = ts;
    partial[(row * gridDim.x + c) * 2 + 1] = tq;
  }
}

__global__ void __launch_bounds__(kThreads)
ln_stats_kernel(const double* __restrict__ partial, float* __restrict__ stats, int chunks,
                int64_t N, double eps) {
  __shared__ double red[32];
  const int64_t row = blockIdx.x;
  double s = 0.0, q = 0.0;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    s += partial[(row * chunks + c) * 2 + 0];
    q += partial[(row * chunks + c) * 2 + 1];
  }
  const double ts = block_sum(s, red);
  const double tq = block_sum(q, red);
  if (threadIdx.x == 0) {
    const double mean = ts / static_cast<double>(N);
    double var = tq / static_cast<double>(N) - mean * mean;
    if (var < 0.0) var = 0.0;
    stats[row * 2 + 0] = static_cast<float>(mean);
    stats[row * 2 + 1] = static_cast<float>(1.0 / sqrt(var + eps));
  }
}

__global__ void __launch_bounds__(kThreads)
ln_apply_kernel(const float* __restrict__ x, const float* __restrict__ w,
                const float* __restrict__ b, const float* __restrict__ stats,
                float* __restrict__ y, int64_t rows, int64_t N) {
  const int64_t total = rows * N;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t row = i / N;
    const int64_t col = i - row * N;
    const float mean = stats[row * 2 + 0];
    const float rstd = stats[row * 2 + 1];
    y[i] = (x[i] - mean) * rstd * w[col] + b[col];
  }
}

}  // namespace

// partial: rows * kChunks * 2 doubles; stats: rows * 2 floats (both scratch).
extern "C" int layer_norm_chunks() { return kChunks; }

extern "C" void layer_norm_launch(const float* x, const float* w, const float* b, float* y,
                                  double* partial, float* stats, int64_t rows, int64_t N,
                                  double eps, cudaStream_t stream) {
  if (rows <= 0 || N <= 0) return;
  const int64_t chunk = (N + kChunks - 1) / kChunks;
  ln_partial_kernel<<<dim3(kChunks, static_cast<unsigned>(rows)), kThreads, 0, stream>>>(
      x, partial, N, chunk);
  ln_stats_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(partial, stats, kChunks,
                                                                        N, eps);
  int64_t grid = (rows * N + kThreads - 1) / kThreads;
  if (grid > (1 << 20)) grid = 1 << 20;
  ln_apply_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(x, w, b, stats, y, rows,
                                                                        N);
}
