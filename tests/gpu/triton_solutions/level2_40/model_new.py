import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def matmul_scale_residual_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, scaling,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # y = epilogue(x @ w.T + b), x: (M, K), w: (N, K) as nn.Linear keeps it; programs grouped along M for L2 reuse.
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * blocks_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_tile = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = offs_k + k < K
        a = tl.load(x_tile, mask=(offs_m < M)[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_tile, mask=k_mask[:, None] & (offs_n < N)[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    acc = acc * scaling + acc
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc, mask=mask)


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scaling_factor):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.scaling_factor = scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        weight = self.matmul.weight
        M, K = x.shape
        N = weight.shape[0]
        y = torch.empty((M, N), device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(M, 128) * triton.cdiv(N, 128),)
        matmul_scale_residual_kernel[grid](x, weight, self.matmul.bias, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
            self.scaling_factor,
            BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3)
        return y
