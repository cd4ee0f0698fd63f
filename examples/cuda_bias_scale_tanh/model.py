import torch
import torch.nn as nn


class Model(nn.Module):
    """y = tanh(x * scale + bias), bias of shape (num_features,) broadcast over rows."""

    def __init__(self, num_features: int, scale: float):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(num_features))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.scale + self.bias)


batch_size = 16384
num_features = 8192
scale = 0.75


def get_inputs():
    return [torch.randn(batch_size, num_features)]


def get_init_inputs():
    return [num_features, scale]
