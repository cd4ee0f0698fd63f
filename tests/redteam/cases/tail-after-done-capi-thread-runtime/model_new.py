import torch
import torch.nn as nn
import cuda_extension



class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return cuda_extension.scaled_swish(x, self.scale)
