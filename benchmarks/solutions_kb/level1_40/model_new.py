import torch
import torch.nn as nn

import cuda_extension


class ModelNew(nn.Module):
    def __init__(self, normalized_shape: tuple):
        super().__init__()
        # Holds ln.weight / ln.bias under Model's names; only its parameters are used.
        self.ln = nn.LayerNorm(normalized_shape=normalized_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cuda_extension.layer_norm(x, self.ln.weight, self.ln.bias, float(self.ln.eps))
