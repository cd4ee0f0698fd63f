// The torch headers this file uses, included here: the CUDA Agent release's own
// binding_registry.h brings in only pybind11, not torch::Tensor or its casters.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>

#include "../binding_registry.h"

// c10's stream header gives the current stream without ATen/cuda/CUDAContext.h,
// which drags in cuBLAS/cuSPARSE headers this op does not need.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" void row_softmax_launch(const float* x, float* y, int64_t rows, int64_t cols,
                                   cudaStream_t stream);

static torch::Tensor row_softmax_forward(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda(), "row_softmax: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "row_softmax: x must be float32");
  TORCH_CHECK(x.is_contiguous(), "row_softmax: x must be contiguous");
  TORCH_CHECK(x.dim() == 2, "row_softmax: x must be 2-D (softmax over dim 1)");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  if (x.numel() == 0) return y;
  row_softmax_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1),
                     c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "row_softmax: kernel launch failed: ",
              cudaGetErrorString(err));
  return y;
}

static void register_row_softmax(pybind11::module& m) {
  m.def("row_softmax", &row_softmax_forward, "softmax over dim 1 of a 2-D float32 CUDA tensor");
}

REGISTER_BINDING(row_softmax, register_row_softmax);
