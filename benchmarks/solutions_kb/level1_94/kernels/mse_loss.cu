// mean((p - t)^2) over all elements of two same-shaped contiguous float32 tensors.
// Pass 1: each block of a fixed grid accumulates a grid-stride share (float per
// thread, double across the block) into partial[block]. Pass 2: one block adds the
// partials in double and writes the mean as a 0-d float. Deterministic: no atomics.
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kThreads = 256;
constexpr int kBlocks = 1024;

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

template <bool VEC>
__global__ void __launch_bounds__(kThreads)
mse_partial_kernel(const float* __restrict__ p, const float* __restrict__ t,
                   double* __restrict__ partial, int64_t n) {
  __shared__ double red[32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // Several float accumulators per thread, flushed into a double every 64 steps,
  // so the float sums stay short.
  double acc = 0.0;
  float s = 0.0f;
  int steps = 0;
  if constexpr (VEC) {
    const float4* p4 = reinterpret_cast<const float4*>(p);
    const float4* t4 = reinterpret_cast<const float4*>(t);
    const int64_t n4 = n / 4;
    for (int64_t i = start; i < n4; i += stride) {
      const float4 a = p4[i], b = t4[i];
      const float d0 = a.x - b.x, d1 = a.y - b.y, d2 = a.z - b.z, d3 = a.w - b.w;
      s += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3);
      if (++steps == 64) {
        acc += s;
        s = 0.0f;
        steps = 0;
      }
    }
    for (int64_t i = n4 * 4 + start; i < n; i += stride) {
      const float d = p[i] - t[i];
      s += d * d;
    }
  } else {
    for (int64_t i = start; i < n; i += stride) {
      const float d = p[i] - t[i];
      s += d * d;
      if (++steps == 256) {
        acc += s;
        s = 0.0f;
        steps = 0;
      }
    }
  }
  acc += s;
  const double total = block_sum(acc, red);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kThreads)
mse_final_kernel(const double* __restrict__ partial, int nparts, float* __restrict__ out,
                 int64_t n) {
  __shared__ double red[32];
  double s = 0.0;
  for (int i = threadIdx.x; i < nparts; i += blockDim.x) s += partial[i];
  const double total = block_sum(s, red);
  if (threadIdx.x == 0) out[0] = static_cast<float>(total / static_cast<double>(n));
}

bool aligned16(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15u) == 0; }

}  // namespace

extern "C" int mse_loss_partials() { return kBlocks; }

// partial: kBlocks doubles of scratch. n > 0.
extern "C" void mse_loss_launch(const float* p, const float* t, double* partial, float* out,
                                int64_t n, cudaStream_t stream) {
  if (aligned16(p) && aligned16(t)) {
    mse_partial_kernel<true><<<kBlocks, kThreads, 0, stream>>>(p, t, partial, n);
  } else {
    mse_partial_kernel<false><<<kBlocks, kThreads, 0, stream>>>(p, t, partial, n);
  }
  mse_final_kernel<<<1, kThreads, 0, stream>>>(partial, kBlocks, out, n);
}
