import torch
import torch.nn as nn

import cuda_extension


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, multiplier, negative_slope):
        super().__init__()
        # Same names and shapes as the task's Model (gemm.weight, gemm.bias).
        self.gemm = nn.Linear(in_features, out_features)
        self.multiplier = multiplier
        self.negative_slope = negative_slope

    def forward(self, x):
        return cuda_extension.gemm_mul_leaky(x, self.gemm.weight, self.gemm.bias,
                                             float(self.multiplier), float(self.negative_slope))
