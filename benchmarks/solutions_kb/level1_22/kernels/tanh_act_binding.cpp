#include "../binding_registry.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" void tanh_act_launch(const float* x, float* y, int64_t n, cudaStream_t stream);

static torch::Tensor tanh_act_forward(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda(), "tanh_act: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "tanh_act: x must be float32");
  TORCH_CHECK(x.is_contiguous(), "tanh_act: x must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  if (x.numel() == 0) return y;
  tanh_act_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(),
              c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "tanh_act: kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

static void register_tanh_act(pybind11::module& m) {
  m.def("tanh_act", &tanh_act_forward, "tanh(x), float32 CUDA");
}

REGISTER_BINDING(tanh_act, register_tanh_act);
