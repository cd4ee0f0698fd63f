"""load_inline candidate files shared by several test modules (tests/ is on sys.path through its conftest)."""

# A CUDA load_inline file in the shape KernelBench generations take (recovery and static checks).
INLINE_ADD_ONE = '''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = """
#include <torch/extension.h>
__global__ void k(const float* x, float* y, int n) {}
torch::Tensor add_one(torch::Tensor x) { return x; }
"""
cpp_source = "torch::Tensor add_one(torch::Tensor x);"

add_one = load_inline(
    name="add_one",
    cpp_sources=cpp_source,
    cuda_sources=source,
    functions=["add_one"],
    extra_cuda_cflags=["-O3"],
    verbose=False,
)

class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.op = add_one

    def forward(self, x):
        return self.op.add_one(x)
'''

# A C++ load_inline solution of the cpu_swish example task (builds and runs on the CPU backend).
INLINE_SWISH = '''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = """
torch::Tensor scaled_swish(torch::Tensor x, double scale) {
    auto y = torch::empty_like(x);
    const float* in = x.data_ptr<float>();
    float* out = y.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) out[i] = scale * in[i] / (1.0f + std::exp(-in[i]));
    return y;
}
"""

ext = load_inline(name="swish_inline", cpp_sources=cpp_source, functions=["scaled_swish"])

class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return ext.scaled_swish(x.contiguous(), self.scale)
'''
