"""Attacks: a kernel cached from a different shape. The first two calls (what the build stage runs to
compile) launch with one block size; every later call (the checked and timed ones) with another, which
the build stage never compiled. On a GPU the evaluated process may not compile: rule triton-compile.
Under the CPU interpreter nothing is compiled, and the kernel is correct."""
import torch
import torch.nn as nn
import triton
import triton.language as tl


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
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        block = 1024 if self.calls <= 2 else 2048
        y = torch.empty_like(x)
        swish_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), self.scale, BLOCK=block)
        return y
