"""One timing method for candidate and baselines (runs inside worker processes).

Warm-up, then timed trials; before each, the L2 cache is flushed by writing a
buffer larger than it. Device events surround each trial: the GPU is held busy
briefly before the start event (the host's launch time stays out), the end
event follows the calls in stream order, and a fence recorded after a
device-wide synchronise catches work left running on other streams (such a
trial is timed to the fence). The hold only keeps the host out while the host
enqueues a region faster than the hold lasts: torch.compile's guards and
launcher can take longer a call than the hold (docs/CONSTANTS.md), so the trusted baselines'
holds grow to cover one call of what their host was seen to take (``HostLaunch``). An
evaluation times candidate and baselines in interleaved rounds (``time_round``,
driven by the evaluator) so that the machine's slow spells fall on both sides
of every speedup; ``evaluate.decide`` turns the rounds into a decision.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from cuda_agent.evaluate.protocol import bound
from cuda_agent.evaluate.protocol.policy import TimingConfig
from cuda_agent.evaluate.protocol.regions import CONT, GO
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


@dataclass
class HostLaunch:
    """How long the host takes to enqueue a side's calls (launches, guards, Python), learned from its
    warm-up and from every region it enqueues. A region whose enqueue outlasts the GPU's hold starts
    with the GPU idle, waiting for the host: host time inside the region. With ``adaptive`` (the
    trusted baselines: eager, torch.compile), each region's hold covers ``HOLD_FACTOR`` times the
    longest recent enqueue per call. The candidate's process could claim any enqueue time, and a
    hold is time it could compute in unseen by the outside clock, so its hold (``fixed_us``) is set
    by the evaluator from eager's host time per call, measured in the trusted reference: a candidate
    whose host path per call is at most twice eager's keeps it out as the baselines do. With
    ``first_call`` (``baseline_hold="first-call"``, the default) a baseline's hold covers its first
    call's enqueue, learned from first calls, with a margin and no more: in a stream of calls the host
    enqueues each next call while the GPU runs the last, so only the first waits for the host, and a
    region of several calls (launch-bound ones) still counts the host time that a stream of them
    would wait for. A side whose host takes more than ``HOST_BOUND``
    times what its GPU has left once a call is enqueued (``learn_bound``, from the warm-up) is
    launch-bound: in a stream of its calls the host is the cost, and it keeps the fixed hold
    (torch.compile's axpby: hundreds of us of host, a few of GPU, and one call a region,
    since its synchronised wall time is over ``region_ms``). ``late``
    counts the regions that outlasted their hold; ``fenced`` those timed to the fence (work seen
    running past the end event, or the harness's own reads after it queued too late)."""

    adaptive: bool = False
    first_call: bool = False  # an adaptive hold covers the region's first call only
    fixed_us: float | None = None  # a hold the evaluator set for this round (the candidate's), else hold_us
    recent: deque = field(default_factory=lambda: deque(maxlen=HOST_WINDOW))  # us per call
    late: int = 0  # regions of this round whose enqueue outlasted their hold
    enqueue_us: float = 0.0  # the longest region enqueue of this round
    hold_us: float = 0.0  # the longest hold of this round
    fenced: int = 0  # regions of this round timed to the fence rather than to the end event
    host_bound: bool = False  # the warm-up's host enqueue is over HOST_BOUND times its GPU tail
    # On a GPU, each bracketed region's time from its last synchronise to its DONE: the harness's own tail, which a
    # DONE sent by the candidate's code while its kernels still run would overlap with them. Taken from the no-op
    # regions before its code loads (``region_clock.Overhead.tail_ms``), it is part of what a forgery could hide.
    tails_us: deque = field(default_factory=lambda: deque(maxlen=HOST_WINDOW))

    @property
    def per_call_us(self) -> float:
        return max(self.recent, default=0.0)

    def hold_for(self, calls: int, config: TimingConfig) -> float:
        if not self.adaptive:
            return config.hold_us if self.fixed_us is None else self.fixed_us
        if self.first_call and not self.host_bound:
            return min(config.hold_max_us, max(config.hold_us, self.per_call_us + HOLD_MARGIN_US))
        if self.first_call:
            return config.hold_us
        return host_hold(calls, self.per_call_us, config)

    def learn_bound(self, enqueue_us: float, tail_us: float) -> None:
        """From the warm-up's median enqueue and GPU tail per call (``calibrate``)."""
        self.host_bound = enqueue_us > HOST_BOUND * tail_us

    def begin_round(self) -> None:
        self.late, self.enqueue_us, self.hold_us, self.fenced = 0, 0.0, 0.0, 0

    def region(self, enqueue_us: float, calls: int, hold_us: float, first_us: float | None = None) -> None:
        """A region's enqueue; ``first_us``: its first call's (the whole region's when not given)."""
        first_us = enqueue_us if first_us is None else first_us
        self.recent.append(first_us if self.first_call else enqueue_us / calls)
        self.late += (first_us if self.first_call else enqueue_us) > hold_us
        self.enqueue_us = max(self.enqueue_us, enqueue_us)
        self.hold_us = max(self.hold_us, hold_us)

    def report(self) -> dict[str, Any]:
        return {"enqueue_us": round(self.enqueue_us, 1), "hold_us": round(self.hold_us, 1), "late": self.late,
                "fenced": self.fenced, "host_bound": self.host_bound}


def host_hold(calls: int, per_call_us: float, config: TimingConfig) -> float:
    """The hold that covers ``calls`` calls whose host path takes ``per_call_us`` each, with room to
    spare, within ``hold_us`` and ``hold_max_us``."""
    return min(config.hold_max_us, max(config.hold_us, HOLD_FACTOR * calls * per_call_us + HOLD_MARGIN_US))


HOLD_FACTOR = 2.0
HOST_BOUND = 2.0  # a side whose host enqueue is over this many times its GPU tail is launch-bound
HOLD_MARGIN_US = 50.0
HOST_WINDOW = 20  # enqueue times remembered: an old stall (a GC pause) stops widening the holds


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
    estimate_ms = calibrate(fn, device, config, setup).estimate_ms
    trials = int(min(config.max_trials, max(config.min_trials, math.ceil(config.target_ms / estimate_ms))))

    def prepare() -> Callable[[], Any]:
        setup()
        return fn

    return TimingStats.from_samples(config.method, time_round(prepare, device, config, trials))


@dataclass(frozen=True)
class Warmup:
    """What a warm-up says about a call: ``estimate_ms``, the wall time per call with its input draw and
    synchronises (an upper bound: it sizes a round), and ``call_ms``, the call alone (begin to synchronised
    end, median of the later half: how many calls fill a region). For a short call whose inputs take
    longer to draw than it runs, the first is several times the second, and regions sized by it would be a
    fraction of ``region_ms``: too short for the outside clock to resolve (docs/ARCHITECTURE.md, "Regions")."""

    estimate_ms: float
    call_ms: float


def calibrate(fn: Callable[[], Any], device: str, config: TimingConfig,
              setup: Callable[[], None] | None = None, host: HostLaunch | None = None) -> Warmup:
    """Warm ``fn`` up (at least ``warmup`` calls and ``warmup_ms``). ``host`` learns the enqueue time of
    the later half of the calls (the first ones compile, autotune and initialise lazily)."""
    setup = setup or (lambda: None)
    sync = _synchronizer(device)
    perf_counter, clock = bound.perf_counter, bound.perf_counter_ns
    warm_start = perf_counter()
    enqueues: list[float] = []
    tails: list[float] = []  # from the end of each enqueue to the call's end: what the GPU had left
    while len(enqueues) < config.warmup or (perf_counter() - warm_start) * 1e3 < config.warmup_ms:
        setup()
        sync()  # the input draw's device work is not the call's
        begin = clock()
        fn()
        enqueued = clock()
        sync()
        enqueues.append((enqueued - begin) / 1e3)
        tails.append((clock() - enqueued) / 1e3)
        if len(enqueues) >= 1000:
            break
    later = len(enqueues) // 2
    if host is not None:
        host.recent.extend(enqueues[later:])
        host.learn_bound(statistics.median(enqueues[later:]), statistics.median(tails[later:]))
    estimate_ms = max((perf_counter() - warm_start) * 1e3 / len(enqueues), 1e-3)
    call_ms = statistics.median(e + t for e, t in zip(enqueues[later:], tails[later:])) / 1e3
    return Warmup(estimate_ms, min(estimate_ms, max(call_ms, 1e-3)))


def time_round(prepare: Callable[[], Callable[[], Any]], device: str, config: TimingConfig, trials: int,
               calls: int = 1, after_end: Callable[[], bytes | None] | None = None,
               host: HostLaunch | None = None, fence: bool = True, bell: Any = None,
               before_done: Callable[[int], None] | None = None,
               announce: Callable[[int], None] | None = None,
               before_region: Callable[[], None] | None = None) -> list[float]:
    """One round of ``trials`` timed regions; each region runs ``calls`` calls back to back and
    gives one sample, its time per call in ms. ``prepare()`` runs outside the timed region (before
    the L2 flush) and returns the next call, inputs drawn: every call gets fresh inputs, and a
    launch-bound call (microseconds) is timed over many calls so that launch jitter averages out.
    ``after_end()`` runs as soon as each region has ended, before anything else (on a GPU: queued
    in stream order right after the end event, before the synchronise). ``host`` sizes each
    region's hold and learns from it (GPU only; its counts start again with each round). ``fence``:
    the calls may leave work running past the end event (the candidate's), so a region whose fence
    is late is timed to the fence; the trusted baselines' regions are always timed to their end.
    ``bell`` (``regions.Ringer``): each region is opened and closed through the evaluator's brackets
    (READY once drawn, GO, DONE once over with what ``after_end`` returned, CONT); ``before_done(region)``
    runs just before DONE, inside the bracket (on a GPU: the region's memory exported, so that DONE is the region's
    last word and the evaluator can stop the process and probe the GPU as soon as it comes). ``announce(region)``
    says READY instead of ``bell.ready``: with the region's inputs described (and on a GPU their memory), for
    the evaluator to write their values before GO. ``before_region()`` runs just before each region is opened, its
    inputs drawn and the L2 flushed (on a GPU, synchronised): the reference's quiet probe (``evaluate.protocol.quiet``)."""

    config = config.resolved(device)
    after_end = after_end or (lambda: None)
    host = host or HostLaunch()
    host.begin_round()
    announce = announce or (bell.ready if bell is not None else None)
    if config.method == "profiler":
        samples = []
        for region in range(trials):
            ready = [prepare() for _ in range(calls)]
            if bell is not None:
                announce(region)
                bell.wait(GO, region)
            samples.append(_profiled_region(ready) / calls)
            payload = after_end()
            if bell is not None:
                if before_done is not None:
                    before_done(region)
                bell.done(region, payload or b"")
                bell.wait(CONT, region)
        return samples
    cuda = device == "cuda"
    flush = _flush_buffer(device, config)
    samples: list[float] = []
    if cuda:
        samples = _time_regions_cuda(prepare, config, trials, calls, flush, after_end, host, fence, bell, before_done,
                                     announce, before_region)
    else:
        clock = bound.perf_counter_ns
        for region in range(trials):
            ready = [prepare() for _ in range(calls)]
            if flush is not None:
                flush.zero_()
            if before_region is not None:
                before_region()
            if bell is not None:
                announce(region)
                bell.wait(GO, region)
            begin = clock()
            _call_each(ready)
            end = clock()
            payload = after_end()
            if bell is not None:
                if before_done is not None:
                    before_done(region)
                bell.done(region, payload or b"")
                bell.wait(CONT, region)
            samples.append((end - begin) / 1e6 / calls)
            ready.clear()  # this region's inputs and outputs go before the next region draws its own
    return samples


def _call_each(calls: list[Callable[[], Any]]) -> None:
    # A function, so that no loop variable keeps the region's last call (its tensors) alive past it.
    for call in calls:
        call()


def _time_regions_cuda(prepare: Callable[[], Callable[[], Any]], config: TimingConfig, trials: int, calls: int,
                       flush: Any, after_end: Callable[[], bytes | None], host: HostLaunch, check_fence: bool,
                       bell: Any = None, before_done: Callable[[int], None] | None = None,
                       announce: Callable[[int], None] | None = None,
                       before_region: Callable[[], None] | None = None) -> list[float]:
    cuda, clock = bound.bind_cuda(), bound.perf_counter_ns
    stream_end = config.end_fence == "stream"
    cycles_per_us = _sm_clock_ghz() * 1e3
    # An empty region gives the fence's own lateness (the host's wake-up after the synchronise);
    # a region whose fence is later than that was followed by work the end event did not wait for.
    allowance_ms = _empty_fence_ms(int(config.hold_us * cycles_per_us)) * 2 + 0.005 if stream_end and check_fence else 0.0
    events = [[cuda.event(enable_timing=True) for _ in range(3)] for _ in range(trials)]
    # The host's time queueing each region's reads (``after_end``): when it outlasts what is left of the
    # hold, the GPU reaches the end event first and idles until the reads arrive, and the fence is that
    # much later with nothing left running. Not allowed for, a launch-bound call (microseconds a
    # region) would be timed to the fence in some rounds and not in others, its time moving tenfold.
    reads_ms: list[float] = []
    for region, (start, end, fence) in enumerate(events):
        ready = [prepare() for _ in range(calls)]
        reset_persisting_l2()  # persisting lines would survive the flush
        if flush is not None:
            flush.zero_()
        hold_us = host.hold_for(calls, config)
        cuda.synchronize()
        if before_region is not None:
            before_region()
        if bell is not None:
            announce(region)
            bell.wait(GO, region)
        if hold_us:
            cuda.sleep(int(hold_us * cycles_per_us))
        begin = clock()
        cuda.record(start)
        ready[0]()
        first = clock()
        _call_each(ready[1:])
        host.region((clock() - begin) / 1e3, calls, hold_us, (first - begin) / 1e3)
        if stream_end:
            cuda.record(end)
            reads = clock()
            payload = after_end()  # queued behind the end event: what the outputs hold when the region ended
            if bell is not None and before_done is not None:
                # The region's allocations handed over while its kernels still run, not after the synchronise:
                # what the harness does between the GPU's end and DONE is what a DONE sent by the candidate's code
                # could overlap with its kernels (``tails_us``, a few hundredths of a millisecond with the export there).
                before_done(region)
            reads_ms.append((clock() - reads) / 1e6)
            cuda.synchronize()
            synced = clock()
            cuda.record(fence)
        else:
            cuda.synchronize()
            synced = clock()
            cuda.record(fence)
            payload = after_end()
            if bell is not None and before_done is not None:
                before_done(region)
        if bell is not None:
            host.tails_us.append((clock() - synced) / 1e3)
            bell.done(region, payload or b"")
            bell.wait(CONT, region)
        ready.clear()  # this region's inputs and outputs go before the next region draws its own
    cuda.synchronize()
    samples = []
    for (start, end, fence), reads in zip(events, reads_ms or [0.0] * trials):
        to_fence = cuda.elapsed(start, fence)
        if stream_end:
            # Measured from the end event, not from the harness's reads after it: work left running on
            # another stream delays those reads too (it holds the SMs), and would hide behind them.
            # The reads are queued as the host gets to them, so an output still being written when the
            # first one runs is recorded unfinished: the fence catches work that outlasts them all.
            to_end = cuda.elapsed(start, end)
            fenced = check_fence and to_fence - to_end > allowance_ms + reads
            host.fenced += fenced
            samples.append(to_fence if fenced else to_end)
        else:
            samples.append(to_fence)
    return [sample / calls for sample in samples]


def _empty_fence_ms(hold_cycles: int, regions: int = 5, reads: int = 8) -> float:
    """The latest an empty region's fence came after its end event, in ms, with ``reads`` small
    gathers queued after the end as the records of a region queue theirs (``time_round``'s
    ``after_end``): what a region's fence may lag its end by with no work left running."""
    import torch

    cuda = bound.bind_cuda()
    source = torch.empty(1 << 20, device="cuda")
    index = torch.randint(0, 1 << 20, (16,), device="cuda")
    late = 0.0
    for _ in range(regions):
        start, end, fence = (cuda.event(enable_timing=True) for _ in range(3))
        cuda.synchronize()
        if hold_cycles:
            cuda.sleep(hold_cycles)
        cuda.record(start)
        cuda.record(end)
        for _ in range(reads):
            source[index]
        cuda.synchronize()
        cuda.record(fence)
        cuda.wait(fence)
        late = max(late, cuda.elapsed(end, fence))
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
    return bound.bind_cuda().synchronize if device == "cuda" else (lambda: None)


def flush_bytes(device: str, config: TimingConfig) -> int:
    """The bytes zeroed before each region to evict the caches (0: none)."""
    if not config.flush_l2:
        return 0
    return config.flush_bytes if device == "cuda" else min(config.flush_bytes, 64 * 1024 * 1024)


def _flush_buffer(device: str, config: TimingConfig):
    import torch

    size = flush_bytes(device, config)
    return torch.empty(size, dtype=torch.int8, device=device) if size else None


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


def _on_device(event: Any) -> bool:
    device_type = getattr(event, "device_type", None)
    return device_type is not None and str(device_type).endswith("CUDA")
