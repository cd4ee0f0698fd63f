import torch
import torch.nn as nn

import cuda_extension


class ModelNew(nn.Module):
    def __init__(self, num_features: int, scale: float):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(num_features))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cuda_extension.bias_scale_tanh(x, self.bias, self.scale)
