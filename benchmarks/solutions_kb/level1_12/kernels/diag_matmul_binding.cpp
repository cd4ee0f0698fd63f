#include "../binding_registry.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" void diag_matmul_launch(const float* a, const float* b, float* c, int64_t n,
                                   int64_t m, cudaStream_t stream);

// A.unsqueeze(1) * B for A (N,), B (N, M).
static torch::Tensor diag_matmul_forward(torch::Tensor a, torch::Tensor b) {
  for (const auto* t : {&a, &b}) {
    TORCH_CHECK(t->is_cuda(), "diag_matmul: tensors must be on CUDA");
    TORCH_CHECK(t->device() == a.device(), "diag_matmul: tensors on different devices");
    TORCH_CHECK(t->scalar_type() == torch::kFloat32, "diag_matmul: tensors must be float32");
    TORCH_CHECK(t->is_contiguous(), "diag_matmul: tensors must be contiguous");
  }
  TORCH_CHECK(a.dim() == 1 && b.dim() == 2 && b.size(0) == a.size(0),
              "diag_matmul: expected A (N,) and B (N, M)");
  const int64_t n = b.size(0), m = b.size(1);
  const c10::cuda::CUDAGuard guard(a.device());
  auto c = torch::empty({n, m}, b.options());
  if (c.numel() == 0) return c;
  diag_matmul_launch(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), n, m,
                     c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "diag_matmul: kernel launch failed: ", cudaGetErrorString(err));
  return c;
}

static void register_diag_matmul(pybind11::module& m) {
  m.def("diag_matmul", &diag_matmul_forward, "A.unsqueeze(1) * B, float32 CUDA");
}

REGISTER_BINDING(diag_matmul, register_diag_matmul);
