"""Orchestrates one evaluation: build -> reference -> baselines -> verify -> profile -> reward.

This process never imports candidate code and never holds expected outputs:
the reference process computes and compares them; the candidate process runs
the candidate. Each evaluation gets fresh processes, so a crash, hang or flood
in one candidate cannot touch the next.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from cuda_agent.build import BuildResult, build
from cuda_agent.candidates import Candidate
from cuda_agent.evaluate.baseline import BaselineCache, baseline_key
from cuda_agent.evaluate.environment import describe_environment
from cuda_agent.evaluate.policy import Policy, TimingConfig
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.evaluate.reward import compute_reward
from cuda_agent.evaluate.timing import trial_seed
from cuda_agent.build.probe import probe_candidate
from cuda_agent.guard import Violation, audit_symbols, check_candidate
from cuda_agent.guard.symbols import imported_symbols
from cuda_agent.guard.attribution import (
    Attribution, AttributionError, attribute, coverage_reason, decoy_reason, extension_kernels, parse_kernel_report,
)
from cuda_agent.guard.device_state import can_check_idle, gpu_busy
from cuda_agent.evaluate.degenerate import DegenerateReport
from cuda_agent.evaluate.plausibility import MemorySystem, below_speed_of_light, memory_system
from cuda_agent.paths import PACKAGE_ROOT, cache_root, worker_env
from cuda_agent.sandbox import Limits, Sandbox, WorkerCrashed, WorkerForgedReply, WorkerProcess, WorkerTimeout, make_sandbox
from cuda_agent.tasks import Task, TaskError

BASELINE_SEED = 0  # baselines are cached, so they are timed on one fixed input draw
TIMED_CHECKS = 2  # timing calls chosen in secret whose outputs are checked, besides the last call
StageCallback = Callable[[str, str], None]


@dataclass(frozen=True)
class Timeouts:
    build_s: float = 300.0
    load_s: float = 300.0
    check_s: float = 300.0
    baseline_s: float = 1200.0
    profile_s: float = 600.0


class _Stop(Exception):
    """Ends an evaluation early with a status and a reason."""

    def __init__(self, status: str, stage: str, reason: str, traceback: str | None = None, rule: str | None = None):
        super().__init__(reason)
        self.status, self.stage, self.reason, self.traceback, self.rule = status, stage, reason, traceback, rule


def resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or auto.")
    return device


@dataclass
class _Workers:
    """The job directory and the two processes of one evaluation."""

    job: Path
    reference: WorkerProcess
    candidate: WorkerProcess

    def alive(self) -> bool:
        return self.reference.proc.poll() is None and self.candidate.proc.poll() is None

    def close(self) -> None:
        # Killed, not asked to exit: nothing is left to say, and an orderly exit of torch and CUDA
        # takes about a second.
        for worker in (self.reference, self.candidate):
            worker.kill()
            worker.close()
        shutil.rmtree(self.job, ignore_errors=True)


def _close_all(spare: list[_Workers]) -> None:
    while spare:
        spare.pop().close()


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
        prestart: bool = False,
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
        self.memory_limit = memory_limit
        self.time_compile = time_compile
        self.check_idle = check_idle
        self.idle_wait_s = idle_wait_s
        # Evaluators that share a GPU share one lock: each times only while it holds it, so
        # timings never overlap while loading, compiling and checking do.
        self.timing_lock = timing_lock or contextlib.nullcontext()
        self.on_stage = on_stage or (lambda stage, detail: None)
        self.baselines = BaselineCache(self.cache_dir / "baselines")
        self._probe_imports: frozenset[str] | None = None
        # With ``prestart``, each evaluation ends by starting the next one's processes (torch imported,
        # CUDA up: seconds saved per evaluation for a long-lived evaluator); close() stops them.
        self.prestart = prestart
        self._spare: list[_Workers] = []
        weakref.finalize(self, _close_all, self._spare)

    @property
    def backend(self) -> str:
        return self.device

    def build(self, candidate: Candidate) -> BuildResult:
        return build(candidate, self.backend, cache_dir=self.cache_dir, sandbox=self.sandbox, timeout_s=self.timeouts.build_s)

    # -- one evaluation -----------------------------------------------------------
    def evaluate(self, task: Task, candidate: Candidate, build_result: BuildResult | None = None) -> EvalResult:
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
            self._evaluate(task, candidate, build_result, result)
        except _Stop as stop:
            result.status, result.stage, result.reason = stop.status, stop.stage, stop.reason
            result.traceback = stop.traceback
            result.rule = stop.rule
            result.reward = None if stop.status == "error" else -1.0
        result.durations["total"] = round(time.monotonic() - started, 3)
        self.on_stage("done", f"{result.status}, reward {result.reward}")
        return result

    def _evaluate(self, task: Task, candidate: Candidate, build_result: BuildResult | None, result: EvalResult) -> None:
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
            raise _Stop("failed", "build", built.error or "build failed")
        if self.policy.static_checks:
            self._refuse(audit_symbols([Path(p) for p in built.modules.values()], code_policy, self.toolchain_imports()),
                         result, "built extension: ")

        workers = self._take_workers()
        try:
            job = workers.job
            (job / "task.py").write_text(task.code)
            (job / "model_new.py").write_text(candidate.model_new)
            self._run_jobs(task, built, self._copy_modules(built, job), result, job, workers.reference,
                           workers.candidate)
        finally:
            workers.close()
            result.output = workers.candidate.output[-8000:]
            if self.prestart:
                # Started now, so they are ready when the next evaluation comes.
                self._spare.append(self._start_workers())

    def _take_workers(self) -> "_Workers":
        """The started spare processes if they are still alive, else new ones."""
        while self._spare:
            workers = self._spare.pop()
            if workers.alive():
                return workers
            workers.close()
        return self._start_workers()

    def _start_workers(self) -> "_Workers":
        """A job directory and both processes of one evaluation, started before they know the task
        or the candidate (importing torch and starting CUDA take seconds)."""
        job = self._new_job()
        (job / "candidate").mkdir()
        reference = self._spawn("reference", job / "reference", [job])
        return _Workers(job, reference, self._spawn("candidate", job / "candidate", [job]))

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
        """Stop the started spare processes (``prestart``); the evaluator can still be used."""
        _close_all(self._spare)

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def toolchain_imports(self) -> frozenset[str]:
        """What a minimal extension built here imports (torch's headers, the toolchain): built
        once per cache (the build cache keys it by compiler, torch and CUDA), read once per evaluator."""
        if self._probe_imports is None:
            probe = self.build(probe_candidate(self.backend))
            if not probe.ok:
                raise _Stop("error", "build", f"the toolchain probe extension does not build: {probe.error}")
            self._probe_imports = imported_symbols([Path(p) for p in probe.modules.values()])
        return self._probe_imports

    @staticmethod
    def _refuse(violations: list[Violation], result: EvalResult, prefix: str = "") -> None:
        if violations:
            result.violations = [v.to_dict() for v in violations]
            raise _Stop("failed", "policy", prefix + violations[0].describe(), rule=violations[0].rule)

    def _new_job(self) -> Path:
        """A job directory for the task and each process's own directory. Each process writes only
        its own directory: the candidate cannot touch the task file or the state dict the
        reference reads."""
        job = Path(tempfile.mkdtemp(prefix="cuda-agent-job-", dir=self.work_dir))
        (job / "reference").mkdir()
        return job

    def _tolerance(self) -> dict[str, Any]:
        return {"atol": self.policy.atol, "rtol": self.policy.rtol, "scale": self.policy.scale_tolerance}

    def _expect(self, seed: int) -> dict[str, Any]:
        """The reference's request for the expected output of the inputs drawn from ``seed``."""
        return {"op": "expect", "seed": seed, "strict": self.policy.strict_expected,
                "slack": self.policy.precision_slack, **self._tolerance()}

    def _run_jobs(self, task: Task, built: BuildResult, modules: dict[str, str], result: EvalResult, job: Path,
                  reference: WorkerProcess, contender: WorkerProcess) -> None:
        common = self._task_message(task, job)

        own_kernels = self._own_kernels(built, result)
        load_candidate = {"op": "load", **common, "model_new_file": str(job / "model_new.py"), "modules": modules}
        key = baseline_key(task.digest, result.environment, result.policy, result.timing, self.device)
        baseline = self._cached_baseline(key)
        clock = time.monotonic()
        self.on_stage("reference", "loading the task")
        self._send(reference, "reference", "reference", {"op": "load", **common, "warm": self._expect(secrets.randbits(62))})
        if baseline is not None:
            # No baseline to time, so candidate code may load while the reference works.
            self._send(contender, "candidate", "load", load_candidate)
        loaded = self._receive(reference, "reference", "reference", self.timeouts.load_s)
        result.durations["reference"] = round(time.monotonic() - clock, 3)

        clock = time.monotonic()
        if baseline is None:
            # Timed while the candidate process is idle and has imported no candidate code.
            baseline = self._measure_baseline(key, reference, result)
            self._send(contender, "candidate", "load", load_candidate)
        else:
            result.baseline_cached = True
        result.times["eager"] = baseline["eager"]
        if "compile" in baseline:
            result.times["compile"] = baseline["compile"]
        elif "compile_error" in baseline:
            result.notes.append(f"torch.compile baseline unavailable: {baseline['compile_error']}")
        result.durations["baseline"] = round(time.monotonic() - clock, 3)

        clock = time.monotonic()
        self.on_stage("load", "importing the candidate")
        self._receive(contender, "candidate", "load", self.timeouts.load_s)
        self._ask(contender, "candidate", "load", {"op": "weights", "state_dict_path": common["state_dict_path"]}, self.timeouts.load_s)
        self._share(loaded.get("share") or {}, reference, contender, result)
        result.durations["load"] = round(time.monotonic() - clock, 3)

        clock = time.monotonic()
        profiled = secrets.randbelow(self.policy.checks) if own_kernels is not None else -1
        attribution = None
        for index in range(self.policy.checks):
            self.on_stage("verify", f"check {index + 1}/{self.policy.checks}")
            seed = secrets.randbits(62)
            out_dir = job / "candidate" / f"output-{index}"
            # Both sides compute at once; only timing needs the device to itself.
            self._send(reference, "reference", "verify", self._expect(seed))
            self._send(contender, "candidate", "verify", {"op": "run", "seed": seed, "dir": str(out_dir),
                                                          "profile": index == profiled})
            expected = self._receive(reference, "reference", "verify", self.timeouts.check_s)
            ran = self._receive(contender, "candidate", "verify", self.timeouts.check_s)
            if index == profiled:
                attribution = self._attribute(ran, own_kernels, result)
            check = self._check(reference, index, ran["fingerprint"], expected["fingerprint"], out_dir, ran["manifest"])
            check["allowance"] = expected.get("allowance", 1.0)
            result.checks.append(check)
            if not check["ok"]:
                result.durations["verify"] = round(time.monotonic() - clock, 3)
                raise _Stop("incorrect", "verify", f"check {index + 1}: {check['reason']}", rule="wrong-output")
        result.durations["verify"] = round(time.monotonic() - clock, 3)
        widest = max(c["allowance"] for c in result.checks)
        if widest > 1:
            result.notes.append(f"tolerance widened up to {widest:.2f}x: the task's own Model under the baselines' "
                                f"precision flags errs by that much over {self.policy.precision_slack:g} (policy "
                                "precision_slack)")
        self._judge_attribution(attribution)
        self._ask(reference, "reference", "verify", {"op": "release"}, 60)  # hold little memory while the candidate is timed

        clock = time.monotonic()
        self.on_stage("profile", f"timing the candidate ({self.timing.method})")
        base = secrets.randbits(62)
        checked_calls = self._calls_to_check()
        with self.timing_lock:
            timed = self._ask(contender, "candidate", "profile", {
                "op": "time", "seed": base, "check": checked_calls, "timing": self.timing.to_dict(),
                "dir": str(job / "candidate" / "timed"),
            }, self.timeouts.profile_s)
        result.durations["profile"] = round(time.monotonic() - clock, 3)

        # The outputs of timed calls are checked too: a candidate that is right
        # only when checked (or replays a stored result) fails here.
        clock = time.monotonic()
        output_bytes = 0
        returned = [c["index"] for c in timed["checked"]]
        if not set(checked_calls) <= set(returned) or len(returned) > len(checked_calls) + 1:
            raise _Stop("failed", "profile", "the timing reply does not hold the calls asked for", rule="forged-reply")
        for number, call in enumerate(timed["checked"]):
            self.on_stage("verify", f"timed output {number + 1}/{len(returned)}")
            out_dir = job / "candidate" / "timed" / f"timed-{call['index']}"
            self._send(reference, "reference", "verify", self._expect(trial_seed(base, call["index"])))
            self._send(contender, "candidate", "verify", {"op": "output", "index": call["index"], "dir": str(out_dir)})
            expected = self._receive(reference, "reference", "verify", self.timeouts.check_s)
            handed = self._receive(contender, "candidate", "verify", self.timeouts.check_s)
            output_bytes = expected["output_bytes"]
            check = self._check(reference, self.policy.checks + number, call["fingerprint"], expected["fingerprint"],
                                out_dir, handed["manifest"])
            check.update(timed=True, call=call["index"], allowance=expected.get("allowance", 1.0))
            result.checks.append(check)
            if not check["ok"]:
                raise _Stop("incorrect", "verify", f"timed call {call['index']}: {check['reason']}", rule="timed-output")
        result.durations["verify"] += round(time.monotonic() - clock, 3)
        result.correct = True
        result.times["candidate"] = timed["candidate"]

        t = timed["candidate"]["median_ms"]
        t_eager = baseline["eager"]["median_ms"]
        t_compile = baseline["compile"]["median_ms"] if "compile" in baseline else None
        result.speedup_eager = t_eager / t if t > 0 else None
        result.speedup_compile = t_compile / t if t_compile and t > 0 else None
        self._check_plausible(t, t_eager, output_bytes, result)
        result.reward = compute_reward(self.policy, True, t, t_eager, t_compile)
        result.status = "correct"

    def _share(self, shared: dict[str, Any], reference: WorkerProcess, contender: WorkerProcess,
               result: EvalResult) -> None:
        """Hand the memory the reference shared when it loaded (``shared``: its answer) to the candidate;
        the descriptor passes through this process, which never maps it. Where that cannot be done,
        outputs travel through files."""
        if not shared.get("shared"):
            result.notes.append(f"outputs handed over through files: {shared.get('reason')}")
            return
        try:
            fd = reference.receive_fd(self.timeouts.check_s)
        except OSError as exc:
            raise _Stop("error", "load", f"reference process: the shared memory did not arrive: {exc}") from None
        try:
            contender.send_fd(fd)
        except OSError as exc:
            raise _Stop("failed", "load", f"candidate process: cannot take the shared memory: {exc}") from None
        finally:
            os.close(fd)
        attached = self._ask(contender, "candidate", "load", {"op": "attach", "bytes": shared["bytes"]},
                             self.timeouts.check_s)
        if not attached.get("attached"):
            result.notes.append(f"outputs handed over through files: {attached.get('reason')}")

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
    def _attribute(ran: dict[str, Any], own: frozenset[str], result: EvalResult) -> Attribution:
        try:
            kernels = parse_kernel_report(ran.get("kernels"))
        except ValueError as exc:
            raise _Stop("failed", "verify", f"the profiled call's kernel report is invalid: {exc}",
                        rule="forged-reply") from None
        attribution = attribute(kernels, own)
        result.attribution = attribution.to_dict()
        return attribution

    def _judge_attribution(self, attribution: Attribution | None) -> None:
        """Decoy: the extension's kernels never ran. Coverage: too little GPU time in them."""
        if attribution is None:
            return
        reason = decoy_reason(attribution)
        if reason:
            raise _Stop("failed", "verify", reason, rule="decoy")
        reason = coverage_reason(attribution, self.policy.min_coverage)
        if reason:
            raise _Stop("failed", "verify", reason, rule="coverage")

    def _calls_to_check(self) -> list[int]:
        """Calls of the timing run, chosen in secret, whose outputs are checked besides
        the last call's: among the calls every run makes (after the fixed warm-up count,
        up to the minimum number of trials; for the profiler method, its profiled calls)."""
        if self.timing.method == "profiler":
            first, count = self.timing.profiler_warmup, self.timing.profiler_iters
        else:
            first, count = self.timing.warmup, self.timing.min_trials
        pool = list(range(first, first + count))
        chosen = set()
        while len(chosen) < min(TIMED_CHECKS, len(pool)):
            chosen.add(pool[secrets.randbelow(len(pool))])
        return sorted(chosen)

    def _check_plausible(self, t: float, t_eager: float, output_bytes: int, result: EvalResult) -> None:
        """Fail results no honest kernel can reach: beyond the policy's speedup ceiling,
        or faster than writing the outputs to memory allows."""
        ceiling = self.policy.max_speedup
        if t <= 0 or (ceiling is not None and t_eager / t > ceiling):
            raise _Stop("failed", "profile", f"implausible speedup: {t_eager / max(t, 1e-12):.1f}x over eager exceeds the "
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
            raise _Stop("failed", "profile", reason, rule="implausible-speedup")

    def baseline(self, task: Task, refresh: bool = False, degenerate: bool = False) -> dict[str, Any]:
        """Eager (and torch.compile) timings of ``task`` on this evaluator's device: the cached record
        evaluations use, measured now if there is none (or with ``refresh``). Adds ``cached``, ``key``,
        ``environment``, ``durations`` (seconds per stage) and ``notes`` (a baseline timed on a busy
        GPU is returned, not cached). With
        ``degenerate``, the same reference process also runs ``check_degenerate``'s check: the record
        gets ``degenerate`` (a ``DegenerateReport``), or ``degenerate_error`` if it could not run."""
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
            record = cached or self._measure_baseline(key, reference, scratch)
            durations["baseline"] = round(time.monotonic() - clock, 3)
            record = record | {"cached": cached is not None, "environment": environment, "notes": scratch.notes,
                               "durations": durations}
            if degenerate:
                clock = time.monotonic()
                try:
                    # Under the timing lock: its model calls would disturb another evaluator's timing.
                    with self.timing_lock:
                        record["degenerate"] = self._degenerate(task, reference, draws=3)
                except _Stop as stop:
                    record["degenerate_error"] = f"{task.source}: the degenerate-task check could not run: {stop.reason}"
                durations["degenerate"] = round(time.monotonic() - clock, 3)
        return record

    def check_degenerate(self, task: Task, draws: int = 3) -> DegenerateReport:
        """Whether trivial candidates (zeros, a constant, an input, an input's mean)
        pass ``task`` under this evaluator's policy. Runs the reference process only."""
        if draws < 2:
            raise ValueError("check_degenerate needs at least 2 draws (one fits the constant).")
        with self._loaded_reference(task, "the degenerate-task check could not run") as reference:
            return self._degenerate(task, reference, draws)

    @contextlib.contextmanager
    def _loaded_reference(self, task: Task, failure: str) -> Iterator[WorkerProcess]:
        """A reference process with ``task`` loaded; trouble in it becomes a ``TaskError`` that says
        ``failure``."""
        job = self._new_job()
        (job / "task.py").write_text(task.code)
        reference = self._spawn("reference", job / "reference", [job])
        try:
            self._ask(reference, "reference", "reference", {"op": "load", **self._task_message(task, job)},
                      self.timeouts.load_s)
            yield reference
        except _Stop as stop:
            raise TaskError(f"{task.source}: {failure}: {stop.reason}") from None
        finally:
            reference.close()
            shutil.rmtree(job, ignore_errors=True)

    def _degenerate(self, task: Task, reference: WorkerProcess, draws: int) -> DegenerateReport:
        reply = self._ask(reference, "reference", "degenerate", {
            "op": "degenerate", "seeds": [secrets.randbits(62) for _ in range(draws)], **self._tolerance(),
        }, self.timeouts.check_s * draws)
        return DegenerateReport(task=task.name, policy=self.policy.name, passing=reply["passing"], details=reply["details"])

    def _task_message(self, task: Task, job: Path) -> dict[str, Any]:
        return {
            "task_file": str(job / "task.py"),
            "task_name": task.name,
            "task_source": task.source,
            "device": self.device,
            "tf32": self.policy.tf32,
            "allowed_aten": list(self.policy.allowed_aten),
            "init_seed": secrets.randbits(62),
            "state_dict_path": str(job / "reference" / "state_dict.pt"),
        }

    def _check(self, reference: WorkerProcess, index: int, seen: Any, expected_fingerprint: Any, out_dir: Path,
               manifest: dict[str, Any]) -> dict[str, Any]:
        if seen != expected_fingerprint:
            raise _Stop("failed", "verify", "the inputs seen by the candidate differ from the reference's "
                        "(input generation was altered in the candidate process, or forward changed its inputs)",
                        rule="input-generation")
        compared = self._ask(reference, "reference", "verify", {
            "op": "compare", "dir": str(out_dir), "manifest": manifest, **self._tolerance(),
        }, self.timeouts.check_s)
        shutil.rmtree(out_dir, ignore_errors=True)  # the reference may not write there
        check: dict[str, Any] = {"index": index, "ok": True, "reason": None, "reports": compared["reports"]}
        failed = [r for r in compared["reports"] if not r["ok"]]
        if failed:
            check.update(ok=False, reason=f"{failed[0]['path']}: {failed[0]['reason']}")
        return check

    def _cached_baseline(self, key: str) -> dict[str, Any] | None:
        cached = self.baselines.get(key)
        if cached is None or (self.time_compile and "compile" not in cached and "compile_error" not in cached):
            return None
        return cached

    def _measure_baseline(self, key: str, reference: WorkerProcess, result: EvalResult) -> dict[str, Any]:
        if self.time_compile:
            self.on_stage("baseline", "torch.compile")
            self._ask(reference, "reference", "baseline", {"op": "compile", "seed": BASELINE_SEED},
                      self.timeouts.baseline_s)
        with self.timing_lock:
            busy = self._wait_until_idle()
            self.on_stage("baseline", "timing eager" + (" and torch.compile" if self.time_compile else ""))
            measured = self._ask(reference, "reference", "baseline", {
                "op": "baseline", "seed": BASELINE_SEED, "timing": self.timing.to_dict(), "compile": self.time_compile,
            }, self.timeouts.baseline_s)
        record = {k: v for k, v in measured.items() if k not in ("ok", "seconds")} | {"key": key}
        if busy:
            # Slow baselines would inflate every later speedup: such a baseline is used once, never cached.
            result.notes.append(f"baselines timed on a busy GPU and not cached: {busy}")
        else:
            self.baselines.put(key, record)
        return record

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

    def _ask(self, worker: WorkerProcess, who: str, stage: str, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self._send(worker, who, stage, message)
        return self._receive(worker, who, stage, timeout_s)

    def _send(self, worker: WorkerProcess, who: str, stage: str, message: dict[str, Any]) -> None:
        try:
            worker.send(message)
        except WorkerCrashed as exc:
            raise _Stop("error" if who == "reference" else "failed", stage, f"{who} process {exc}") from None

    def _receive(self, worker: WorkerProcess, who: str, stage: str, timeout_s: float) -> dict[str, Any]:
        # Harness or task trouble in the reference process is an "error" (no
        # reward); anything that goes wrong in the candidate's process is its failure.
        status = "error" if who == "reference" else "failed"
        try:
            reply = worker.receive(timeout_s)
        except WorkerTimeout as exc:
            raise _Stop(status, stage, f"{who} process: {exc}") from None
        except WorkerCrashed as exc:
            rule = "forged-reply" if isinstance(exc, WorkerForgedReply) and who == "candidate" else None
            raise _Stop(status, stage, f"{who} process {exc}", rule=rule) from None
        if not reply.get("ok"):
            kind = reply.get("kind", "exception")
            prefix = {"out_of_memory": "out of memory", "rule": "rule broken", "task": "task error"}.get(kind, "exception")
            rule = reply.get("rule") if who == "candidate" else None
            raise _Stop(status if kind != "task" else "error", stage, f"{who}: {prefix}: {reply.get('error')}",
                        reply.get("traceback"), rule=rule)
        return reply


def evaluate(task: Task, candidate: Candidate, device: str = "auto", **options: Any) -> EvalResult:
    """Evaluate one candidate; options are :class:`Evaluator`'s."""
    return Evaluator(device, **options).evaluate(task, candidate)
