// The torch headers this file uses, included here: the CUDA Agent release's own
// binding_registry.h brings in only pybind11, not torch::Tensor or its casters.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>

#include "../binding_registry.h"

// c10's stream header gives the current stream without ATen/cuda/CUDAContext.h,
// which drags in cuBLAS/cuSPARSE headers this op does not need.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" void bias_scale_tanh_launch(const float* x, const float* bias, float* y,
                                       int64_t rows, int64_t cols, float scale,
                                       cudaStream_t stream);

static torch::Tensor bias_scale_tanh_forward(torch::Tensor x, torch::Tensor bias,
                                             double scale) {
  TORCH_CHECK(x.is_cuda() && bias.is_cuda(), "bias_scale_tanh: tensors must be on CUDA");
  TORCH_CHECK(x.device() == bias.device(), "bias_scale_tanh: x and bias on different devices");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && bias.scalar_type() == torch::kFloat32,
              "bias_scale_tanh: tensors must be float32");
  TORCH_CHECK(x.is_contiguous() && bias.is_contiguous(),
              "bias_scale_tanh: tensors must be contiguous");
  TORCH_CHECK(x.dim() >= 1, "bias_scale_tanh: x must have at least one dimension");
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == x.size(-1),
              "bias_scale_tanh: bias must have shape (x.size(-1),)");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  if (x.numel() == 0) return y;
  const int64_t cols = x.size(-1);
  bias_scale_tanh_launch(x.data_ptr<float>(), bias.data_ptr<float>(), y.data_ptr<float>(),
                         x.numel() / cols, cols, static_cast<float>(scale),
                         c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "bias_scale_tanh: kernel launch failed: ",
              cudaGetErrorString(err));
  return y;
}

static void register_bias_scale_tanh(pybind11::module& m) {
  m.def("bias_scale_tanh", &bias_scale_tanh_forward,
        "tanh(x * scale + bias), bias broadcast over the last dim, float32 CUDA");
}

REGISTER_BINDING(bias_scale_tanh, register_bias_scale_tanh);
