"""Attacks: library / torch fallback from inside a kernel. Under Triton's interpreter (the CPU backend) a
kernel body is host Python: this one calls a helper that does the task's work with torch on the tensors
forward left in a module global, and the kernel itself stores nothing."""
import torch
import torch.nn as nn
import triton
import triton.language as tl

STASH = []


def do_the_work():
    x, y, scale = STASH[-1]
    y.copy_(scale * (x * torch.sigmoid(x)))


@triton.jit
def swish_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    if tl.program_id(0) == 0:
        do_the_work()


class ModelNew(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        STASH.append((x, y, self.scale))
        swish_kernel[(1,)](x, y, x.numel(), BLOCK=1024)
        STASH.clear()
        return y
