import torch
import torch.nn as nn

import cuda_extension


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, bias_shape):
        super().__init__()
        # Same names and shapes as the task's Model so its state dict loads strictly.
        self.gemm = nn.Linear(in_features, out_features, bias=False)
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        return cuda_extension.gemm_bias_relu(x, self.gemm.weight, self.bias)
