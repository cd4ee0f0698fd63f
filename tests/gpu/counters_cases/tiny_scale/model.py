import torch
import torch.nn as nn


class Model(nn.Module):
    """y = 2x + 1 on 256 numbers: microseconds of work, all launch."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


def get_inputs():
    return [torch.randn(256)]


def get_init_inputs():
    return []
