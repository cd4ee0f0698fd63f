import torch
import torch.nn as nn


class Model(nn.Module):
    """Swish activation followed by a scale: y = scale * x * sigmoid(x)."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * (x * torch.sigmoid(x))


batch_size = 64
dim = 16384


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [1.5]
