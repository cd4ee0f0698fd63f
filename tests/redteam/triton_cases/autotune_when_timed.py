"""Attacks: autotuning that picks a config on the timed inputs. The autotuning key holds a value that
changes with every call (a counter), so every call is a key the build stage never tuned: on a GPU the
evaluated process would time configs on the evaluated inputs (rule triton-autotune). Under the CPU
interpreter autotuned kernels run their first config."""
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"BLOCK": 1024}), triton.Config({"BLOCK": 4096})], key=["tag"])
@triton.jit
def swish_kernel(x_ptr, y_ptr, n, scale, tag, BLOCK: tl.constexpr):
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
        y = torch.empty_like(x)
        n = x.numel()
        swish_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n, self.scale, self.calls)
        return y
