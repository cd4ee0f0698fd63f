"""The evaluator's clock against the worker's: what the region brackets (``evaluate.regions``) say about the
times a worker reported for its regions.

The outside time of a region is its calls plus a fixed overhead (the wake-ups, the hold, the
synchronise, the DONE itself), which the worker measures with a no-op call through the same
brackets before any candidate code is loaded (``Overhead``). A region whose time as the worker
reports it falls short of the outside time less that overhead by more than the policy allows is
a forged time (``judge``): the outside clock wins.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from cuda_agent.evaluate.regions import Bracket

# The worker's time exporting a region's allocations, just before DONE, is part of the region (the candidate's code
# could run then), less what looking up (a driver call or three) and exporting (a descriptor made) more allocations
# than the no-op regions did costs. Both are rare after a round's first region: the worker looks its allocations up
# before each region, while it draws the inputs. Generous against the measured costs (docs/SECURITY.md), so that a
# task with 6 GiB tensors (hundreds of 20 MiB allocations) is not failed by its first region.
CHECK_MS_PER_CHUNK = 0.01
EXPORT_MS_PER_CHUNK = 0.15


@dataclass(frozen=True)
class Overhead:
    """What the brackets add to a region beyond its calls, measured with a no-op call before any
    candidate code loaded: by the wall clock (less the run-queue wait) and by the timing thread's CPU
    time, medians, and each one's spread (robust standard deviation) over regions. The two spreads are
    kept apart: a host busy in bursts (the reference process loading beside the no-op regions) spreads
    the wall clock by milliseconds and the thread's CPU time hardly at all."""

    median_ms: float
    spread_ms: float
    regions: int
    hold_us: float  # the hold the calibration regions had (a region with another hold differs by that)
    cpu_ms: float = 0.0
    cpu_spread_ms: float = 0.0
    chunks: float = 0.0  # GPU: allocations a no-op region looked up at its end (median)
    new_chunks: float = 0.0  # GPU: allocations it exported anew (median)
    let_go_cpu_ms: float = 0.0  # the timing thread's CPU time from the let-go to GO (inputs written from outside)
    let_go_cpu_spread_ms: float = 0.0
    # GPU read from outside: the reference's probe after DONE (``Bracket.after_done_us``), its median and spread in
    # ms; 0 regions: not probed.
    after_done_ms: float = 0.0
    after_done_spread_ms: float = 0.0
    after_done_regions: int = 0
    # The harness's tail in the no-op regions, from the last synchronise to DONE (``timing.HostLaunch.tails_us``).
    tail_ms: float = 0.0

    def for_hold(self, hold_us: float) -> float:
        return self.median_ms + (hold_us - self.hold_us) / 1e3

    def export_ms(self, bracket: Bracket) -> float:
        """What looking up and exporting more allocations at the region's end than the no-op regions did adds to a
        region."""
        return (CHECK_MS_PER_CHUNK * max(0.0, bracket.looked_up - self.chunks)
                + EXPORT_MS_PER_CHUNK * max(0.0, bracket.new_chunks - self.new_chunks))

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v, 5) if isinstance(v, float) else v for k, v in asdict(self).items()}


def overhead(brackets: list[Bracket], inside_ms: list[float], hold_us: float, tail_ms: float = 0.0) -> Overhead:
    """From the no-op regions' brackets and the times the (still pristine) harness reported for them."""
    wall = [b.wall_ms - inside for b, inside in zip(brackets, inside_ms)]
    cpu = [b.cpu_ms - inside for b, inside in zip(brackets, inside_ms)]
    # The harness's own time is at least its CPU time. On a busy host (a 2-core machine while the reference
    # loads beside these regions) the run-queue wait is over-counted (a wait begun before GO counts whole),
    # which would understate the brackets' cost and make every later region look long.
    let_go = [b.let_go_cpu_ns / 1e6 for b in brackets]
    after = [b.after_done_us / 1e3 for b in brackets if b.probed_ns]
    return Overhead(max(statistics.median(wall), statistics.median(cpu)), robust_sd(wall), len(wall), hold_us,
                    statistics.median(cpu), robust_sd(cpu), statistics.median(b.looked_up for b in brackets),
                    statistics.median(b.new_chunks for b in brackets), statistics.median(let_go), robust_sd(let_go),
                    statistics.median(after) if after else 0.0, robust_sd(after), len(after), tail_ms)


@dataclass
class RegionClock:
    """The candidate's regions as its process reported them, against the evaluator's brackets.

    Per region, two lower bounds on the region's real length, each less the calibrated overhead: the
    bracket less the time the timing thread waited for a CPU (a busy host lengthens a bracket, not a
    region), and the CPU time the timing thread used within it (a thread runs at most as long as the
    wall clock; on a busy host this bound holds where the first loosens). Each bound is judged on its own,
    against its own limit (the calibration's spread of that bound): ``excess`` is the wall bound less the
    reported region, ``cpu_excess`` the CPU bound less it; honest regions sit at or below zero. A region
    whose work runs off the timing thread leaves the CPU bound loose and the wall bound to decide; a host
    busy in bursts while the brackets were calibrated leaves the wall bound loose and the CPU bound to
    decide. The judgement is on medians, so that a stall in a few regions is no forgery while a forgery
    in most regions is one. ``agreement``: the median of (bracket less wait and overhead) / reported,
    1.0 when the clocks agree."""

    regions: int = 0
    reported_ms: float = 0.0  # median reported region
    outside_ms: float = 0.0  # median bracket
    overhead_ms: float = 0.0
    excess_ms: float = 0.0  # median excess of the wall bound
    limit_ms: float = 0.0
    cpu_excess_ms: float = 0.0  # median excess of the CPU bound
    cpu_limit_ms: float = 0.0
    agreement: float = 1.0
    prep_ms: float = 0.0  # median prep (inputs drawn between regions)
    waited_ms: float = 0.0  # median run-queue wait of the timing thread within a bracket
    cpu_ms: float = 0.0  # median CPU time of the timing thread within a bracket
    noise_ms: float = 0.0  # the tighter bound's allowance for the calibration's spread (3 x that spread)
    chunks: float = 0.0  # GPU: median allocations a region looked up at its end
    let_go_ms: float = 0.0  # inputs written from outside: median time from letting the worker go to GO (unbracketed)
    let_go_cpu_ms: float = 0.0  # and the timing thread's median CPU time meanwhile (in the CPU bound on the CPU backend)
    # Where the let-go's CPU time is not in the CPU bound (a GPU): its median over the no-op regions', and the limit
    # (as each bound's: slack and region_us, plus three times its spread in the calibration); 0: not judged apart.
    let_go_excess_ms: float = 0.0
    let_go_limit_ms: float = 0.0
    # GPU read from outside: the reference's probe once the worker was stopped after DONE waited for what the region
    # left on the GPU (median; its excess over the no-op regions' and the limit, as each bound's; 0: not judged),
    # and the median time from the region's last datagram to the probe, where work could end unseen.
    after_done_ms: float = 0.0
    after_done_excess_ms: float = 0.0
    after_done_limit_ms: float = 0.0
    blind_ms: float = 0.0
    asked_ms: float = 0.0  # of it, the median time before the evaluator asked the reference for the probe
    # Where the probe is judged: the wall bound's median excess with the probe's (where positive) added, against
    # the wall bound's limit. A DONE sent early shortens the bracket by what it leaves and the probe finds that
    # again, less the blind window: so a forged report gains at most that window over the wall bound's limit, not
    # the window and the probe's limit too (0.79 of a 0.52 ms region before).
    past_done_excess_ms: float = 0.0
    # Past this the outside clock's time is taken over the reported one (``outside_factor``): the wall limit less
    # its slack where the outside clock wins within the limit (``TimingConfig.outside_wins``), else the limit.
    tolerance_ms: float = 0.0
    # Where the GPU is probed after DONE: the harness's tail after its last synchronise (``Overhead.tail_ms``). A DONE
    # the candidate's code sends itself before the kernels end skips it (the calibration takes it off every bracket).
    tail_ms: float = 0.0

    @property
    def breached(self) -> str | None:
        """Which bound the reported regions fall short of: "wall" (checked first), "after-done" (GPU work left
        running past the region's DONE), "past-done" (the wall bound with that work added), "cpu", "let-go" (work
        done between the let-go and GO), or None."""
        if self.excess_ms > self.limit_ms:
            return "wall"
        if self.after_done_limit_ms > 0 and self.after_done_excess_ms > self.after_done_limit_ms:
            return "after-done"
        if self.after_done_limit_ms > 0 and self.past_done_excess_ms > self.limit_ms:
            return "past-done"
        if self.cpu_excess_ms > self.cpu_limit_ms:
            return "cpu"
        return "let-go" if self.let_go_limit_ms > 0 and self.let_go_excess_ms > self.let_go_limit_ms else None

    @property
    def ok(self) -> bool:
        return self.breached is None

    @property
    def spread_share(self) -> float:
        """The tighter bound's allowance for the calibration's own spread (3 x spread), as a share of the
        median reported region: how much of a region the brackets cannot resolve on this host now."""
        return self.noise_ms / self.reported_ms if self.reported_ms > 0 else 0.0

    @property
    def margin(self) -> float:
        """The shortest reported region the tighter bound still lets pass, as a share of the reported one
        less than 1: what a forgery can take off a region undetected. Where the GPU is probed after DONE, a region
        that says DONE early (its timing thread asleep in a blocking synchronise: the CPU bound loose) can take off
        the wall bound's room past what its probes found, the blind window and the harness's tail besides (red team
        done-sent-late-gpu, H200: its bracket 0.11 ms short of an honest one with 0.04 ms of blind window)."""
        if self.reported_ms <= 0:
            return 0.0
        wall = self.tolerance_ms or self.limit_ms  # what the wall bound lets a report take off undetected, or uncorrected
        room = min(wall - self.excess_ms, self.cpu_limit_ms - self.cpu_excess_ms)
        if self.after_done_limit_ms > 0:
            room = max(room, wall - self.past_done_excess_ms + self.blind_ms + self.tail_ms)
        return room / self.reported_ms

    @property
    def outside_factor(self) -> float:
        """What the candidate's times are multiplied by so that they are the outside clock's: 1 + the wall bound's
        excess (with what the probe after DONE found, where judged) past ``tolerance_ms``, over the reported
        region. 1.0 where the two agree within the tolerance."""
        if self.reported_ms <= 0 or not self.tolerance_ms:
            return 1.0
        return 1.0 + max(0.0, max(self.excess_ms, self.past_done_excess_ms) - self.tolerance_ms) / self.reported_ms

    def to_dict(self) -> dict[str, Any]:
        short = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        return short | {"ok": self.ok, "margin": round(self.margin, 5), "spread_share": round(self.spread_share, 5),
                        "outside_factor": round(self.outside_factor, 5)}


def judge(brackets: list[Bracket], reported_ms: list[float], cost: Overhead, hold_us: float, slack: float,
          region_us: float, let_go_apart: bool = False, outside_wins: bool = False) -> RegionClock:
    """``reported_ms[i]``: the region of ``brackets[i]`` as the worker reported it (time per call x calls).
    Each bound's limit: ``slack`` of the reported region plus ``region_us`` plus three times that bound's
    spread in the calibration (what the brackets alone move it by on this host). ``let_go_apart``: the timing
    thread's CPU time between the let-go and GO is not in the CPU bound and is judged on its own.
    ``outside_wins``: the wall bound's excess past ``region_us`` and three times its spread (no slack) is
    taken into the candidate's times (``RegionClock.outside_factor``)."""
    fixed = cost.for_hold(hold_us)
    wall = [b.wall_ms - fixed - cost.export_ms(b) - r for b, r in zip(brackets, reported_ms)]
    # A longer hold than the calibration's may be spent spinning on the timing thread; a shorter one is not
    # taken off (it may have been spent asleep).
    cpu_fixed = cost.cpu_ms + max(0.0, hold_us - cost.hold_us) / 1e3
    cpu = [b.cpu_ms - cpu_fixed - cost.export_ms(b) - r for b, r in zip(brackets, reported_ms)]
    reported = statistics.median(reported_ms)
    ratios = [(b.wall_ms - fixed - cost.export_ms(b)) / r for b, r in zip(brackets, reported_ms) if r > 0]
    base = slack * reported + region_us / 1e3
    let_go_cpu = statistics.median(b.let_go_cpu_ns / 1e6 for b in brackets)
    probed = [b for b in brackets if b.probed_ns]
    after = statistics.median(b.after_done_us / 1e3 for b in probed) if probed else 0.0
    after_judged = bool(probed) and cost.after_done_regions > 0
    return RegionClock(len(brackets), reported, statistics.median(b.outside_ms for b in brackets), fixed,
                       statistics.median(wall), base + 3 * cost.spread_ms, statistics.median(cpu),
                       base + 3 * cost.cpu_spread_ms, statistics.median(ratios) if ratios else 1.0,
                       statistics.median(b.prep_ms for b in brackets), statistics.median(b.waited_ns / 1e6 for b in brackets),
                       statistics.median(b.cpu_ms for b in brackets), 3 * min(cost.spread_ms, cost.cpu_spread_ms),
                       statistics.median(b.looked_up for b in brackets),
                       let_go_ms=statistics.median(b.let_go_ns / 1e6 for b in brackets),
                       let_go_cpu_ms=let_go_cpu,
                       let_go_excess_ms=let_go_cpu - cost.let_go_cpu_ms if let_go_apart else 0.0,
                       let_go_limit_ms=base + 3 * cost.let_go_cpu_spread_ms if let_go_apart else 0.0,
                       after_done_ms=after,
                       after_done_excess_ms=after - cost.after_done_ms if after_judged else 0.0,
                       after_done_limit_ms=base + 3 * cost.after_done_spread_ms if after_judged else 0.0,
                       blind_ms=statistics.median(b.blind_ms for b in probed) if probed else 0.0,
                       asked_ms=statistics.median(b.asked_ms for b in probed) if probed else 0.0,
                       # The two medians as recorded in every result (benchmarks/results), what was replayed.
                       past_done_excess_ms=statistics.median(wall) + max(0.0, after - cost.after_done_ms)
                       if after_judged else 0.0,
                       tolerance_ms=region_us / 1e3 + 3 * cost.spread_ms if outside_wins else 0.0,
                       tail_ms=cost.tail_ms if after_judged else 0.0)


def robust_sd(values: list[float]) -> float:
    """1.4826 x the median absolute deviation; for two values, their distance over sqrt(2)."""
    if len(values) < 2:
        return 0.0
    if len(values) == 2:
        return abs(values[0] - values[1]) / 2 ** 0.5
    middle = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - middle) for v in values)
