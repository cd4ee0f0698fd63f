"""Where a candidate worker's start-up goes (device machine): import torch, CUDA
context, torch._dynamo import, profiler warm-up. Prints one JSON line.

    python experiments/startup_profile.py
"""

from __future__ import annotations

import json
import time

marks: dict[str, float] = {}
start = time.perf_counter()


def mark(name: str) -> None:
    marks[name] = round(time.perf_counter() - start, 3)


import torch  # noqa: E402

mark("import torch")
torch.cuda.init()
torch.randn(1 << 18, device="cuda").sum()
torch.cuda.synchronize()
mark("cuda context + first kernel")
import torch._dynamo  # noqa: E402, F401

mark("import torch._dynamo")
from cuda_agent.evaluate.worker.profiling import profile_call  # noqa: E402

profile_call(lambda: torch.randn(1 << 10, device="cuda").sum(), "cuda")
mark("profiler warm-up")
_, profiled = profile_call(lambda: torch.randn(1 << 20, device="cuda").sum(), "cuda")
kernels = profiled.kernels
mark("second profiled call")
print(json.dumps({"cumulative_s": marks, "kernels": kernels[:3]}))
