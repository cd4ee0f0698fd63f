#include "../binding_registry.h"

// c10's stream header gives the current stream without ATen/cuda/CUDAContext.h,
// which drags in cuBLAS/cuSPARSE headers this op does not need.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

extern "C" void sum_dim_launch(const float* x, float* y, int64_t outer, int64_t R,
                               int64_t inner, cudaStream_t stream);

// torch.sum(x, dim=dim, keepdim=True)
static torch::Tensor sum_dim_forward(torch::Tensor x, int64_t dim) {
  TORCH_CHECK(x.is_cuda(), "sum_dim: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "sum_dim: x must be float32");
  TORCH_CHECK(x.is_contiguous(), "sum_dim: x must be contiguous");
  const int64_t nd = x.dim();
  // A 0-d tensor behaves as 1-d for dim wrapping, as in torch.
  const int64_t wrap = nd > 0 ? nd : 1;
  TORCH_CHECK(dim >= -wrap && dim < wrap, "sum_dim: dim ", dim, " out of range for a ",
              nd, "-d tensor");
  if (dim < 0) dim += wrap;

  int64_t outer = 1, R = 1, inner = 1;
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  if (nd > 0) {
    for (int64_t i = 0; i < dim; ++i) outer *= x.size(i);
    R = x.size(dim);
    for (int64_t i = dim + 1; i < nd; ++i) inner *= x.size(i);
    out_sizes[dim] = 1;
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty(out_sizes, x.options());
  if (y.numel() == 0) return y;
  // R == 0 reaches the kernels, whose empty loops write the correct 0.
  sum_dim_launch(x.data_ptr<float>(), y.data_ptr<float>(), outer, R, inner,
                 c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "sum_dim: kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

static void register_sum_dim(pybind11::module& m) {
  m.def("sum_dim", &sum_dim_forward, "torch.sum(x, dim, keepdim=True), float32 CUDA");
}

REGISTER_BINDING(sum_dim, register_sum_dim);
