#include "../binding_registry.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" void leaky_relu_launch(const float* x, float* y, int64_t n, float p, cudaStream_t stream);

static torch::Tensor leaky_relu_forward(torch::Tensor x, double p) {
  TORCH_CHECK(x.is_cuda(), "leaky_relu: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "leaky_relu: x must be float32");
  TORCH_CHECK(x.is_contiguous(), "leaky_relu: x must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  if (x.numel() == 0) return y;
  leaky_relu_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), static_cast<float>(p),
              c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "leaky_relu: kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

static void register_leaky_relu(pybind11::module& m) {
  m.def("leaky_relu", &leaky_relu_forward, "leaky_relu(x, negative_slope), float32 CUDA");
}

REGISTER_BINDING(leaky_relu, register_leaky_relu);
