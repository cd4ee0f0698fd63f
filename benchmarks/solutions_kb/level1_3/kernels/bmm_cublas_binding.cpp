#include "../binding_registry.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <limits>

extern "C" int bmm_cublas_launch(cublasHandle_t handle, const float* A, const float* B, float* C,
                                 int batch, int m, int n, int k, cudaStream_t stream);

// torch.bmm(A, B) for A (batch, m, k), B (batch, k, n).
static torch::Tensor bmm_cublas_forward(torch::Tensor A, torch::Tensor B) {
  for (const auto* t : {&A, &B}) {
    TORCH_CHECK(t->is_cuda(), "bmm_cublas: tensors must be on CUDA");
    TORCH_CHECK(t->device() == A.device(), "bmm_cublas: tensors on different devices");
    TORCH_CHECK(t->scalar_type() == torch::kFloat32, "bmm_cublas: tensors must be float32");
    TORCH_CHECK(t->is_contiguous(), "bmm_cublas: tensors must be contiguous");
  }
  TORCH_CHECK(A.dim() == 3 && B.dim() == 3, "bmm_cublas: expected 3-D A and B");
  TORCH_CHECK(A.size(0) == B.size(0) && A.size(2) == B.size(1), "bmm_cublas: shapes differ");
  const int64_t batch = A.size(0), m = A.size(1), k = A.size(2), n = B.size(2);
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  TORCH_CHECK(batch <= kIntMax && m <= kIntMax && n <= kIntMax && k <= kIntMax,
              "bmm_cublas: shape too large");
  const c10::cuda::CUDAGuard guard(A.device());
  auto C = torch::empty({batch, m, n}, A.options());
  if (C.numel() == 0) return C;
  // k == 0: cuBLAS with beta = 0 writes zeros.
  const int st = bmm_cublas_launch(at::cuda::getCurrentCUDABlasHandle(), A.data_ptr<float>(),
                                   B.data_ptr<float>(), C.data_ptr<float>(),
                                   static_cast<int>(batch), static_cast<int>(m),
                                   static_cast<int>(n), static_cast<int>(k),
                                   c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(st == 0, "bmm_cublas: cublasSgemmStridedBatched failed with status ", st);
  return C;
}

static void register_bmm_cublas(pybind11::module& m) {
  m.def("bmm_cublas", &bmm_cublas_forward, "torch.bmm via cuBLAS strided-batched SGEMM");
}

REGISTER_BINDING(bmm_cublas, register_bmm_cublas);
