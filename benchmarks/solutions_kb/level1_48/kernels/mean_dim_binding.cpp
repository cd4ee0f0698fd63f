#include "../binding_registry.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

extern "C" void mean_dim_launch(const float* x, float* y, int64_t outer, int64_t R,
                              int64_t inner, cudaStream_t stream);

// torch.mean(x, dim) (no keepdim)
static torch::Tensor mean_dim_forward(torch::Tensor x, int64_t dim) {
  TORCH_CHECK(x.is_cuda(), "mean_dim: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "mean_dim: x must be float32");
  TORCH_CHECK(x.is_contiguous(), "mean_dim: x must be contiguous");
  const int64_t nd = x.dim();
  TORCH_CHECK(nd >= 1, "mean_dim: x must have at least one dimension");
  TORCH_CHECK(dim >= -nd && dim < nd, "mean_dim: dim out of range");
  if (dim < 0) dim += nd;
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < dim; ++i) outer *= x.size(i);
  const int64_t R = x.size(dim);
  for (int64_t i = dim + 1; i < nd; ++i) inner *= x.size(i);
  TORCH_CHECK(R > 0, "mean_dim: cannot reduce over an empty dimension");
  std::vector<int64_t> out_sizes;
  for (int64_t i = 0; i < nd; ++i)
    if (i != dim) out_sizes.push_back(x.size(i));
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty(out_sizes, x.options());
  if (y.numel() == 0) return y;
  mean_dim_launch(x.data_ptr<float>(), y.data_ptr<float>(), outer, R, inner,
                c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "mean_dim: kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

static void register_mean_dim(pybind11::module& m) {
  m.def("mean_dim", &mean_dim_forward, "torch.mean(x, dim) (no keepdim), float32 CUDA");
}

REGISTER_BINDING(mean_dim, register_mean_dim);
