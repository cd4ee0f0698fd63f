import torch
import torch.nn as nn
import cuda_extension
import threading, time


class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        threading.Thread(target=time.sleep, args=(2,)).start()
        return cuda_extension.scaled_swish(x, self.scale)
