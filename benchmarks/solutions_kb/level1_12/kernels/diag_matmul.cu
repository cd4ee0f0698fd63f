// C[i, j] = A[i] * B[i, j] for A (N,), B (N, M): diag(A) @ B without forming diag(A).
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kThreads = 256;

// One block row-walk per row: blockIdx.y picks the row (grid-stride over rows),
// threads stride over the columns.
__global__ void diag_matmul_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                   float* __restrict__ c, int64_t n, int64_t m) {
  for (int64_t row = blockIdx.y; row < n; row += gridDim.y) {
    const float s = a[row];
    const float* brow = b + row * m;
    float* crow = c + row * m;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < m;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      crow[j] = s * brow[j];
    }
  }
}

}  // namespace

extern "C" void diag_matmul_launch(const float* a, const float* b, float* c, int64_t n,
                                   int64_t m, cudaStream_t stream) {
  if (n <= 0 || m <= 0) return;
  int64_t gx = (m + kThreads - 1) / kThreads;
  if (gx > 1024) gx = 1024;
  const int64_t gy = n < 65535 ? n : 65535;
  diag_matmul_kernel<<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), kThreads, 0,
                       stream>>>(a, b, c, n, m);
}
