// C[b] = A[b] @ B[b] for row-major float32 A (batch, m, k), B (batch, k, n), C (batch, m, n),
// as one cuBLAS strided-batched SGEMM. cuBLAS is column-major: a row-major (r, c) matrix
// is its own transpose in column-major, so C^T = B^T A^T is computed with no transposes:
// the column-major "A" operand is B (n x k, ld n) and the "B" operand is A (k x m, ld k).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

extern "C" int bmm_cublas_launch(cublasHandle_t handle, const float* A, const float* B, float* C,
                                 int batch, int m, int n, int k, cudaStream_t stream) {
  if (batch <= 0 || m <= 0 || n <= 0) return 0;
  cublasStatus_t st = cublasSetStream(handle, stream);
  if (st != CUBLAS_STATUS_SUCCESS) return static_cast<int>(st);
  const float alpha = 1.0f, beta = 0.0f;
  st = cublasSgemmStridedBatched(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &alpha,
                                 B, n, static_cast<long long>(k) * n,
                                 A, k, static_cast<long long>(m) * k, &beta,
                                 C, n, static_cast<long long>(m) * n, batch);
  return static_cast<int>(st);
}
