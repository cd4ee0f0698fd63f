"""The build stage of a Triton candidate on a GPU: its kernels compiled, and its autotuned configs chosen, on
the task's input shapes, in a sandboxed process of their own; the evaluated process only loads them
(``evaluate.worker.triton_runtime``, docs/SECURITY.md "Triton candidates").

The compile process (``evaluate.worker.triton_target``) imports the candidate, builds ``ModelNew`` and runs forward
twice on inputs drawn from a seed of its own, with a private ``TRITON_CACHE_DIR`` and autotuning results kept
on disk. Of what it leaves, only Triton's kernel files (metadata ``.json`` and ``.cubin``, autotuned choices
``.autotune.json``) are kept: the native modules the process built (Triton's launchers) are never loaded anywhere
else, since they were built beside the candidate's code. Where Triton compiles a launcher per kernel signature
(3.6), the evaluator builds each one again itself, in a process of its own that runs no candidate code, from the
signatures the build stage recorded (checked as data: ``triton_runtime.launcher_records``), into the kept cache,
where the evaluated process finds them. The kept kernels are cached by candidate, task, GPU and Triton version,
like built extensions.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from cuda_agent.candidates import Candidate
from cuda_agent.candidates.triton import triton_kernels
from cuda_agent.evaluate.protocol.channel import Stop
from cuda_agent.evaluate.context import Setup
from cuda_agent.evaluate.processes import new_job
from cuda_agent.evaluate.protocol.messages import LoadRequest
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.evaluate.worker.triton_runtime import LAUNCHER_DIR, LAUNCHERS_FILE, REFUSED_EXIT, launcher_records
from cuda_agent.paths import PACKAGE_ROOT, worker_env
from cuda_agent.sandbox import Limits, run_command
from cuda_agent.tasks import Task

KEPT_SUFFIXES = (".json", ".cubin")  # metadata (and autotuned choices) and the kernels' machine code
GROUP_PREFIX = "__grp__"  # Triton's file naming the files of one compiled kernel
MAX_FILES = 4096
MAX_BYTES = 512 * 1024 * 1024
MAX_LAUNCHERS_FILE = 16 * 1024 * 1024
BUILD_SEED = 7  # the compile process's inputs: only their shapes, dtypes and layouts matter
LAYOUT = 2  # what a kept cache holds (2: with the evaluator's per-signature launchers), part of its key


def triton_kernels_of(candidate: Candidate) -> list[str]:
    """The Triton kernels a Triton candidate defines (none for a CUDA one)."""
    return triton_kernels(candidate.model_new) if candidate.language == "triton" else []


def triton_own_kernels(setup: Setup, names: frozenset[str]) -> frozenset[str] | None:
    """The kernels attribution counts as the candidate's own: Triton names each after its Python function."""
    if setup.device != "cuda" or not setup.policy.attribute_kernels:
        return None
    return names


def _version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def compile_triton(setup: Setup, task: Task, candidate: Candidate, result: EvalResult) -> Path | None:
    """The candidate's compiled kernels (a directory of the cache), or None on the CPU backend, where Triton's
    interpreter runs them and nothing is compiled. A compile that fails stops the evaluation ("failed" at
    "build") with the last line Triton or the candidate printed. Called within the evaluation's share of the
    device (``device_lock.shared_use``): autotuning times configs, which no other evaluation's timing may meet."""
    if setup.device != "cuda":
        return None
    clock = time.monotonic()
    gpu = result.environment.get("gpu", "") if isinstance(result.environment, dict) else ""
    key = hashlib.sha256(json.dumps([candidate.digest, task.digest, gpu, _version(), setup.policy.tf32,
                                     LAYOUT]).encode())
    home = setup.cache_dir / "triton" / key.hexdigest()[:32]
    if (home / "done").exists():
        result.durations["triton_compile"] = 0.0
        result.notes.append("Triton kernels from the cache (compiled on the task's shapes before)")
        return home
    setup.on_stage("build", "Triton: compiling and autotuning the kernels on the task's shapes")
    job = new_job(setup.work_dir, "cuda-agent-triton-")
    try:
        (job / "task.py").write_text(task.code)
        (job / "model_new.py").write_text(candidate.model_new)
        request = LoadRequest(**setup.task_message(task, job, secrets.randbits(31)),
                              model_new_file=str(job / "model_new.py"), language="triton")
        (job / "spec.json").write_text(json.dumps({"request": asdict(request), "seed": BUILD_SEED}))
        env = worker_env(job)
        env["TRITON_CACHE_DIR"] = str(job / "kernels")
        env["TRITON_CACHE_AUTOTUNING"] = "1"
        if setup.gpu_index is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(setup.gpu_index)
        argv = [sys.executable, "-m", "cuda_agent.evaluate.worker.triton_target", str(job / "spec.json")]
        ran = run_command(argv, cwd=job, env=env, sandbox=setup.sandbox, gpu=True, writable=[job],
                          readable=[PACKAGE_ROOT],
                          limits=Limits(timeout_s=setup.timeouts.build_s, output_bytes=setup.output_limit,
                                        memory_bytes=setup.memory_limit))
        result.durations["triton_compile"] = round(time.monotonic() - clock, 3)
        if ran.timed_out or ran.returncode != 0 or not (job / "compiled").exists():
            why = f"timed out after {setup.timeouts.build_s:.0f} s" if ran.timed_out else _last_line(ran.output)
            raise Stop("failed", "build", f"Triton compile on the task's shapes failed: {why}")
        records = _recorded_launchers(job / LAUNCHERS_FILE)
        clock = time.monotonic()
        _keep(job / "kernels", home, lambda staging: build_recorded_launchers(setup, records, staging))
        if records:
            result.durations["triton_launchers"] = round(time.monotonic() - clock, 3)
            result.notes.append(f"Triton: {len(records)} launcher(s) built by the evaluator from the build stage's "
                                "recorded signatures")
        return home
    finally:
        shutil.rmtree(job, ignore_errors=True)


def _last_line(output: str) -> str:
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:600] if lines else "the compile process printed nothing"


def _recorded_launchers(path: Path) -> list[dict[str, Any]]:
    """The launcher signatures the build stage recorded, checked; one that is not what Triton records (it was
    written where the candidate's code ran) stops the build."""
    if not path.exists() and not path.is_symlink():
        return []  # none recorded: every launch then needs a launcher that is not there (triton-compile)
    try:
        if path.is_symlink() or not path.is_file():  # a link could name a file that is not the build stage's
            raise ValueError("not a plain file")
        if path.stat().st_size > MAX_LAUNCHERS_FILE:
            raise ValueError(f"larger than {MAX_LAUNCHERS_FILE >> 20} MiB")
        return launcher_records(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        raise Stop("failed", "build", f"the build stage's record of Triton's launchers is not Triton's: {exc}") \
            from None


def build_recorded_launchers(setup: Setup, records: list[dict[str, Any]], where: Path) -> None:
    """Triton's launcher for each recorded signature, built into ``where`` (the kept cache being made) by a process
    that runs harness code alone, outside the sandbox, as ``build_launcher``: Triton's own template and the C
    compiler, fed the checked signatures. A signature Triton's template refuses fails the candidate's build; a
    launcher that does not build otherwise is the harness's failure (an error)."""
    if not records:
        return
    env = dict(os.environ) | ({"CUDA_VISIBLE_DEVICES": str(setup.gpu_index)} if setup.gpu_index is not None else {})
    env["PYTHONPATH"] = str(PACKAGE_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.pop("TRITON_INTERPRET", None)
    argv = [sys.executable, "-m", "cuda_agent.evaluate.worker.triton_runtime", "--launchers", str(where)]
    try:
        ran = subprocess.run(argv, env=env, input=json.dumps(records), capture_output=True, text=True,
                             timeout=setup.timeouts.build_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Stop("error", "build", f"Triton's launchers for the candidate's kernels did not build: {exc}") from None
    if ran.returncode == REFUSED_EXIT:  # a record Triton's template refuses: written where the candidate's code ran
        raise Stop("failed", "build", _last_line(ran.stderr))
    if ran.returncode != 0:
        raise Stop("error", "build", "Triton's launchers for the candidate's kernels did not build: "
                   f"{_last_line(ran.stderr or ran.stdout)}")


def _keep(source: Path, home: Path, launchers: Callable[[Path], None] | None = None) -> None:
    """Triton's kernel files from ``source`` into ``home``, bounded; the directory appears whole or not at all.
    A group file (``__grp__NAME.json``: which files make one compiled kernel) names its files by absolute path;
    kept, each is named relative to the cache (``HASH/FILE``) and only where it lies in the group's own folder
    and is kept too. ``copy_kernels`` makes them absolute again where the copy lies. ``launchers`` adds the
    evaluator's own builds of Triton's launchers to the directory before it appears."""
    staging = home.with_name(home.name + f".{os.getpid()}.{secrets.token_hex(4)}")
    files = [p for p in sorted(source.rglob("*")) if not p.is_symlink() and p.is_file()
             and p.name.endswith(KEPT_SUFFIXES)] if source.is_dir() else []
    if len(files) > MAX_FILES or sum(p.stat().st_size for p in files) > MAX_BYTES:
        raise Stop("failed", "build", f"Triton's cache holds more than {MAX_FILES} files or {MAX_BYTES >> 20} MiB "
                   "after one compile: too many kernels for one task")
    kept = {p.relative_to(source).as_posix() for p in files}
    for path in files:
        rel = path.relative_to(source)
        target = staging / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.name.startswith(GROUP_PREFIX):
            group = _relative_group(path, rel.parent.as_posix(), kept)
            if group is not None:
                target.write_text(json.dumps({"child_paths": group}))
            continue
        shutil.copyfile(path, target)
    staging.mkdir(parents=True, exist_ok=True)
    try:
        if launchers is not None:
            launchers(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    (staging / "done").write_text("")
    try:
        staging.rename(home)
    except OSError:  # another evaluator kept the same kernels first
        shutil.rmtree(staging, ignore_errors=True)


def _relative_group(path: Path, folder: str, kept: set[str]) -> dict[str, str] | None:
    """The group's kept files (its metadata and machine code: what Triton loads a compiled kernel from; its
    intermediate representations are dropped), or None where the group has not both or is not Triton's."""
    try:
        children = json.loads(path.read_text())["child_paths"]
        group = {str(name): f"{folder}/{Path(str(child)).name}" for name, child in children.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    group = {name: rel for name, rel in group.items() if rel in kept and name == Path(rel).name}
    suffixes = {Path(rel).suffix for rel in group.values()}
    return group if {".json", ".cubin"} <= suffixes else None


def build_launcher(setup: Setup) -> Path | None:
    """Triton's launcher module, built once per cache and Triton version from Triton's own source by a process
    that runs harness code alone (no candidate's: outside the sandbox, like the builder's own probe), for every
    evaluated process to find instead of running the C compiler; None where it does not build (each evaluated
    process then builds its own, before its candidate loads)."""
    home = setup.cache_dir / "triton-harness" / _version()
    if (home / "done").exists():
        return home
    staging = home.with_name(home.name + f".{os.getpid()}.{secrets.token_hex(4)}")
    env = dict(os.environ) | ({"CUDA_VISIBLE_DEVICES": str(setup.gpu_index)} if setup.gpu_index is not None else {})
    env["PYTHONPATH"] = str(PACKAGE_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.pop("TRITON_INTERPRET", None)
    try:
        ran = subprocess.run([sys.executable, "-m", "cuda_agent.evaluate.worker.triton_runtime", str(staging)], env=env,
                             capture_output=True, text=True, timeout=setup.timeouts.build_s)
    except (OSError, subprocess.TimeoutExpired):
        shutil.rmtree(staging, ignore_errors=True)
        return None
    if ran.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        return None
    (staging / "done").write_text("")
    try:
        staging.rename(home)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return home if (home / "done").exists() else None


def copy_kernels(home: Path, job: Path, launcher: Path | None = None) -> Path:
    """The compiled kernels, copied into the job (readable, not writable, by the candidate's process), each group
    file naming its kernel's files where the copy lies; beside them Triton's ``launcher`` module, when built."""
    if launcher is not None:
        shutil.copytree(launcher, job / LAUNCHER_DIR, ignore=shutil.ignore_patterns("done"))
    target = job / "triton-kernels"
    shutil.copytree(home, target, ignore=shutil.ignore_patterns("done"))
    for group in target.rglob(GROUP_PREFIX + "*"):
        children = json.loads(group.read_text())["child_paths"]
        group.write_text(json.dumps({"child_paths": {name: str(target / rel) for name, rel in children.items()}}))
    return target
