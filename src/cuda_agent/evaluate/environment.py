"""Facts about the machine and software that every result and baseline records."""

from __future__ import annotations

import platform
import sys
from functools import lru_cache
from typing import Any

from cuda_agent.build.toolchain import visible_gpus
from cuda_agent.evaluate.protocol.policy import CPU_THREADS


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=None)
def describe_environment(device: str, gpu_index: int | None = None) -> dict[str, Any]:
    """Read without creating a CUDA context in this (the orchestrating) process."""
    import torch

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "platform": platform.platform(),
        "cpu": cpu_name(),
        # What the evaluation processes use (a CPU backend's baselines are keyed by it), not this process's pool.
        "torch_threads": CPU_THREADS if device == "cpu" else torch.get_num_threads(),
    }
    if device == "cuda":
        gpus = visible_gpus()
        if gpus:
            gpu = gpus[gpu_index or 0] if (gpu_index or 0) < len(gpus) else gpus[0]
            env.update(gpu=gpu["name"], driver=gpu["driver"], compute_capability=gpu["compute_cap"])
    return env
