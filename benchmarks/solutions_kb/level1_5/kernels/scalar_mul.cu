// Elementwise A * s (matrix times a Python scalar), float32.
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float op(float v, float p) { return v * p; }

__global__ void scalar_mul_vec4_kernel(const float4* __restrict__ x, float4* __restrict__ y,
                                   int64_t n4, float p) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4;
       i += stride) {
    float4 v = x[i];
    v.x = op(v.x, p);
    v.y = op(v.y, p);
    v.z = op(v.z, p);
    v.w = op(v.w, p);
    y[i] = v;
  }
}

__global__ void scalar_mul_scalar_kernel(const float* __restrict__ x, float* __restrict__ y,
                                     int64_t n, float p) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    y[i] = op(x[i], p);
  }
}

int grid_for(int64_t work) {
  const int64_t needed = (work + kThreads - 1) / kThreads;
  constexpr int64_t kMaxBlocks = 1 << 20;  // grid-stride loop covers the rest
  return static_cast<int>(needed < kMaxBlocks ? (needed > 0 ? needed : 1) : kMaxBlocks);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

extern "C" void scalar_mul_launch(const float* x, float* y, int64_t n, float p, cudaStream_t stream) {
  if (n <= 0) return;
  if (aligned16(x) && aligned16(y)) {
    const int64_t n4 = n / 4;
    if (n4 > 0) {
      scalar_mul_vec4_kernel<<<grid_for(n4), kThreads, 0, stream>>>(
          reinterpret_cast<const float4*>(x), reinterpret_cast<float4*>(y), n4, p);
    }
    const int64_t done = n4 * 4;
    if (done < n) {
      scalar_mul_scalar_kernel<<<1, kThreads, 0, stream>>>(x + done, y + done, n - done, p);
    }
  } else {
    scalar_mul_scalar_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, y, n, p);
  }
}
