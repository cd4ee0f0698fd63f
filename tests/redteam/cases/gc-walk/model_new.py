import torch
import torch.nn as nn
import cuda_extension
import gc


class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        objs = gc.get_objects()
        return cuda_extension.scaled_swish(x, self.scale)
