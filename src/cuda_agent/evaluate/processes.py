"""The worker processes of an evaluation and their job directories: spawning a sandboxed worker, the
candidate processes started ahead (spares) and standing them still while anything is timed, and the
built extensions copied into a job."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from cuda_agent import scratch
from cuda_agent.build import BuildResult
from cuda_agent.evaluate.context import Setup
from cuda_agent.evaluate.references import ReferencePool
from cuda_agent.paths import PACKAGE_ROOT, worker_env
from cuda_agent.evaluate.worker.triton_runtime import INTERPRET_ENV
from cuda_agent.sandbox import Limits, WorkerProcess
from cuda_agent.sandbox.nocode import LOCK_CODE_ENV
from cuda_agent.sandbox.nothreads import BAN_THREADS_ENV

SPARE_CANDIDATES = 3  # candidate processes started ahead by a prestarted evaluator


@dataclass
class Workers:
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


def close_all(spare: list[Workers], references: ReferencePool | None) -> None:
    while spare:
        spare.pop().close()
    if references is not None:
        references.close()


def new_job(work_dir: Path | None, prefix: str = "cuda-agent-job-") -> Path:
    """A job directory for the task and each process's own directory. Each process writes only
    its own directory: the candidate cannot touch the task file or the state dict the
    reference reads."""
    job = scratch.made(Path(tempfile.mkdtemp(prefix=prefix, dir=work_dir)))
    (job / "reference").mkdir()
    return job


def spawn(setup: Setup, role: str, home: Path, readable: list[Path]) -> WorkerProcess:
    writable = [home]
    inductor = None
    if role == "reference":
        inductor = setup.cache_dir / "inductor"
        inductor.mkdir(parents=True, exist_ok=True)
        writable.append(inductor)
    env = worker_env(home, inductor)
    if setup.gpu_index is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(setup.gpu_index)
    if role == "candidate":
        env[LOCK_CODE_ENV] = "1"  # nothing may become executable once its start-up is over (sandbox.nocode)
        env[BAN_THREADS_ENV] = "1"  # no new thread or process once its code starts to load (sandbox.nothreads)
        if setup.device == "cpu":
            # Triton, should the candidate be a Triton one, runs in its interpreter; read as Triton is imported, which
            # torch's profiler does during the worker's start-up (``evaluate.worker.triton_runtime``).
            env[INTERPRET_ENV] = "1"
        if setup.device == "cuda":
            # Memory of the driver's VMM API, which another process can map: its timed outputs are read
            # from outside it (evaluate.protocol.vmm). Replaces any other allocator setting of the user's.
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    limits = Limits(timeout_s=setup.timeouts.baseline_s, output_bytes=setup.output_limit,
                    memory_bytes=setup.memory_limit)
    return WorkerProcess(
        argv=[sys.executable, "-m", "cuda_agent.evaluate.worker.loop", "--role", role, "--device", setup.device],
        cwd=home,
        env=env,
        limits=limits,
        gpu=setup.device == "cuda",
        sandbox=setup.sandbox,
        writable=writable,
        readable=[*readable, PACKAGE_ROOT],
        fd_channel=True,
    )


def start_workers(setup: Setup) -> Workers:
    """A job directory and the candidate process of one evaluation, started before it knows the
    task or the candidate (importing torch and starting CUDA take seconds)."""
    job = new_job(setup.work_dir)
    (job / "candidate").mkdir()
    return Workers(job, spawn(setup, "candidate", job / "candidate", [job]))


def take_workers(spare: list[Workers], setup: Setup) -> Workers:
    """The oldest started spare candidate process (the likeliest to have finished starting) if it
    is still alive, else a new one."""
    while spare:
        workers = spare.pop(0)
        if workers.alive():
            return workers
        workers.close()
    return start_workers(setup)


@contextlib.contextmanager
def spares_stopped(*groups: list[Workers]) -> Iterator[None]:
    """The prestarted candidate processes stand still while anything is timed: one still starting
    (CUDA context, first kernels, the profiler) puts work on the GPU, and measured in the
    middle of an evaluation's rounds it slowed whichever side was timed then by up to 10%.
    ``groups``: the spare lists of every evaluator on the device, read when the block is entered (under
    the timing lock, when no other evaluator adds to them)."""
    paused = [workers.candidate for spare in groups for workers in list(spare) if workers.alive()]
    try:
        for worker in paused:
            worker.pause()
        yield
    finally:
        for worker in paused:
            worker.resume()


def copy_modules(built: BuildResult, job: Path) -> dict[str, str]:
    """The built extensions, copied into the job: the candidate process sees its own build and
    nothing else of the build cache."""
    modules = {}
    for number, (name, path) in enumerate(sorted(built.modules.items())):
        home = job / "extensions" / str(number)
        home.mkdir(parents=True)
        modules[name] = str(shutil.copy2(path, home / Path(path).name))
    return modules
