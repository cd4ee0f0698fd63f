// y[r, c] = tanh(x[r, c] * scale + bias[c]) in one pass: eager PyTorch runs three
// kernels (mul, add, tanh) and moves the tensor through HBM three times.
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float op(float v, float s, float b) { return tanhf(fmaf(v, s, b)); }

// Threads are laid out 2-D: x over column groups (VEC groups of 4 columns), y over
// rows, so the bias index is the thread's column and no per-element `i % cols`
// (a 64-bit division) is needed; a thread loads its bias once for all its rows.
template <bool VEC>
__global__ void bias_scale_tanh_kernel(const float* __restrict__ x,
                                       const float* __restrict__ bias, float* __restrict__ y,
                                       int64_t rows, int64_t cols, float scale) {
  constexpr int W = VEC ? 4 : 1;
  const int64_t groups = cols / W;  // VEC is chosen only when cols % 4 == 0
  const int64_t row_stride = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (VEC) {
      const float4 b = reinterpret_cast<const float4*>(bias)[g];
      for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows;
           r += row_stride) {
        const int64_t idx = r * groups + g;
        float4 v = reinterpret_cast<const float4*>(x)[idx];
        v.x = op(v.x, scale, b.x);
        v.y = op(v.y, scale, b.y);
        v.z = op(v.z, scale, b.z);
        v.w = op(v.w, scale, b.w);
        reinterpret_cast<float4*>(y)[idx] = v;
      }
    } else {
      const float b = bias[g];
      for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows;
           r += row_stride) {
        const int64_t idx = r * cols + g;
        y[idx] = op(x[idx], scale, b);
      }
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <bool VEC>
void launch(const float* x, const float* bias, float* y, int64_t rows, int64_t cols,
            float scale, cudaStream_t stream) {
  const int64_t groups = VEC ? cols / 4 : cols;
  // Narrow rows would leave most of a 256-wide block idle, so the block gives
  // its spare threads to extra rows instead (bx is a multiple of a warp).
  int bx = 32;
  while (bx < kThreads && bx < groups) bx *= 2;
  const int by = kThreads / bx;
  const int64_t gx64 = (groups + bx - 1) / bx;
  const unsigned gx = static_cast<unsigned>(gx64 < 65535 ? gx64 : 65535);

  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (sms <= 0) sms = 132;
  // About one wave of resident blocks, each thread looping over rows with its
  // bias in registers: on an H200 this streamed ~7% faster than one row per
  // thread, which re-reads the bias for every row.
  const int64_t want_blocks = static_cast<int64_t>(sms) * (2048 / kThreads);
  int64_t gy64 = (want_blocks + gx - 1) / gx;
  const int64_t rows_needed = (rows + by - 1) / by;
  if (gy64 > rows_needed) gy64 = rows_needed;
  if (gy64 > 65535) gy64 = 65535;
  if (gy64 < 1) gy64 = 1;

  bias_scale_tanh_kernel<VEC><<<dim3(gx, static_cast<unsigned>(gy64)), dim3(bx, by), 0, stream>>>(
      x, bias, y, rows, cols, scale);
}

}  // namespace

extern "C" void bias_scale_tanh_launch(const float* x, const float* bias, float* y,
                                       int64_t rows, int64_t cols, float scale,
                                       cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  if (cols % 4 == 0 && aligned16(x) && aligned16(y) && aligned16(bias)) {
    launch<true>(x, bias, y, rows, cols, scale, stream);
  } else {
    launch<false>(x, bias, y, rows, cols, scale, stream);
  }
}
