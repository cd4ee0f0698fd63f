import torch
import torch.nn as nn

import cuda_extension


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        # diag(A) @ B == A.unsqueeze(1) * B
        return cuda_extension.diag_matmul(A, B)
