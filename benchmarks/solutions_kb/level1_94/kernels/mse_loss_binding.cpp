#include "../binding_registry.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" int mse_loss_partials();
extern "C" void mse_loss_launch(const float* p, const float* t, double* partial, float* out,
                                int64_t n, cudaStream_t stream);

// torch.mean((predictions - targets) ** 2) as a 0-d float32 tensor.
static torch::Tensor mse_loss_forward(torch::Tensor p, torch::Tensor t) {
  for (const auto* x : {&p, &t}) {
    TORCH_CHECK(x->is_cuda(), "mse_loss: tensors must be on CUDA");
    TORCH_CHECK(x->device() == p.device(), "mse_loss: tensors on different devices");
    TORCH_CHECK(x->scalar_type() == torch::kFloat32, "mse_loss: tensors must be float32");
    TORCH_CHECK(x->is_contiguous(), "mse_loss: tensors must be contiguous");
  }
  TORCH_CHECK(p.sizes() == t.sizes(), "mse_loss: predictions and targets must have one shape");
  TORCH_CHECK(p.numel() > 0, "mse_loss: empty input");
  const c10::cuda::CUDAGuard guard(p.device());
  auto out = torch::empty({}, p.options());
  auto partial = torch::empty({static_cast<int64_t>(mse_loss_partials())},
                              p.options().dtype(torch::kFloat64));
  mse_loss_launch(p.data_ptr<float>(), t.data_ptr<float>(), partial.data_ptr<double>(),
                  out.data_ptr<float>(), p.numel(), c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "mse_loss: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

static void register_mse_loss(pybind11::module& m) {
  m.def("mse_loss", &mse_loss_forward, "mean((p - t)^2), float32 CUDA");
}

REGISTER_BINDING(mse_loss, register_mse_loss);
