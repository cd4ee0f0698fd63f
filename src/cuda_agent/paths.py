"""Where cuda-agent keeps its caches (builds, baselines, inductor)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$CUDA_AGENT_CACHE``, else ``$XDG_CACHE_HOME/cuda-agent``, else ``~/.cache/cuda-agent``."""
    explicit = os.environ.get("CUDA_AGENT_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cuda-agent"
