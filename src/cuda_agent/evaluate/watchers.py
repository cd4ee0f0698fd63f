"""Watchers: each looks at the candidate (its process from outside, or what its run left) at the fixed
points where the pipeline asks, and answers with the breaches it found, each under a rule name of
``guard.policy``. They stop nothing themselves: ``stop_on`` turns the first breach into the ``Stop``
that fails the candidate at the stage the pipeline names."""

from __future__ import annotations

import contextlib
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Protocol

from cuda_agent.evaluate.protocol.channel import Channel, Stop
from cuda_agent.evaluate.decide import clock_check, other_threads_ms
from cuda_agent.evaluate.plausibility import MemorySystem, below_speed_of_light, memory_system
from cuda_agent.evaluate.protocol.policy import Policy, TimingConfig
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.guard.attribution import Attribution, coverage_reason, decoy_reason, stream_reason
from cuda_agent.guard.integrity import IntegrityWatch
from cuda_agent.guard.policy import RULES

# CPU time a thread of the candidate's process that existed before its code loaded (not the one that
# calls it) may use while it is timed on a GPU: this much, or this share of the calling thread's, whichever
# is more (BorrowedThreads). Both sit well above what legitimate candidates' pre-existing threads use, with other
# evaluations on the machine too (torch's CPU pool spinning after the harness's own CPU work): docs/CONSTANTS.md.
BORROWED_THREAD_MS = 50.0
BORROWED_THREAD_SHARE = 0.25


@dataclass(frozen=True)
class Breach:
    """What a watcher found: the rule broken and the reason the result gives."""

    rule: str
    reason: str

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown rule {self.rule!r}; rules are listed in cuda_agent.guard.RULES")


class Watcher(Protocol):
    def check(self, stage: str, when: str) -> list[Breach]:
        """The breaches seen now; ``when`` says what the candidate was doing since the last look."""
        ...


def stop_on(stage: str, when: str, *watchers: Watcher) -> None:
    """Ask each watcher in turn; the first breach fails the candidate at ``stage``."""
    for watcher in watchers:
        found = watcher.check(stage, when)
        if found:
            raise Stop("failed", stage, found[0].reason, rule=found[0].rule)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class Signals:
    """Signal handlers of the candidate's processes, read from outside, against those before its code
    loaded: the harness installs none after that, so a new one is the candidate's. A fault handler is
    how an output can be computed only when something reads it (``PROT_NONE`` pages filled on
    access, after the timed region); seccomp refuses ``userfaultfd``, the other way."""

    def __init__(self, candidate: Channel):
        self.candidate = candidate
        self.before = candidate.worker.signal_handlers()

    def check(self, stage: str, when: str) -> list[Breach]:
        added = {signal_number for pid, mask in self.candidate.worker.signal_handlers().items() if pid in self.before
                 for signal_number in range(1, 65) if mask & ~self.before[pid] & (1 << (signal_number - 1))}
        if not added:
            return []
        names = ", ".join(_signal_name(n) for n in sorted(added))
        return [Breach("signal-handler", f"the candidate's process installed a handler for {names} {when}, seen from "
                       "outside it; a solution handles no signals")]


class NewThreads:
    """Threads of the candidate's process tree, counted from outside, against ``before`` (those there
    when the watch began): the worker starts the threads torch, the runtime and the profiler start on
    first use before its first request (``worker.warm_up_runtime``), so a thread that appears later is
    the candidate's, whatever its name. The in-process check trusts runtime-like names; this one trusts
    none, and does not depend on which thread wins a race (a helper that finishes an output after
    forward returned can beat the records' read on a busy machine)."""

    def __init__(self, candidate: Channel, before: dict[int, str] | None = None):
        self.candidate = candidate
        self.before = candidate.worker.threads() if before is None else before

    def check(self, stage: str, when: str) -> list[Breach]:
        started = {tid: name for tid, name in self.candidate.worker.threads().items() if tid not in self.before}
        if not started:
            return []
        names = ", ".join(sorted(set(started.values())))
        return [Breach("thread", f"{len(started)} thread(s) or process(es) started {when}, seen from "
                       f"outside the candidate's process ({names})")]


class BorrowedThreads:
    """CPU time, read from outside, of the candidate's threads that existed before its code loaded,
    over its timing rounds. A new thread fails anyway (``NewThreads``); one of the harness's own (the
    CUDA runtime's, torch's pool) could be handed work that ends after the end event. On a GPU the
    harness gives them none while it times (inputs are drawn on the device), so one that ran more than
    ``BORROWED_THREAD_MS``, and more than ``BORROWED_THREAD_SHARE`` of the calling thread's time, fails
    as ``thread``. That catches work of a size, not a few launches (the calling thread's own time
    includes its waits for the GPU). On the CPU backend torch's pool draws the inputs, so the figures
    are recorded only. ``main_pid``: the thread that answers the requests (None: nothing is judged)."""

    def __init__(self, candidate: Channel, main_pid: int | None, device: str, result: EvalResult):
        self.candidate, self.main_pid, self.device, self.result = candidate, main_pid, device, result
        self.before = candidate.worker.thread_cpu()

    @property
    def names(self) -> dict[int, str]:
        return {tid: name for tid, (name, _) in self.before.items()}

    def check(self, stage: str, when: str) -> list[Breach]:
        if self.main_pid is None:
            return []
        main_ms, others = other_threads_ms(self.before, self.candidate.worker.thread_cpu(), self.main_pid)
        self.result.timing = self.result.timing | {"threads": {
            "main_ms": round(main_ms, 3), "others_ms": round(sum(ms for ms, _, _ in others), 3),
            "busiest": {f"{name} ({tid})": round(ms, 3) for ms, name, tid in others[-3:] if ms > 0}}}
        limit = max(BORROWED_THREAD_MS, BORROWED_THREAD_SHARE * main_ms)
        if self.device == "cuda" and others and others[-1][0] > limit:
            ms, name, tid = others[-1]
            return [Breach("thread", f"thread {tid} ({name}) of the candidate's process, there before its code "
                           f"loaded, ran {ms:.1f} ms on a CPU {when} (limit {limit:.0f} ms; the "
                           f"thread that calls it ran {main_ms:.1f} ms): work handed to another thread is not timed")]
        return []


class Integrity:
    """The harness's native entry points in the candidate's process (``guard.integrity``): import-table
    slots, the C functions behind the harness's builtins and the code mappings, first read from outside
    before any candidate code, then again at each check: changed by candidate code, or unreadable now
    that they were readable. Where its memory cannot be read from here (no permission to read another
    process's memory) nothing is watched and the result says so."""

    def __init__(self, candidate: Channel, slots: dict[str, int], job: Path, result: EvalResult):
        self.result = result
        self.watch: IntegrityWatch | None = None
        # The written code pages (smaps, a few times the cost of maps in a CUDA process) are counted
        # from the check after the load's on.
        self._pages = False
        pid = candidate.worker.harness_pid()
        if pid is None:
            result.notes.append("native entry points not checked: the worker's process was not found")
            return
        clock = time.monotonic()
        try:
            self.watch = IntegrityWatch.start(pid, slots, (str(job),))
        except OSError as exc:
            result.notes.append(f"native entry points not checked: cannot read the worker's memory ({exc})")
        finally:
            result.durations["integrity"] = round(time.monotonic() - clock, 3)

    @property
    def pid(self) -> int | None:
        """The worker's own process, whose main thread answers the requests."""
        return self.watch.pid if self.watch is not None else None

    def check(self, stage: str, when: str) -> list[Breach]:
        if self.watch is None:
            return []
        pages, self._pages = self._pages, True
        clock = time.monotonic()
        try:
            problems = self.watch.problems(pages)
        except OSError as exc:
            problems = [f"its memory can no longer be read from outside ({exc})"]
        durations = self.result.durations
        durations["integrity"] = round(durations.get("integrity", 0.0) + time.monotonic() - clock, 3)
        if not problems:
            return []
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return [Breach("integrity", f"the harness's native entry points changed {when}, seen from outside the "
                       f"candidate's process: {problems[0]}{more}")]

    def during(self, within_s: float) -> ContextManager[list[str]]:
        """One read at a moment drawn within the next ``within_s`` seconds; the problems it found."""
        return self.watch.read_sometime(within_s) if self.watch is not None else contextlib.nullcontext([])

    @staticmethod
    def breach(found: list[str], when: str) -> list[Breach]:
        """``during``'s problems as a breach."""
        if not found:
            return []
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        return [Breach("integrity", f"the harness's native entry points changed {when}, seen "
                       f"from outside the candidate's process during a round: {found[0]}{more}")]


class Clock:
    """The candidate's reported regions against the evaluator's own clock (``decide.clock_check``)."""

    def __init__(self, walls_ms: list[float], claimed_ms: list[float], empty_ms: list[float], trials: int,
                 timing: TimingConfig, result: EvalResult, regions: "Regions | None" = None):
        self.rounds = (walls_ms, claimed_ms, empty_ms, trials)
        self.timing, self.result = timing, result
        self.regions = regions

    def check(self, stage: str, when: str) -> list[Breach]:
        check = clock_check(*self.rounds, self.timing)
        # Where the brackets judged every region, they bound the reported time far tighter than the round
        # does; the round's empty twin runs in another process, whose harness time differs from the
        # candidate's by several ms for no fault of the candidate (enough to put an honest one just over), so
        # only a gross excess (time spent outside every region) is still judged there.
        bracketed = self.regions is not None and self.regions.judged
        decisive = check.decisive and not bracketed
        self.result.timing = self.result.timing | {"clock": check.to_dict() | {"decisive": decisive}}
        if not check.ok and not (decisive or check.gross):
            why = ("the evaluator's brackets, which judged each timed region, found the regions explained"
                   if bracketed else "the harness alone moves by that much between processes")
            self.result.notes.append(
                f"the outside clock cannot resolve regions this short: the candidate's rounds took {check.unexplained_ms:.1f} "
                f"ms more than its reported regions ({check.claimed_ms:.3f} ms) and the harness explain, over the "
                f"limit of {check.limit_ms:.1f} ms, but {why}: not judged (an excess over three times the limit would be)")
        elif not check.ok:
            return [Breach("clock", f"the candidate's process reported timed regions {check.unexplained_ms:.3f} ms "
                           f"per round shorter than the evaluator's own clock allows (limit {check.limit_ms:.3f} ms; "
                           f"reported {check.claimed_ms:.3f} ms, round {check.wall_ms:.3f} ms, empty round "
                           f"{check.empty_ms:.3f} ms)")]
        return []


class Regions:
    """The candidate's regions by the evaluator's clock (``region_clock.judge``), which its times are: stated in the
    result beside what its process reported, and refused (no reward either way) where what that clock leaves unseen
    (its ``allowance``: work that runs and ends there is not timed) is more than ``allowance_max`` of a region. Its
    ``uncertainty`` (how far the calibrated cost may be off) is judged with the speedups (``verdict.clock_settles``):
    it refuses only a reward it could change. Neither is the candidate's doing: the clock was calibrated before its
    code loaded, and the regions were sized for it."""

    def __init__(self, brackets: Any, hold_us: float | None, setup: Any, result: EvalResult):
        self.brackets, self.result = brackets, result
        self.verdict: Any = None  # the brackets' RegionClock, set by check once every region was timed
        self.hold_us = (hold_us or 0.0) if setup.device == "cuda" else 0.0
        self.timing = setup.timing

    @property
    def judged(self) -> bool:
        return self.verdict is not None

    def check(self, stage: str, when: str) -> list[Breach]:
        if self.brackets is None:
            return []
        verdict = self.brackets.judge(self.hold_us)
        if verdict is None:
            return []
        self.verdict = verdict
        self.result.timing = self.result.timing | {"regions": verdict.to_dict() | {"overhead": self.brackets.cost.to_dict()}}
        if verdict.allowance > self.timing.allowance_max:
            raise Stop("error", "profile", f"the evaluator's own clock cannot time these regions closely enough: its "
                       f"allowance (the window after each region's DONE that its probe of the GPU cannot see) is "
                       f"{verdict.allowance:.1%} of a {verdict.outside_ms:.3f} ms region (limit "
                       f"{self.timing.allowance_max:.1%}, regions at most {self.timing.region_max_ms:g} ms); the host "
                       f"or GPU was busy with other work: evaluate again when it is quieter")
        return []


class Plausibility:
    """Results no honest kernel can reach: beyond the policy's speedup ceiling, or faster than writing
    the outputs to memory allows (``t``: the candidate's median ms)."""

    def __init__(self, t: float, speedup_eager: float | None, output_bytes: int, policy: Policy, device: str,
                 result: EvalResult):
        self.t, self.speedup_eager, self.output_bytes = t, speedup_eager, output_bytes
        self.policy, self.device, self.result = policy, device, result

    def check(self, stage: str, when: str) -> list[Breach]:
        ceiling, speedup_eager = self.policy.max_speedup, self.speedup_eager
        if self.t <= 0 or (ceiling is not None and speedup_eager is not None and speedup_eager > ceiling):
            return [Breach("implausible-speedup", f"implausible speedup: {speedup_eager or math.inf:.1f}x over eager "
                           f"exceeds the policy's ceiling of {ceiling:g}x; such results need review before they are "
                           "rewarded")]
        if not self.policy.speed_of_light:
            return []
        if self.policy.memory_system is not None:
            memory = MemorySystem(*self.policy.memory_system)
        else:
            memory = memory_system(self.result.environment.get("gpu")) if self.device == "cuda" else None
        reason = below_speed_of_light(self.t, self.output_bytes, memory)
        return [Breach("implausible-speedup", reason)] if reason else []


class Attributed:
    """The profiled check's kernels (``guard.attribution``). Decoy: the extension's kernels never ran.
    Coverage: too little GPU time in them. Stream: they ran on another stream than forward was called on."""

    def __init__(self, attribution: Attribution | None, policy: Policy):
        self.attribution, self.policy = attribution, policy

    def check(self, stage: str, when: str) -> list[Breach]:
        if self.attribution is None:
            return []
        reason = decoy_reason(self.attribution)
        if reason:
            return [Breach("decoy", reason)]
        reason = coverage_reason(self.attribution, self.policy.min_coverage)
        if reason:
            return [Breach("coverage", reason)]
        reason = None if self.policy.allow_streams else stream_reason(self.attribution)
        return [Breach("stream", reason)] if reason else []
