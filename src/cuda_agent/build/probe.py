"""A minimal extension in the workspace layout, built with the same toolchain as the
candidates: what it imports comes from torch's headers, the CUDA toolchain and the
project's fixed binding, never from a candidate.

The symbol audit allows those imports. They vary with versions: with torch 2.11
headers, CUDA 13.0 and Ubuntu's compiler every example extension
imports ``open``, ``syscall`` and c10's stream-pool functions although none of
its sources calls them; with torch 2.13 on Debian 12 none of them appears.
"""

from __future__ import annotations

from cuda_agent.candidates.candidate import FIXED_FILES, WORKSPACE_MODULE, Candidate, Extension, fixed_file

# The headers and calls every solution in examples/ and tests/gpu uses.
_CUDA_KERNEL = r"""#include <cuda_runtime.h>
#include <cstdint>

__global__ void probe_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i];
}

extern "C" void probe_launch(const float* x, float* y, int64_t n, cudaStream_t stream) {
  probe_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(x, y, n);
}
"""
_CUDA_BINDING = r"""#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>

#include "../binding_registry.h"
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cstdint>

extern "C" void probe_launch(const float* x, float* y, int64_t n, cudaStream_t stream);

static torch::Tensor probe_forward(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), "probe: x must be a contiguous CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  probe_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "probe: ", cudaGetErrorString(err));
  return y;
}

static void register_probe(pybind11::module& m) { m.def("probe", &probe_forward); }

REGISTER_BINDING(probe, register_probe);
"""
_CPU_KERNEL = r"""#include <cstdint>

extern "C" void probe_launch(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i];
}
"""
_CPU_BINDING = r"""#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>

#include "../binding_registry.h"
#include <cstdint>

extern "C" void probe_launch(const float* x, float* y, int64_t n);

static torch::Tensor probe_forward(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous(), "probe: x must be contiguous");
  auto y = torch::empty_like(x);
  probe_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
  return y;
}

static void register_probe(pybind11::module& m) { m.def("probe", &probe_forward); }

REGISTER_BINDING(probe, register_probe);
"""


def probe_candidate(backend: str) -> Candidate:
    """The minimal extension for ``backend`` ("cuda" or "cpu")."""
    if backend == "cuda":
        sources = {"kernels/probe.cu": _CUDA_KERNEL, "kernels/probe_binding.cpp": _CUDA_BINDING}
    else:
        sources = {"kernels/probe.cpp": _CPU_KERNEL, "kernels/probe_binding.cpp": _CPU_BINDING}
    sources |= {name: fixed_file(name) for name in FIXED_FILES}
    return Candidate(
        model_new="import torch\nimport cuda_extension\n\n\nclass ModelNew(torch.nn.Module):\n"
                  "    def forward(self, x):\n        return cuda_extension.probe(x)\n",
        extensions=(Extension(name=WORKSPACE_MODULE, sources=sources),),
        kind="workspace",
        origin=f"<toolchain probe: {backend}>",
    )
