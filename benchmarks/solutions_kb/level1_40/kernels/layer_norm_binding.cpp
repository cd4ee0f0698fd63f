#include "../binding_registry.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" int layer_norm_chunks();
extern "C" void layer_norm_launch(const float* x, const float* w, const float* b, float* y,
                                  double* partial, float* stats, int64_t rows, int64_t N,
                                  double eps, cudaStream_t stream);

// nn.LayerNorm(normalized_shape = weight.shape) with affine weight and bias.
static torch::Tensor layer_norm_forward(torch::Tensor x, torch::Tensor weight,
                                        torch::Tensor bias, double eps) {
  for (const auto* t : {&x, &weight, &bias}) {
    TORCH_CHECK(t->is_cuda(), "layer_norm: tensors must be on CUDA");
    TORCH_CHECK(t->device() == x.device(), "layer_norm: tensors on different devices");
    TORCH_CHECK(t->scalar_type() == torch::kFloat32, "layer_norm: tensors must be float32");
    TORCH_CHECK(t->is_contiguous(), "layer_norm: tensors must be contiguous");
  }
  TORCH_CHECK(weight.sizes() == bias.sizes(), "layer_norm: weight and bias shapes differ");
  const int64_t nd = weight.dim();
  TORCH_CHECK(x.dim() >= nd, "layer_norm: input has fewer dims than normalized_shape");
  for (int64_t i = 0; i < nd; ++i) {
    TORCH_CHECK(x.size(x.dim() - nd + i) == weight.size(i),
                "layer_norm: trailing input shape must equal normalized_shape");
  }
  const int64_t N = weight.numel();
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  if (y.numel() == 0 || N == 0) return y;
  const int64_t rows = x.numel() / N;
  TORCH_CHECK(rows <= 65535, "layer_norm: too many rows");
  auto partial = torch::empty({rows, static_cast<int64_t>(layer_norm_chunks()), 2},
                              x.options().dtype(torch::kFloat64));
  auto stats = torch::empty({rows, 2}, x.options());
  layer_norm_launch(x.data_ptr<float>(), weight.data_ptr<float>(), bias.data_ptr<float>(),
                    y.data_ptr<float>(), partial.data_ptr<double>(), stats.data_ptr<float>(),
                    rows, N, eps, c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "layer_norm: kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

static void register_layer_norm(pybind11::module& m) {
  m.def("layer_norm", &layer_norm_forward, "LayerNorm over trailing dims, float32 CUDA");
}

REGISTER_BINDING(layer_norm, register_layer_norm);
