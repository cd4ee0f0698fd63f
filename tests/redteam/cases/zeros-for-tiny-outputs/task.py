import torch
import torch.nn as nn


class Model(nn.Module):
    """Outputs far below a fixed atol of 1e-2: zeros pass a naive tolerance."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return 1e-3 * self.scale * (x * torch.sigmoid(x))


def get_inputs():
    return [torch.randn(64, 16384)]


def get_init_inputs():
    return [1.5]
