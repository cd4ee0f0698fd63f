#include "../binding_registry.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" void new_gelu_launch(const float* x, float* y, int64_t n, cudaStream_t stream);

static torch::Tensor new_gelu_forward(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda(), "new_gelu: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "new_gelu: x must be float32");
  TORCH_CHECK(x.is_contiguous(), "new_gelu: x must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  if (x.numel() == 0) return y;
  new_gelu_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(),
              c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "new_gelu: kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

static void register_new_gelu(pybind11::module& m) {
  m.def("new_gelu", &new_gelu_forward, "0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (GPT GELU), float32 CUDA");
}

REGISTER_BINDING(new_gelu, register_new_gelu);
