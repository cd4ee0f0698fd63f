#include "../binding_registry.h"

// c10's stream header gives the current stream without ATen/cuda/CUDAContext.h,
// which drags in cuBLAS/cuSPARSE headers this op does not need.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <limits>

extern "C" void gemm_bias_relu_launch(const float* x, const float* w, const float* b, float* y,
                                      int M, int N, int K, cudaStream_t stream);

// relu(x @ weight^T + bias), weight in nn.Linear's (out_features, in_features) layout.
static torch::Tensor gemm_bias_relu_forward(torch::Tensor x, torch::Tensor weight,
                                            torch::Tensor bias) {
  for (const auto* t : {&x, &weight, &bias}) {
    TORCH_CHECK(t->is_cuda(), "gemm_bias_relu: tensors must be on CUDA");
    TORCH_CHECK(t->device() == x.device(), "gemm_bias_relu: tensors on different devices");
    TORCH_CHECK(t->scalar_type() == torch::kFloat32, "gemm_bias_relu: tensors must be float32");
    TORCH_CHECK(t->is_contiguous(), "gemm_bias_relu: tensors must be contiguous");
  }
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && bias.dim() == 1,
              "gemm_bias_relu: expected x (M, K), weight (N, K), bias (N,)");
  TORCH_CHECK(weight.size(1) == x.size(1), "gemm_bias_relu: in_features mismatch");
  TORCH_CHECK(bias.size(0) == weight.size(0), "gemm_bias_relu: bias must have shape (N,)");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  TORCH_CHECK(M <= kIntMax && N <= kIntMax && K <= kIntMax && (M + 127) / 128 <= 65535,
              "gemm_bias_relu: shape too large");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty({M, N}, x.options());
  if (y.numel() == 0) return y;
  // K == 0 still launches: the product is all zeros and the epilogue applies.
  gemm_bias_relu_launch(x.data_ptr<float>(), weight.data_ptr<float>(), bias.data_ptr<float>(),
                        y.data_ptr<float>(), static_cast<int>(M), static_cast<int>(N),
                        static_cast<int>(K), c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "gemm_bias_relu: kernel launch failed: ",
              cudaGetErrorString(err));
  return y;
}

static void register_gemm_bias_relu(pybind11::module& m) {
  m.def("gemm_bias_relu", &gemm_bias_relu_forward,
        "relu(x @ weight^T + bias), fp32 SIMT GEMM with fused epilogue");
}

REGISTER_BINDING(gemm_bias_relu, register_gemm_bias_relu);
