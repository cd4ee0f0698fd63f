#include "../binding_registry.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" void softmax_rows_launch(const float* x, float* y, int64_t rows, int64_t n,
                              cudaStream_t stream);

// torch.softmax(x, dim=1) for a 2-D input reduced over its last dimension.
static torch::Tensor softmax_rows_forward(torch::Tensor x, int64_t dim) {
  TORCH_CHECK(x.is_cuda(), "softmax_rows: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "softmax_rows: x must be float32");
  TORCH_CHECK(x.is_contiguous(), "softmax_rows: x must be contiguous");
  TORCH_CHECK(x.dim() == 2, "softmax_rows: expected a 2-D input");
  TORCH_CHECK(dim == 1 || dim == -1, "softmax_rows: only the last dimension is supported");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  if (y.numel() == 0) return y;
  softmax_rows_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1),
                c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "softmax_rows: kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

static void register_softmax_rows(pybind11::module& m) {
  m.def("softmax_rows", &softmax_rows_forward, "torch.softmax(x, dim=1), float32 CUDA");
}

REGISTER_BINDING(softmax_rows, register_softmax_rows);
