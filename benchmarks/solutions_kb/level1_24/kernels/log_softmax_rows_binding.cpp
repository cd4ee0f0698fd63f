#include "../binding_registry.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" void log_softmax_rows_launch(const float* x, float* y, int64_t rows, int64_t n,
                              cudaStream_t stream);

// torch.log_softmax(x, dim) for a 2-D input reduced over its last dimension.
static torch::Tensor log_softmax_rows_forward(torch::Tensor x, int64_t dim) {
  TORCH_CHECK(x.is_cuda(), "log_softmax_rows: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "log_softmax_rows: x must be float32");
  TORCH_CHECK(x.is_contiguous(), "log_softmax_rows: x must be contiguous");
  TORCH_CHECK(x.dim() == 2, "log_softmax_rows: expected a 2-D input");
  TORCH_CHECK(dim == 1 || dim == -1, "log_softmax_rows: only the last dimension is supported");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  if (y.numel() == 0) return y;
  log_softmax_rows_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1),
                c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "log_softmax_rows: kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

static void register_log_softmax_rows(pybind11::module& m) {
  m.def("log_softmax_rows", &log_softmax_rows_forward, "torch.log_softmax(x, dim), float32 CUDA");
}

REGISTER_BINDING(log_softmax_rows, register_log_softmax_rows);
