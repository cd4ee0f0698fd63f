"""Interleaved timing rounds and the noise-aware reward decision (runs in the evaluator).

A speedup is a ratio of two times measured in two processes. Timing one side
after the other lets a slow spell of the machine (clocks, another tenant, the
host) fall on one side only: the same candidate then earned rewards 1 and 3 in
turn. Here every round times every side (candidate, eager, torch.compile) for a
short while, in a rotating order, and gives one speedup per round; the rounds'
log-speedups give an estimate (their geometric mean) and a Student-t interval.
While an interval straddles a reward line (1/0.95 for the milestone reward),
more rounds run, within a budget; the result records the interval and whether
the decision was confident.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from cuda_agent.evaluate.region_clock import robust_sd
from cuda_agent.evaluate.protocol.policy import Policy, TimingConfig
from cuda_agent.evaluate.reward import beats, milestone, reward_line
from cuda_agent.evaluate.protocol.timing import TimingStats

# A side times ``trials`` regions of ``calls`` calls each, its call indices starting at ``first``,
# and returns one sample (ms per call) per region.
Side = Callable[[int, int, int], list[float]]


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on its CDF)."""
    if df < 1:
        raise ValueError("t_quantile needs at least 1 degree of freedom.")
    low, high = 0.0, 1e3
    for _ in range(200):
        mid = (low + high) / 2
        if _t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
    return (low + high) / 2 if p >= 0.5 else -t_quantile(1 - p, df)


def _t_cdf(t: float, df: int) -> float:
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2, 0.5, x)
    return 1 - tail if t >= 0 else tail


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) (continued fraction, modified Lentz)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1) / (a + b + 2):
        return 1 - _betainc(b, a, 1 - x)
    tiny = 1e-300
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            numerator = 1.0
        elif i % 2 == 0:
            numerator = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            numerator = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1 + numerator * d
        d = 1 / (d if abs(d) > tiny else tiny)
        c = 1 + numerator / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1 - c * d) < 1e-12:
            break
    return front * (f - 1) / a


@dataclass(frozen=True)
class Speedup:
    """One speedup (baseline time over candidate time) with its interval and its reward line."""

    baseline: str
    estimate: float  # geometric mean of the rounds' speedups
    low: float
    high: float
    rounds: int
    line: float | None  # the speedup the reward asks for (1 / beat_factor); None: no line
    confidence: float

    @property
    def beats(self) -> bool:
        return beats(self.estimate, self.line)

    @property
    def confident(self) -> bool:
        """The whole interval lies on one side of the line: more rounds would not change the decision
        (at the stated confidence)."""
        return self.line is None or self.low > self.line or self.high < self.line

    def to_dict(self) -> dict[str, object]:
        return asdict(self) | {"beats": self.beats, "confident": self.confident}


def speedup(baseline: str, ratios: list[float], line: float | None, confidence: float) -> Speedup:
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = 0.0
    if len(logs) > 1:
        half = t_quantile((1 + confidence) / 2, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return Speedup(baseline, math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(logs), line, confidence)


def settled(speedups: dict[str, Speedup], reward_of: Callable[[dict[str, bool]], float]) -> bool:
    """Whether more rounds could still change the reward: every outcome an unconfident interval
    allows (beats its line or not) gives the same reward. Beating torch.compile decides nothing
    while eager is confidently not beaten, so no rounds are spent on it."""
    options = [[s.beats] if s.confident else [True, False] for s in speedups.values()]
    return len({reward_of(dict(zip(speedups, combo))) for combo in itertools.product(*options)}) == 1


BASELINES = ("eager", "compile")


def speedups(rounds: "Rounds", policy: Policy, timing: TimingConfig) -> dict[str, Speedup]:
    """The candidate's speedup over each baseline timed (or fixed) in ``rounds``, against the reward's line."""
    return {side: speedup(side, rounds.ratios(side), reward_line(policy), timing.confidence)
            for side in BASELINES if (rounds.count(side) or side in rounds.fixed) and rounds.count("candidate")}


def reward_settled(speedups: dict[str, Speedup]) -> bool:
    """No outcome the intervals still allow changes the reward."""
    return settled(speedups, lambda beats: milestone(beats.get("eager", False), beats.get("compile", False)))


@dataclass(frozen=True)
class Plan:
    """How one side is timed in every round: ``trials`` regions of ``calls`` calls each."""

    trials: int
    calls: int

    @classmethod
    def for_call(cls, estimate_ms: float, config: TimingConfig, call_ms: float = 0.0, call_bytes: int = 0,
                 device_bytes: int = 0) -> "Plan":
        """From a call's warm-up wall time (input draw and a synchronise included) and, where known, the
        call's own time: calls shorter than ``region_ms`` are grouped so that a region's calls last about
        ``region_ms``, and a round lasts about ``round_ms`` per side, draws included. A side's word on its call
        only sizes its regions: a shorter one gives it longer regions, which the outside clock resolves
        better; a longer one shorter regions, which it may refuse to judge (``region_spread_max``). A region's
        calls stay alive together: ``call_bytes`` (a call's inputs and output, as the reference found them) caps
        them at ``region_bytes``. Without it a candidate whose timed calls return at once would claim 100 calls a
        region of 2 GiB each, and the reference's empty round, which mirrors its plan, would run out of GPU memory:
        an ``error`` where the verdict is ``incorrect``. On a GPU (``device_bytes``: its memory) the cap is
        ``region_memory_share`` of it where that is more: with one 2 GiB call a region, cuda_gelu's 0.52 ms
        regions would leave the outside clock's fixed window a large share of each to forge (docs/SECURITY.md)."""
        alone = call_ms if 0 < call_ms <= estimate_ms else estimate_ms
        calls = 1 if alone >= config.region_ms else min(config.max_calls, math.ceil(config.region_ms / alone))
        if call_bytes > 0:
            cap = max(config.region_bytes, int(config.region_memory_share * device_bytes))
            calls = max(1, min(calls, cap // call_bytes))
        low, high = config.round_trials
        trials = max(low, min(high, round(config.round_ms / (estimate_ms * calls))))
        return cls(trials, calls)


@dataclass
class Rounds:
    """Samples per side and round; speedups are taken per round and pooled over rounds."""

    samples: dict[str, list[list[float]]] = field(default_factory=dict)
    fixed: dict[str, float] = field(default_factory=dict)  # baselines taken from the cache: median ms

    def add(self, side: str, samples: list[float]) -> None:
        self.samples.setdefault(side, []).append(samples)

    def count(self, side: str) -> int:
        return len(self.samples.get(side, []))

    def scaled(self, side: str, factor: float) -> "Rounds":
        """These rounds with every sample of ``side`` multiplied by ``factor``."""
        samples = dict(self.samples) | {side: [[s * factor for s in r] for r in self.samples.get(side, [])]}
        return Rounds(samples, dict(self.fixed))

    def medians(self, side: str) -> list[float]:
        return [statistics.median(r) for r in self.samples.get(side, [])]

    def stats(self, side: str, method: str) -> TimingStats:
        return TimingStats.from_samples(method, [s for r in self.samples[side] for s in r])

    def spread(self, side: str) -> float:
        """The CV of a side's per-round medians: how much its time moved between rounds."""
        medians = self.medians(side)
        return statistics.pstdev(medians) / statistics.fmean(medians) if len(medians) > 1 else 0.0

    def ratios(self, baseline: str, candidate: str = "candidate") -> list[float]:
        own = self.medians(candidate)
        base = self.medians(baseline) if baseline not in self.fixed else [self.fixed[baseline]] * len(own)
        return [b / c for b, c in zip(base, own) if b > 0 and c > 0]


def run_rounds(sides: dict[str, Side], plans: dict[str, Plan], config: TimingConfig,
               undecided: Callable[[Rounds], bool], rounds: Rounds | None = None,
               on_round: Callable[[int, Rounds], None] | None = None) -> Rounds:
    """Time every side once per round, in a rotating order, for at least ``rounds_min`` rounds and
    while ``undecided(rounds)`` holds, up to ``rounds_max`` rounds and ``budget_s`` seconds."""
    rounds = rounds or Rounds()
    started = time.monotonic()
    names = list(sides)
    next_call = {name: 0 for name in names}
    for number in range(config.rounds_max):
        if number >= config.rounds_min and (not undecided(rounds) or time.monotonic() - started > config.budget_s):
            break
        shift = number % len(names)
        for name in names[shift:] + names[:shift]:
            plan = plans[name]
            rounds.add(name, sides[name](next_call[name], plan.trials, plan.calls))
            next_call[name] += plan.trials * plan.calls
        if on_round:
            on_round(number + 1, rounds)
    return rounds


@dataclass(frozen=True)
class ClockCheck:
    """The candidate's timing as its own process reported it, against the evaluator's clock.

    The evaluator times each of the candidate's rounds from outside (request sent to reply read),
    and rounds of the same plan with the calls left out in the trusted reference process (input
    draws, flushes, holds, records and replies alone). What the outside clock saw beyond those and
    beyond the regions the candidate reported is ``unexplained``: a candidate that reports regions
    shorter than they were (a timer patched below Python, however) leaves the difference there.
    """

    rounds: int
    claimed_ms: float  # median over rounds of the regions the candidate reported (time per call x calls)
    wall_ms: float  # median over rounds of the outside clock's time of the round
    empty_ms: float  # the median round with the calls left out
    unexplained_ms: float
    limit_ms: float
    scatter_ms: float = 0.0
    harness_ms: list[float] = field(default_factory=list)  # each round: outside clock minus reported regions
    empties_ms: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.unexplained_ms <= self.limit_ms

    @property
    def decisive(self) -> bool:
        """Whether the clock resolves the reported regions at all: a report that hid as much again as
        it claimed would exceed the limit. A launch-bound call's rounds report well under a
        millisecond against a harness that moves by 10-20 ms between processes (enough to put an honest
        launch-bound candidate over the limit), so there only a gross excess is judged."""
        return self.claimed_ms > self.limit_ms

    @property
    def gross(self) -> bool:
        return self.unexplained_ms > CLOCK_GROSS * self.limit_ms

    def to_dict(self) -> dict[str, object]:
        def short(value: object) -> object:
            if isinstance(value, float):
                return round(value, 4)
            return [short(v) for v in value] if isinstance(value, list) else value
        return {k: short(v) for k, v in asdict(self).items()} | {"ok": self.ok}


CLOCK_GROSS = 3.0  # an excess this many times the limit is judged even where the clock is not decisive


def clock_check(walls_ms: list[float], claimed_ms: list[float], empty_ms: list[float], trials: int,
                config: TimingConfig) -> ClockCheck:
    """``walls_ms[r]`` and ``claimed_ms[r]`` of each candidate round; ``empty_ms``: rounds of the same
    plan without the calls. Medians on both sides (a slow spell in one round is not a forgery; a
    forgery in most rounds shows in the median). The limit is the policy's share of the reported time,
    an allowance per region, ``clock_noise`` times the rounds' own scatter (robust standard deviation
    of each side's harness time) and a share of the harness's own time: a machine whose harness time
    wanders (a busy CPU host) cannot be held to microseconds."""
    harness = [w - c for w, c in zip(walls_ms, claimed_ms)]
    unexplained = statistics.median(harness) - statistics.median(empty_ms)
    claimed = statistics.median(claimed_ms)
    scatter = max(robust_sd(harness), robust_sd(empty_ms))
    limit = (config.clock_slack * claimed + config.clock_trial_us * trials / 1e3 + config.clock_noise * scatter
             + config.clock_harness_share * statistics.median(empty_ms))
    return ClockCheck(len(walls_ms), claimed, statistics.median(walls_ms), statistics.median(empty_ms),
                      unexplained, limit, scatter, harness, list(empty_ms))


def other_threads_ms(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]],
                     main: int) -> tuple[float, list[tuple[float, str, int]]]:
    """CPU milliseconds between two readings of a process tree's threads (``sandbox.proctree.tree_thread_cpu``):
    the ``main`` thread's, and (ms, name, tid) of every other thread present in both, busiest last."""
    main_ms = (after.get(main, ("", 0))[1] - before.get(main, ("", 0))[1]) / 1e6
    others = sorted(((after[tid][1] - ran) / 1e6, name, tid) for tid, (name, ran) in before.items()
                    if tid != main and tid in after)
    return main_ms, others
