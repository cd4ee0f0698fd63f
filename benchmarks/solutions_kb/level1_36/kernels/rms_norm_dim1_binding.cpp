#include "../binding_registry.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" void rms_norm_dim1_launch(const float* x, float* y, int64_t B, int64_t C, int64_t S,
                                     float eps, cudaStream_t stream);

// x / sqrt(mean(x ** 2, dim=1, keepdim=True) + eps)
static torch::Tensor rms_norm_dim1_forward(torch::Tensor x, double eps) {
  TORCH_CHECK(x.is_cuda(), "rms_norm_dim1: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "rms_norm_dim1: x must be float32");
  TORCH_CHECK(x.is_contiguous(), "rms_norm_dim1: x must be contiguous");
  TORCH_CHECK(x.dim() >= 2, "rms_norm_dim1: expected (B, C, *)");
  const int64_t B = x.size(0), C = x.size(1);
  int64_t S = 1;
  for (int64_t i = 2; i < x.dim(); ++i) S *= x.size(i);
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  if (y.numel() == 0) return y;
  rms_norm_dim1_launch(x.data_ptr<float>(), y.data_ptr<float>(), B, C, S,
                       static_cast<float>(eps), c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "rms_norm_dim1: kernel launch failed: ",
              cudaGetErrorString(err));
  return y;
}

static void register_rms_norm_dim1(pybind11::module& m) {
  m.def("rms_norm_dim1", &rms_norm_dim1_forward, "RMS norm over dim 1, float32 CUDA");
}

REGISTER_BINDING(rms_norm_dim1, register_rms_norm_dim1);
