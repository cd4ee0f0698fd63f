import torch
import torch.nn as nn


class Model(nn.Module):
    """Softmax over dim=1 of a (batch, features) tensor."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=1)


batch_size = 16384
features = 16384


def get_inputs():
    return [torch.randn(batch_size, features)]


def get_init_inputs():
    return []
