"""One timing method for candidate and baselines (runs inside worker processes).

Warm-up, then timed trials; before each, the L2 cache is flushed by writing a
buffer larger than it. Device events surround each trial: the GPU is held busy
briefly before the start event (the host's launch time stays out), the end
event follows the calls in stream order, and a fence recorded after a
device-wide synchronise catches work left running on other streams (such a
trial is timed to the fence). An
evaluation times candidate and baselines in interleaved rounds (``time_round``,
driven by the evaluator) so that the machine's slow spells fall on both sides
of every speedup; ``evaluate.decide`` turns the rounds into a decision.
"""

from __future__ import annotations

import functools
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
    """Time ``fn`` with the configured method in one run: warm-up, then enough trials to fill
    ``target_ms`` (at least ``min_trials``). ``setup``, if given, runs before every call outside the
    timed region (before the L2 flush): fresh inputs for each call. Evaluations time in interleaved
    rounds instead (``calibrate`` then ``time_round``); this one-shot form is the synth screen's."""
    config = config.resolved(device)
    setup = setup or (lambda: None)
    if config.method == "profiler":
        return _measure_profiler(fn, config, setup)
    estimate_ms = calibrate(fn, device, config, setup)
    trials = int(min(config.max_trials, max(config.min_trials, math.ceil(config.target_ms / estimate_ms))))

    def prepare() -> Callable[[], Any]:
        setup()
        return fn

    return TimingStats.from_samples(config.method, time_round(prepare, device, config, trials))


def calibrate(fn: Callable[[], Any], device: str, config: TimingConfig,
              setup: Callable[[], None] | None = None) -> float:
    """Warm ``fn`` up (at least ``warmup`` calls and ``warmup_ms``); return its wall time per call
    in ms (synchronised, ``setup`` included: an upper bound used to size the trials)."""
    setup = setup or (lambda: None)
    sync = _synchronizer(device)
    warm_start = time.perf_counter()
    calls = 0
    while calls < config.warmup or (time.perf_counter() - warm_start) * 1e3 < config.warmup_ms:
        setup()
        fn()
        sync()
        calls += 1
        if calls >= 1000:
            break
    return max((time.perf_counter() - warm_start) * 1e3 / calls, 1e-3)


def time_round(prepare: Callable[[], Callable[[], Any]], device: str, config: TimingConfig, trials: int,
               calls: int = 1, after_end: Callable[[], None] | None = None) -> list[float]:
    """One round of ``trials`` timed regions; each region runs ``calls`` calls back to back and
    gives one sample, its time per call in ms. ``prepare()`` runs outside the timed region (before
    the L2 flush) and returns the next call, inputs drawn: every call gets fresh inputs, and a
    launch-bound call (microseconds) is timed over many calls so that launch jitter averages out.
    ``after_end()`` runs as soon as each region has ended, before anything else (on a GPU: queued
    in stream order right after the end event, before the synchronise)."""
    import torch

    config = config.resolved(device)
    after_end = after_end or (lambda: None)
    if config.method == "profiler":
        samples = []
        for _ in range(trials):
            samples.append(_profiled_region([prepare() for _ in range(calls)]) / calls)
            after_end()
        return samples
    cuda = device == "cuda"
    flush = _flush_buffer(device, config)
    samples: list[float] = []
    if cuda:
        samples = _time_regions_cuda(prepare, config, trials, calls, flush, after_end)
    else:
        for _ in range(trials):
            ready = [prepare() for _ in range(calls)]
            if flush is not None:
                flush.zero_()
            begin = time.perf_counter_ns()
            for call in ready:
                call()
            samples.append((time.perf_counter_ns() - begin) / 1e6 / calls)
            after_end()
    return samples


def _time_regions_cuda(prepare: Callable[[], Callable[[], Any]], config: TimingConfig, trials: int, calls: int,
                       flush: Any, after_end: Callable[[], None]) -> list[float]:
    import torch

    stream_end = config.end_fence == "stream"
    hold_cycles = int(config.hold_us * _sm_clock_ghz() * 1e3)
    # An empty region gives the fence's own lateness (the host's wake-up after the synchronise);
    # a region whose fence is later than that was followed by work the end event did not wait for.
    allowance_ms = _empty_fence_ms(hold_cycles) * 2 + 0.005 if stream_end else 0.0
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(trials)]
    for start, end, fence in events:
        ready = [prepare() for _ in range(calls)]
        reset_persisting_l2()  # persisting lines would survive the flush
        if flush is not None:
            flush.zero_()
        torch.cuda.synchronize()
        if hold_cycles:
            torch.cuda._sleep(hold_cycles)
        start.record()
        for call in ready:
            call()
        if stream_end:
            end.record()
            after_end()  # queued behind the end event: what the outputs hold when the region ended
            torch.cuda.synchronize()
            fence.record()
        else:
            torch.cuda.synchronize()
            fence.record()
            after_end()
    torch.cuda.synchronize()
    samples = []
    for start, end, fence in events:
        to_fence = start.elapsed_time(fence)
        if stream_end:
            # Measured from the end event, not from the harness's reads after it: work left running on
            # another stream delays those reads too (it holds the SMs), and would hide behind them.
            to_end = start.elapsed_time(end)
            samples.append(to_end if to_fence - to_end <= allowance_ms else to_fence)
        else:
            samples.append(to_fence)
    return [sample / calls for sample in samples]


def _empty_fence_ms(hold_cycles: int, regions: int = 5, reads: int = 8) -> float:
    """The latest an empty region's fence came after its end event, in ms, with ``reads`` small
    gathers queued after the end as the records of a region queue theirs (``time_round``'s
    ``after_end``): what a region's fence may lag its end by with no work left running."""
    import torch

    source = torch.empty(1 << 20, device="cuda")
    index = torch.randint(0, 1 << 20, (16,), device="cuda")
    late = 0.0
    for _ in range(regions):
        start, end, fence = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        if hold_cycles:
            torch.cuda._sleep(hold_cycles)
        start.record()
        end.record()
        for _ in range(reads):
            source[index]
        torch.cuda.synchronize()
        fence.record()
        fence.synchronize()
        late = max(late, end.elapsed_time(fence))
    return late


@functools.cache
def _sm_clock_ghz() -> float:
    import torch

    rate_khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 2_000_000
    return rate_khz / 1e6


def _profiled_region(ready: list[Callable[[], Any]]) -> float:
    """The paper's measure of one region: device time of every kernel it ran, in ms."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for call in ready:
            call()
        torch.cuda.synchronize()
    return sum(float(e.device_time_total) for e in prof.events() if _on_device(e)) / 1e3


def _synchronizer(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def _flush_buffer(device: str, config: TimingConfig):
    import torch

    if not config.flush_l2:
        return None
    size = config.flush_bytes if device == "cuda" else min(config.flush_bytes, 64 * 1024 * 1024)
    return torch.empty(size, dtype=torch.int8, device=device)


def _measure_profiler(fn: Callable[[], Any], config: TimingConfig, setup: Callable[[], None]) -> TimingStats:
    """The paper's method: CUDA kernel device time per iteration, each iteration profiled on its
    own so that ``setup`` (input generation) is not counted."""
    import torch

    for _ in range(config.profiler_warmup):
        setup()
        fn()
    torch.cuda.synchronize()

    def prepare() -> Callable[[], Any]:
        setup()
        return fn

    return TimingStats.from_samples("profiler", time_round(prepare, "cuda", config, config.profiler_iters))


FORWARD_SCOPE = "cuda_agent::forward"  # the profiler range around the profiled call
MAX_OP_NODES = 4096  # operators of one profiled call kept for the torch-compute check


@dataclass(frozen=True)
class CallProfile:
    """What one profiled call ran. ``ops``: the ATen operator tree under the call, as
    ``(name, children)`` nodes, outermost first (``guard.runtime.unlisted_aten`` reads it).
    ``kernels``: ``[name, launches, total ms, launches off the harness's stream]`` rows, longest
    first (GPU only; ``guard.attribution.parse_kernel_report`` reads them)."""

    ops: tuple[tuple[str, tuple[Any, ...]], ...]
    kernels: list[list[Any]]


def profile_call(fn: Callable[[], Any], device: str, on_start: Callable[[], None] = lambda: None,
                 limit: int = 256) -> tuple[Any, CallProfile]:
    """Run ``fn`` once under the profiler (operators; kernels too on the GPU); its result and what
    it ran. ``on_start`` runs once the profiler is active, before ``fn``. On the GPU a one-element
    fill on the current stream, launched and finished first, names the harness's stream: kernels
    on any other stream are counted as such."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    gpu = device == "cuda"
    marker = torch.zeros(1, device="cuda") if gpu else None
    synchronize = _synchronizer(device)
    synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        on_start()
        if marker is not None:
            marker.fill_(1.0)
            synchronize()
        with record_function(FORWARD_SCOPE):
            result = fn()
        synchronize()
    return result, CallProfile(_op_tree(prof), _kernel_table(prof, limit) if gpu else [])


def _op_tree(prof: Any) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """The operators recorded inside the ``FORWARD_SCOPE`` range, as nested ``(name, children)``."""
    budget = [MAX_OP_NODES]

    def node(event: Any) -> tuple[str, tuple[Any, ...]]:
        budget[0] -= 1
        children = tuple(node(c) for c in event.cpu_children if budget[0] > 0)
        return event.name, children

    scopes = [e for e in prof.events() if e.name == FORWARD_SCOPE and not _on_device(e)]
    return tuple(node(child) for scope in scopes for child in scope.cpu_children if budget[0] > 0)


def _on_device(event: Any) -> bool:
    device_type = getattr(event, "device_type", None)
    return device_type is not None and str(device_type).endswith("CUDA")


def _kernel_table(prof: Any, limit: int) -> list[list[Any]]:
    """Kernels, copies and memsets by name, the harness's marker (the first to start) left out."""
    events = sorted((e for e in prof.events() if _on_device(e) and e.name != FORWARD_SCOPE
                     and not getattr(e, "is_user_annotation", False)), key=lambda e: e.time_range.start)
    if not events:
        return []
    harness_stream = events[0].device_resource_id
    table: dict[str, list[Any]] = {}
    for event in events[1:]:
        row = table.setdefault(event.name, [event.name, 0, 0.0, 0])
        row[1] += 1
        row[2] += float(event.device_time_total) / 1e3
        row[3] += int(event.device_resource_id != harness_stream)
    return sorted(table.values(), key=lambda row: -row[2])[:limit]
