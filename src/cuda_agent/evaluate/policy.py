"""What counts as correct and how things are timed: recorded in every result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Policy:
    """Correctness and reward rules.

    ``paper`` reproduces the paper's protocol: atol = rtol = 1e-2, five checks,
    the milestone reward with a 5% margin. TF32 is off in every process, so the
    baselines run in strict fp32 (the trust issue adds the other presets).
    """

    name: str = "paper"
    atol: float = 1e-2
    rtol: float = 1e-2
    checks: int = 5
    allow_tf32: bool = False
    reward: str = "milestone"  # "milestone" | "speedup"
    beat_factor: float = 0.95  # "faster" means t < beat_factor * t_baseline

    def __post_init__(self) -> None:
        if self.checks < 1:
            raise ValueError("Policy.checks must be at least 1.")
        if self.reward not in ("milestone", "speedup"):
            raise ValueError(f"unknown reward {self.reward!r}; use 'milestone' or 'speedup'.")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_(self, **changes: Any) -> "Policy":
        return replace(self, **changes)


@dataclass(frozen=True)
class TimingConfig:
    """One timing method for candidate and baselines alike.

    ``events``: device events around each call, a device-wide synchronise before
    the end event, L2 flushed before each trial. ``profiler``: the paper's
    method (sum of CUDA kernel time in torch.profiler over ``profiler_iters``).
    ``host``: the same protocol as ``events`` with a host clock (CPU backend).
    """

    method: str = "auto"  # auto -> events on cuda, host on cpu
    warmup: int = 5
    warmup_ms: float = 50.0
    min_trials: int = 20
    max_trials: int = 200
    target_ms: float = 1000.0
    flush_l2: bool = True
    flush_bytes: int = 256 * 1024 * 1024
    profiler_warmup: int = 5
    profiler_iters: int = 10
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in ("auto", "events", "host", "profiler"):
            raise ValueError(f"unknown timing method {self.method!r}; use events, host or profiler.")
        if self.min_trials < 20:
            raise ValueError("TimingConfig.min_trials must be at least 20.")

    def resolved(self, device: str) -> "TimingConfig":
        if self.method != "auto":
            if device == "cpu" and self.method != "host":
                raise ValueError(f"timing method {self.method!r} needs a CUDA device; use 'host' on the CPU.")
            return self
        return replace(self, method="events" if device == "cuda" else "host")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
