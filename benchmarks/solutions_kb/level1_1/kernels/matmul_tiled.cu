// C = A @ B for row-major float32 A (M, K), B (K, N), C (M, N), with a plain
// shared-memory tiled SIMT kernel (deliberately simple, not tuned): a 32x32 thread
// block computes a 32x32 tile of C, stepping K by 32; out-of-range elements of the
// A and B tiles are loaded as zero, so any M, N, K works. fp32 accumulation.
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int TILE = 32;

__global__ void __launch_bounds__(TILE * TILE)
matmul_tiled_kernel(const float* __restrict__ A, const float* __restrict__ B,
                    float* __restrict__ C, int M, int N, int K) {
  __shared__ float As[TILE][TILE];
  __shared__ float Bs[TILE][TILE + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int row = blockIdx.y * TILE + ty;
  const int col = blockIdx.x * TILE + tx;
  float acc = 0.0f;
  for (int k0 = 0; k0 < K; k0 += TILE) {
    const int ka = k0 + tx;  // column of A loaded by this thread
    const int kb = k0 + ty;  // row of B loaded by this thread
    As[ty][tx] = (row < M && ka < K) ? A[static_cast<int64_t>(row) * K + ka] : 0.0f;
    Bs[ty][tx] = (kb < K && col < N) ? B[static_cast<int64_t>(kb) * N + col] : 0.0f;
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < TILE; ++kk) acc = fmaf(As[ty][kk], Bs[kk][tx], acc);
    __syncthreads();
  }
  if (row < M && col < N) C[static_cast<int64_t>(row) * N + col] = acc;
}

}  // namespace

// grid.y carries the M tiles: the binding checks (M + 31) / 32 <= 65535.
extern "C" void matmul_tiled_launch(const float* A, const float* B, float* C, int M, int N, int K,
                                    cudaStream_t stream) {
  if (M <= 0 || N <= 0) return;
  const dim3 grid((N + TILE - 1) / TILE, (M + TILE - 1) / TILE);
  matmul_tiled_kernel<<<grid, dim3(TILE, TILE), 0, stream>>>(A, B, C, M, N, K);
}
