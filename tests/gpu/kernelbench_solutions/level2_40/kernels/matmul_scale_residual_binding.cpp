#include "../binding_registry.h"

// c10's stream header gives the current stream without ATen/cuda/CUDAContext.h,
// which drags in cuBLAS/cuSPARSE headers this op does not need.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <limits>

extern "C" void matmul_scale_residual_launch(const float* x, const float* w, const float* b,
                                             float* y, int M, int N, int K, float scale,
                                             cudaStream_t stream);

// v * scale + v with v = x @ weight^T + bias (weight in nn.Linear's layout).
static torch::Tensor matmul_scale_residual_forward(torch::Tensor x, torch::Tensor weight,
                                                   torch::Tensor bias, double scale) {
  for (const auto* t : {&x, &weight, &bias}) {
    TORCH_CHECK(t->is_cuda(), "matmul_scale_residual: tensors must be on CUDA");
    TORCH_CHECK(t->device() == x.device(), "matmul_scale_residual: tensors on different devices");
    TORCH_CHECK(t->scalar_type() == torch::kFloat32,
                "matmul_scale_residual: tensors must be float32");
    TORCH_CHECK(t->is_contiguous(), "matmul_scale_residual: tensors must be contiguous");
  }
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && bias.dim() == 1,
              "matmul_scale_residual: expected x (M, K), weight (N, K), bias (N,)");
  TORCH_CHECK(weight.size(1) == x.size(1), "matmul_scale_residual: in_features mismatch");
  TORCH_CHECK(bias.size(0) == weight.size(0),
              "matmul_scale_residual: bias must have shape (N,)");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  TORCH_CHECK(M <= kIntMax && N <= kIntMax && K <= kIntMax && (M + 127) / 128 <= 65535,
              "matmul_scale_residual: shape too large");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty({M, N}, x.options());
  if (y.numel() == 0) return y;
  // K == 0 still launches: the product is all zeros and the epilogue applies.
  matmul_scale_residual_launch(x.data_ptr<float>(), weight.data_ptr<float>(),
                               bias.data_ptr<float>(), y.data_ptr<float>(),
                               static_cast<int>(M), static_cast<int>(N), static_cast<int>(K),
                               static_cast<float>(scale),
                               c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "matmul_scale_residual: kernel launch failed: ",
              cudaGetErrorString(err));
  return y;
}

static void register_matmul_scale_residual(pybind11::module& m) {
  m.def("matmul_scale_residual", &matmul_scale_residual_forward,
        "(x @ weight^T + bias) * (1 + scale) as v * scale + v, fp32 SIMT GEMM");
}

REGISTER_BINDING(matmul_scale_residual, register_matmul_scale_residual);
