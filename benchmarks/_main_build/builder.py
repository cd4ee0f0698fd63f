"""Compile a candidate's extensions in parallel, one process per translation unit,
with a content-keyed cache: an unchanged candidate is never rebuilt."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cuda_agent.build.diagnostics import Diagnostic, parse_diagnostics, summarize
from _main_build.toolchain import Toolchain, ToolchainError, detect_toolchain
from cuda_agent.candidates import Candidate, Extension
from cuda_agent.paths import cache_root
from cuda_agent.sandbox import Limits, LocalSandbox, Sandbox, run_command

DEFAULT_COMPILE_TIMEOUT_S = 300.0
LOG_LIMIT = 64 * 1024


@dataclass
class BuildResult:
    ok: bool
    backend: str
    key: str
    modules: dict[str, str] = field(default_factory=dict)  # module name -> shared library path
    diagnostics: list[Diagnostic] = field(default_factory=list)
    cached: bool = False
    seconds: float = 0.0
    error: str | None = None
    log: str = ""

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "backend": self.backend,
            "key": self.key,
            "modules": dict(self.modules),
            "diagnostics": [d.to_dict() for d in self.diagnostics],
            "cached": self.cached,
            "seconds": round(self.seconds, 3),
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], log: str = "") -> "BuildResult":
        return cls(
            ok=data["ok"],
            backend=data["backend"],
            key=data["key"],
            modules=dict(data["modules"]),
            diagnostics=[Diagnostic(**d) for d in data["diagnostics"]],
            cached=data.get("cached", False),
            seconds=data.get("seconds", 0.0),
            error=data.get("error"),
            log=log,
        )


def build_key(candidate: Candidate, toolchain: Toolchain, mode: str) -> str:
    placeholder = Path("/src")
    payload = {
        "mode": mode,
        "toolchain": toolchain.fingerprint(),
        # The command lines themselves, so any change to the flags invalidates the cache.
        "commands": [
            toolchain.cxx_command(placeholder, placeholder, "m", placeholder, ()),
            toolchain.nvcc_command(placeholder, placeholder, "m", placeholder, ()) if toolchain.nvcc else None,
            toolchain.link_command([placeholder], placeholder, False, ()),
        ],
        "extensions": [e.fingerprint() for e in candidate.extensions],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def build(
    candidate: Candidate,
    backend: str,
    *,
    mode: str = "link",
    cache_dir: Path | None = None,
    sandbox: Sandbox | None = None,
    timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    jobs: int | None = None,
) -> BuildResult:
    """Compile (and with ``mode="link"``, link) every extension of ``candidate``.

    The result is cached under a key of everything that affects it; an
    unchanged candidate is never rebuilt.
    """
    if mode not in ("link", "compile"):
        raise ValueError(f"unknown build mode {mode!r}; use 'link' or 'compile'.")
    start = time.monotonic()
    try:
        toolchain = detect_toolchain(backend)
    except ToolchainError as exc:
        return BuildResult(ok=False, backend=backend, key="", error=str(exc))
    key = build_key(candidate, toolchain, mode)
    if backend == "cpu":
        cuda_files = [p for e in candidate.extensions for p in e.compile_units if p.endswith(".cu")]
        if cuda_files:
            return BuildResult(
                ok=False,
                backend=backend,
                key=key,
                error=f"the CPU backend cannot build CUDA sources ({', '.join(cuda_files)}); "
                "use kernels/*.cpp or run with --device cuda.",
            )
    root = (cache_dir or cache_root()) / "builds"
    final = root / key
    cached = _load_cached(final)
    if cached is not None:
        cached.cached = True
        cached.seconds = time.monotonic() - start
        return cached
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=root))
    try:
        result = _compile_all(candidate, toolchain, mode, work, sandbox or LocalSandbox(), timeout_s, jobs)
        result.key = key
        result.seconds = time.monotonic() - start
        if result.error and "timed out" in result.error:
            return result  # a timeout may be load, not the source: never cache it
        _store(result, work, final)
        return _load_cached(final) or result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compile_only(candidate: Candidate, backend: str, **options: Any) -> BuildResult:
    """Compile each source without linking: finds compile errors on a machine without a GPU."""
    return build(candidate, backend, mode="compile", **options)


def _compile_all(
    candidate: Candidate,
    toolchain: Toolchain,
    mode: str,
    work: Path,
    sandbox: Sandbox,
    timeout_s: float,
    jobs: int | None,
) -> BuildResult:
    result = BuildResult(ok=True, backend=toolchain.backend, key="")
    logs: list[str] = []
    for ext in candidate.extensions:
        src_root = work / "src" / ext.name
        obj_root = work / "obj" / ext.name
        for rel, text in ext.sources.items():
            path = src_root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        commands = []
        for rel in ext.compile_units:
            obj = obj_root / (rel.replace("/", "__") + ".o")
            obj.parent.mkdir(parents=True, exist_ok=True)
            make = toolchain.nvcc_command if rel.endswith(".cu") else toolchain.cxx_command
            extra = ext.cuda_cflags if rel.endswith(".cu") else ext.cflags
            try:
                commands.append((rel, obj, make(src_root / rel, obj, ext.name, src_root, extra)))
            except ToolchainError as exc:
                return BuildResult(ok=False, backend=toolchain.backend, key="", error=str(exc))
        limits = Limits(timeout_s=timeout_s, output_bytes=4 * 1024 * 1024)
        workers = max(1, min(len(commands) or 1, jobs or os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            outcomes = list(
                pool.map(lambda c: (c, run_command(c[2], cwd=src_root, limits=limits, sandbox=sandbox, writable=(work,))), commands)
            )
        failed = []
        for (rel, _obj, _argv), proc in outcomes:
            logs.append(f"$ compile {ext.name}/{rel}\n{proc.output}")
            result.diagnostics += parse_diagnostics(proc.output, str(src_root) + "/")
            if not proc.ok:
                failed.append(f"{rel} ({proc.describe_failure()})")
        if failed:
            result.ok = False
            result.error = "compilation failed: " + ", ".join(failed)
            if not any(d.severity == "error" for d in result.diagnostics):
                result.diagnostics.append(Diagnostic("error", result.error))
            break
        if mode == "link":
            output = work / "lib" / f"{ext.name}.so"
            output.parent.mkdir(parents=True, exist_ok=True)
            try:
                argv = toolchain.link_command([o for _r, o, _a in commands], output, ext.uses_cuda, ext.ldflags)
            except ToolchainError as exc:
                return BuildResult(ok=False, backend=toolchain.backend, key="", error=str(exc))
            proc = run_command(argv, cwd=work, limits=limits, sandbox=sandbox, writable=(work,))
            logs.append(f"$ link {ext.name}\n{proc.output}")
            result.diagnostics += parse_diagnostics(proc.output, str(work) + "/")
            if not proc.ok:
                result.ok = False
                result.error = f"linking {ext.name} failed ({proc.describe_failure()})"
                break
            result.modules[ext.name] = str(output)
    result.diagnostics = summarize(result.diagnostics)
    log = "\n".join(logs)
    result.log = log if len(log) <= LOG_LIMIT else log[: LOG_LIMIT // 2] + "\n[...]\n" + log[-LOG_LIMIT // 2 :]
    return result


def _store(result: BuildResult, work: Path, final: Path) -> None:
    staged = work / "result"
    staged.mkdir()
    modules = {}
    for name, path in result.modules.items():
        target = staged / f"{name}.so"
        shutil.copy2(path, target)
        modules[name] = str(final / f"{name}.so")
    record = result.to_dict() | {"modules": modules}
    (staged / "build.json").write_text(json.dumps(record, indent=1))
    (staged / "build.log").write_text(result.log)
    try:
        os.rename(staged, final)
    except OSError:
        pass  # another process stored the same key first; theirs is identical


def _load_cached(final: Path) -> BuildResult | None:
    meta = final / "build.json"
    if not meta.exists():
        return None
    data = json.loads(meta.read_text())
    if not all(Path(p).exists() for p in data["modules"].values()):
        return None
    log_path = final / "build.log"
    return BuildResult.from_dict(data, log=log_path.read_text() if log_path.exists() else "")
