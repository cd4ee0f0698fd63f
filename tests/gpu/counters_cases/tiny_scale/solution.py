import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = """
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

__global__ void scale_shift_kernel(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i] + 1.0f;
}

torch::Tensor scale_shift(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int n = x.numel();
    scale_shift_kernel<<<(n + 255) / 256, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""
cpp_source = "torch::Tensor scale_shift(torch::Tensor x);"

ext = load_inline(name="scale_shift", cpp_sources=cpp_source, cuda_sources=cuda_source, functions=["scale_shift"],
                  extra_cuda_cflags=["-O3"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return ext.scale_shift(x.contiguous())
