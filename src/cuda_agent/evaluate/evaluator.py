"""Orchestrates one evaluation: build -> load -> verify -> time -> decide, the stages after the build read top to
bottom in ``stages.Stages._run``.

This process never imports candidate code and never holds expected outputs:
the reference process computes and compares them; the candidate process runs
the candidate. Each evaluation gets a fresh candidate process, so a crash, hang
or flood in one candidate cannot touch the next. Reference processes run only
the pristine task program, so a long-lived evaluator keeps them across
evaluations (``evaluate.references``). Candidate and baselines are timed in
interleaved rounds until each reward decision is confident (``evaluate.rounds``,
``evaluate.decide``). Watchers (``evaluate.watchers``) look at the candidate's
process at fixed points of the pipeline; the first breach they name stops it.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from cuda_agent.build import BuildResult, build
from cuda_agent.build.builder import PROBE_NAMESPACE
from cuda_agent.build.probe import probe_candidate
from cuda_agent.candidates import Candidate
from cuda_agent.evaluate import reference_process as ref
from cuda_agent.evaluate.baseline import BaselineCache
from cuda_agent.evaluate.brackets import CandidateBrackets
from cuda_agent.evaluate.protocol.channel import Channel, Stop
from cuda_agent.evaluate.checks import TIMED_CHECKS
from cuda_agent.evaluate.context import (
    Evaluation, Setup, StageCallback, Timeouts, default_memory_limit, resolve_device,
)
from cuda_agent.evaluate.counters import CounterReport, unavailable
from cuda_agent.evaluate.counters_run import find_ncu, profile_counters
from cuda_agent.evaluate.protocol.degenerate import DegenerateReport
from cuda_agent.evaluate.device_lock import HUNGRY_SHARE, MEMORY_HUNGRY, DeviceLock, shared_use
from cuda_agent.evaluate.environment import describe_environment
from cuda_agent.evaluate.protocol.policy import Policy, TimingConfig
from cuda_agent.evaluate.triton_build import build_launcher, compile_triton, copy_kernels, triton_kernels_of
from cuda_agent.evaluate.processes import (
    SPARE_CANDIDATES, Workers, close_all, copy_modules, spares_stopped, start_workers, take_workers,
)
from cuda_agent.evaluate.protocol.messages import LoadReply
from cuda_agent.evaluate.references import REFERENCE_MEMORY, LiveReference, ReferencePool, kept_references
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.evaluate.retry import RetryPolicy, with_retries
from cuda_agent.evaluate.stages import Stages
from cuda_agent.guard import CodePolicy, Violation, audit_symbols, check_candidate
from cuda_agent.guard.symbols import imported_symbols
from cuda_agent.paths import cache_root
from cuda_agent.sandbox import Sandbox, make_sandbox
from cuda_agent.tasks import Task

__all__ = ["TIMED_CHECKS", "Evaluator", "StageCallback", "Timeouts", "default_memory_limit", "evaluate", "find_ncu",
           "long_lived", "resolve_device"]


def long_lived(device: str) -> dict[str, Any]:
    """``Evaluator`` options for one that serves many evaluations (an agent's episodes, a service slot, a
    trainer, a benchmark run): on a GPU, candidate processes started ahead and up to 4 task references kept;
    on the CPU, where a process started ahead competes with the evaluation for a few cores, none started
    ahead and the last task's reference kept (its start and torch.compile cost seconds of a small host; idle,
    it costs no CPU). A one-shot evaluator (``Evaluator()``) keeps nothing."""
    cuda = resolve_device(device) == "cuda"
    return {"prestart": cuda, "references": None if cuda else 1}


class Evaluator(Stages):
    """Evaluates candidates against tasks on one device (one GPU, or the CPU)."""

    def __init__(
        self,
        device: str = "auto",
        *,
        policy: Policy | None = None,
        timing: TimingConfig | None = None,
        cache_dir: Path | str | None = None,
        work_dir: Path | str | None = None,
        sandbox: Sandbox | str = "auto",
        gpu_index: int | None = None,
        timeouts: Timeouts = Timeouts(),
        output_limit: int = 2 * 1024 * 1024,
        memory_limit: int | None = None,
        time_compile: bool = True,
        check_idle: bool = True,
        idle_wait_s: float = 30.0,
        timing_lock: contextlib.AbstractContextManager | None = None,
        build_lock: Any = None,
        prestart: bool | int = False,
        references: int | ReferencePool | None = None,
        reference_memory: int = REFERENCE_MEMORY,
        on_stage: StageCallback | None = None,
        retry: RetryPolicy | None = None,
    ):
        self.device = resolve_device(device)
        # An evaluation without a verdict for a busy host is tried again within this budget (``evaluate.retry``).
        self.retry = retry or RetryPolicy()
        self.policy = policy or Policy()
        self.timing = (timing or TimingConfig()).resolved(self.device)
        self.cache_dir = Path(cache_dir) if cache_dir else cache_root()
        self.work_dir = Path(work_dir) if work_dir else None
        # "auto" is bubblewrap or an error naming the fix, never a silent fallback.
        self.sandbox = make_sandbox(sandbox) if isinstance(sandbox, str) else sandbox
        self.gpu_index = gpu_index
        self.timeouts = timeouts
        self.output_limit = output_limit
        self.memory_limit = default_memory_limit() if memory_limit is None else (memory_limit or None)
        self.time_compile = time_compile
        self.check_idle = check_idle
        self.idle_wait_s = idle_wait_s
        # Evaluators that share a GPU share one lock: each times only while it holds it, so
        # timings never overlap while loading, compiling and checking do.
        self.timing_lock = timing_lock or contextlib.nullcontext()
        # Whose shared side a compile takes (``device_lock.shared_use``): on the CPU backend the timing
        # lock (compiles use the device its evaluators time on); a service's build workers get every GPU's
        # lock, since a compile beside a timing slows the timed process's host side.
        self.build_lock = build_lock if build_lock is not None else (self.timing_lock if self.device == "cpu" else None)
        self.on_stage = on_stage or (lambda stage, detail: None)
        self.baselines = BaselineCache(self.cache_dir / "baselines")
        self._probe_imports: frozenset[str] | None = None
        self._probe: BuildResult | None = None
        self._probe_lock = threading.Lock()
        self._triton_launcher: Path | None = None  # Triton's launcher module, built by the harness (``triton_build``)
        # With ``prestart``, each evaluation ends by topping up the candidate processes started ahead
        # (torch imported, CUDA up: a process takes longer to start than a warm evaluation takes, so
        # back-to-back evaluations need several in flight; docs/CONSTANTS.md); close() stops them.
        # ``prestart=True`` keeps SPARE_CANDIDATES; an int keeps that many.
        self.prestart = SPARE_CANDIDATES if prestart is True else int(prestart)
        self._spare: list[Workers] = []
        # Reference processes kept between evaluations (least recently used evicted): by default 4 for
        # a long-lived (prestarted) evaluator, none for a one-shot one, which leaves nothing behind.
        # They hold GPU memory while idle (model, compiled graph, CUDA context): at most
        # ``reference_memory`` bytes together (a larger card: all but 64 GiB), or candidates of other tasks run out.
        # Evaluators on one GPU may share a pool (``local_service``): each task's reference started once.
        self.references = references if isinstance(references, ReferencePool) else ReferencePool(
            kept_references(references, self.prestart),
            reference_memory if self.device == "cuda" else None)
        if isinstance(self.timing_lock, DeviceLock):
            # Another slot's spares, started as its evaluation ended, may still be starting (CUDA up, first
            # kernels) while this one times: they stand still too.
            self.timing_lock.spares.append(self._spare)
        # Collected without close(), an evaluator closes only what it started: a pool passed in is its owner's to
        # close, and the evaluators that share it (a test's or a trainer's short-lived ones) come and go before it.
        owned = self.references if self.references is not references else None
        weakref.finalize(self, close_all, self._spare, owned)

    def _pausable(self, reference: LiveReference, candidate: Any) -> contextlib.AbstractContextManager:
        """A stretch of an evaluation in which its thread only waits for its ``reference`` process (its start,
        torch.compile) or for its candidate's process to finish starting: another slot's timing may stop both its
        processes rather than wait for the stretch to end (``DeviceLock.pausable``, where the lock's ``pause`` is
        on). The candidate's process is stopped too (it may be loading the task onto the GPU meanwhile, or still
        starting CUDA), which is safe only because this evaluation does not stop and let go of it itself inside
        these stretches: its own stops (outputs read from outside while it stands still, its regions) interleaved
        with another slot's would let it run inside one. So never the checks."""
        lock = self.timing_lock
        if not isinstance(lock, DeviceLock):
            return contextlib.nullcontext()
        return lock.pausable(reference.channel.worker, candidate)

    def _spare_groups(self) -> list[list[Workers]]:
        """The spare candidate processes to stop while this evaluator times: every evaluator's on its device."""
        lock = self.timing_lock
        return list(lock.spares) if isinstance(lock, DeviceLock) else [self._spare]

    @property
    def backend(self) -> str:
        return self.device

    def _setup(self) -> Setup:
        """The settings as they are now (a caller may have changed ``policy`` since the last call)."""
        return Setup(self.device, self.policy, self.timing, self.timeouts, self.cache_dir, self.work_dir, self.sandbox,
                     self.gpu_index, self.output_limit, self.memory_limit, self.time_compile, self.check_idle,
                     self.idle_wait_s, self.timing_lock, self.on_stage)

    def build(self, candidate: Candidate) -> BuildResult:
        # The audit's probe first, so it is built before any candidate of this evaluator (and, in its own
        # namespace of the cache, apart from every candidate's objects).
        if candidate.extensions:
            self.build_probe()
        return self._build(candidate)

    def _build(self, candidate: Candidate, namespace: str | None = None) -> BuildResult:
        # A compile waits for the timing of evaluators sharing ``build_lock``, and their timing for it.
        with shared_use(self.build_lock, occupy=False):
            return build(candidate, self.backend, cache_dir=self.cache_dir, sandbox=self.sandbox,
                         timeout_s=self.timeouts.build_s, namespace=namespace)

    def build_probe(self) -> BuildResult:
        """The symbol audit's probe extension (``build.probe``), built once per evaluator in the cache's
        probe namespace, which candidate builds read but never write (``build.PROBE_NAMESPACE``). Called
        before the first candidate's build; ``eval`` and ``serve`` call it at start-up."""
        with self._probe_lock:
            if self._probe is None:
                self.on_stage("build", "toolchain probe: a minimal extension, built once per cache before any "
                                       "candidate, tells the symbol audit what the toolchain itself imports")
                clock = time.monotonic()
                probe = self._build(probe_candidate(self.backend), PROBE_NAMESPACE)
                if probe.ok and not probe.cached:
                    self.on_stage("build", f"toolchain probe built in {time.monotonic() - clock:.0f} s (cached from now on)")
                if not probe.ok:
                    return probe  # not kept: the next call tries again, and the audit reports it
                self._probe = probe
            return self._probe

    # -- one evaluation -----------------------------------------------------------
    def evaluate(self, task: Task, candidate: Candidate, build_result: BuildResult | None = None, *,
                 timed: bool = True) -> EvalResult:
        """Build, verify and (``timed``) time ``candidate`` on ``task``: the rewarded record. With
        ``timed=False`` (``verify``) the record says whether it is correct, with no times and no reward. Without a
        verdict for a busy host it is evaluated again, up to ``retry.attempts`` times (the result's ``attempts``)."""
        started = time.monotonic()

        def again(number: int, result: EvalResult) -> None:
            self.on_stage("retry", f"attempt {number} had no verdict (the host or GPU was busy): evaluating again "
                                   f"once it is quieter ({number + 1} of {self.retry.attempts})")

        result = with_retries(lambda: self._evaluate_once(task, candidate, build_result, timed), self.retry, again)
        result.durations["total"] = round(time.monotonic() - started, 3)
        self.on_stage("done", f"{result.status}, reward {result.reward}")
        return result

    def _evaluate_once(self, task: Task, candidate: Candidate, build_result: BuildResult | None,
                       timed: bool) -> EvalResult:
        lock = self.timing_lock
        if not isinstance(lock, DeviceLock):
            key = ref.reference_key(self._setup(), task) if self.device == "cuda" else ""
            # Counted before: this task's own reference, given back as the attempt ends, may evict them.
            beside = self.references.idle_besides(key) if key else 0
            result = self._attempt(task, candidate, build_result, timed)
            # Alone on its GPU, the memory that ran out may have been this evaluator's own idle references of other
            # tasks: the reward must not depend on which tasks came before, so it is evaluated again without them.
            if self._out_of_memory(result) and beside:
                self.references.drop_idle(keep=key)
                self.on_stage("build", "out of GPU memory beside the idle references of other tasks: evaluated "
                                       "again with them closed")
                result = self._attempt(task, candidate, build_result, timed)
                result.notes.append("evaluated again with the idle references of other tasks closed: it ran out of "
                                    "GPU memory beside them")
        elif task.digest in lock.alone_keys:
            result = self._attempt_alone(task, candidate, build_result, timed)
            result.notes.append("evaluated with the GPU alone: this task ran out of memory beside other evaluations "
                                "on this GPU before")
        else:
            result, again = None, ""
            if task.digest not in lock.apart_keys:
                result = self._attempt(task, candidate, build_result, timed)
                if result.rule == MEMORY_HUNGRY:
                    # Given up before the candidate's process put anything on the device: nothing was decided.
                    lock.apart_keys[task.digest] = result.reason or ""
                    self.on_stage("build", f"{result.reason}: evaluated apart")
                    result = None
                elif self._out_of_memory_beside_others(result):
                    # Another evaluation's memory, not this candidate's, may have been what ran out: the reward must
                    # not depend on what else shared the GPU. Apart first (the cheaper try), alone if that runs out.
                    lock.apart_keys[task.digest] = f"beside other evaluations it ran out of memory ({result.reason})"
                    self.on_stage("build", "out of GPU memory beside other evaluations: evaluated again apart")
                    result, again = None, "again "
            if result is None:
                result = self._attempt_apart(task, candidate, build_result, timed)
                if result is not None:
                    result.notes.append(f"evaluated {again}apart from other memory-hungry evaluations: "
                                        f"{lock.apart_keys[task.digest]}")
        if result is None:
            # Out of memory apart as well: its final word is the GPU's alone.
            self.on_stage("build", "out of GPU memory apart from other memory-hungry evaluations: evaluated again "
                                   "with the GPU alone")
            lock.alone_keys.add(task.digest)
            result = self._attempt_alone(task, candidate, build_result, timed)
            result.notes.append(f"evaluated again with the GPU alone: it ran out of memory apart from other "
                                f"memory-hungry ones too, apart since {lock.apart_keys[task.digest]}")
        return result

    def _attempt(self, task: Task, candidate: Candidate, build_result: BuildResult | None, timed: bool) -> EvalResult:
        result = EvalResult(
            task=task.to_dict(),
            candidate=candidate.to_dict(),
            device=self.device,
            policy=self.policy.to_dict(),
            timing=self.timing.to_dict(),
            environment=describe_environment(self.device, self.gpu_index),
            notes=list(candidate.notes),
        )
        lock = self.timing_lock if isinstance(self.timing_lock, DeviceLock) else None
        if lock is not None:
            lock.take_waited()  # from here: this attempt's waits only
            lock.take_share_waited()
        try:
            self._evaluate(task, candidate, build_result, result, timed)
        except Stop as stop:
            result.status, result.stage, result.reason = stop.status, stop.stage, stop.reason
            result.traceback = stop.traceback
            result.rule = stop.rule
            result.reward = None if stop.status == "error" else -1.0
        if lock is not None:
            # Part of the "reference" and "profile" stages, not beside them: the wait for neighbours on the device.
            result.durations["wait_timing"] = lock.take_waited()
            # Before any stage (its start) or inside "profile" and "reference" (after a timing): behind timings.
            result.durations["wait_share"] = lock.take_share_waited()
        return result

    def _attempt_alone(self, task: Task, candidate: Candidate, build_result: BuildResult | None,
                       timed: bool) -> EvalResult:
        """``_attempt`` with the GPU alone: the evaluations in progress finish first. The idle references of
        other tasks (up to ``reference_memory`` of device memory) are closed only if it still runs out of memory
        beside them: closed up front, every task's next candidate would start its reference again."""
        with self.timing_lock.alone():
            result = self._attempt(task, candidate, build_result, timed)
            if self._out_of_memory(result) and self.references.drop_idle(keep=ref.reference_key(self._setup(), task)):
                result = self._attempt(task, candidate, build_result, timed)
            return result

    def _attempt_apart(self, task: Task, candidate: Candidate, build_result: BuildResult | None,
                       timed: bool) -> EvalResult | None:
        """``_attempt`` beside other evaluations but not beside another one apart (``DeviceLock.apart``); None
        where it runs out of device memory even so (whether or not others were beside it: the memory of one
        that has just ended may still be going), for the caller to run it alone."""
        asked = time.monotonic()
        with self.timing_lock.apart():
            waited = time.monotonic() - asked
            result = self._attempt(task, candidate, build_result, timed)
        # Before any stage: the turn of the evaluation apart before it (the memory-hungry tasks' chain).
        result.durations["wait_apart"] = round(waited, 3)
        return None if self._out_of_memory(result) else result

    def _beside_others(self) -> bool:
        """Whether this attempt is at the step beside any evaluation, with other evaluators on its GPU."""
        lock = self.timing_lock
        # ``spares``: one list per evaluator on this GPU; alone on it, nothing is beside it to run out beside.
        return isinstance(lock, DeviceLock) and len(lock.spares) >= 2 and lock.step == "shared"

    def _hungry_first(self, setup: Setup, task: Task, reference: LiveReference, candidate: Any, result: EvalResult,
                      timed: bool) -> None:
        """Where ``_stop_if_hungry`` may stop this attempt, it is asked as soon as the reference has loaded, before
        the candidate's process (started meanwhile) is told anything, so that it can serve the attempt apart."""
        if not self._beside_others():
            return
        if reference.loaded is None:
            clock = time.monotonic()
            with self._pausable(reference, candidate):
                ref.await_loaded(setup, reference)
            result.durations["reference"] = round(time.monotonic() - clock, 3)  # ``_load`` adds its own
        self._stop_if_hungry(reference.loaded, (lambda: self._baselines_ahead(setup, task, reference, candidate,
                                                                               result)) if timed else (lambda: None))

    def _stop_if_hungry(self, loaded: LoadReply | None, ahead: Callable[[], None] = lambda: None) -> None:
        """An attempt beside any evaluation, of a task whose output is ``HUNGRY_SHARE`` of the GPU's memory or
        more, stops here, before the candidate's inputs are written, for ``evaluate`` to run it ``apart``; having
        done ``ahead`` first (``_baselines_ahead``)."""
        if (not self._beside_others() or loaded is None or not loaded.device_bytes
                or loaded.output_bytes < HUNGRY_SHARE * loaded.device_bytes):
            return
        ahead()
        raise Stop("error", "reference", f"its output ({loaded.output_bytes / 1024**3:.1f} GiB) is at least "
                   f"1/{round(1 / HUNGRY_SHARE)} of the GPU's memory", rule=MEMORY_HUNGRY)

    def _baselines_ahead(self, setup: Setup, task: Task, reference: LiveReference, candidate: Any,
                         result: EvalResult) -> None:
        """At the hungry stop the reference is loaded and the apart turn is still to come: torch.compile it now,
        beside the others (seconds for a GB-output task, which its first candidate would otherwise spend holding
        the apart turn that the other memory-hungry tasks wait for). The reference is kept for that turn,
        so it finds its compiled model there. Running out of memory here only leaves the compile to that turn."""
        try:
            with self._pausable(reference, candidate):
                ref.baselines_for(setup, self.baselines, task, reference, result)
        except Stop as stop:
            if "out of memory" not in stop.reason:
                raise

    def _out_of_memory(self, result: EvalResult) -> bool:
        return self.device == "cuda" and result.stage is not None and "out of memory" in (result.reason or "")

    def _out_of_memory_beside_others(self, result: EvalResult) -> bool:
        """A GPU evaluation that ran out of device memory (the candidate's or the reference's) while
        another evaluation shared the device."""
        lock = self.timing_lock
        return isinstance(lock, DeviceLock) and lock.crowded and self._out_of_memory(result)

    def verify(self, task: Task, candidate: Candidate, build_result: BuildResult | None = None) -> EvalResult:
        """Correctness only (the checks, the runtime guards, attribution), no timing: what an agent's
        "is it correct?" needs, at a fraction of an evaluation's cost. ``reward`` is None when correct."""
        return self.evaluate(task, candidate, build_result, timed=False)

    def _evaluate(self, task: Task, candidate: Candidate, build_result: BuildResult | None, result: EvalResult,
                  timed: bool) -> None:
        """The build stage, then the two processes of ``_run`` (and the spares topped up after it)."""
        setup = self._setup()
        code_policy = self.policy.code_policy()
        if self.policy.static_checks:
            self._refuse(check_candidate(candidate, code_policy), result)
        # On a device shared with other evaluators (a DeviceLock), this evaluation uses it side by side with
        # theirs and times it alone (on the CPU backend its compiles use the device too: ``build``).
        built = self._built(candidate, build_result, result)
        with shared_use(setup.timing_lock):
            kernels = None
            if candidate.language == "triton":
                # Triton compiles and autotunes here, on the task's shapes, never in the evaluated process; on the
                # device side by side with other evaluations, as the rest of this one, never during their timing.
                kernels = compile_triton(setup, task, candidate, result)
                if kernels is not None:
                    self._triton_launcher = self._triton_launcher or build_launcher(setup)
            self._evaluate_built(task, candidate, built, result, timed, setup, code_policy, kernels)

    def _built(self, candidate: Candidate, build_result: BuildResult | None, result: EvalResult) -> BuildResult:
        clock = time.monotonic()
        self.on_stage("build", f"{len(candidate.extensions)} extension(s), backend {self.backend}")
        built = build_result or self.build(candidate)
        result.build = built.to_dict()
        result.compiled = built.ok
        result.durations["build"] = round(time.monotonic() - clock, 3)
        if not built.ok:
            raise Stop("failed", "build", built.error or "build failed")
        return built

    def _evaluate_built(self, task: Task, candidate: Candidate, built: BuildResult, result: EvalResult, timed: bool,
                        setup: Setup, code_policy: CodePolicy, triton_kernels: Path | None = None) -> None:
        if self.policy.static_checks and built.modules:
            self._refuse(audit_symbols([Path(p) for p in built.modules.values()], code_policy,
                                       self.toolchain_imports()), result, "built extension: ")

        workers = take_workers(self._spare, setup)
        reference = self.references.take(ref.reference_key(setup, task))
        fresh = reference is None
        brackets = None
        told = False  # whether the candidate's process has been told anything of this evaluation
        try:
            if reference is None:
                reference = ref.launch(setup, task)
            self._hungry_first(setup, task, reference, workers.candidate, result, timed)
            told = True
            job = workers.job
            (job / "task.py").write_text(task.code)
            (job / "model_new.py").write_text(candidate.model_new)
            if setup.timing.brackets:
                brackets = CandidateBrackets.open(workers.candidate, setup.device,
                                                  setup.policy.writes_inputs(setup.device))
            run = Evaluation(setup, task, result, job, reference, Channel(workers.candidate, "candidate"), fresh,
                             brackets, language=candidate.language,
                             kernel_names=frozenset(triton_kernels_of(candidate)),
                             triton_kernels=copy_kernels(triton_kernels, job, self._triton_launcher)
                             if triton_kernels else None)
            self._run(run, built, copy_modules(built, job), timed)
        finally:
            if brackets is not None:
                brackets.close()
            result.output = workers.candidate.output[-8000:]
            if told or not workers.alive():
                workers.close()
            else:
                # Stopped for ``apart`` before it was told anything: the apart attempt's, started already (a new
                # one starts slowly beside a stream's first wave of evaluations).
                self._spare.insert(0, workers)
            if reference is not None:
                # Kept only if it is loaded and answers nothing still (an evaluation that stopped early
                # may have left a request unanswered).
                reference.evaluations += 1
                healthy = ref.idle(setup, self.references, reference)
                kept = self.references.give_back(reference, healthy)
                if healthy and self.references.bound:
                    # What a kept reference costs the card: the pool's bound is sized by these (docs/SCALE.md).
                    result.notes.append(f"reference process idle: {reference.reserved / 1024**3:.2f} GiB of device "
                                        f"memory, {'kept' if kept else 'closed'}")
                    if not kept:
                        result.notes.append(
                            f"its reference process was not kept for the next evaluation: it holds "
                            f"{reference.reserved / 1024**3:.1f} GiB of device memory idle, more than idle references "
                            f"may hold together ({self.references.bound / 1024**3:.1f} GiB)")
            else:
                self.references.forfeit(ref.reference_key(setup, task))
            self._top_up(setup, self.prestart)  # started now, so they are ready when the next evaluations come

    def _top_up(self, setup: Setup, count: int) -> None:
        """Candidate processes started ahead until this evaluator holds ``count``. Called inside its device share: a
        timing, which stops every slot's spares, reads these lists only while no slot holds one."""
        while len(self._spare) < count:
            self._spare.append(start_workers(setup))

    @staticmethod
    def _refuse(violations: list[Violation], result: EvalResult, prefix: str = "") -> None:
        if violations:
            result.violations = [v.to_dict() for v in violations]
            raise Stop("failed", "policy", prefix + violations[0].describe(), rule=violations[0].rule)

    def toolchain_imports(self) -> frozenset[str]:
        """What a minimal extension built here imports (torch's headers, the toolchain): built
        once per cache, in its own namespace (the build cache keys it by compiler, torch and CUDA), read
        once per evaluator."""
        if self._probe_imports is None:
            probe = self.build_probe()
            if not probe.ok:
                raise Stop("error", "build", f"the toolchain probe extension does not build: {probe.error}")
            self._probe_imports = imported_symbols([Path(p) for p in probe.modules.values()])
        return self._probe_imports

    # -- beside evaluations: baselines, degenerate tasks, hardware counters ------------------
    def baseline(self, task: Task, refresh: bool = False, degenerate: bool = False) -> dict[str, Any]:
        """Eager (and torch.compile) timings of ``task`` on this evaluator's device: the cached record,
        measured now if there is none (or with ``refresh``) in rounds until each baseline's per-round
        spread is within ``TimingConfig.baseline_spread`` (a baseline still too noisy, or timed on a
        busy GPU, is returned with a note and not cached). Adds ``cached``, ``key``, ``environment``,
        ``durations`` (seconds per stage) and ``notes``. With ``degenerate``, the same reference
        process also runs ``check_degenerate``'s check: the record gets ``degenerate`` (a
        ``DegenerateReport``), or ``degenerate_error`` if it could not run."""
        return ref.baseline(self._setup(), self.baselines, self.references, task, refresh, degenerate,
                            spares_stopped(*self._spare_groups()))

    def check_degenerate(self, task: Task, draws: int = 3) -> DegenerateReport:
        """Whether trivial candidates (zeros, a constant, an input, an input's mean)
        pass ``task`` under this evaluator's policy. Runs the reference process only."""
        if draws < 2:
            raise ValueError("check_degenerate needs at least 2 draws (one fits the constant).")
        setup = self._setup()
        with ref.loaded_reference(setup, self.references, task, "the degenerate-task check could not run") as reference:
            return ref.run_degenerate(setup, task, reference.channel, draws)

    def counters(self, task: Task, candidate: Candidate, times: dict[str, float] | None = None,
                 build_result: BuildResult | None = None, raw_to: Path | None = None) -> CounterReport:
        """Profile one call of ``candidate`` with Nsight Compute, in the sandbox: per-kernel counters,
        what limits each kernel, and the task's speed of light (``evaluate.counters``). ``times`` (median
        ms of candidate/eager/compile: ``counters.times_of(result)`` of its evaluation) are set against
        the speed of light; profile only a candidate that evaluated correct. Where there is nothing to
        profile with, the report says why instead of failing. ``raw_to`` keeps ncu's CSV and the task's
        facts there (test fixtures)."""
        times = dict(times or {})
        if self.device != "cuda":
            return unavailable("the CPU backend reports times only; hardware counters need an NVIDIA GPU "
                               "and Nsight Compute (--device cuda)", times)
        ncu = find_ncu()
        if ncu is None:
            return unavailable("Nsight Compute (ncu) was not found: it ships with the CUDA toolkit "
                               "(CUDA_HOME/bin/ncu); put it on PATH or set CUDA_AGENT_NCU", times)
        built = build_result or self.build(candidate)
        if not built.ok:
            return unavailable(f"the build failed: {(built.error or '')[:300]}", times)
        return profile_counters(self._setup(), task, candidate, times, built, raw_to, ncu)

    # -- the processes it keeps ----------------------------------------------------------
    def close(self) -> None:
        """Stop the started spare processes and the kept reference processes; the evaluator can
        still be used."""
        close_all(self._spare, self.references)

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def evaluate(task: Task, candidate: Candidate, device: str = "auto", **options: Any) -> EvalResult:
    """Evaluate one candidate; options are :class:`Evaluator`'s."""
    return Evaluator(device, **options).evaluate(task, candidate)
