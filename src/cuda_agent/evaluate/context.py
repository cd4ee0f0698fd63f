"""What the parts of an evaluation are handed: the evaluator's settings (``Setup``, taken afresh for each
call, so a changed ``Evaluator.policy`` counts from the next one) and one evaluation's state
(``Evaluation``: the task, its job, the two processes' channels, the record being written). Also the
module-level defaults of ``Evaluator``'s constructor (``Timeouts``, the device, the memory limit)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cuda_agent.evaluate.brackets import CandidateBrackets
from cuda_agent.evaluate.protocol.channel import Channel
from cuda_agent.evaluate.protocol.policy import Policy, TimingConfig
from cuda_agent.evaluate.protocol.messages import ExpectRequest
from cuda_agent.evaluate.protocol.quiet import GpuQuiet
from cuda_agent.evaluate.references import LiveReference
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.sandbox import Sandbox
from cuda_agent.tasks import Task

StageCallback = Callable[[str, str], None]


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
                     "Compiling needs no GPU: `cuda-agent compile CANDIDATE --backend cuda` (nvcc, and for the C++ "
                     "glue a CUDA build of torch).")


def default_memory_limit() -> int:
    """Host memory one worker process may use unless told otherwise: half the machine, at least 4 GiB.
    Without it a candidate that allocates a little at a time meets no bound short of the host's OOM
    killer, which may pick the evaluator. Enforced through the job's cgroup (memory.max) where one can
    be delegated, else as an address-space limit (RLIMIT_AS) for CPU jobs; GPU jobs without a cgroup
    get none (an address-space limit breaks CUDA start-up)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(4 * 1024**3, physical // 2)


@dataclass(frozen=True)
class Setup:
    """The evaluator's settings, as one call of it sees them."""

    device: str
    policy: Policy
    timing: TimingConfig
    timeouts: Timeouts
    cache_dir: Path
    work_dir: Path | None
    sandbox: Sandbox
    gpu_index: int | None
    output_limit: int
    memory_limit: int | None
    time_compile: bool
    check_idle: bool
    idle_wait_s: float
    timing_lock: contextlib.AbstractContextManager
    on_stage: StageCallback

    def tolerance(self) -> dict[str, Any]:
        return self.policy.tolerance()

    def expect(self, seed: int) -> ExpectRequest:
        """The reference's request for the expected output of the inputs drawn from ``seed``."""
        return ExpectRequest(seed=seed, strict=self.policy.strict_expected, slack=self.policy.precision_slack,
                             **self.tolerance())

    def task_message(self, task: Task, home: Path, init_seed: int) -> dict[str, Any]:
        return {
            "task_file": str(home / "task.py"),
            "task_name": task.name,
            "task_source": task.source,
            "device": self.device,
            "tf32": self.policy.tf32,
            "allowed_aten": list(self.policy.allowed_aten),
            "memory_limit": self.memory_limit,
            "init_seed": init_seed,
            "state_dict_path": str(home / "reference" / "state_dict.pt"),
        }


@dataclass
class Evaluation:
    """One evaluation's state, passed to each stage."""

    setup: Setup
    task: Task
    result: EvalResult
    job: Path  # the job directory: task.py, model_new.py, the candidate's own directory
    reference: LiveReference
    candidate: Channel
    fresh: bool  # the reference process was started for this evaluation (not kept from an earlier one)
    brackets: CandidateBrackets | None = None  # the candidate's region brackets (TimingConfig.brackets)
    gpu_quiet: GpuQuiet | None = None  # judges the reference's quiet probes (a GPU's evaluations)
    call_bytes: int = 0  # a call's inputs and output as the reference drew and computed them (the checks)
    language: str = "cuda"  # the candidate's (``candidates.triton``)
    triton_kernels: Path | None = None  # a Triton candidate on a GPU: its build stage's kernels, copied into the job
    kernel_names: frozenset[str] = frozenset()  # a Triton candidate's kernels (``candidates.triton.triton_kernels``)
