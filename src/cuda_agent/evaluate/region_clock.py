"""The evaluator's own clock of a candidate's timed regions: the time a reward is computed from.

A region, as the evaluator sees it (``span_ms``), runs from the moment the worker is let go with the
region's inputs written (GO where nothing is written) to the moment its work is seen done from outside: on a
GPU read from outside, the end of a probe kernel the reference launches once the candidate's processes are
stopped after DONE (the GPU runs one context at a time, so the probe waits for whatever any of them left
queued); elsewhere the worker's DONE. On the CPU backend a region is that span less the time the worker's timing
thread waited for a CPU in it (the kernel's account, read from outside). Never shorter than the time that thread
was runnable (on the CPU backend: ran) from the let-go to its stop after DONE. The brackets' own cost in the same
terms is measured with no-op regions before any candidate code loads (``Overhead``); a region's time is its span
less that cost (``times``).

What the candidate's process reports for its regions is a diagnostic (``RegionClock.agreement``). What the
outside clock cannot see is stated in every result (``RegionClock.allowance``): on a GPU, the window between DONE
and the probe's launch, where work that runs and ends is not seen. So is how far the calibrated cost may be off
(``RegionClock.uncertainty``), which the candidate cannot steer (it was measured before its code loaded) but
which moves its time.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from cuda_agent.evaluate.protocol.regions import Bracket

# The worker's time exporting a region's allocations, just before DONE, is part of the region (the candidate's code
# could run then), less what looking up (a driver call or three) and exporting (a descriptor made) more allocations
# than the no-op regions did costs. Both are rare after a round's first region: the worker looks its allocations up
# before each region, while it draws the inputs. Generous against the measured costs (docs/SECURITY.md), so that a
# task with 6 GiB tensors (hundreds of 20 MiB allocations) is not failed by its first region.
CHECK_MS_PER_CHUNK = 0.01
EXPORT_MS_PER_CHUNK = 0.15
# The shortest time a region is taken to last: a region whose span is within the calibrated cost's noise of it is
# below what the clock resolves (the allowance then refuses the evaluation), never a zero or negative time.
FLOOR_MS = 1e-4


def span_ms(bracket: Bracket, less_waits: bool = False) -> float:
    """One region's length by the evaluator's clock, its cost included (module docstring). On a GPU a region's time
    is wall time, as the baselines' is (they are timed by the reference's clock, which a busy host slows alike); with
    ``less_waits`` it is without the timing thread's run-queue waits: the CPU backend's regions (``times``), and the
    no-op regions that measure the brackets' own cost, which ran beside the reference process's start and whose waits
    say nothing of the brackets. Never shorter than the timing thread's CPU time from the let-go to its stop."""
    start_ns = bracket.go_ns - bracket.let_go_ns
    end_ns = bracket.done_ns
    if bracket.probed_ns:
        end_ns = max(end_ns, bracket.probed_ns + int(bracket.after_done_us * 1e3))
    waits = bracket.waited_ns + bracket.let_go_waited_ns if less_waits else 0
    # The timing thread was runnable (running, or waiting for a CPU) this long from the let-go to its stop: work it did
    # after DONE (a hook on the harness's own thread) is in it, at the wall time it took on this host.
    runnable = bracket.thread_cpu_ns + (0 if less_waits else bracket.thread_waited_ns)
    return max((end_ns - start_ns - waits) / 1e6, runnable / 1e6)


@dataclass(frozen=True)
class Overhead:
    """What the brackets add to a region beyond its calls, measured with no-op regions before any candidate code
    loaded: the median of (``span_ms`` less the no-op's own reported time) and its spread (robust standard
    deviation) over regions; on a GPU the median window from DONE to the probe's launch."""

    median_ms: float
    spread_ms: float
    regions: int
    hold_us: float  # the hold the calibration regions had (a region with another hold differs by that)
    chunks: float = 0.0  # GPU: allocations a no-op region looked up at its end (median)
    new_chunks: float = 0.0  # GPU: allocations it exported anew (median)
    blind_ms: float = 0.0  # GPU read from outside: DONE to the probe's launch (median; 0: not probed)
    after_done_ms: float = 0.0  # and the probe's own wait
    # The harness's tail in the no-op regions, from the last synchronise to DONE (``timing.HostLaunch.tails_us``).
    tail_ms: float = 0.0
    cpu_ms: float = 0.0  # the timing thread's CPU time in a no-op region (median), of the let-go to its stop

    def for_hold(self, hold_us: float) -> float:
        return self.median_ms + (hold_us - self.hold_us) / 1e3

    def export_ms(self, bracket: Bracket) -> float:
        """What looking up and exporting more allocations at the region's end than the no-op regions did adds to a
        region."""
        return (CHECK_MS_PER_CHUNK * max(0.0, bracket.looked_up - self.chunks)
                + EXPORT_MS_PER_CHUNK * max(0.0, bracket.new_chunks - self.new_chunks))

    @property
    def error_ms(self) -> float:
        """How far the calibrated median may be from the cost it estimates: three standard errors of a median."""
        return 3 * 1.2533 * self.spread_ms / math.sqrt(self.regions) if self.regions else 0.0

    @property
    def allowance_ms(self) -> float:
        """What a region's work could hide from the outside clock: the window before the probe (GPU)."""
        return self.blind_ms

    def region_ms_for(self, allowance: float, uncertainty: float, resolution: float) -> float:
        """The shortest region whose allowance, uncertainty and resolution (spread) are at most these shares of it."""
        return max(self.allowance_ms / allowance, self.error_ms / uncertainty, self.spread_ms / resolution)

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v, 5) if isinstance(v, float) else v for k, v in asdict(self).items()}


def overhead(brackets: list[Bracket], inside_ms: list[float], hold_us: float, tail_ms: float = 0.0) -> Overhead:
    """From the no-op regions' brackets and the times the (still pristine) harness reported for them."""
    spans = [span_ms(b, less_waits=True) - inside for b, inside in zip(brackets, inside_ms)]
    probed = [b for b in brackets if b.probed_ns]
    return Overhead(statistics.median(spans), robust_sd(spans), len(spans), hold_us,
                    statistics.median(b.looked_up for b in brackets),
                    statistics.median(b.new_chunks for b in brackets),
                    statistics.median(b.blind_ms for b in probed) if probed else 0.0,
                    statistics.median(b.after_done_us / 1e3 for b in probed) if probed else 0.0, tail_ms,
                    statistics.median(b.thread_cpu_ns / 1e6 for b in brackets))


def times(brackets: list[Bracket], cost: Overhead, hold_us: float, less_waits: bool = False) -> list[float]:
    """Each region's time by the evaluator's clock, in ms: its span less the brackets' calibrated cost; ``less_waits``
    (the CPU backend): less the timing thread's run-queue waits too, by the kernel's account. There the thread is
    the only one of the candidate's that computes (``sandbox.nothreads``) and computes nothing while it waits, so
    other work on the host costs the candidate nothing; on a GPU its work runs on while its host thread waits."""
    fixed = cost.for_hold(hold_us)
    if not less_waits:
        return [max(FLOOR_MS, span_ms(b) - fixed - cost.export_ms(b)) for b in brackets]
    # Where the thread's CPU time is what bounds a region (work after DONE), only the no-op regions' CPU time is the
    # brackets': the rest of their cost (wake-ups, the evaluator's own steps) is none of the thread's CPU time.
    return [max(FLOOR_MS, span_ms(b, less_waits) - fixed - cost.export_ms(b), b.thread_cpu_ns / 1e6 - cost.cpu_ms)
            for b in brackets]


@dataclass
class RegionClock:
    """The candidate's regions by the evaluator's clock (what its reward is computed from), beside what its process
    reported for them (a diagnostic). ``allowance``: the share of a region the outside clock leaves unseen
    (``Overhead.allowance_ms`` over the median region); ``uncertainty``: how far the calibrated cost may be off, as
    a share; ``resolution``: the calibrated cost's spread over the median region (how precisely one region is
    timed). All three are stated in every result."""

    regions: int = 0
    outside_ms: float = 0.0  # median region by the evaluator's clock
    reported_ms: float = 0.0  # median region as the candidate's process reported it
    overhead_ms: float = 0.0
    spread_ms: float = 0.0
    allowance_ms: float = 0.0
    error_ms: float = 0.0
    agreement: float = 1.0  # median of outside / reported: 1.0 where the two clocks agree
    prep_ms: float = 0.0  # median prep (inputs drawn between regions)
    waited_ms: float = 0.0  # median run-queue wait of the timing thread within a region
    cpu_ms: float = 0.0  # median CPU time of the timing thread within a region (let-go to stop)
    chunks: float = 0.0  # GPU: median allocations a region looked up at its end
    let_go_ms: float = 0.0  # inputs written from outside: median time from letting the worker go to GO
    # GPU read from outside: the probe after each DONE, its median wait, the median window from DONE to its launch
    # (of it, the time before the evaluator asked for it).
    after_done_ms: float = 0.0
    blind_ms: float = 0.0
    asked_ms: float = 0.0

    @property
    def allowance(self) -> float:
        return self.allowance_ms / self.outside_ms if self.outside_ms > 0 else 1.0

    @property
    def uncertainty(self) -> float:
        return self.error_ms / self.outside_ms if self.outside_ms > 0 else 1.0

    @property
    def resolution(self) -> float:
        return self.spread_ms / self.outside_ms if self.outside_ms > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        short = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        return short | {"allowance": round(self.allowance, 5),
                        "uncertainty": round(self.uncertainty, 5), "resolution": round(self.resolution, 5)}


def judge(brackets: list[Bracket], reported_ms: list[float], cost: Overhead, hold_us: float,
          less_waits: bool = False) -> RegionClock:
    """``reported_ms[i]``: the region of ``brackets[i]`` as the worker reported it (time per call x calls)."""
    outside = times(brackets, cost, hold_us, less_waits)
    probed = [b for b in brackets if b.probed_ns]
    ratios = [o / r for o, r in zip(outside, reported_ms) if r > 0]
    return RegionClock(len(brackets), statistics.median(outside), statistics.median(reported_ms),
                       cost.for_hold(hold_us), cost.spread_ms, cost.allowance_ms, cost.error_ms,
                       statistics.median(ratios) if ratios else 1.0,
                       statistics.median(b.prep_ms for b in brackets),
                       statistics.median(b.waited_ns / 1e6 for b in brackets),
                       statistics.median(b.thread_cpu_ns / 1e6 for b in brackets),
                       statistics.median(b.looked_up for b in brackets),
                       statistics.median(b.let_go_ns / 1e6 for b in brackets),
                       statistics.median(b.after_done_us / 1e3 for b in probed) if probed else 0.0,
                       statistics.median(b.blind_ms for b in probed) if probed else 0.0,
                       statistics.median(b.asked_ms for b in probed) if probed else 0.0)


def robust_sd(values: list[float]) -> float:
    """1.4826 x the median absolute deviation; for two values, their distance over sqrt(2)."""
    if len(values) < 2:
        return 0.0
    if len(values) == 2:
        return abs(values[0] - values[1]) / 2 ** 0.5
    middle = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - middle) for v in values)
