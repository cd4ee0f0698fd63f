"""``Evaluator.counters``: one call of a candidate profiled with Nsight Compute in the sandbox, and the
report made of it (``evaluate.counters``). Advice for the agent; never part of a reward."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

from cuda_agent.build import BuildResult
from cuda_agent.candidates import Candidate
from cuda_agent.evaluate.context import Setup
from cuda_agent.evaluate.counters import (
    MAX_NCU_BYTES, METRICS, NCU_FLAGS, CounterReport, CountersError, build_report, unavailable,
)
from cuda_agent.evaluate.processes import copy_modules, new_job
from cuda_agent.evaluate.protocol.messages import LoadRequest
from cuda_agent.evaluate.triton_build import triton_kernels_of
from cuda_agent.guard.attribution import AttributionError, extension_kernels, own_matcher
from cuda_agent.paths import PACKAGE_ROOT, worker_env
from cuda_agent.sandbox import Limits, run_command
from cuda_agent.tasks import Task


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


def profile_counters(setup: Setup, task: Task, candidate: Candidate, times: dict[str, float],
                     built: BuildResult, raw_to: Path | None, ncu: str) -> CounterReport:
    """The profile run of ``Evaluator.counters``, for a candidate that built (``built.ok``)."""
    try:
        # A Triton candidate's kernels are named after its @triton.jit functions (it compiles them itself here).
        own = (frozenset(triton_kernels_of(candidate)) if candidate.language == "triton"
               else extension_kernels([Path(p) for p in built.modules.values()]))
    except AttributionError:
        own = frozenset()  # every kernel then shows as library/other; the counters still stand
    job = new_job(setup.work_dir, "cuda-agent-counters-")
    started = time.monotonic()
    try:
        (job / "task.py").write_text(task.code)
        (job / "model_new.py").write_text(candidate.model_new)
        request = LoadRequest(**setup.task_message(task, job, secrets.randbits(31)),
                              model_new_file=str(job / "model_new.py"), modules=copy_modules(built, job))
        (job / "spec.json").write_text(json.dumps({"request": asdict(request), "seed": secrets.randbits(31)}))
        env = worker_env(job)
        if setup.gpu_index is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(setup.gpu_index)
        argv = [ncu, *NCU_FLAGS, "--metrics", ",".join(METRICS), "--log-file", str(job / "ncu.csv"),
                sys.executable, "-m", "cuda_agent.evaluate.worker.counters_target", str(job / "spec.json")]
        setup.on_stage("counters", "one call under Nsight Compute")
        with setup.timing_lock:  # its replays would disturb another evaluator's timing on this GPU
            ran = run_command(argv, cwd=job, env=env, sandbox=setup.sandbox, gpu=True, writable=[job],
                              readable=[PACKAGE_ROOT],
                              limits=Limits(timeout_s=setup.timeouts.counters_s, output_bytes=setup.output_limit,
                                            memory_bytes=setup.memory_limit))
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
