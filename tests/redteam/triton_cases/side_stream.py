"""Attacks: side stream. The kernel is launched on a stream of the candidate's own, so that timing that
waits on the current stream alone would miss it. Static rule `stream`; with the static checks off, on a GPU
the evaluator's device-wide synchronisation times it at its true cost."""
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
        self.side = torch.cuda.Stream() if torch.cuda.is_available() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        if self.side is None:
            swish_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), self.scale, BLOCK=4096)
            return y
        with torch.cuda.stream(self.side):
            swish_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), self.scale, BLOCK=4096)
        return y
