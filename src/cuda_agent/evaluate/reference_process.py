"""The evaluator's side of the task's reference process (``worker.ReferenceSide`` is the process's own):
started and loaded, or kept from an earlier evaluation, and left idle for the next; the output memory it
shares, handed to the candidate; and what it does on its own: the baselines (from the cache, or timed in
rounds; ``Evaluator.baseline``) and the degenerate-task check."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import time
from typing import Any, Iterator

from cuda_agent.evaluate.baseline import BaselineCache, baseline_key
from cuda_agent.evaluate.protocol.channel import Channel, Stop
from cuda_agent.evaluate.context import Setup
from cuda_agent.evaluate.decide import BASELINES, Rounds
from cuda_agent.evaluate.protocol.degenerate import DegenerateReport
from cuda_agent.evaluate.device_lock import DeviceLock
from cuda_agent.evaluate.environment import describe_environment
from cuda_agent.evaluate.protocol.outside import Draw, OutsideError
from cuda_agent.evaluate.processes import new_job, spawn
from cuda_agent.evaluate.protocol.messages import (
    AfterDoneReply, AfterDoneRequest, GpuHeld, KeepGpuReply, KeepGpuRequest, ReadGpuReply, ReadGpuRequest, DrawReply,
    DrawRequest, WriteGpuReply, WriteGpuRequest,
    AttachReply, AttachRequest, CompileReply, CompileRequest, DegenerateReply, DegenerateRequest, LoadReply,
    LoadRequest, ReleaseReply, ReleaseRequest,
)
from cuda_agent.evaluate.protocol.quiet import Doorbell, GpuQuiet
from cuda_agent.evaluate.references import LiveReference, ReferencePool
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.evaluate.rounds import time_rounds
from cuda_agent.tasks import Task, TaskError


# -- the reference process ----------------------------------------------------------------
def reference_key(setup: Setup, task: Task) -> str:
    """What a kept reference must share with an evaluation to serve it: the task, and everything its load
    depends on (``Setup.task_message``), so that evaluators with other settings may share one pool."""
    loaded = (setup.device, setup.gpu_index, setup.policy.tf32, tuple(setup.policy.allowed_aten), setup.memory_limit,
              type(setup.sandbox).__name__)
    return f"{task.digest}:{task.name}:{hashlib.sha256(repr(loaded).encode()).hexdigest()[:16]}"


def launch(setup: Setup, task: Task) -> LiveReference:
    """Start a reference process for ``task`` and ask it to load (without waiting: the candidate
    loads meanwhile); ``await_loaded`` takes the answer."""
    home = new_job(setup.work_dir, "cuda-agent-ref-")
    (home / "task.py").write_text(task.code)
    init_seed = secrets.randbits(62)
    channel = Channel(spawn(setup, "reference", home / "reference", [home]), "reference")
    reference = LiveReference(reference_key(setup, task), home, channel, init_seed)
    try:
        channel.send("reference", LoadRequest(**setup.task_message(task, home, init_seed),
                                              warm=setup.expect(secrets.randbits(62))))
    except Stop:
        reference.close()
        raise
    return reference


def await_loaded(setup: Setup, reference: LiveReference) -> None:
    """The reference's load answer, and the memory it shares for outputs (its descriptor is kept
    here, unmapped, and relayed to every candidate process)."""
    loaded = reference.channel.receive_typed("reference", LoadReply, setup.timeouts.load_s)
    shared = loaded.share
    if shared is not None and shared.shared:
        try:
            reference.share_fd = reference.channel.worker.receive_fd(setup.timeouts.check_s)
            reference.share_bytes = int(shared.bytes or 0)
        except OSError as exc:
            raise Stop("error", "load", f"reference process: the shared memory did not arrive: {exc}") from None
    else:
        reference.share_note = str(shared.reason if shared is not None else None)
    reference.loaded = loaded


def idle(setup: Setup, pool: ReferencePool, reference: LiveReference) -> bool:
    """Leave ``reference`` holding as little as it can; whether it can be kept for the next
    evaluation (loaded, nothing unanswered, still answering)."""
    if pool.capacity <= 0 or reference.loaded is None or not reference.channel.drain(setup.timeouts.check_s):
        return False
    try:
        reference.reserved = int(reference.channel.ask_typed("idle", ReleaseRequest(ended=True), ReleaseReply, 60).reserved)
    except Stop:
        return False
    return True


@contextlib.contextmanager
def loaded_reference(setup: Setup, pool: ReferencePool, task: Task, failure: str) -> Iterator[LiveReference]:
    """A reference process with ``task`` loaded (a kept one where there is one); trouble in it
    becomes a ``TaskError`` that says ``failure``."""
    reference = pool.take(reference_key(setup, task))
    healthy = False
    try:
        if reference is None:
            reference = launch(setup, task)
            await_loaded(setup, reference)
        yield reference
        healthy = True
    except Stop as stop:
        raise TaskError(f"{task.source}: {failure}: {stop.reason}") from None
    finally:
        if reference is not None:
            pool.give_back(reference, healthy and idle(setup, pool, reference))
        else:
            pool.forfeit(reference_key(setup, task))


# -- baselines -----------------------------------------------------------------------------
def baselines_for(setup: Setup, cache: BaselineCache, task: Task, reference: LiveReference,
                  result: EvalResult) -> tuple[dict[str, Any], str]:
    """What the baselines are timed from: ``{"fixed": {side: stats}}`` for cached baselines
    (``TimingConfig.baselines == "cached"`` and a record in the cache), else the sides to time
    in the rounds."""
    key = baseline_key(task.digest, result.environment, result.policy, result.timing, setup.device)
    if setup.timing.baselines == "cached":
        cached = cached_baseline(setup, cache, key)
        if cached is not None:
            result.baseline_cached = True
            return {"fixed": {side: cached[side] for side in BASELINES if side in cached}, "record": cached}, key
    # A key already cached needs no new record, nor the idle check (0.2-0.5 s) that guards writing one.
    return _timed_baselines(setup, reference, cache=cached_baseline(setup, cache, key) is None), key


def _timed_baselines(setup: Setup, reference: LiveReference, cache: bool) -> dict[str, Any]:
    """Baselines to time in the rounds; with ``cache``, their record is written (if steady, on an
    idle GPU). torch.compile happens here, once per reference process."""
    return {"fixed": {}, "sides": _baseline_sides(setup, reference),
            "compile_error": (reference.compiled or {}).get("compile_error"), "cache": cache}


def _baseline_sides(setup: Setup, reference: LiveReference) -> list[str]:
    """The baselines the reference can time now (torch.compile asked for once per process)."""
    if not setup.time_compile:
        return ["eager"]
    if reference.compiled is None:
        setup.on_stage("baseline", "torch.compile (once per task's reference process)")
        compiled = reference.channel.ask_typed("baseline", CompileRequest(seed=secrets.randbits(62)),
                                               CompileReply, setup.timeouts.baseline_s).to_dict()
        error = compiled.get("compile_error") or ""
        lock = setup.timing_lock
        if "out of memory" in error and isinstance(lock, DeviceLock) and lock.step != "alone":
            # Beside other evaluations the memory it lacked may have been theirs: kept, this error would drop the
            # torch.compile baseline from this task's rewards (and its cached record) for good. The evaluator's
            # ladder runs it again apart, then alone, where an error that remains is the task's own.
            raise Stop("error", "baseline", f"torch.compile of the reference ran out of memory beside other "
                                            f"evaluations: {error}")
        reference.compiled = compiled
    return ["eager", "compile"] if "compile_error" not in reference.compiled else ["eager"]


def cached_baseline(setup: Setup, cache: BaselineCache, key: str) -> dict[str, Any] | None:
    cached = cache.get(key)
    if cached is None or (setup.time_compile and "compile" not in cached and "compile_error" not in cached):
        return None
    return cached


def keep_baseline(setup: Setup, cache: BaselineCache, key: str, rounds: Rounds, baseline: dict[str, Any],
                  result: EvalResult) -> dict[str, Any]:
    """Cache the baselines timed in these rounds, unless their own spread is too wide or the GPU
    was busy: a noisy baseline is re-measured next time, never reused."""
    timing = setup.timing
    record: dict[str, Any] = {side: rounds.stats(side, timing.method).to_dict()
                              for side in baseline["sides"] if rounds.count(side)}
    record["spread"] = {side: round(rounds.spread(side), 5) for side in baseline["sides"] if rounds.count(side)}
    record["rounds"] = max(rounds.count(side) for side in baseline["sides"])
    record["key"] = key
    if baseline.get("compile_error"):
        record["compile_error"] = baseline["compile_error"]
    wide = {side: spread for side, spread in record["spread"].items() if spread > timing.baseline_spread}
    busy = any(note.startswith("baselines timed on a busy GPU") for note in result.notes)
    if wide:
        result.notes.append("baselines not cached: their per-round times vary by " + ", ".join(
            f"{side} {spread:.1%}" for side, spread in wide.items()) + f" (over {timing.baseline_spread:.0%})")
    elif not busy:
        cache.put(key, record)
    return record


def baseline(setup: Setup, cache: BaselineCache, pool: ReferencePool, task: Task, refresh: bool, degenerate: bool,
             quiet: contextlib.AbstractContextManager) -> dict[str, Any]:
    """``Evaluator.baseline``: the cached record, or the baselines measured now in rounds of their own
    until each one's per-round spread is small enough (``quiet``: entered while they are timed)."""
    environment = describe_environment(setup.device, setup.gpu_index)
    key = baseline_key(task.digest, environment, setup.policy.to_dict(), setup.timing.to_dict(), setup.device)
    cached = None if refresh else cached_baseline(setup, cache, key)
    if cached is not None and not degenerate:
        return cached | {"cached": True, "environment": environment, "notes": []}
    scratch = EvalResult(task=task.to_dict(), candidate={}, device=setup.device, policy=setup.policy.to_dict(),
                         timing=setup.timing.to_dict(), environment=environment)
    clock = time.monotonic()
    with loaded_reference(setup, pool, task, "the baselines could not be timed") as reference:
        durations = {"load": round(time.monotonic() - clock, 3)}
        clock = time.monotonic()
        record = cached or _measure_baselines(setup, cache, key, reference, scratch, quiet)
        durations["baseline"] = round(time.monotonic() - clock, 3)
        record = record | {"cached": cached is not None, "environment": environment, "notes": scratch.notes,
                           "durations": durations}
        if degenerate:
            clock = time.monotonic()
            try:
                # Under the timing lock: its model calls would disturb another evaluator's timing.
                with setup.timing_lock:
                    record["degenerate"] = run_degenerate(setup, task, reference.channel, draws=3)
            except Stop as stop:
                record["degenerate_error"] = f"{task.source}: the degenerate-task check could not run: {stop.reason}"
            durations["degenerate"] = round(time.monotonic() - clock, 3)
    return record


def _measure_baselines(setup: Setup, cache: BaselineCache, key: str, reference: LiveReference, result: EvalResult,
                       quiet: contextlib.AbstractContextManager) -> dict[str, Any]:
    """The baselines alone, in rounds, until each one's per-round spread is small enough."""
    baseline = _timed_baselines(setup, reference, cache=True)
    wide = lambda r: any(r.spread(side) > setup.timing.baseline_spread for side in baseline["sides"])  # noqa: E731
    rounds, _ = time_rounds(setup, reference.channel, baseline, result, quiet, undecided=wide)
    return keep_baseline(setup, cache, key, rounds, baseline, result)


def run_degenerate(setup: Setup, task: Task, reference: Channel, draws: int) -> DegenerateReport:
    """Whether trivial candidates pass ``task``, asked of its reference process (``evaluate.protocol.degenerate``)."""
    request = DegenerateRequest(seeds=[secrets.randbits(62) for _ in range(draws)], **setup.tolerance())
    reply = reference.ask_typed("degenerate", request, DegenerateReply, setup.timeouts.check_s * draws)
    return DegenerateReport(task=task.name, policy=setup.policy.name, passing=reply.passing, details=reply.details)


def share_output_memory(setup: Setup, reference: LiveReference, candidate: Channel, result: EvalResult) -> None:
    """Hand the memory the reference shared when it loaded to the candidate; the descriptor
    passes through this process, which never maps it. Where that cannot be done, outputs
    travel through files."""
    if reference.share_fd is None:
        result.notes.append(f"outputs handed over through files: {reference.share_note}")
        return
    try:
        candidate.worker.send_fd(reference.share_fd)
    except OSError as exc:
        raise Stop("failed", "load", f"candidate process: cannot take the shared memory: {exc}") from None
    attached = candidate.ask_typed("load", AttachRequest(bytes=reference.share_bytes), AttachReply,
                                   setup.timeouts.check_s)
    if not attached.attached:
        result.notes.append(f"outputs handed over through files: {attached.reason}")


class ReferenceGpu:
    """The reference process's reads and writes of the candidate's GPU memory (``evaluate.protocol.vmm``, ``outside.GpuRemote``):
    the descriptors of allocations it does not hold yet relayed over its descriptor channel, then the request.
    Writes draw the inputs from the evaluator's secret seeds and flush ``flush_bytes`` of L2 after."""

    def __init__(self, setup: Setup, reference: LiveReference, flush_bytes: int = 0,
                 quiet: GpuQuiet | None = None) -> None:
        self.setup, self.reference, self.flush_bytes, self.quiet = setup, reference, flush_bytes, quiet

    def _send(self, fds: list[int]) -> None:
        try:
            self.reference.channel.worker.send_fds(fds)
        except OSError as exc:
            raise Stop("error", "profile", f"reference process: cannot take the candidate's GPU memory: {exc}") from None

    def read(self, held: GpuHeld, fds: list[int], sizes: list[int], reads: list[tuple[int, int, int]],
             apart_s: float) -> tuple[list[bytes], list[int]]:
        self._send(fds)
        request = ReadGpuRequest(held=held, sizes=sizes, reads=[list(r) for r in reads], apart_s=apart_s)
        reply = self.reference.channel.ask_typed("profile", request, ReadGpuReply, self.setup.timeouts.check_s)
        if reply.error:
            raise OutsideError(reply.error)
        return [bytes.fromhex(d) for d in reply.data], reply.changed

    def write(self, held: GpuHeld, fds: list[int], sizes: list[int], offsets: list[int], seeds: list[int],
              leaves: list[list[list[Any]]]) -> None:
        self._send(fds)
        request = WriteGpuRequest(held=held, sizes=sizes, offsets=offsets, seeds=seeds, leaves=leaves,
                                  flush_bytes=self.flush_bytes)
        reply = self.reference.channel.ask_typed("profile", request, WriteGpuReply, self.setup.timeouts.check_s)
        if reply.error:
            raise OutsideError(reply.error)
        if self.quiet is not None:
            self.quiet.judge(reply.busy_us, "once a region's inputs were written, before its GO")

    def after_done(self, within_s: float) -> "ArmedProbe":
        """The reference asked, before a region's GO, for a probe as soon as its DONE is rung (``quiet.after_done``);
        the doorbell's page handed over with the first request of the process's life."""
        reference = self.reference
        page = reference.doorbell is None
        if page:
            reference.doorbell = Doorbell.create()
            self._send([reference.doorbell.fd])
        reference.rung += 1
        reference.channel.send("profile", AfterDoneRequest(region=reference.rung, within_s=within_s, page=page))
        return ArmedProbe(reference.doorbell, reference.rung, reference.channel,  # type: ignore[arg-type]
                          self.setup.timeouts.check_s + within_s)

    def keep(self, held: GpuHeld, fds: list[int], sizes: list[int], offsets: list[int], leaves: list[list[Any]],
             call: int) -> None:
        self._send(fds)
        request = KeepGpuRequest(held=held, sizes=sizes, offsets=offsets, leaves=leaves, call=call)
        reply = self.reference.channel.ask_typed("profile", request, KeepGpuReply, self.setup.timeouts.check_s)
        if reply.error:
            raise OutsideError(reply.error)


class ArmedProbe:
    """A probe the reference waits to launch (``ReferenceGpu.after_done``): ``ring`` at the region's DONE, or
    ``call_off`` where the region went no further; ``answer`` then takes its reply."""

    def __init__(self, bell: Doorbell, region: int, channel: Channel, timeout_s: float) -> None:
        self.bell, self.region, self.channel, self.timeout_s = bell, region, channel, timeout_s

    def ring(self) -> int:
        self.bell.ring(self.region)
        return time.time_ns()

    def call_off(self) -> None:
        self.bell.call_off(self.region)

    def answer(self) -> tuple[float, int]:
        """The probe's wait in us and when it was launched (0 where it was called off)."""
        reply = self.channel.receive_typed("profile", AfterDoneReply, self.timeout_s)
        return reply.wait_us, reply.launched_ns


def input_drawer(setup: Setup, reference: LiveReference) -> Draw:
    """Timed calls' inputs drawn by the reference process from the evaluator's secret seeds, for the evaluator to
    write into the candidate's (``outside.InputWriter``); the memory they are packed in arrives as a descriptor."""
    def draw(seeds: list[int], leaves: list[list[list[Any]]], send: bool) -> tuple[list[list[list[int]]], int, int | None]:
        reply = reference.channel.ask_typed("profile", DrawRequest(seeds=seeds, leaves=leaves, send=send), DrawReply,
                                            setup.timeouts.check_s)
        fd = None
        if reply.grown:
            try:
                fd = reference.channel.worker.receive_fd(setup.timeouts.check_s)
            except OSError as exc:
                raise Stop("error", "profile", f"reference process: the drawn inputs' memory did not arrive: {exc}") \
                    from None
        if reply.error:
            if fd is not None:
                os.close(fd)
            raise OutsideError(reply.error)
        return reply.spans, reply.bytes, fd
    return draw


