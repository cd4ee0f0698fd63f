import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def sum_middle_kernel(x_ptr, y_ptr, n_reduce, n_inner, stride_outer, stride_reduce,
                      BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    # x viewed as (outer, reduce, inner): each program sums BLOCK_I contiguous inner columns of one outer slice.
    outer = tl.program_id(0).to(tl.int64)
    inner = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    inner_mask = inner < n_inner
    base = x_ptr + outer * stride_outer
    acc = tl.zeros([BLOCK_R, BLOCK_I], tl.float32)
    rows = tl.arange(0, BLOCK_R)
    for start in range(0, n_reduce, BLOCK_R):
        r = start + rows
        mask = (r < n_reduce)[:, None] & inner_mask[None, :]
        acc += tl.load(base + r.to(tl.int64)[:, None] * stride_reduce + inner[None, :], mask=mask, other=0.0)
    tl.store(y_ptr + outer * n_inner + inner, tl.sum(acc, axis=0), mask=inner_mask)


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dim = self.dim % x.dim()
        outer = x.shape[:dim].numel()
        n_reduce = x.shape[dim]
        n_inner = x.shape[dim + 1:].numel()
        shape = list(x.shape)
        shape[dim] = 1
        y = torch.empty(shape, device=x.device, dtype=x.dtype)
        grid = (outer, triton.cdiv(n_inner, 128))
        sum_middle_kernel[grid](x, y, n_reduce, n_inner, n_reduce * n_inner, n_inner, BLOCK_R=32, BLOCK_I=128,
                                num_warps=4)
        return y
