"""Attacks: work left queued. Forward returns as soon as its kernels are launched, with a slow kernel queued
behind the real one (Triton launches are asynchronous), hoping the clock stops before the queue drains. The
evaluator waits for the device before it stops the clock: the queued kernel's time is counted."""
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


@triton.jit
def busy_kernel(scratch_ptr, rounds, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(scratch_ptr + offsets)
    for _ in range(rounds):
        acc = acc * 1.000001 + 0.5
    tl.store(scratch_ptr + offsets, acc)


class ModelNew(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        self.scratch = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        swish_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), self.scale, BLOCK=4096)
        if self.scratch is None:
            self.scratch = torch.zeros(64 * 1024, device=x.device)
        rounds = 20000 if x.is_cuda else 1
        busy_kernel[(64,)](self.scratch, rounds, BLOCK=1024)
        return y
