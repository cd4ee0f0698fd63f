"""One timing method for candidate and baselines (runs inside worker processes).

Warm-up, then at least ``min_trials`` timed calls; before each, the L2 cache is
flushed by writing a buffer larger than it; device events surround each call
with a device-wide synchronise before the end event, so work left on side
streams is counted.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from cuda_agent.evaluate.policy import TimingConfig
from cuda_agent.guard.device_state import reset_persisting_l2


@dataclass(frozen=True)
class TimingStats:
    method: str
    median_ms: float
    mean_ms: float
    std_ms: float
    min_ms: float
    max_ms: float
    p20_ms: float
    p80_ms: float
    trials: int
    # Median of the last quarter of the trials over that of the first, minus 1: how far the
    # timing moved while it ran (clocks still ramping after warm-up show as a negative drift).
    drift: float = 0.0

    @property
    def cv(self) -> float:
        return self.std_ms / self.mean_ms if self.mean_ms else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"cv": self.cv}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TimingStats":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    @classmethod
    def from_samples(cls, method: str, samples: list[float]) -> "TimingStats":
        """``samples`` in the order they were taken."""
        ordered = sorted(samples)
        quarter = len(samples) // 4
        drift = (statistics.median(samples[-quarter:]) / statistics.median(samples[:quarter]) - 1
                 if quarter and statistics.median(samples[:quarter]) > 0 else 0.0)

        def quantile(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

        return cls(
            method=method,
            median_ms=statistics.median(ordered),
            mean_ms=statistics.fmean(ordered),
            std_ms=statistics.pstdev(ordered) if len(ordered) > 1 else 0.0,
            min_ms=ordered[0],
            max_ms=ordered[-1],
            p20_ms=quantile(0.2),
            p80_ms=quantile(0.8),
            trials=len(ordered),
            drift=drift,
        )


def trial_seed(base: int, index: int) -> int:
    """The input seed of call ``index`` of a timing run (warm-up calls included), shared by
    the process that times and the one that checks what it returned."""
    return (base + (index + 1) * 0x9E3779B97F4A7C15) % (1 << 62)


def measure(fn: Callable[[], Any], device: str, config: TimingConfig,
            setup: Callable[[], None] | None = None) -> TimingStats:
    """Time ``fn`` with the configured method. ``setup``, if given, runs before every
    call outside the timed region (before the L2 flush): fresh inputs for each call."""
    import torch

    config = config.resolved(device)
    setup = setup or (lambda: None)
    if config.method == "profiler":
        return _measure_profiler(fn, config, setup)
    cuda = device == "cuda"
    flush = _flush_buffer(device, config)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    warm_start = time.perf_counter()
    calls = 0
    while calls < config.warmup or (time.perf_counter() - warm_start) * 1e3 < config.warmup_ms:
        setup()
        fn()
        sync()
        calls += 1
        if calls >= 1000:
            break
    estimate_ms = max((time.perf_counter() - warm_start) * 1e3 / calls, 1e-3)
    trials = int(min(config.max_trials, max(config.min_trials, math.ceil(config.target_ms / estimate_ms))))

    samples: list[float] = []
    if cuda:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(trials)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(trials)]
        for start, end in zip(starts, ends):
            setup()
            reset_persisting_l2()  # persisting lines would survive the flush
            if flush is not None:
                flush.zero_()
            torch.cuda.synchronize()
            start.record()
            fn()
            torch.cuda.synchronize()
            end.record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(trials):
            setup()
            if flush is not None:
                flush.zero_()
            begin = time.perf_counter_ns()
            fn()
            samples.append((time.perf_counter_ns() - begin) / 1e6)
    return TimingStats.from_samples(config.method, samples)


def _flush_buffer(device: str, config: TimingConfig):
    import torch

    if not config.flush_l2:
        return None
    size = config.flush_bytes if device == "cuda" else min(config.flush_bytes, 64 * 1024 * 1024)
    return torch.empty(size, dtype=torch.int8, device=device)


def _measure_profiler(fn: Callable[[], Any], config: TimingConfig, setup: Callable[[], None]) -> TimingStats:
    """The paper's method: CUDA kernel device time summed over iterations, per iteration.
    Each iteration is profiled on its own so that ``setup`` (input generation) is not counted."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(config.profiler_warmup):
        setup()
        fn()
    torch.cuda.synchronize()
    total_us = 0.0
    for _ in range(config.profiler_iters):
        setup()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        total_us += sum(us for _name, us in _device_events(prof))
    per_iter = total_us / 1e3 / config.profiler_iters
    return TimingStats.from_samples("profiler", [per_iter])


def profile_kernels(fn: Callable[[], Any], on_start: Callable[[], None] = lambda: None,
                    limit: int = 256) -> tuple[Any, list[list[Any]]]:
    """Run ``fn`` once under the profiler; return its result and the device work it ran
    as ``[name, launches, total ms]`` rows, longest first (at most ``limit`` names).
    ``on_start`` runs once the profiler is active, before ``fn``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        on_start()
        result = fn()
        torch.cuda.synchronize()
    table: dict[str, list[Any]] = {}
    for name, us in _device_events(prof):
        row = table.setdefault(name, [name, 0, 0.0])
        row[1] += 1
        row[2] += us / 1e3
    return result, sorted(table.values(), key=lambda row: -row[2])[:limit]


def _device_events(prof: Any) -> list[tuple[str, float]]:
    """(name, device microseconds) of every kernel, copy and memset a profile recorded."""
    rows = []
    for event in prof.events():
        device_type = getattr(event, "device_type", None)
        if device_type is not None and str(device_type).endswith("CUDA"):
            rows.append((event.name, float(event.device_time_total)))
    return rows
