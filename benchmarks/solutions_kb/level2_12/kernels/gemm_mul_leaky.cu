// y = leaky_relu((x @ W^T + b) * multiplier, negative_slope) for x (M, K), W (N, K)
// (nn.Linear's layout), b (N,).
// The GEMM is one cuBLAS SGEMM; a row-major (r, c) matrix is its own transpose in
// cuBLAS's column-major view, so y^T (N x M, ld N) = W (op T on the K x N column-major
// view of W, ld K) times x^T (K x M, ld K). Our kernel then applies bias, scale and
// LeakyReLU in place.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
bias_mul_leaky_kernel(float* __restrict__ y, const float* __restrict__ b, int64_t M, int64_t N,
                      float mult, float slope) {
  const int64_t total = M * N;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t col = i % N;
    const float v = (y[i] + b[col]) * mult;
    y[i] = v > 0.0f ? v : v * slope;
  }
}

}  // namespace

// Returns a cublasStatus_t (0 on success); launch errors are read by the caller.
extern "C" int gemm_mul_leaky_launch(cublasHandle_t handle, const float* x, const float* w,
                                     const float* b, float* y, int M, int N, int K, float mult,
                                     float slope, cudaStream_t stream) {
  if (M <= 0 || N <= 0) return 0;
  cublasStatus_t st = cublasSetStream(handle, stream);
  if (st != CUBLAS_STATUS_SUCCESS) return static_cast<int>(st);
  const float alpha = 1.0f, beta = 0.0f;
  st = cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, w, K, x, K, &beta, y, N);
  if (st != CUBLAS_STATUS_SUCCESS) return static_cast<int>(st);
  const int64_t total = static_cast<int64_t>(M) * N;
  int64_t grid = (total + kThreads - 1) / kThreads;
  if (grid > (1 << 20)) grid = 1 << 20;
  bias_mul_leaky_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(y, b, M, N, mult,
                                                                              slope);
  return 0;
}
