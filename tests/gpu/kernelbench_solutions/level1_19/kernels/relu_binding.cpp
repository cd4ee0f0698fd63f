#include "../binding_registry.h"

// c10's stream header gives the current stream without ATen/cuda/CUDAContext.h,
// which drags in cuBLAS/cuSPARSE headers this op does not need.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" void relu_launch(const float* x, float* y, int64_t n, cudaStream_t stream);

static torch::Tensor relu_forward(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda(), "relu: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "relu: x must be float32");
  TORCH_CHECK(x.is_contiguous(), "relu: x must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  if (x.numel() == 0) return y;
  relu_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(),
              c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "relu: kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

static void register_relu(pybind11::module& m) {
  m.def("relu", &relu_forward, "elementwise ReLU, float32 CUDA");
}

REGISTER_BINDING(relu, register_relu);
