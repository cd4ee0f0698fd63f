#include "../binding_registry.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <limits>

extern "C" int gemm_mul_leaky_launch(cublasHandle_t handle, const float* x, const float* w,
                                     const float* b, float* y, int M, int N, int K, float mult,
                                     float slope, cudaStream_t stream);

// leaky_relu((x @ weight^T + bias) * multiplier, negative_slope)
static torch::Tensor gemm_mul_leaky_forward(torch::Tensor x, torch::Tensor weight,
                                            torch::Tensor bias, double multiplier,
                                            double negative_slope) {
  for (const auto* t : {&x, &weight, &bias}) {
    TORCH_CHECK(t->is_cuda(), "gemm_mul_leaky: tensors must be on CUDA");
    TORCH_CHECK(t->device() == x.device(), "gemm_mul_leaky: tensors on different devices");
    TORCH_CHECK(t->scalar_type() == torch::kFloat32, "gemm_mul_leaky: tensors must be float32");
    TORCH_CHECK(t->is_contiguous(), "gemm_mul_leaky: tensors must be contiguous");
  }
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && bias.dim() == 1,
              "gemm_mul_leaky: expected x (M, K), weight (N, K), bias (N,)");
  TORCH_CHECK(weight.size(1) == x.size(1), "gemm_mul_leaky: in_features mismatch");
  TORCH_CHECK(bias.size(0) == weight.size(0), "gemm_mul_leaky: bias must have shape (N,)");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  TORCH_CHECK(M <= kIntMax && N <= kIntMax && K <= kIntMax, "gemm_mul_leaky: shape too large");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty({M, N}, x.options());
  if (y.numel() == 0) return y;
  const int st = gemm_mul_leaky_launch(
      at::cuda::getCurrentCUDABlasHandle(), x.data_ptr<float>(), weight.data_ptr<float>(),
      bias.data_ptr<float>(), y.data_ptr<float>(), static_cast<int>(M), static_cast<int>(N),
      static_cast<int>(K), static_cast<float>(multiplier), static_cast<float>(negative_slope),
      c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(st == 0, "gemm_mul_leaky: cublasSgemm failed with status ", st);
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "gemm_mul_leaky: kernel launch failed: ",
              cudaGetErrorString(err));
  return y;
}

static void register_gemm_mul_leaky(pybind11::module& m) {
  m.def("gemm_mul_leaky", &gemm_mul_leaky_forward,
        "leaky_relu((x @ W^T + b) * multiplier), cuBLAS SGEMM + fused epilogue kernel");
}

REGISTER_BINDING(gemm_mul_leaky, register_gemm_mul_leaky);
