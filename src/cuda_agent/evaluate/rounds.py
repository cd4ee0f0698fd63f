"""The timing rounds: the candidate (in its process) and the baselines (in the reference) timed in
interleaved rounds until each reward decision is confident (``decide.run_rounds``). Both sides of the
region protocol as the evaluator speaks it: calibration, the hold before each region, the empty rounds
of the outside clock, the candidate stopped between its rounds, and what its rounds leave for the checks
after them (``CandidateLog``)."""

from __future__ import annotations

import contextlib
import math
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from cuda_agent.evaluate.brackets import CandidateBrackets
from cuda_agent.evaluate.protocol.channel import Channel, Stop
from cuda_agent.evaluate.context import Setup
from cuda_agent.evaluate.decide import Plan, Rounds, run_rounds, speedups, reward_settled
from cuda_agent.evaluate.protocol.messages import CalibrateReply, CalibrateRequest, CallRecord, TimeReply, TimeRequest
from cuda_agent.evaluate.protocol.records import RECORDED_PER_REGION
from cuda_agent.evaluate.protocol.regions import thread_times
from cuda_agent.evaluate.protocol.policy import TimingConfig
from cuda_agent.evaluate.pressure import ThreadWaits
from cuda_agent.evaluate.protocol.quiet import GpuQuiet, quiet_after_stops
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.evaluate.protocol.timing import host_hold
from cuda_agent.evaluate.watchers import BorrowedThreads, Integrity, NewThreads, Signals, stop_on
from cuda_agent.guard.device_state import can_check_idle, gpu_busy

EMPTY_ROUNDS = 3  # rounds of the candidate's plan without its calls, in the reference (the outside clock)
LATE_SHARE = 0.25  # of the candidate's regions outlasting their hold before its result says so


@dataclass
class CandidateLog:
    """What the candidate's timing rounds left for the checks after them."""

    plan: Plan
    records: list[tuple[int, CallRecord]] = field(default_factory=list)  # (the round's probe, record)
    walls_ms: list[float] = field(default_factory=list)  # each round by the evaluator's clock
    claimed_ms: list[float] = field(default_factory=list)  # each round's regions as the candidate reported them
    empty_ms: list[float] = field(default_factory=list)  # rounds of its plan without the calls (reference)
    hold_us: float | None = None  # before each of its regions and the empty rounds' (candidate_hold)
    outside: bool = False  # its calls read from outside (CandidateBrackets): the empty rounds record none either


@dataclass
class CandidateRounds:
    """The candidate's part in the rounds: its channel, the seed its timed inputs are drawn from, and
    what watches its process during them."""

    channel: Channel
    base: int
    signals: Signals
    integrity: Integrity
    brackets: CandidateBrackets | None = None  # each region bracketed by the evaluator (evaluate.protocol.regions)
    gpu_quiet: GpuQuiet | None = None  # judges the reference's quiet probes before the baselines' regions
    call_bytes: int = 0  # a call's inputs and output, as the reference's checks found them (caps a region's calls)
    device_bytes: int = 0  # the GPU's memory as the reference found it (0: the CPU backend)


def time_rounds(setup: Setup, reference: Channel, baseline: dict[str, Any], result: EvalResult,
                quiet: contextlib.AbstractContextManager, candidate: CandidateRounds | None = None,
                undecided: Callable[[Rounds], bool] | None = None) -> tuple[Rounds, CandidateLog | None]:
    """Time the candidate (if any) and the baselines in interleaved rounds until every decision is
    confident (or ``undecided`` says no more are needed). Returns the rounds and what the candidate's
    rounds left: records, outside clock. ``quiet``: entered under the timing lock, for the rounds
    (the spare candidate processes stopped)."""
    config = setup.timing
    fixed = {side: stats["median_ms"] for side, stats in baseline["fixed"].items()}
    sides: dict[str, Callable[[int, int, int], list[float]]] = {}
    plans: dict[str, Plan] = {}
    hosts: dict[str, dict[str, float]] = {}
    log: CandidateLog | None = None
    # Work found on the GPU before a baseline's region is another process's unless the candidate's code ran.
    gpu_quiet = candidate.gpu_quiet if candidate is not None and candidate.gpu_quiet is not None else (
        GpuQuiet(reference, setup.timeouts.check_s))
    with setup.timing_lock, quiet:
        quiet_after_stops(setup, reference)
        if baseline.get("sides") and baseline.get("cache"):
            clock = time.monotonic()
            busy = wait_until_idle(setup)
            # Part of the "profile" stage, under the exclusive side: up to idle_wait_s with the device held.
            result.durations["wait_idle"] = round(time.monotonic() - clock, 3)
            if busy:
                result.notes.append(f"baselines timed on a busy GPU and not cached: {busy}")
        if candidate is not None:
            main_pid = candidate.integrity.pid
            borrowed = BorrowedThreads(candidate.channel, main_pid, setup.device, result)
            started = NewThreads(candidate.channel, borrowed.names)
            setup.on_stage("profile", "warming the candidate up")
            request = CalibrateRequest(seed=secrets.randbits(62), timing=config.to_dict())
            warmed = candidate.channel.ask_typed("profile", request, CalibrateReply, setup.timeouts.profile_s)
            pause(candidate.channel)
            estimate = _positive(warmed.estimate_ms, "warm-up time")
            config = sized(config, candidate.brackets)
            plans["candidate"] = plan = Plan.for_call(estimate, config, _positive(warmed.call_ms, "call time"),
                                                      candidate.call_bytes, candidate.device_bytes)
            log = CandidateLog(plan, outside=candidate.brackets is not None and candidate.brackets.outside)
            sides["candidate"] = _candidate_side(setup, candidate, log, hosts, estimate)
        host_us: dict[str, float] = {}
        for side in baseline.get("sides", []):
            setup.on_stage("baseline", f"warming {side} up")
            request = CalibrateRequest(side=side, seed=secrets.randbits(62), timing=config.to_dict())
            calibrated = reference.ask_typed("baseline", request, CalibrateReply, setup.timeouts.profile_s)
            plans[side] = Plan.for_call(calibrated.estimate_ms, config, calibrated.call_ms,
                                        candidate.call_bytes if candidate else 0, candidate.device_bytes if candidate else 0)
            host_us[side] = calibrated.host_us
            sides[side] = _baseline_side(setup, reference, side, secrets.randbits(62), hosts, gpu_quiet)
        if log is not None:
            log.hold_us = candidate_hold(setup, reference, log.plan, host_us.get("eager"))
            _time_empty(setup, reference, log)
        rounds = Rounds(fixed=fixed)
        if undecided is None:
            undecided = lambda r: not reward_settled(speedups(r, setup.policy, config))  # noqa: E731
        waits = ThreadWaits()
        if setup.device == "cpu":
            pid = reference.worker.harness_pid()
            threads = {side: thread_times(pid) if pid else None for side in sides} | {
                "candidate": candidate.brackets.thread if candidate is not None and candidate.brackets else None}
            sides = {side: waits.wrap(side, call, threads[side]) for side, call in sides.items()}
        try:
            run_rounds(sides, plans, config, undecided, rounds, on_round=lambda n, r: _report_round(setup, n, r))
        finally:
            if candidate is not None:
                candidate.channel.worker.resume()
        if candidate is not None and log is not None:
            stop_on("profile", "while it was timed", started)
            stop_on("profile", "while the candidate was timed", borrowed)
            for _ in range(EMPTY_ROUNDS - 1):
                _time_empty(setup, reference, log)
    shares = waits.shares()
    result.timing = result.timing | {"plans": {side: vars(plan) for side, plan in plans.items()}, "host": hosts,
                                     "cpu_waits": shares, "cpu_waits_total": waits.totals()}
    # The candidate's regions are timed less its thread's waits (``region_clock.times``); a baseline's include them.
    busy = {side: share for side, share in shares.items() if side != "candidate" and share > config.wait_max}
    if setup.device == "cpu" and log is not None and busy:
        raise Stop("error", "profile", "the host was busy with other work while the baselines were timed: their thread "
                   "waited for a CPU in " + ", ".join(f"{share:.1%} of {side}'s timing" for side, share in busy.items())
                   + f" (limit {config.wait_max:.1%}), which lengthens their time and would inflate the speedup: "
                   "evaluate again when the host is quieter")
    late = hosts.get("candidate", {})
    # A stall in one region in a few (honest candidates show one or two in 35) moves no round's median; a
    # host path longer than the hold in a quarter of them is the candidate's to shorten.
    if log is not None and log.hold_us and late.get("late", 0) >= LATE_SHARE * late.get("regions", 0) > 0:
        source = " (twice eager's host time per call)" if config.baseline_hold == "adaptive" else ""
        result.notes.append(
            f"the candidate's host took up to {late['enqueue_us']:.0f} us to enqueue a timed region, longer than the "
            f"GPU is held before it ({log.hold_us:.0f} us{source}): the GPU waited for the host in {late['late']} of "
            f"{late['regions']} regions, and that time counts (fewer launches or less Python per call shorten it)")
    return rounds, log


def sized(config: TimingConfig, brackets: CandidateBrackets | None) -> TimingConfig:
    """``config`` with regions as long as the evaluator's clock needs (``Overhead.region_ms_for``), for every side:
    the baselines' regions last as long as the candidate's."""
    if brackets is None or brackets.cost is None:
        return config
    needed = brackets.cost.region_ms_for(config.allowance_target, config.uncertainty_target, config.resolution_target)
    return replace(config, region_ms=min(config.region_max_ms, max(config.region_ms, needed)))


def candidate_hold(setup: Setup, reference: Channel, plan: Plan, eager_host_us: float | None) -> float:
    """The candidate's hold before each region: ``hold_us``, except with ``baseline_hold="adaptive"``:
    what covers eager's host time per call (measured in the trusted reference, in the
    cached-baselines mode too) for the candidate's calls per region, as the baselines' own holds
    cover theirs. Never from the candidate's word: a hold is time its process could compute in,
    unseen by the outside clock."""
    if setup.timing.baseline_hold != "adaptive" or setup.device != "cuda":
        return setup.timing.hold_us  # a host clock (CPU backend) holds nothing
    if eager_host_us is None:
        request = CalibrateRequest(side="eager", seed=secrets.randbits(62), timing=setup.timing.to_dict())
        eager_host_us = reference.ask_typed("baseline", request, CalibrateReply, setup.timeouts.profile_s).host_us
    return host_hold(plan.calls, eager_host_us, setup.timing)


def _time_empty(setup: Setup, reference: Channel, log: CandidateLog) -> None:
    """A round of the candidate's plan in the reference with the calls left out, timed from here:
    what the outside clock sees of the harness alone (draws, flushes, holds, records, the reply)."""
    plan = log.plan
    request = TimeRequest(side="empty", seed=secrets.randbits(62), first=0, trials=plan.trials, calls=plan.calls,
                          probe=None if log.outside else secrets.randbits(62), timing=setup.timing.to_dict(),
                          hold_us=log.hold_us, outside=log.outside)
    started = time.perf_counter()
    reference.ask_typed("baseline", request, TimeReply, setup.timeouts.baseline_s)
    log.empty_ms.append((time.perf_counter() - started) * 1e3)


def pause(candidate: Channel) -> None:
    """Stop the candidate's processes while the baselines are timed: code it left running (a
    thread, a child) could otherwise slow the baselines and inflate its speedup."""
    if not candidate.worker.pause():
        raise Stop("failed", "profile", "the candidate's processes did not stop while the baselines were timed",
                   rule="baseline-interference")


def _candidate_side(setup: Setup, candidate: CandidateRounds, log: CandidateLog, hosts: dict[str, dict[str, float]],
                    estimate_ms: float) -> Callable[[int, int, int], list[float]]:
    channel, brackets = candidate.channel, candidate.brackets
    outside = brackets is not None and brackets.outside
    if outside:
        # A handler installed to fill memory when it is read is named as such, before the read would fail.
        brackets.stopped_check = lambda: stop_on("profile", "while it was timed", candidate.signals)

    def time_candidate(first: int, trials: int, calls: int) -> list[float]:
        # Read from outside, no secret enters the candidate's process: its calls are chosen and read at
        # positions drawn after each region (CandidateBrackets); else its harness records them.
        probe = secrets.randbits(62)
        request = TimeRequest(seed=candidate.base, first=first, trials=trials, calls=calls,
                              probe=None if outside else probe, timing=setup.timing.to_dict(), hold_us=log.hold_us,
                              bell=brackets is not None, outside=outside,
                              written=brackets is not None and brackets.writer is not None)
        # The read lands within the round: within most of the last round's length (the calls'
        # estimate for the first), so that it is seldom left unmade at the round's end.
        within_s = 0.9 * (log.walls_ms[-1] if log.walls_ms else trials * calls * estimate_ms) / 1e3
        channel.worker.resume()
        try:
            with candidate.integrity.during(within_s) as found:
                started = time.perf_counter()
                if brackets is not None:
                    brackets.bell.drain()
                    records_before = len(brackets.records)
                channel.send("profile", request)
                bracketed = brackets.round(first, trials, calls, setup.timeouts.profile_s) if brackets else None
                reply = channel.receive_typed("profile", TimeReply, setup.timeouts.profile_s)
                wall_ms = (time.perf_counter() - started) * 1e3
        finally:
            pause(channel)
        for breach in Integrity.breach(found, "while it was timed"):
            raise Stop("failed", "profile", breach.reason, rule=breach.rule)
        # Read before anything else runs there: a handler needed while this round's records were read
        # is still installed now.
        stop_on("profile", "while it was timed", candidate.signals)
        samples = reply.samples
        if len(samples) != trials or not all(
                isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in samples):
            raise Stop("failed", "profile", "the timing reply is not one positive time per trial", rule="forged-reply")
        if brackets is not None:
            if bracketed is None or len(bracketed) != trials:
                raise Stop("failed", "profile", "the timing reply came without its regions' brackets", rule="forged-reply")
            brackets.add(bracketed, samples, calls)
            # The evaluator's clock times the candidate (``region_clock``); its process's samples stay a diagnostic.
            samples = [t / calls for t in brackets.times(bracketed, log.hold_us if setup.device == "cuda" else 0.0)]
            # The round's clock counts the candidate's time only: what the evaluator did between its regions
            # (stopping it, reading outputs from outside: milliseconds a region on the CPU backend) is not, and the
            # empty round has none of it; left in, it brings an honest CPU candidate to the limit.
            wall_ms -= sum(b.held_ns for b in bracketed) / 1e6
        if outside:
            if reply.records:
                raise Stop("failed", "profile", "the timing reply holds records no one asked for", rule="forged-reply")
            log.records.extend(brackets.records[records_before:])
            _tally_host(hosts, "candidate", reply, trials)
            log.walls_ms.append(wall_ms)
            log.claimed_ms.append(sum(samples) * calls)
            return [float(x) for x in samples]
        # Records of calls of this round only, each once, as many as the harness takes per region.
        indices = [r.index for r in reply.records]
        wanted = trials * min(calls, RECORDED_PER_REGION)
        if len(set(indices)) != len(indices) or len(indices) != wanted or not all(
                first <= i < first + trials * calls for i in indices):
            raise Stop("failed", "profile", f"the timing reply does not hold {wanted} records of this round's calls",
                       rule="forged-reply")
        log.records.extend((probe, record) for record in reply.records)
        _tally_host(hosts, "candidate", reply, trials)  # what its process says: a diagnostic only
        log.walls_ms.append(wall_ms)
        log.claimed_ms.append(sum(samples) * calls)
        return [float(x) for x in samples]
    return time_candidate


def _baseline_side(setup: Setup, reference: Channel, side: str, seed: int, hosts: dict[str, dict[str, float]],
                   gpu_quiet: GpuQuiet) -> Callable[[int, int, int], list[float]]:
    def time_baseline(first: int, trials: int, calls: int) -> list[float]:
        request = TimeRequest(side=side, seed=seed, first=first, trials=trials, calls=calls,
                              timing=setup.timing.to_dict())
        reply = reference.ask_typed("baseline", request, TimeReply, setup.timeouts.baseline_s)
        gpu_quiet.judge(reply.busy_us, f"before a region of {side}'s")
        _tally_host(hosts, side, reply, trials)
        return reply.samples
    return time_baseline


def _tally_host(hosts: dict[str, dict[str, float]], side: str, reply: TimeReply, trials: int) -> None:
    """Each side's host over its rounds (``timing.HostLaunch``): the longest region enqueue and hold,
    how many regions the GPU waited for the host in, how many were timed to the fence, and whether
    its warm-up found it launch-bound (``HostLaunch.host_bound``)."""
    if reply.host is None:
        return
    tally = hosts.setdefault(side, {"enqueue_us": 0.0, "hold_us": 0.0, "late": 0, "fenced": 0, "regions": 0})
    tally["enqueue_us"] = max(tally["enqueue_us"], reply.host.enqueue_us)
    tally["hold_us"] = max(tally["hold_us"], reply.host.hold_us)
    tally["late"] += reply.host.late
    tally["fenced"] += reply.host.fenced
    tally["host_bound"] = reply.host.host_bound
    tally["regions"] += trials


def _positive(value: Any, what: str) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise Stop("failed", "profile", f"the candidate process reported an invalid {what}", rule="forged-reply")
    return float(value)


def _report_round(setup: Setup, number: int, rounds: Rounds) -> None:
    if rounds.count("candidate"):
        text = ", ".join(f"{s.estimate:.3f}x vs {side} [{s.low:.3f}, {s.high:.3f}]"
                         for side, s in speedups(rounds, setup.policy, setup.timing).items())
    else:
        text = ", ".join(f"{side} spread {rounds.spread(side):.1%}" for side in rounds.samples)
    setup.on_stage("profile", f"round {number}: {text}")


IDLE_POLL_S = 0.2  # between readings of a GPU found busy before the baselines' rounds


def wait_until_idle(setup: Setup) -> str | None:
    """Wait up to ``idle_wait_s`` for other work on the GPU (the reference's own loading
    included) to end; the reason if it does not."""
    if setup.device != "cuda" or not setup.check_idle:
        return None
    if not can_check_idle(setup.gpu_index or 0):
        setup.on_stage("baseline", "cannot tell whether the GPU is idle (no NVML, no nvidia-smi)")
        return None
    deadline = time.monotonic() + setup.idle_wait_s
    while True:
        busy = gpu_busy(setup.gpu_index or 0)
        if busy is None or time.monotonic() >= deadline:
            return busy
        setup.on_stage("baseline", f"waiting for the GPU to be idle ({busy})")
        # Asked again soon: what shows as busy is mostly this evaluation's own checks, in NVML's sample period
        # just ended (a second slept each time held the device over a second for nothing at every task's first
        # evaluation; readings are three 0.1 s apart, so busy work is still seen).
        time.sleep(IDLE_POLL_S)
