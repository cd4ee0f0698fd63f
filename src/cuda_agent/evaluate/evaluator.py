"""Orchestrates one evaluation: build -> reference -> verify -> timing rounds -> reward.

This process never imports candidate code and never holds expected outputs:
the reference process computes and compares them; the candidate process runs
the candidate. Each evaluation gets a fresh candidate process, so a crash, hang
or flood in one candidate cannot touch the next. Reference processes run only
the pristine task program, so a long-lived evaluator keeps them across
evaluations (``evaluate.references``). Candidate and baselines are timed in
interleaved rounds until each reward decision is confident (``evaluate.decide``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from cuda_agent.build import BuildResult, build
from cuda_agent.candidates import Candidate
from cuda_agent.evaluate.baseline import BaselineCache, baseline_key
from cuda_agent.evaluate.brackets import CandidateBrackets
from cuda_agent.evaluate.channel import Channel, Stop
from cuda_agent.evaluate.counters import (
    MAX_NCU_BYTES, METRICS, NCU_FLAGS, CounterReport, CountersError, build_report, unavailable,
)
from cuda_agent.evaluate.decide import (
    Plan, Rounds, Speedup, clock_check, other_threads_ms, run_rounds, settled, speedup,
)
from cuda_agent.evaluate.environment import describe_environment
from cuda_agent.evaluate.policy import Policy, TimingConfig
from cuda_agent.evaluate.protocol import (
    AttachReply, AttachRequest, CalibrateReply, CallRecord, CalibrateRequest, CompareReply, CompareRequest, CompileReply,
    CompileRequest, DegenerateReply, DegenerateRequest, ExpectReply, ExpectRequest, LoadReply, LoadRequest,
    OutputReply, OutputRequest, RecordCheck, RecordsReply, RecordsRequest, ReleaseReply, ReleaseRequest, RunReply,
    ReadyReply, ReadyRequest, RunRequest, SampleReply, SampleRequest, TimedReply, TimedRequest, TimeReply,
    TimeRequest, WeightsRequest,
)
from cuda_agent.evaluate.references import LiveReference, ReferencePool
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.evaluate.reward import compute_reward, milestone
from cuda_agent.evaluate.timing import host_hold, trial_seed
from cuda_agent.evaluate.records import RECORDED_PER_REGION, same_samples
from cuda_agent.build.probe import probe_candidate
from cuda_agent.guard import Violation, audit_symbols, check_candidate
from cuda_agent.guard.symbols import imported_symbols
from cuda_agent.guard.attribution import (
    Attribution, AttributionError, attribute, coverage_reason, decoy_reason, extension_kernels, own_matcher,
    parse_kernel_report, stream_reason,
)
from cuda_agent.guard.device_state import can_check_idle, gpu_busy
from cuda_agent.guard.integrity import IntegrityWatch
from cuda_agent.evaluate.degenerate import DegenerateReport
from cuda_agent.evaluate.plausibility import MemorySystem, below_speed_of_light, memory_system
from cuda_agent.paths import PACKAGE_ROOT, cache_root, worker_env
from cuda_agent.sandbox import Limits, Sandbox, WorkerProcess, make_sandbox, run_command
from cuda_agent.sandbox.nocode import LOCK_CODE_ENV
from cuda_agent.tasks import Task, TaskError

SPARE_CANDIDATES = 3  # candidate processes started ahead by a prestarted evaluator
# Recorded timed calls whose records are checked, drawn after all rounds uniformly over all of them (the
# last call is checked whole besides): a candidate wrong on a share p of its calls passes with (1-p)^8.
TIMED_CHECKS = 8
EMPTY_ROUNDS = 3  # rounds of the candidate's plan without its calls, in the reference (the outside clock)
BASELINES = ("eager", "compile")
StageCallback = Callable[[str, str], None]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass
class CandidateLog:
    """What the candidate's timing rounds left for the checks after them."""

    plan: Plan
    records: list[tuple[int, CallRecord]] = field(default_factory=list)  # (the round's probe, record)
    walls_ms: list[float] = field(default_factory=list)  # each round by the evaluator's clock
    claimed_ms: list[float] = field(default_factory=list)  # each round's regions as the candidate reported them
    empty_ms: list[float] = field(default_factory=list)  # rounds of its plan without the calls (reference)
    hold_us: float | None = None  # before each of its regions and the empty rounds' (Evaluator._candidate_hold)


LATE_SHARE = 0.25  # of the candidate's regions outlasting their hold before its result says so
# CPU time a thread of the candidate's process that existed before its code loaded (not the one that
# calls it) may use while it is timed on a GPU: this much, or this share of the calling thread's, whichever
# is more (_check_borrowed_threads). Measured on the H200, legitimate candidates: at most 2.7 ms and 0.3%
# alone, 20.8 ms and 2.8% with other evaluations on the machine (torch's CPU pool spinning after the
# harness's own CPU work).
BORROWED_THREAD_MS = 50.0
BORROWED_THREAD_SHARE = 0.25


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


@dataclass(frozen=True)
class Timeouts:
    build_s: float = 300.0
    load_s: float = 300.0
    check_s: float = 300.0
    baseline_s: float = 1200.0
    profile_s: float = 600.0
    counters_s: float = 600.0  # the Nsight Compute run of Evaluator.counters (each kernel is replayed)


def resolve_device(device: str) -> str:
    """The device to run on: "auto" is the one this machine has; "cuda" only where torch sees a GPU."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or auto.")
    if device == "cpu":
        return device
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if device == "auto":
        return "cpu"
    # Checked here, not left to the evaluation: without a GPU it would first spend a minute in nvcc
    # building the toolchain probe and then fail on that, naming the wrong problem.
    build = f"torch {torch.__version__} is built for CUDA {torch.version.cuda}" if torch.version.cuda \
        else f"torch {torch.__version__} is a CPU-only build"
    raise ValueError(f"device 'cuda': no CUDA GPU is visible here (torch.cuda.is_available() is False; {build}); "
                     "use device 'cpu' (`--device cpu`, or `--device auto`), or run on a machine with a GPU. "
                     "Compiling needs no GPU: `cuda-agent compile CANDIDATE --backend cuda`.")


@dataclass
class _Workers:
    """The job directory and the candidate process of one evaluation."""

    job: Path
    candidate: WorkerProcess

    def alive(self) -> bool:
        return self.candidate.proc.poll() is None

    def close(self) -> None:
        # Killed, not asked to exit: nothing is left to say.
        self.candidate.kill()
        self.candidate.close()
        shutil.rmtree(self.job, ignore_errors=True)


def _close_all(spare: list[_Workers], references: ReferencePool) -> None:
    while spare:
        spare.pop().close()
    references.close()


class Evaluator:
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
        prestart: bool | int = False,
        references: int | None = None,
        reference_memory: int = 16 * 1024**3,
        on_stage: StageCallback | None = None,
    ):
        self.device = resolve_device(device)
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
        self.on_stage = on_stage or (lambda stage, detail: None)
        self.baselines = BaselineCache(self.cache_dir / "baselines")
        self._probe_imports: frozenset[str] | None = None
        # With ``prestart``, each evaluation ends by topping up the candidate processes started ahead
        # (torch imported, CUDA up: a process takes 6-8 s to start on the H200, longer than a warm
        # evaluation, so back-to-back evaluations need several in flight); close() stops them.
        # ``prestart=True`` keeps SPARE_CANDIDATES; an int keeps that many.
        self.prestart = SPARE_CANDIDATES if prestart is True else int(prestart)
        self._spare: list[_Workers] = []
        # Reference processes kept between evaluations (least recently used evicted): by default 4 for
        # a long-lived (prestarted) evaluator, none for a one-shot one, which leaves nothing behind.
        # They hold GPU memory while idle (model, compiled graph, CUDA context): at most
        # ``reference_memory`` bytes together, or candidates of other tasks run out of memory.
        self.references = ReferencePool(references if references is not None else (4 if self.prestart else 0),
                                        reference_memory if self.device == "cuda" else None)
        weakref.finalize(self, _close_all, self._spare, self.references)

    @property
    def backend(self) -> str:
        return self.device

    def build(self, candidate: Candidate) -> BuildResult:
        return build(candidate, self.backend, cache_dir=self.cache_dir, sandbox=self.sandbox, timeout_s=self.timeouts.build_s)

    # -- one evaluation -----------------------------------------------------------
    def evaluate(self, task: Task, candidate: Candidate, build_result: BuildResult | None = None, *,
                 timed: bool = True) -> EvalResult:
        """Build, verify and (``timed``) time ``candidate`` on ``task``: the rewarded record. With
        ``timed=False`` (``verify``) the record says whether it is correct, with no times and no reward."""
        started = time.monotonic()
        result = EvalResult(
            task=task.to_dict(),
            candidate=candidate.to_dict(),
            device=self.device,
            policy=self.policy.to_dict(),
            timing=self.timing.to_dict(),
            environment=describe_environment(self.device, self.gpu_index),
            notes=list(candidate.notes),
        )
        try:
            self._evaluate(task, candidate, build_result, result, timed)
        except Stop as stop:
            result.status, result.stage, result.reason = stop.status, stop.stage, stop.reason
            result.traceback = stop.traceback
            result.rule = stop.rule
            result.reward = None if stop.status == "error" else -1.0
        result.durations["total"] = round(time.monotonic() - started, 3)
        self.on_stage("done", f"{result.status}, reward {result.reward}")
        return result

    def verify(self, task: Task, candidate: Candidate, build_result: BuildResult | None = None) -> EvalResult:
        """Correctness only (the checks, the runtime guards, attribution), no timing: what an agent's
        "is it correct?" needs, at a fraction of an evaluation's cost. ``reward`` is None when correct."""
        return self.evaluate(task, candidate, build_result, timed=False)

    def _evaluate(self, task: Task, candidate: Candidate, build_result: BuildResult | None, result: EvalResult,
                  timed: bool) -> None:
        code_policy = self.policy.code_policy()
        if self.policy.static_checks:
            self._refuse(check_candidate(candidate, code_policy), result)
        clock = time.monotonic()
        self.on_stage("build", f"{len(candidate.extensions)} extension(s), backend {self.backend}")
        built = build_result or self.build(candidate)
        result.build = built.to_dict()
        result.compiled = built.ok
        result.durations["build"] = round(time.monotonic() - clock, 3)
        if not built.ok:
            raise Stop("failed", "build", built.error or "build failed")
        if self.policy.static_checks:
            self._refuse(audit_symbols([Path(p) for p in built.modules.values()], code_policy, self.toolchain_imports()),
                         result, "built extension: ")

        workers = self._take_workers()
        reference = self.references.take(self._reference_key(task))
        fresh = reference is None
        brackets = None
        try:
            if reference is None:
                reference = self._launch_reference(task)
            job = workers.job
            (job / "task.py").write_text(task.code)
            (job / "model_new.py").write_text(candidate.model_new)
            if self.timing.brackets:
                brackets = CandidateBrackets.open(workers.candidate, self.device)
            self._run(task, built, self._copy_modules(built, job), result, job, reference, fresh,
                      Channel(workers.candidate, "candidate"), timed, brackets)
        finally:
            if brackets is not None:
                brackets.close()
            workers.close()
            result.output = workers.candidate.output[-8000:]
            if reference is not None:
                # Kept only if it is loaded and answers nothing still (an evaluation that stopped early
                # may have left a request unanswered).
                reference.evaluations += 1
                self.references.give_back(reference, self._idle(reference))
            while len(self._spare) < self.prestart:
                # Started now, so they are ready when the next evaluations come.
                self._spare.append(self._start_workers())

    # -- hardware counters (advice for the agent; never part of a reward) ----------------------
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
        try:
            own = extension_kernels([Path(p) for p in built.modules.values()])
        except AttributionError:
            own = frozenset()  # every kernel then shows as library/other; the counters still stand
        job = self._new_job("cuda-agent-counters-")
        started = time.monotonic()
        try:
            (job / "task.py").write_text(task.code)
            (job / "model_new.py").write_text(candidate.model_new)
            request = LoadRequest(**self._task_message(task, job, secrets.randbits(31)),
                                  model_new_file=str(job / "model_new.py"), modules=self._copy_modules(built, job))
            (job / "spec.json").write_text(json.dumps({"request": asdict(request), "seed": secrets.randbits(31)}))
            env = worker_env(job)
            if self.gpu_index is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(self.gpu_index)
            argv = [ncu, *NCU_FLAGS, "--metrics", ",".join(METRICS), "--log-file", str(job / "ncu.csv"),
                    sys.executable, "-m", "cuda_agent.evaluate.counters_target", str(job / "spec.json")]
            self.on_stage("counters", "one call under Nsight Compute")
            with self.timing_lock:  # its replays would disturb another evaluator's timing on this GPU
                ran = run_command(argv, cwd=job, env=env, sandbox=self.sandbox, gpu=True, writable=[job],
                                  readable=[PACKAGE_ROOT],
                                  limits=Limits(timeout_s=self.timeouts.counters_s, output_bytes=self.output_limit,
                                                memory_bytes=self.memory_limit))
            log = ""
            if (job / "ncu.csv").exists():
                with open(job / "ncu.csv", "rb") as handle:  # bounded: the sandbox could have written it
                    log = handle.read(MAX_NCU_BYTES + 1).decode(errors="replace")
            if raw_to is not None:
                raw_to.mkdir(parents=True, exist_ok=True)
                for name in ("ncu.csv", "facts.json"):
                    if (job / name).exists():
                        shutil.copy2(job / name, raw_to / name)
            if ran.timed_out or ran.returncode != 0 or not (job / "facts.json").exists():
                why = "timed out" if ran.timed_out else f"exit status {ran.returncode}"
                return unavailable(f"the profile run failed ({why}): {(log + ran.output)[-1500:].strip()}", times)
            try:
                facts = json.loads((job / "facts.json").read_text())
                report = build_report(log, facts, own_matcher(own), times)
            except (CountersError, ValueError, TypeError) as exc:
                return unavailable(f"ncu's output could not be read: {exc}; {(log + ran.output)[-800:].strip()}", times)
            report.seconds = round(time.monotonic() - started, 2)
            return report
        finally:
            shutil.rmtree(job, ignore_errors=True)

    def _take_workers(self) -> "_Workers":
        """The oldest started spare candidate process (the likeliest to have finished starting) if it
        is still alive, else a new one."""
        while self._spare:
            workers = self._spare.pop(0)
            if workers.alive():
                return workers
            workers.close()
        return self._start_workers()

    def _start_workers(self) -> "_Workers":
        """A job directory and the candidate process of one evaluation, started before it knows the
        task or the candidate (importing torch and starting CUDA take seconds)."""
        job = self._new_job()
        (job / "candidate").mkdir()
        return _Workers(job, self._spawn("candidate", job / "candidate", [job]))

    @staticmethod
    def _copy_modules(built: BuildResult, job: Path) -> dict[str, str]:
        """The built extensions, copied into the job: the candidate process sees its own build and
        nothing else of the build cache."""
        modules = {}
        for number, (name, path) in enumerate(sorted(built.modules.items())):
            home = job / "extensions" / str(number)
            home.mkdir(parents=True)
            modules[name] = str(shutil.copy2(path, home / Path(path).name))
        return modules

    def close(self) -> None:
        """Stop the started spare processes and the kept reference processes; the evaluator can
        still be used."""
        _close_all(self._spare, self.references)

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def toolchain_imports(self) -> frozenset[str]:
        """What a minimal extension built here imports (torch's headers, the toolchain): built
        once per cache (the build cache keys it by compiler, torch and CUDA), read once per evaluator."""
        if self._probe_imports is None:
            # Said aloud: on a fresh cache this build is a silent pause of ~30 s after the candidate's.
            self.on_stage("build", "one-time toolchain probe: a minimal extension, built once per cache, "
                                   "tells the symbol audit what the toolchain itself imports")
            clock = time.monotonic()
            probe = self.build(probe_candidate(self.backend))
            if probe.ok and not probe.cached:
                self.on_stage("build", f"toolchain probe built in {time.monotonic() - clock:.0f} s (cached from now on)")
            if not probe.ok:
                raise Stop("error", "build", f"the toolchain probe extension does not build: {probe.error}")
            self._probe_imports = imported_symbols([Path(p) for p in probe.modules.values()])
        return self._probe_imports

    @staticmethod
    def _refuse(violations: list[Violation], result: EvalResult, prefix: str = "") -> None:
        if violations:
            result.violations = [v.to_dict() for v in violations]
            raise Stop("failed", "policy", prefix + violations[0].describe(), rule=violations[0].rule)

    def _new_job(self, prefix: str = "cuda-agent-job-") -> Path:
        """A job directory for the task and each process's own directory. Each process writes only
        its own directory: the candidate cannot touch the task file or the state dict the
        reference reads."""
        job = Path(tempfile.mkdtemp(prefix=prefix, dir=self.work_dir))
        (job / "reference").mkdir()
        return job

    def _tolerance(self) -> dict[str, Any]:
        return self.policy.tolerance()

    def _expect(self, seed: int) -> ExpectRequest:
        """The reference's request for the expected output of the inputs drawn from ``seed``."""
        return ExpectRequest(seed=seed, strict=self.policy.strict_expected, slack=self.policy.precision_slack,
                             **self._tolerance())

    # -- reference processes --------------------------------------------------------
    def _reference_key(self, task: Task) -> str:
        return f"{task.digest}:{task.name}:{self.policy.tf32}"

    def _launch_reference(self, task: Task) -> LiveReference:
        """Start a reference process for ``task`` and ask it to load (without waiting: the candidate
        loads meanwhile); ``_await_reference`` takes the answer."""
        home = self._new_job("cuda-agent-ref-")
        (home / "task.py").write_text(task.code)
        init_seed = secrets.randbits(62)
        channel = Channel(self._spawn("reference", home / "reference", [home]), "reference")
        reference = LiveReference(self._reference_key(task), home, channel, init_seed)
        try:
            channel.send("reference", LoadRequest(**self._task_message(task, home, init_seed),
                                                  warm=self._expect(secrets.randbits(62))))
        except Stop:
            reference.close()
            raise
        return reference

    def _await_reference(self, reference: LiveReference) -> None:
        """The reference's load answer, and the memory it shares for outputs (its descriptor is kept
        here, unmapped, and relayed to every candidate process)."""
        loaded = reference.channel.receive_typed("reference", LoadReply, self.timeouts.load_s)
        shared = loaded.share
        if shared is not None and shared.shared:
            try:
                reference.share_fd = reference.channel.worker.receive_fd(self.timeouts.check_s)
                reference.share_bytes = int(shared.bytes or 0)
            except OSError as exc:
                raise Stop("error", "load", f"reference process: the shared memory did not arrive: {exc}") from None
        else:
            reference.share_note = str(shared.reason if shared is not None else None)
        reference.loaded = loaded

    def _idle(self, reference: LiveReference) -> bool:
        """Leave ``reference`` holding as little as it can; whether it can be kept for the next
        evaluation (loaded, nothing unanswered, still answering)."""
        if self.references.capacity <= 0 or reference.loaded is None or not reference.channel.drain(self.timeouts.check_s):
            return False
        try:
            reference.reserved = int(reference.channel.ask_typed("idle", ReleaseRequest(), ReleaseReply, 60).reserved)
        except Stop:
            return False
        return True

    @contextlib.contextmanager
    def _loaded_reference(self, task: Task, failure: str) -> Iterator[LiveReference]:
        """A reference process with ``task`` loaded (a kept one where there is one); trouble in it
        becomes a ``TaskError`` that says ``failure``."""
        reference = self.references.take(self._reference_key(task))
        healthy = False
        try:
            if reference is None:
                reference = self._launch_reference(task)
                self._await_reference(reference)
            yield reference
            healthy = True
        except Stop as stop:
            raise TaskError(f"{task.source}: {failure}: {stop.reason}") from None
        finally:
            if reference is not None:
                self.references.give_back(reference, healthy and self._idle(reference))

    def _task_message(self, task: Task, home: Path, init_seed: int) -> dict[str, Any]:
        return {
            "task_file": str(home / "task.py"),
            "task_name": task.name,
            "task_source": task.source,
            "device": self.device,
            "tf32": self.policy.tf32,
            "allowed_aten": list(self.policy.allowed_aten),
            "init_seed": init_seed,
            "state_dict_path": str(home / "reference" / "state_dict.pt"),
        }

    # -- the stages -------------------------------------------------------------------
    def _run(self, task: Task, built: BuildResult, modules: dict[str, str], result: EvalResult, job: Path,
             reference: LiveReference, fresh: bool, candidate: Channel, timed: bool,
             brackets: CandidateBrackets | None = None) -> None:
        own_kernels = self._own_kernels(built, result)
        clock = time.monotonic()
        self.on_stage("reference", "starting the task's reference process" if fresh else "kept from earlier")
        # The candidate imports its code while the reference loads; baselines are timed later, in
        # rounds interleaved with the candidate's. Before it does, the signals its process catches are
        # read from outside, once its own start-up is over.
        ready = candidate.ask_typed("load", ReadyRequest(bell=brackets is not None), ReadyReply, self.timeouts.load_s)
        handlers = candidate.worker.signal_handlers()
        threads = candidate.worker.threads()  # the harness's own, started before the first request
        watch = self._watch_integrity(candidate, ready.slots or {}, job, result)
        if ready.code_lock != "on":
            result.notes.append(f"code pages not locked in the candidate's process: {ready.code_lock}")
        calibrating: dict[str, Any] = {}
        if brackets is not None:
            brackets.read_from(watch.pid if watch is not None else candidate.worker.harness_pid())
            calibrating = brackets.calibration_fields(self._bracket_hold(), self.timing.to_dict())
        candidate.send("load", LoadRequest(**self._task_message(task, job, reference.init_seed),
                                           model_new_file=str(job / "model_new.py"), modules=modules, **calibrating))
        calibration = brackets.serve_calibration(self.timeouts.load_s) if brackets is not None else None
        if fresh:
            self._await_reference(reference)
        result.durations["reference"] = round(time.monotonic() - clock, 3)
        result.notes.append(f"reference process {'started' if fresh else 'kept'} "
                            f"({reference.evaluations} earlier evaluation(s))")

        clock = time.monotonic()
        self.on_stage("load", "importing the candidate")
        weights = job / "state_dict.pt"  # readable by the candidate, in its job, not the reference's home
        try:
            os.link(reference.state_dict, weights)
        except OSError:
            shutil.copy2(reference.state_dict, weights)
        loaded = candidate.receive_typed("load", LoadReply, self.timeouts.load_s)
        if brackets is not None:
            brackets.calibrate(calibration, loaded.bell_ms, self._bracket_hold())
        candidate.ask("load", WeightsRequest(state_dict_path=str(weights)), self.timeouts.load_s)
        self._share(reference, candidate, result)
        result.durations["load"] = round(time.monotonic() - clock, 3)
        self._check_signals(candidate, handlers, "load", "while model_new.py was imported")
        self._check_no_new_threads(candidate, threads, "load", "while model_new.py was imported")
        self._check_integrity(watch, "load", "while model_new.py was imported", result, pages=False)

        self._verify(reference.channel, candidate, job, own_kernels, result)
        self._check_signals(candidate, handlers, "verify", "during the checks")
        self._check_no_new_threads(candidate, threads, "verify", "during the checks")
        self._check_integrity(watch, "verify", "during the checks", result)
        if not timed:
            result.correct = True
            result.status = "correct"
            result.notes.append("verified only (no timing, no reward)")
            return
        reference.channel.ask("verify", ReleaseRequest(), 60)  # hold little memory while timing

        clock = time.monotonic()
        baseline, key = self._baselines_for(task, reference, result)
        result.durations["baseline"] = round(time.monotonic() - clock, 3)

        clock = time.monotonic()
        base = secrets.randbits(62)
        rounds, log = self._time_rounds(reference.channel, candidate, base, baseline, result, handlers=handlers,
                                        watch=watch, brackets=brackets)
        result.durations["profile"] = round(time.monotonic() - clock, 3)

        clock = time.monotonic()
        plan = Plan(**result.timing["plans"]["candidate"])
        last = rounds.count("candidate") * plan.trials * plan.calls - 1
        output_bytes = self._check_timed_outputs(reference.channel, candidate, base, log, last, job, result)
        self._check_signals(candidate, handlers, "verify", "while its timed outputs were read")
        # Before the clock: a timer patched below Python fails here by what was patched.
        self._check_integrity(watch, "profile", "during the timing rounds", result)
        # After the records: work finished past the end fails there, by name, before it shows as lost time.
        self._check_regions(brackets, log, result)
        self._check_clock(log, result)
        result.durations["verify"] += round(time.monotonic() - clock, 3)
        result.correct = True
        self._decide(rounds, baseline, key, output_bytes, result)

    def _verify(self, reference: Channel, candidate: Channel, job: Path, own_kernels: frozenset[str] | None,
                result: EvalResult) -> None:
        """The checks: fresh inputs from secret seeds, both sides computing at once; one of them,
        chosen in secret, profiled (its operators; on the GPU its kernels, for attribution)."""
        clock = time.monotonic()
        profiled = secrets.randbelow(self.policy.checks) if self.policy.checks > 0 else -1
        attribution = None
        for index in range(self.policy.checks):
            self.on_stage("verify", f"check {index + 1}/{self.policy.checks}")
            seed = secrets.randbits(62)
            out_dir = job / "candidate" / f"output-{index}"
            # Both sides compute at once; only timing needs the device to itself.
            reference.send("verify", self._expect(seed))
            candidate.send("verify", RunRequest(seed=seed, dir=str(out_dir), profile=index == profiled))
            expected = reference.receive_typed("verify", ExpectReply, self.timeouts.check_s)
            ran = candidate.receive_typed("verify", RunReply, self.timeouts.check_s)
            if index == profiled and own_kernels is not None:
                attribution = self._attribute(ran, own_kernels, result)
            check = self._check(reference, index, ran.fingerprint, expected.fingerprint, out_dir, ran.manifest)
            check["allowance"] = expected.allowance
            result.checks.append(check)
            if not check["ok"]:
                result.durations["verify"] = round(time.monotonic() - clock, 3)
                raise Stop("incorrect", "verify", f"check {index + 1}: {check['reason']}", rule="wrong-output")
        result.durations["verify"] = round(time.monotonic() - clock, 3)
        widest = max(c["allowance"] for c in result.checks)
        if widest > 1:
            result.notes.append(f"tolerance widened up to {widest:.2f}x: the task's own Model under the baselines' "
                                f"precision flags errs by that much over {self.policy.precision_slack:g} (policy "
                                "precision_slack)")
        self._judge_attribution(attribution)

    def _baselines_for(self, task: Task, reference: LiveReference, result: EvalResult) -> tuple[dict[str, Any], str]:
        """What the baselines are timed from: ``{"fixed": {side: stats}}`` for cached baselines
        (``TimingConfig.baselines == "cached"`` and a record in the cache), else the sides to time
        in the rounds."""
        key = baseline_key(task.digest, result.environment, result.policy, result.timing, self.device)
        if self.timing.baselines == "cached":
            cached = self._cached_baseline(key)
            if cached is not None:
                result.baseline_cached = True
                return {"fixed": {side: cached[side] for side in BASELINES if side in cached}, "record": cached}, key
        # A key already cached needs no new record, nor the idle check (0.2-0.5 s) that guards writing one.
        return self._timed_baselines(reference, cache=self._cached_baseline(key) is None), key

    def _timed_baselines(self, reference: LiveReference, cache: bool) -> dict[str, Any]:
        """Baselines to time in the rounds; with ``cache``, their record is written (if steady, on an
        idle GPU). torch.compile happens here, once per reference process."""
        return {"fixed": {}, "sides": self._baseline_sides(reference),
                "compile_error": (reference.compiled or {}).get("compile_error"), "cache": cache}

    def _baseline_sides(self, reference: LiveReference) -> list[str]:
        """The baselines the reference can time now (torch.compile asked for once per process)."""
        if not self.time_compile:
            return ["eager"]
        if reference.compiled is None:
            self.on_stage("baseline", "torch.compile (once per task's reference process)")
            reference.compiled = reference.channel.ask_typed("baseline", CompileRequest(seed=secrets.randbits(62)),
                                                             CompileReply, self.timeouts.baseline_s).to_dict()
        return ["eager", "compile"] if "compile_error" not in reference.compiled else ["eager"]

    def _time_rounds(self, reference: Channel, candidate: Channel | None, base: int, baseline: dict[str, Any],
                     result: EvalResult, undecided: Callable[[Rounds], bool] | None = None,
                     handlers: dict[int, int] | None = None, watch: IntegrityWatch | None = None,
                     brackets: CandidateBrackets | None = None) -> tuple[Rounds, CandidateLog | None]:
        """Time the candidate (if any) and the baselines in interleaved rounds until every decision is
        confident. Returns the rounds and what the candidate's rounds left: records, outside clock.
        ``watch``: the candidate's native entry points (``guard.integrity``), read once during each of
        its rounds; its pid is the worker's, whose main thread answers the requests."""
        main_pid = watch.pid if watch is not None else None
        config = self.timing
        fixed = {side: stats["median_ms"] for side, stats in baseline["fixed"].items()}
        sides: dict[str, Callable[[int, int, int], list[float]]] = {}
        plans: dict[str, Plan] = {}
        hosts: dict[str, dict[str, float]] = {}
        log: CandidateLog | None = None
        with self.timing_lock, self._spares_stopped():
            if baseline.get("sides") and baseline.get("cache"):
                result.notes.extend(f"baselines timed on a busy GPU and not cached: {busy}"
                                    for busy in [self._wait_until_idle()] if busy)
            cpu_before = candidate.worker.thread_cpu() if candidate is not None else {}
            threads_before = {tid: name for tid, (name, _) in cpu_before.items()}
            if candidate is not None:
                self.on_stage("profile", "warming the candidate up")
                estimate = candidate.ask_typed("profile", CalibrateRequest(seed=secrets.randbits(62), timing=config.to_dict()),
                                               CalibrateReply, self.timeouts.profile_s).estimate_ms
                self._pause(candidate)
                plans["candidate"] = plan = Plan.for_call(self._positive(estimate, "warm-up time"), config)
                log = CandidateLog(plan)
                sides["candidate"] = self._candidate_side(candidate, base, log, handlers or {}, hosts, watch, estimate,
                                                          brackets)
            host_us: dict[str, float] = {}
            for side in baseline.get("sides", []):
                self.on_stage("baseline", f"warming {side} up")
                request = CalibrateRequest(side=side, seed=secrets.randbits(62), timing=config.to_dict())
                calibrated = reference.ask_typed("baseline", request, CalibrateReply, self.timeouts.profile_s)
                plans[side] = Plan.for_call(calibrated.estimate_ms, config)
                host_us[side] = calibrated.host_us
                sides[side] = self._baseline_side(reference, side, secrets.randbits(62), hosts)
            if log is not None:
                log.hold_us = self._candidate_hold(reference, log.plan, host_us.get("eager"))
                self._time_empty(reference, log)
            rounds = Rounds(fixed=fixed)
            if undecided is None:
                undecided = lambda r: not self._settled(self._speedups(r))  # noqa: E731
            try:
                run_rounds(sides, plans, config, undecided, rounds, on_round=self._report_round)
            finally:
                if candidate is not None:
                    candidate.worker.resume()
            if candidate is not None and log is not None:
                self._check_no_new_threads(candidate, threads_before, "profile", "while it was timed")
                self._check_borrowed_threads(candidate, cpu_before, main_pid, result)
                for _ in range(EMPTY_ROUNDS - 1):
                    self._time_empty(reference, log)
        result.timing = result.timing | {"plans": {side: vars(plan) for side, plan in plans.items()}, "host": hosts}
        late = hosts.get("candidate", {})
        # A stall in one region in a few (measured: 1-2 of 35 on the H200) moves no round's median; a
        # host path longer than the hold in a quarter of them is the candidate's to shorten.
        if log is not None and log.hold_us and late.get("late", 0) >= LATE_SHARE * late.get("regions", 0) > 0:
            source = " (twice eager's host time per call)" if self.timing.baseline_hold == "adaptive" else ""
            result.notes.append(
                f"the candidate's host took up to {late['enqueue_us']:.0f} us to enqueue a timed region, longer than the "
                f"GPU is held before it ({log.hold_us:.0f} us{source}): the GPU waited for the host in {late['late']} of "
                f"{late['regions']} regions, and that time counts (fewer launches or less Python per call shorten it)")
        return rounds, log

    def _candidate_hold(self, reference: Channel, plan: Plan, eager_host_us: float | None) -> float:
        """The candidate's hold before each region: ``hold_us``, except with ``baseline_hold="adaptive"``:
        what covers eager's host time per call (measured in the trusted reference, in the
        cached-baselines mode too) for the candidate's calls per region, as the baselines' own holds
        cover theirs. Never from the candidate's word: a hold is time its process could compute in,
        unseen by the outside clock."""
        if self.timing.baseline_hold != "adaptive" or self.device != "cuda":
            return self.timing.hold_us  # a host clock (CPU backend) holds nothing
        if eager_host_us is None:
            request = CalibrateRequest(side="eager", seed=secrets.randbits(62), timing=self.timing.to_dict())
            eager_host_us = reference.ask_typed("baseline", request, CalibrateReply, self.timeouts.profile_s).host_us
        return host_hold(plan.calls, eager_host_us, self.timing)

    def _time_empty(self, reference: Channel, log: CandidateLog) -> None:
        """A round of the candidate's plan in the reference with the calls left out, timed from here:
        what the outside clock sees of the harness alone (draws, flushes, holds, records, the reply)."""
        plan = log.plan
        request = TimeRequest(side="empty", seed=secrets.randbits(62), first=0, trials=plan.trials, calls=plan.calls,
                              probe=secrets.randbits(62), timing=self.timing.to_dict(), hold_us=log.hold_us)
        started = time.perf_counter()
        reference.ask_typed("baseline", request, TimeReply, self.timeouts.baseline_s)
        log.empty_ms.append((time.perf_counter() - started) * 1e3)

    def _bracket_hold(self) -> float:
        """The hold of the brackets' no-op regions: the candidate's own unless the baselines' eager sets it."""
        return self.timing.hold_us if self.device == "cuda" else 0.0

    def _check_regions(self, brackets: CandidateBrackets | None, log: CandidateLog, result: EvalResult) -> None:
        """The regions the candidate's process reported against the evaluator's brackets (``regions.judge``):
        where the two disagree the brackets win, and a reported time shorter than they allow is forged."""
        if brackets is None:
            return
        hold = (log.hold_us or 0.0) if self.device == "cuda" else 0.0
        verdict = brackets.judge(hold, self.timing.region_slack, self.timing.region_us)
        if verdict is None:
            return
        result.timing = result.timing | {"regions": verdict.to_dict() | {"overhead": brackets.cost.to_dict()}}
        if not verdict.ok:
            raise Stop("failed", "profile", f"the candidate's process reported its timed regions {verdict.excess_ms:.3f} "
                       f"ms shorter than the evaluator's own brackets allow (median over {verdict.regions} regions: "
                       f"reported {verdict.reported_ms:.3f} ms; bracket {verdict.outside_ms:.3f} ms, of which its timing "
                       f"thread waited for a CPU {verdict.waited_ms:.3f} ms and ran {verdict.cpu_ms:.3f} ms; the "
                       f"brackets' own cost {verdict.overhead_ms:.3f} ms; limit {verdict.limit_ms:.3f} ms)", rule="clock")

    def _check_clock(self, log: CandidateLog, result: EvalResult) -> None:
        """The candidate's reported regions against the evaluator's own clock (``decide.clock_check``)."""
        check = clock_check(log.walls_ms, log.claimed_ms, log.empty_ms, log.plan.trials, self.timing)
        result.timing = result.timing | {"clock": check.to_dict() | {"decisive": check.decisive}}
        if not check.ok and not (check.decisive or check.gross):
            result.notes.append(
                f"the outside clock cannot resolve regions this short: the candidate's rounds took {check.unexplained_ms:.1f} "
                f"ms more than its reported regions ({check.claimed_ms:.3f} ms) and the harness explain, over the "
                f"limit of {check.limit_ms:.1f} ms, but the harness alone moves by that much between processes: "
                "not judged (an excess over three times the limit would be)")
        elif not check.ok:
            raise Stop("failed", "profile", f"the candidate's process reported timed regions {check.unexplained_ms:.3f} ms "
                       f"per round shorter than the evaluator's own clock allows (limit {check.limit_ms:.3f} ms; "
                       f"reported {check.claimed_ms:.3f} ms, round {check.wall_ms:.3f} ms, empty round "
                       f"{check.empty_ms:.3f} ms)", rule="clock")

    @staticmethod
    def _check_signals(candidate: Channel, before: dict[int, int], stage: str, when: str) -> None:
        """Signal handlers of the candidate's processes, read from outside, against those before its code
        loaded: the harness installs none after that, so a new one is the candidate's. A fault handler is
        how an output can be computed only when something reads it (``PROT_NONE`` pages filled on
        access, after the timed region); seccomp refuses ``userfaultfd``, the other way."""
        added = {signal_number for pid, mask in candidate.worker.signal_handlers().items() if pid in before
                 for signal_number in range(1, 65) if mask & ~before[pid] & (1 << (signal_number - 1))}
        if added:
            names = ", ".join(_signal_name(n) for n in sorted(added))
            raise Stop("failed", stage, f"the candidate's process installed a handler for {names} {when}, seen from "
                       "outside it; a solution handles no signals", rule="signal-handler")

    def _check_borrowed_threads(self, candidate: Channel, before: dict[int, tuple[str, int]], main_pid: int | None,
                                result: EvalResult) -> None:
        """CPU time, read from outside, of the candidate's threads that existed before its code loaded,
        over its timing rounds. A new thread fails anyway (``_check_no_new_threads``); one of the
        harness's own (the CUDA runtime's, torch's pool) could be handed work that ends after the end
        event. On a GPU the harness gives them none while it times (inputs are drawn on the device), so
        one that ran more than ``BORROWED_THREAD_MS``, and more than ``BORROWED_THREAD_SHARE`` of the
        calling thread's time, fails as ``thread``. That catches work of a size, not a few launches (the
        calling thread's own time includes its waits for the GPU). On the CPU backend torch's pool draws
        the inputs, so the figures are recorded only."""
        if main_pid is None:
            return
        main_ms, others = other_threads_ms(before, candidate.worker.thread_cpu(), main_pid)
        result.timing = result.timing | {"threads": {
            "main_ms": round(main_ms, 3), "others_ms": round(sum(ms for ms, _, _ in others), 3),
            "busiest": {f"{name} ({tid})": round(ms, 3) for ms, name, tid in others[-3:] if ms > 0}}}
        limit = max(BORROWED_THREAD_MS, BORROWED_THREAD_SHARE * main_ms)
        if self.device == "cuda" and others and others[-1][0] > limit:
            ms, name, tid = others[-1]
            raise Stop("failed", "profile", f"thread {tid} ({name}) of the candidate's process, there before its code "
                       f"loaded, ran {ms:.1f} ms on a CPU while the candidate was timed (limit {limit:.0f} ms; the "
                       f"thread that calls it ran {main_ms:.1f} ms): work handed to another thread is not timed",
                       rule="thread")

    @staticmethod
    def _check_no_new_threads(candidate: Channel, before: dict[int, str], stage: str, when: str) -> None:
        """Threads of the candidate's process tree, counted from outside, against ``before``: the
        worker starts the threads torch, the runtime and the profiler start on first use before its
        first request (``worker.warm_up_runtime``), so a thread that appears later is the candidate's,
        whatever its name. The in-process check trusts runtime-like names; this one trusts none, and
        does not depend on which thread wins a race (a helper that finishes an output after forward
        returned can beat the records' read on a busy machine)."""
        started = {tid: name for tid, name in candidate.worker.threads().items() if tid not in before}
        if started:
            names = ", ".join(sorted(set(started.values())))
            raise Stop("failed", stage, f"{len(started)} thread(s) or process(es) started {when}, seen from "
                       f"outside the candidate's process ({names})", rule="thread")

    def _watch_integrity(self, candidate: Channel, slots: dict[str, int], job: Path,
                         result: EvalResult) -> IntegrityWatch | None:
        """The harness's native entry points in the candidate's process, first read from outside now,
        before any candidate code (``guard.integrity``); None, with a note, where its memory cannot be
        read from here (no permission to read another process's memory)."""
        pid = candidate.worker.harness_pid()
        if pid is None:
            result.notes.append("native entry points not checked: the worker's process was not found")
            return None
        clock = time.monotonic()
        try:
            return IntegrityWatch.start(pid, slots, (str(job),))
        except OSError as exc:
            result.notes.append(f"native entry points not checked: cannot read the worker's memory ({exc})")
            return None
        finally:
            result.durations["integrity"] = round(time.monotonic() - clock, 3)

    @staticmethod
    def _check_integrity(watch: IntegrityWatch | None, stage: str, when: str, result: EvalResult,
                         pages: bool = True) -> None:
        """Import-table slots, the C functions behind the harness's builtins and the code mappings, read
        from outside again: changed by candidate code (``guard.integrity``), or unreadable now that they
        were readable. ``pages`` (written code pages) on the evaluation's last check."""
        if watch is None:
            return
        clock = time.monotonic()
        try:
            problems = watch.problems(pages)
        except OSError as exc:
            problems = [f"its memory can no longer be read from outside ({exc})"]
        result.durations["integrity"] = round(result.durations.get("integrity", 0.0) + time.monotonic() - clock, 3)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise Stop("failed", stage, f"the harness's native entry points changed {when}, seen from outside the "
                       f"candidate's process: {problems[0]}{more}", rule="integrity")

    @contextlib.contextmanager
    def _spares_stopped(self) -> Iterator[None]:
        """The prestarted candidate processes stand still while anything is timed: one still starting
        (CUDA context, first kernels, the profiler) puts work on the GPU, and measured in the
        middle of an evaluation's rounds it slowed whichever side was timed then by up to 10%."""
        paused = [workers.candidate for workers in self._spare if workers.alive()]
        try:
            for worker in paused:
                worker.pause()
            yield
        finally:
            for worker in paused:
                worker.resume()

    @staticmethod
    def _pause(candidate: Channel) -> None:
        """Stop the candidate's processes while the baselines are timed: code it left running (a
        thread, a child) could otherwise slow the baselines and inflate its speedup."""
        if not candidate.worker.pause():
            raise Stop("failed", "profile", "the candidate's processes did not stop while the baselines were timed",
                       rule="baseline-interference")

    def _candidate_side(self, candidate: Channel, base: int, log: CandidateLog, handlers: dict[int, int],
                        hosts: dict[str, dict[str, float]], watch: IntegrityWatch | None = None,
                        estimate_ms: float = 0.0, brackets: CandidateBrackets | None = None,
                        ) -> Callable[[int, int, int], list[float]]:
        outside = brackets is not None and brackets.outside
        if outside:
            # A handler installed to fill memory when it is read is named as such, before the read would fail.
            brackets.stopped_check = lambda: self._check_signals(candidate, handlers, "profile", "while it was timed")

        def time_candidate(first: int, trials: int, calls: int) -> list[float]:
            # Read from outside, no secret enters the candidate's process: its calls are chosen and read at
            # positions drawn after each region (CandidateBrackets); else its harness records them.
            probe = secrets.randbits(62)
            request = TimeRequest(seed=base, first=first, trials=trials, calls=calls,
                                  probe=None if outside else probe, timing=self.timing.to_dict(),
                                  hold_us=log.hold_us, bell=brackets is not None, outside=outside)
            # The read lands within the round: within most of the last round's length (the calls'
            # estimate for the first), so that it is seldom left unmade at the round's end.
            within_s = 0.9 * (log.walls_ms[-1] if log.walls_ms else trials * calls * estimate_ms) / 1e3
            during = watch.read_sometime(within_s) if watch is not None else contextlib.nullcontext([])
            candidate.worker.resume()
            try:
                with during as found:
                    started = time.perf_counter()
                    if brackets is not None:
                        brackets.bell.drain()
                        records_before = len(brackets.records)
                    candidate.send("profile", request)
                    bracketed = brackets.round(first, trials, calls, self.timeouts.profile_s) if brackets else None
                    reply = candidate.receive_typed("profile", TimeReply, self.timeouts.profile_s)
                    wall_ms = (time.perf_counter() - started) * 1e3
            finally:
                self._pause(candidate)
            if found:
                more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
                raise Stop("failed", "profile", "the harness's native entry points changed while it was timed, seen "
                           f"from outside the candidate's process during a round: {found[0]}{more}", rule="integrity")
            # Read before anything else runs there: a handler needed while this round's records were read
            # is still installed now.
            self._check_signals(candidate, handlers, "profile", "while it was timed")
            samples = reply.samples
            if len(samples) != trials or not all(
                    isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in samples):
                raise Stop("failed", "profile", "the timing reply is not one positive time per trial", rule="forged-reply")
            if brackets is not None:
                if bracketed is None or len(bracketed) != trials:
                    raise Stop("failed", "profile", "the timing reply came without its regions' brackets",
                               rule="forged-reply")
                brackets.add(bracketed, samples, calls)
            if outside:
                if reply.records:
                    raise Stop("failed", "profile", "the timing reply holds records no one asked for",
                               rule="forged-reply")
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

    def _baseline_side(self, reference: Channel, side: str, seed: int,
                       hosts: dict[str, dict[str, float]]) -> Callable[[int, int, int], list[float]]:
        def time_baseline(first: int, trials: int, calls: int) -> list[float]:
            request = TimeRequest(side=side, seed=seed, first=first, trials=trials, calls=calls,
                                  timing=self.timing.to_dict())
            reply = reference.ask_typed("baseline", request, TimeReply, self.timeouts.baseline_s)
            _tally_host(hosts, side, reply, trials)
            return reply.samples
        return time_baseline

    @staticmethod
    def _positive(value: Any, what: str) -> float:
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise Stop("failed", "profile", f"the candidate process reported an invalid {what}", rule="forged-reply")
        return float(value)

    def _speedups(self, rounds: Rounds) -> dict[str, Speedup]:
        line = 1 / self.policy.beat_factor if self.policy.reward == "milestone" else None
        return {side: speedup(side, rounds.ratios(side), line, self.timing.confidence)
                for side in BASELINES if (rounds.count(side) or side in rounds.fixed) and rounds.count("candidate")}

    def _settled(self, speedups: dict[str, Speedup]) -> bool:
        """No outcome the intervals still allow changes the reward."""
        return settled(speedups, lambda beats: milestone(beats.get("eager", False), beats.get("compile", False)))

    def _report_round(self, number: int, rounds: Rounds) -> None:
        if rounds.count("candidate"):
            text = ", ".join(f"{s.estimate:.3f}x vs {side} [{s.low:.3f}, {s.high:.3f}]"
                             for side, s in self._speedups(rounds).items())
        else:
            text = ", ".join(f"{side} spread {rounds.spread(side):.1%}" for side in rounds.samples)
        self.on_stage("profile", f"round {number}: {text}")

    def _check_timed_outputs(self, reference: Channel, candidate: Channel, base: int, log: CandidateLog, last: int,
                             job: Path, result: EvalResult) -> int:
        """The outputs of timed calls are checked too: records of calls drawn now, after all rounds,
        uniformly over every recorded call, and the last call whole. A candidate that is right only
        when checked (or replays a stored result) fails here. Returns the output's size in bytes."""
        timed = candidate.ask_typed("profile", TimedRequest(), TimedReply, self.timeouts.profile_s)
        # Exactly the last timed call, whose index the evaluator knows (any other "last" would let the
        # candidate pick a call it got right).
        if [c.index for c in timed.checked] != [last]:
            raise Stop("failed", "profile", f"the timing reply does not hold the last timed call ({last})",
                       rule="forged-reply")
        self.on_stage("verify", f"records of {min(TIMED_CHECKS, len(log.records))} timed calls, drawn now")
        chosen = secrets.SystemRandom().sample(log.records, min(TIMED_CHECKS, len(log.records)))
        widest = max((c.get("allowance", 1.0) for c in result.checks), default=1.0)
        tolerance = self._tolerance()
        request = RecordsRequest(checks=[RecordCheck(seed=trial_seed(base, record.index), probe=probe, record=record)
                                         for probe, record in chosen],
                                 atol=tolerance["atol"] * widest, rtol=tolerance["rtol"] * widest,
                                 scale=tolerance["scale"], strict=self.policy.strict_expected)
        verdicts = reference.ask_typed("verify", request, RecordsReply, self.timeouts.check_s).verdicts
        for number, ((probe, record), verdict) in enumerate(zip(chosen, verdicts)):
            result.checks.append({"index": self.policy.checks + number, "timed": True, "call": record.index,
                                  "record": True, "ok": verdict.ok, "reason": verdict.reason})
            if not verdict.ok:
                raise Stop("incorrect" if verdict.rule is None else "failed", "verify",
                           f"timed call {record.index} (its record): {verdict.reason}",
                           rule=verdict.rule or "timed-output")
        output_bytes = 0
        for number, call in enumerate(timed.checked):
            self.on_stage("verify", "the last timed output")
            out_dir = job / "candidate" / "timed" / f"timed-{call.index}"
            reference.send("verify", self._expect(trial_seed(base, call.index)))
            candidate.send("verify", OutputRequest(index=call.index, dir=str(out_dir)))
            expected = reference.receive_typed("verify", ExpectReply, self.timeouts.check_s)
            handed = candidate.receive_typed("verify", OutputReply, self.timeouts.check_s)
            output_bytes = expected.output_bytes
            check = self._check(reference, self.policy.checks + len(chosen) + number, call.fingerprint,
                                expected.fingerprint, out_dir, handed.manifest)
            check.update(timed=True, call=call.index, allowance=expected.allowance)
            result.checks.append(check)
            if not check["ok"]:
                raise Stop("incorrect", "verify", f"timed call {call.index}: {check['reason']}", rule="timed-output")
        if self.policy.rerun_check and chosen:
            self._check_rerun(reference, candidate, base, secrets.SystemRandom().choice(chosen), job, result)
        return output_bytes

    def _check_rerun(self, reference: Channel, candidate: Channel, base: int, chosen: tuple[int, CallRecord],
                     job: Path, result: EvalResult) -> None:
        """One recorded timed call, run again on its inputs as a check (the dispatch mode on): a candidate
        that computes otherwise when nothing watches (a torch fallback reached from C++, which no observer
        sees on timed calls) passes the records within the tolerance, but seldom bit for bit. Where the
        bits differ, a second run, compared with the first over the whole output in the reference, tells
        a candidate whose results vary from run to run (atomics), which is then not judged."""
        probe, record = chosen
        self.on_stage("verify", f"timed call {record.index} run again under check")
        entry = {"index": len(result.checks), "timed": True, "call": record.index}
        for attempt in (1, 2):
            out_dir = job / "candidate" / "rerun" / f"run-{attempt}"
            ran = candidate.ask_typed("verify", RunRequest(seed=trial_seed(base, record.index), dir=str(out_dir)),
                                      RunReply, self.timeouts.check_s)
            sampled = reference.ask_typed("verify", SampleRequest(dir=str(out_dir), manifest=ran.manifest, probe=probe,
                                                                  keep=attempt == 1),
                                          SampleReply, self.timeouts.check_s)
            shutil.rmtree(out_dir, ignore_errors=True)
            entry["rerun"] = attempt
            if sampled.reason:
                raise Stop("incorrect", "verify", f"timed call {record.index} run again: {sampled.reason}",
                           rule="wrong-output")
            # The output the reference kept for a second run goes when it idles (Evaluator._idle).
            if attempt == 1 and same_samples(sampled.outputs, record.outputs):
                result.checks.append(entry | {"ok": True, "reason": None})
                return
        if sampled.same_as_kept:
            result.checks.append(entry | {"ok": False, "reason": "differs bit for bit from the timed call"})
            raise Stop("failed", "verify", f"timed call {record.index} gave other values than the same call run "
                       "twice again under check, whose outputs agreed in every element: it computes otherwise "
                       "when unwatched", rule="unwatched-compute")
        result.checks.append(entry | {"ok": True, "reason": "not deterministic: not compared bit for bit"})
        result.notes.append(f"timed call {record.index} run again twice under check gave other values each time (a "
                            "candidate whose results vary from run to run): its record was not compared bit for bit")

    def _decide(self, rounds: Rounds, baseline: dict[str, Any], key: str, output_bytes: int,
                result: EvalResult) -> None:
        """Times, speedups with their intervals, the reward: each decision from the rounds."""
        method = self.timing.method
        result.times["candidate"] = rounds.stats("candidate", method).to_dict()
        for side in BASELINES:
            if side in baseline["fixed"]:
                result.times[side] = baseline["fixed"][side]
            elif rounds.count(side):
                result.times[side] = rounds.stats(side, method).to_dict()
        speedups = self._speedups(rounds)
        if baseline.get("sides") and baseline.get("cache"):
            self._keep_baseline(key, rounds, baseline, result)
        compile_error = baseline.get("compile_error") or (baseline.get("record") or {}).get("compile_error")
        if "compile" not in speedups and compile_error:
            result.notes.append(f"torch.compile baseline unavailable: {compile_error}")
        result.decision = {
            "rounds": rounds.count("candidate"),
            # The reward is settled: more rounds could not change it (each speedup's own "confident"
            # says whether its interval is clear of its line).
            "confident": self._settled(speedups),
            "speedups": {side: s.to_dict() for side, s in speedups.items()},
            "spread": {side: round(rounds.spread(side), 5) for side in rounds.samples},
        }
        if not result.decision["confident"]:
            result.notes.append("the reward decision is not confident: a speedup's interval still straddles its "
                                "line after the timing budget (TimingConfig.rounds_max / budget_s)")
        eager, compiled = speedups.get("eager"), speedups.get("compile")
        result.speedup_eager = eager.estimate if eager else None
        result.speedup_compile = compiled.estimate if compiled else None
        self._check_plausible(result.times["candidate"]["median_ms"], result.speedup_eager, output_bytes, result)
        # Speedups in place of times: "t < beat * t0" is "t0 / t > 1 / beat".
        result.reward = compute_reward(self.policy, True, 1.0, result.speedup_eager, result.speedup_compile)
        result.status = "correct"

    def _keep_baseline(self, key: str, rounds: Rounds, baseline: dict[str, Any], result: EvalResult) -> dict[str, Any]:
        """Cache the baselines timed in these rounds, unless their own spread is too wide or the GPU
        was busy: a noisy baseline is re-measured next time, never reused."""
        record: dict[str, Any] = {side: rounds.stats(side, self.timing.method).to_dict()
                                  for side in baseline["sides"] if rounds.count(side)}
        record["spread"] = {side: round(rounds.spread(side), 5) for side in baseline["sides"] if rounds.count(side)}
        record["rounds"] = max(rounds.count(side) for side in baseline["sides"])
        record["key"] = key
        if baseline.get("compile_error"):
            record["compile_error"] = baseline["compile_error"]
        wide = {side: spread for side, spread in record["spread"].items() if spread > self.timing.baseline_spread}
        busy = any(note.startswith("baselines timed on a busy GPU") for note in result.notes)
        if wide:
            result.notes.append("baselines not cached: their per-round times vary by " + ", ".join(
                f"{side} {spread:.1%}" for side, spread in wide.items()) + f" (over {self.timing.baseline_spread:.0%})")
        elif not busy:
            self.baselines.put(key, record)
        return record

    def _share(self, reference: LiveReference, candidate: Channel, result: EvalResult) -> None:
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
                                       self.timeouts.check_s)
        if not attached.attached:
            result.notes.append(f"outputs handed over through files: {attached.reason}")

    def _own_kernels(self, built: BuildResult, result: EvalResult) -> frozenset[str] | None:
        """The kernels the built extension defines, or None where attribution is off or impossible."""
        if self.device != "cuda" or not self.policy.attribute_kernels:
            return None
        try:
            return extension_kernels([Path(p) for p in built.modules.values()])
        except AttributionError as exc:
            result.notes.append(f"no kernel attribution: {exc}")
            return None

    @staticmethod
    def _attribute(ran: RunReply, own: frozenset[str], result: EvalResult) -> Attribution:
        try:
            kernels = parse_kernel_report(ran.kernels)
        except ValueError as exc:
            raise Stop("failed", "verify", f"the profiled call's kernel report is invalid: {exc}",
                        rule="forged-reply") from None
        attribution = attribute(kernels, own)
        result.attribution = attribution.to_dict()
        return attribution

    def _judge_attribution(self, attribution: Attribution | None) -> None:
        """Decoy: the extension's kernels never ran. Coverage: too little GPU time in them. Stream: they
        ran on another stream than forward was called on."""
        if attribution is None:
            return
        reason = decoy_reason(attribution)
        if reason:
            raise Stop("failed", "verify", reason, rule="decoy")
        reason = coverage_reason(attribution, self.policy.min_coverage)
        if reason:
            raise Stop("failed", "verify", reason, rule="coverage")
        reason = None if self.policy.allow_streams else stream_reason(attribution)
        if reason:
            raise Stop("failed", "verify", reason, rule="stream")

    def _check_plausible(self, t: float, speedup_eager: float | None, output_bytes: int, result: EvalResult) -> None:
        """Fail results no honest kernel can reach: beyond the policy's speedup ceiling,
        or faster than writing the outputs to memory allows (``t``: the candidate's median ms)."""
        ceiling = self.policy.max_speedup
        if t <= 0 or (ceiling is not None and speedup_eager is not None and speedup_eager > ceiling):
            raise Stop("failed", "profile", f"implausible speedup: {speedup_eager or math.inf:.1f}x over eager exceeds the "
                       f"policy's ceiling of {ceiling:g}x; such results need review before they are rewarded",
                       rule="implausible-speedup")
        if not self.policy.speed_of_light:
            return
        if self.policy.memory_system is not None:
            memory = MemorySystem(*self.policy.memory_system)
        else:
            memory = memory_system(result.environment.get("gpu")) if self.device == "cuda" else None
        reason = below_speed_of_light(t, output_bytes, memory)
        if reason:
            raise Stop("failed", "profile", reason, rule="implausible-speedup")

    def baseline(self, task: Task, refresh: bool = False, degenerate: bool = False) -> dict[str, Any]:
        """Eager (and torch.compile) timings of ``task`` on this evaluator's device: the cached record,
        measured now if there is none (or with ``refresh``) in rounds until each baseline's per-round
        spread is within ``TimingConfig.baseline_spread`` (a baseline still too noisy, or timed on a
        busy GPU, is returned with a note and not cached). Adds ``cached``, ``key``, ``environment``,
        ``durations`` (seconds per stage) and ``notes``. With ``degenerate``, the same reference
        process also runs ``check_degenerate``'s check: the record gets ``degenerate`` (a
        ``DegenerateReport``), or ``degenerate_error`` if it could not run."""
        environment = describe_environment(self.device, self.gpu_index)
        key = baseline_key(task.digest, environment, self.policy.to_dict(), self.timing.to_dict(), self.device)
        cached = None if refresh else self._cached_baseline(key)
        if cached is not None and not degenerate:
            return cached | {"cached": True, "environment": environment, "notes": []}
        scratch = EvalResult(task=task.to_dict(), candidate={}, device=self.device, policy=self.policy.to_dict(),
                             timing=self.timing.to_dict(), environment=environment)
        clock = time.monotonic()
        with self._loaded_reference(task, "the baselines could not be timed") as reference:
            durations = {"load": round(time.monotonic() - clock, 3)}
            clock = time.monotonic()
            record = cached or self._measure_baselines(key, reference, scratch)
            durations["baseline"] = round(time.monotonic() - clock, 3)
            record = record | {"cached": cached is not None, "environment": environment, "notes": scratch.notes,
                               "durations": durations}
            if degenerate:
                clock = time.monotonic()
                try:
                    # Under the timing lock: its model calls would disturb another evaluator's timing.
                    with self.timing_lock:
                        record["degenerate"] = self._degenerate(task, reference.channel, draws=3)
                except Stop as stop:
                    record["degenerate_error"] = f"{task.source}: the degenerate-task check could not run: {stop.reason}"
                durations["degenerate"] = round(time.monotonic() - clock, 3)
        return record

    def _measure_baselines(self, key: str, reference: LiveReference, result: EvalResult) -> dict[str, Any]:
        """The baselines alone, in rounds, until each one's per-round spread is small enough."""
        baseline = self._timed_baselines(reference, cache=True)
        wide = lambda r: any(r.spread(side) > self.timing.baseline_spread for side in baseline["sides"])  # noqa: E731
        rounds, _ = self._time_rounds(reference.channel, None, 0, baseline, result, undecided=wide)
        return self._keep_baseline(key, rounds, baseline, result)

    def check_degenerate(self, task: Task, draws: int = 3) -> DegenerateReport:
        """Whether trivial candidates (zeros, a constant, an input, an input's mean)
        pass ``task`` under this evaluator's policy. Runs the reference process only."""
        if draws < 2:
            raise ValueError("check_degenerate needs at least 2 draws (one fits the constant).")
        with self._loaded_reference(task, "the degenerate-task check could not run") as reference:
            return self._degenerate(task, reference.channel, draws)

    def _degenerate(self, task: Task, reference: Channel, draws: int) -> DegenerateReport:
        request = DegenerateRequest(seeds=[secrets.randbits(62) for _ in range(draws)], **self._tolerance())
        reply = reference.ask_typed("degenerate", request, DegenerateReply, self.timeouts.check_s * draws)
        return DegenerateReport(task=task.name, policy=self.policy.name, passing=reply.passing, details=reply.details)

    def _check(self, reference: Channel, index: int, seen: Any, expected_fingerprint: Any, out_dir: Path,
               manifest: dict[str, Any]) -> dict[str, Any]:
        if seen != expected_fingerprint:
            raise Stop("failed", "verify", "the inputs seen by the candidate differ from the reference's "
                       "(input generation was altered in the candidate process, or forward changed its inputs)",
                       rule="input-generation")
        compared = reference.ask_typed("verify", CompareRequest(dir=str(out_dir), manifest=manifest, **self._tolerance()),
                                       CompareReply, self.timeouts.check_s)
        shutil.rmtree(out_dir, ignore_errors=True)  # the reference may not write there
        check: dict[str, Any] = {"index": index, "ok": True, "reason": None, "reports": compared.reports}
        failed = [r for r in compared.reports if not r["ok"]]
        if failed:
            check.update(ok=False, reason=f"{failed[0]['path']}: {failed[0]['reason']}")
        return check

    def _cached_baseline(self, key: str) -> dict[str, Any] | None:
        cached = self.baselines.get(key)
        if cached is None or (self.time_compile and "compile" not in cached and "compile_error" not in cached):
            return None
        return cached

    def _wait_until_idle(self) -> str | None:
        """Wait up to ``idle_wait_s`` for other work on the GPU (the reference's own loading
        included) to end; the reason if it does not."""
        if self.device != "cuda" or not self.check_idle:
            return None
        if not can_check_idle(self.gpu_index or 0):
            self.on_stage("baseline", "cannot tell whether the GPU is idle (no NVML, no nvidia-smi)")
            return None
        deadline = time.monotonic() + self.idle_wait_s
        while True:
            busy = gpu_busy(self.gpu_index or 0)
            if busy is None or time.monotonic() >= deadline:
                return busy
            self.on_stage("baseline", f"waiting for the GPU to be idle ({busy})")
            time.sleep(1.0)

    # -- processes ------------------------------------------------------------------
    def _spawn(self, role: str, home: Path, readable: list[Path]) -> WorkerProcess:
        writable = [home]
        inductor = None
        if role == "reference":
            inductor = self.cache_dir / "inductor"
            inductor.mkdir(parents=True, exist_ok=True)
            writable.append(inductor)
        env = worker_env(home, inductor)
        if self.gpu_index is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu_index)
        if role == "candidate":
            env[LOCK_CODE_ENV] = "1"  # nothing may become executable once its start-up is over (sandbox.nocode)
        limits = Limits(timeout_s=self.timeouts.baseline_s, output_bytes=self.output_limit, memory_bytes=self.memory_limit)
        return WorkerProcess(
            argv=[sys.executable, "-m", "cuda_agent.evaluate.worker", "--role", role, "--device", self.device],
            cwd=home,
            env=env,
            limits=limits,
            gpu=self.device == "cuda",
            sandbox=self.sandbox,
            writable=writable,
            readable=[*readable, PACKAGE_ROOT],
            fd_channel=True,
        )


def find_ncu() -> str | None:
    """Nsight Compute's command line: $CUDA_AGENT_NCU, PATH, then the CUDA toolkit's bin."""
    named = os.environ.get("CUDA_AGENT_NCU")
    if named:
        return named if os.access(named, os.X_OK) else None
    found = shutil.which("ncu")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "ncu"), os.X_OK):
            return os.path.join(home, "bin", "ncu")
    return None


def default_memory_limit() -> int:
    """Host memory one worker process may use unless told otherwise: half the machine, at least 4 GiB.
    Without it a candidate that allocates a little at a time meets no bound short of the host's OOM
    killer, which may pick the evaluator. Enforced through the job's cgroup (memory.max) where one can
    be delegated, else as an address-space limit (RLIMIT_AS) for CPU jobs; GPU jobs without a cgroup
    get none (an address-space limit breaks CUDA start-up)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(4 * 1024**3, physical // 2)


def evaluate(task: Task, candidate: Candidate, device: str = "auto", **options: Any) -> EvalResult:
    """Evaluate one candidate; options are :class:`Evaluator`'s."""
    return Evaluator(device, **options).evaluate(task, candidate)
