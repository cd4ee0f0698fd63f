#include "../binding_registry.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

extern "C" void max_dim_launch(const float* x, float* y, int64_t outer, int64_t R,
                              int64_t inner, cudaStream_t stream);

// torch.max(x, dim)[0] (no keepdim; NaN propagates)
static torch::Tensor max_dim_forward(torch::Tensor x, int64_t dim) {
  TORCH_CHECK(x.is_cuda(), "max_dim: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "max_dim: x must be float32");
  TORCH_CHECK(x.is_contiguous(), "max_dim: x must be contiguous");
  const int64_t nd = x.dim();
  TORCH_CHECK(nd >= 1, "max_dim: x must have at least one dimension");
  TORCH_CHECK(dim >= -nd && dim < nd, "max_dim: dim out of range");
  if (dim < 0) dim += nd;
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < dim; ++i) outer *= x.size(i);
  const int64_t R = x.size(dim);
  for (int64_t i = dim + 1; i < nd; ++i) inner *= x.size(i);
  TORCH_CHECK(R > 0, "max_dim: cannot reduce over an empty dimension");
  std::vector<int64_t> out_sizes;
  for (int64_t i = 0; i < nd; ++i)
    if (i != dim) out_sizes.push_back(x.size(i));
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty(out_sizes, x.options());
  if (y.numel() == 0) return y;
  max_dim_launch(x.data_ptr<float>(), y.data_ptr<float>(), outer, R, inner,
                c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "max_dim: kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

static void register_max_dim(pybind11::module& m) {
  m.def("max_dim", &max_dim_forward, "torch.max(x, dim)[0] (no keepdim; NaN propagates), float32 CUDA");
}

REGISTER_BINDING(max_dim, register_max_dim);
