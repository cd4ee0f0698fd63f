import torch
import torch.nn as nn
import cuda_extension
torch.backends.cudnn.allow_tf32 = False


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return cuda_extension.gelu(x)
