// Numerically stable softmax over the rows of a contiguous (rows, cols) matrix,
// one thread block per row.
//
// Two strategies, picked by row size:
//  * cached: the row is staged in shared memory, so HBM sees one read and one
//    write per element (max, sum and normalise all run out of shared memory);
//  * online: rows too big for shared memory keep a running (max, sum) pair per
//    thread (sum rescaled whenever the max grows), so one read pass finds both,
//    and a second read pass writes the output: two reads instead of the three
//    of a max pass / sum pass / write pass scheme.
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kMaxThreads = 512;
// Above this a cached row costs too much occupancy (fewer than two 512-thread
// blocks per SM), and the online path's second read mostly hits L2 anyway.
constexpr int64_t kMaxCachedRowBytes = 96 * 1024;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide reduction whose result every thread receives: each warp re-reduces
// the per-warp partials itself, so no extra broadcast barrier is needed. The
// leading barrier keeps a previous call's readers of `red` from seeing new data.
template <bool IS_MAX>
__device__ __forceinline__ float block_reduce(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = IS_MAX ? warp_max(v) : warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < nwarps ? red[lane] : (IS_MAX ? -INFINITY : 0.0f);
  return IS_MAX ? warp_max(v) : warp_sum(v);
}

// Merges two running (max, sum-of-exp relative to that max) pairs.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;  // both empty: exp(-inf - -inf) would be NaN
  s = s * __expf(m - mn) + s2 * __expf(m2 - mn);
  m = mn;
}

__device__ __forceinline__ void block_reduce_pair(float& m, float& s, float* red_m,
                                                  float* red_s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  }
  __syncthreads();
  if (lane == 0) {
    red_m[warp] = m;
    red_s[warp] = s;
  }
  __syncthreads();
  m = lane < nwarps ? red_m[lane] : -INFINITY;
  s = lane < nwarps ? red_s[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  }
}

__device__ __forceinline__ float max4(float4 v) { return fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)); }

// Every thread touches the same shared-memory slots in all three phases, so the
// staged row needs no barriers of its own; only the reductions synchronise.
template <bool VEC>
__global__ void __launch_bounds__(kMaxThreads)
softmax_cached_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t rows,
                      int64_t cols) {
  extern __shared__ float4 cache4[];  // float4 so the buffer is 16-byte aligned
  float* cache = reinterpret_cast<float*>(cache4);
  __shared__ float red[32];
  const int64_t n = VEC ? cols / 4 : cols;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;

    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      if constexpr (VEC) {
        const float4 v = reinterpret_cast<const float4*>(xr)[i];
        cache4[i] = v;
        m = fmaxf(m, max4(v));
      } else {
        const float v = xr[i];
        cache[i] = v;
        m = fmaxf(m, v);
      }
    }
    m = block_reduce<true>(m, red);

    float s = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      if constexpr (VEC) {
        float4 v = cache4[i];
        v.x = __expf(v.x - m);
        v.y = __expf(v.y - m);
        v.z = __expf(v.z - m);
        v.w = __expf(v.w - m);
        cache4[i] = v;
        s += (v.x + v.y) + (v.z + v.w);
      } else {
        const float e = __expf(cache[i] - m);
        cache[i] = e;
        s += e;
      }
    }
    const float inv = 1.0f / block_reduce<false>(s, red);

    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      if constexpr (VEC) {
        float4 v = cache4[i];
        v.x *= inv;
        v.y *= inv;
        v.z *= inv;
        v.w *= inv;
        reinterpret_cast<float4*>(yr)[i] = v;
      } else {
        yr[i] = cache[i] * inv;
      }
    }
  }
}

template <bool VEC>
__global__ void __launch_bounds__(kMaxThreads)
softmax_online_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t rows,
                      int64_t cols) {
  __shared__ float red_m[32], red_s[32];
  const int64_t n = VEC ? cols / 4 : cols;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;

    float m = -INFINITY, s = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      if constexpr (VEC) {
        const float4 v = reinterpret_cast<const float4*>(xr)[i];
        const float mn = fmaxf(m, max4(v));
        if (mn == -INFINITY) continue;
        s = s * __expf(m - mn) +
            ((__expf(v.x - mn) + __expf(v.y - mn)) + (__expf(v.z - mn) + __expf(v.w - mn)));
        m = mn;
      } else {
        const float v = xr[i];
        const float mn = fmaxf(m, v);
        if (mn == -INFINITY) continue;
        s = s * __expf(m - mn) + __expf(v - mn);
        m = mn;
      }
    }
    block_reduce_pair(m, s, red_m, red_s);
    const float inv = 1.0f / s;

    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      if constexpr (VEC) {
        float4 v = reinterpret_cast<const float4*>(xr)[i];
        v.x = __expf(v.x - m) * inv;
        v.y = __expf(v.y - m) * inv;
        v.z = __expf(v.z - m) * inv;
        v.w = __expf(v.w - m) * inv;
        reinterpret_cast<float4*>(yr)[i] = v;
      } else {
        yr[i] = __expf(xr[i] - m) * inv;
      }
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <bool VEC>
void launch(const float* x, float* y, int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t work = VEC ? cols / 4 : cols;
  // Short rows get a smaller block so most threads still have an element.
  int threads = 32;
  while (threads < kMaxThreads && threads < work) threads *= 2;
  const unsigned grid = static_cast<unsigned>(rows < 0x7fffffff ? rows : 0x7fffffff);

  int dev = 0, smem_optin = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  const int64_t row_bytes = cols * static_cast<int64_t>(sizeof(float));
  // Row bytes are a multiple of 16 on the VEC path (cols % 4 == 0); the scalar
  // path only ever indexes the buffer as floats.
  if (row_bytes <= kMaxCachedRowBytes && row_bytes + 1024 <= smem_optin) {
    const int smem = static_cast<int>((row_bytes + 15) / 16 * 16);
    if (smem > 48 * 1024) {
      cudaFuncSetAttribute(softmax_cached_kernel<VEC>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    }
    softmax_cached_kernel<VEC><<<grid, threads, smem, stream>>>(x, y, rows, cols);
  } else {
    softmax_online_kernel<VEC><<<grid, threads, 0, stream>>>(x, y, rows, cols);
  }
}

}  // namespace

extern "C" void row_softmax_launch(const float* x, float* y, int64_t rows, int64_t cols,
                                   cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  if (cols % 4 == 0 && aligned16(x) && aligned16(y)) {
    launch<true>(x, y, rows, cols, stream);
  } else {
    launch<false>(x, y, rows, cols, stream);
  }
}
