#include "../binding_registry.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" void scalar_mul_launch(const float* x, float* y, int64_t n, float p, cudaStream_t stream);

static torch::Tensor scalar_mul_forward(torch::Tensor x, double p) {
  TORCH_CHECK(x.is_cuda(), "scalar_mul: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "scalar_mul: x must be float32");
  TORCH_CHECK(x.is_contiguous(), "scalar_mul: x must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  if (x.numel() == 0) return y;
  scalar_mul_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), static_cast<float>(p),
              c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "scalar_mul: kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

static void register_scalar_mul(pybind11::module& m) {
  m.def("scalar_mul", &scalar_mul_forward, "A * s (matrix times a Python scalar), float32 CUDA");
}

REGISTER_BINDING(scalar_mul, register_scalar_mul);
