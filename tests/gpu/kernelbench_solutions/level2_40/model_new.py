import torch
import torch.nn as nn

import cuda_extension


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scaling_factor):
        super().__init__()
        # Same names and shapes as the task's Model so its state dict loads strictly.
        self.matmul = nn.Linear(in_features, out_features)
        self.scaling_factor = scaling_factor

    def forward(self, x):
        return cuda_extension.matmul_scale_residual(
            x, self.matmul.weight, self.matmul.bias, self.scaling_factor
        )
