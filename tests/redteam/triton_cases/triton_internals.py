"""Attacks: harness tampering through Triton. The candidate reaches Triton's knobs and runtime (the
harness's: they say where kernels come from and whether compiling is allowed) to compile again in the
evaluated process and to read the build stage's autotuning results."""
import torch
import torch.nn as nn
import triton
import triton.language as tl
from triton import knobs


@triton.jit
def swish_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(y_ptr + offsets, scale * x * tl.sigmoid(x), mask=mask)


class ModelNew(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        knobs.compilation.always_compile = True
        triton.runtime.driver.active.utils

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        swish_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), self.scale, BLOCK=4096)
        return y
