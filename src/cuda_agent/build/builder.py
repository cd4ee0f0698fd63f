"""Compile a candidate's extensions in parallel, one process per translation unit,
with a content-keyed cache: an unchanged candidate is never rebuilt."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cuda_agent.build.diagnostics import Diagnostic, parse_diagnostics, summarize
from cuda_agent.build.cache import ObjectCache
from cuda_agent.build.toolchain import GLUE_OPT, KERNEL_OPT, Toolchain, ToolchainError, detect_toolchain, usable_cpus
from cuda_agent.candidates import Candidate, CandidateError, Extension, check_extension
from cuda_agent.candidates.candidate import COMPILE_SUFFIXES
from cuda_agent.paths import cache_root
from cuda_agent.sandbox import Limits, LocalSandbox, Sandbox, run_command

DEFAULT_COMPILE_TIMEOUT_S = 300.0
LOG_LIMIT = 64 * 1024
# The symbol audit's probe extension is built into a cache of its own under the cache directory, which
# candidate builds read (its precompiled header and binding.cpp are theirs too) but never write: no
# candidate's compile can stand in for an object the audit's allowlist is read from.
PROBE_NAMESPACE = "probe"

# Exactly the headers SKILL.md tells a binding file to include (and binding_registry.h includes), so the
# .gch is what every glue unit parses first anyway. An include guard, not #pragma once: g++ warns
# about #pragma once in the header it precompiles.
PCH_NAME = "cuda_agent_pch.h"
PCH_TEXT = """// cuda-agent: precompiled for the glue units (binding.cpp, kernels/*_binding.cpp).
#ifndef CUDA_AGENT_PCH_H
#define CUDA_AGENT_PCH_H
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>
#endif
"""


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
    # One entry per translation unit compiled for this result: unit, key, reused (taken from the object
    # cache) or compiled, glue, pch, compile seconds. Empty for a result reused whole.
    units: list[dict[str, Any]] = field(default_factory=list)
    # User+system CPU-seconds of the compiler and linker processes this call ran (0 for a result reused
    # whole; None where a process's usage could not be read): the host's cost, which the wall
    # ``seconds`` of a build sharing its cores with others does not give.
    cpu_s: float | None = 0.0

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
            "units": [dict(u) for u in self.units],
            "cpu_s": None if self.cpu_s is None else round(self.cpu_s, 3),
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
            units=[dict(u) for u in data.get("units", [])],
            cpu_s=data.get("cpu_s"),
        )


def build_key(candidate: Candidate, toolchain: Toolchain, mode: str) -> str:
    placeholder = Path("/src")
    payload = {
        "mode": mode,
        "toolchain": toolchain.fingerprint(),
        # The command lines themselves, so any change to the flags invalidates the cache.
        "commands": [
            toolchain.cxx_command(placeholder, placeholder, "m", placeholder, ()),
            toolchain.cxx_command(placeholder, placeholder, "m", placeholder, (), opt=GLUE_OPT, pch=placeholder),
            toolchain.pch_command(placeholder, placeholder),
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
    namespace: str | None = None,
) -> BuildResult:
    """Compile (and with ``mode="link"``, link) every extension of ``candidate``.

    Two caches under ``cache_dir``: ``builds/<key>`` holds whole results (an unchanged candidate is
    never rebuilt, not even linked), ``objects/`` holds one object per translation unit (an edit to
    one file recompiles that file and links; see cache.py and docs/BUILD.md). ``namespace`` puts both
    under ``cache_dir/<namespace>`` (PROBE_NAMESPACE: the audit's probe, kept apart from candidates).

    Isolation: every compile runs in a private directory, the only one its sandbox may write; sources,
    placed objects and the precompiled header are read-only to every sandbox; objects reach the shared
    cache only as copies the evaluator makes after the compiler exited (cache.py).
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
    base = cache_dir or cache_root()
    store = base / namespace if namespace else base
    root = store / "builds"
    final = root / key
    cached = _load_cached(final)
    if cached is not None:
        cached.cached = True
        cached.seconds = time.monotonic() - start
        cached.cpu_s = 0.0
        return cached
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=root))
    try:
        units: list[dict[str, Any]] = []
        probe_objects = ObjectCache(base / PROBE_NAMESPACE / "objects")
        objects = probe_objects if namespace == PROBE_NAMESPACE else ObjectCache(store / "objects", seed=probe_objects)
        result = _compile_all(candidate, toolchain, mode, work, sandbox or LocalSandbox(), timeout_s, jobs, objects, units)
        result.units = units
        result.key = key
        result.seconds = time.monotonic() - start
        if result.error and "timed out" in result.error:
            return result  # a timeout may be load, not the source: never cache it
        _store(result, work, final)
        stored = _load_cached(final)
        if stored is None:
            return result
        stored.units = result.units  # what this call compiled or reused, even where a twin stored first
        stored.cpu_s = result.cpu_s
        return stored
    finally:
        shutil.rmtree(work, ignore_errors=True)


def prepare(backend: str, **options: Any) -> BuildResult:
    """Build what every candidate of ``backend`` shares before the first one arrives: the glue's
    precompiled header and ``binding.cpp`` (module cuda_extension), by building the toolchain probe,
    the same minimal extension the evaluator's symbol audit builds anyway, in its own namespace
    (PROBE_NAMESPACE), whose objects candidate builds reuse read-only. On a fresh cache this moves ~30
    CPU-s out of the first candidate's build; afterwards it returns the cached probe at once.
    ``options`` as for ``build``."""
    from cuda_agent.build.probe import probe_candidate

    return build(probe_candidate(backend), backend, namespace=PROBE_NAMESPACE, **options)


def compile_only(candidate: Candidate, backend: str, **options: Any) -> BuildResult:
    """Compile each source without linking: finds compile errors on a machine without a GPU."""
    return build(candidate, backend, mode="compile", **options)


def _compile_all(*args: Any) -> BuildResult:
    pch_state: dict[str, Any] = {}
    try:
        result = _compile_extensions(*args, pch_state)
    finally:
        if "pool" in pch_state:
            pch_state["pool"].shutdown(wait=True)  # never leave it writing into a work dir being removed
    result.cpu_s = _add_cpu(result.cpu_s, pch_state.get("cpu_s", 0.0))
    return result


def _add_cpu(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def _compile_extensions(
    candidate: Candidate,
    toolchain: Toolchain,
    mode: str,
    work: Path,
    sandbox: Sandbox,
    timeout_s: float,
    jobs: int | None,
    objects: ObjectCache,
    units_out: list[dict[str, Any]],
    pch_state: dict[str, Any],
) -> BuildResult:
    result = BuildResult(ok=True, backend=toolchain.backend, key="")
    logs: list[str] = []
    limits = Limits(timeout_s=timeout_s, output_bytes=4 * 1024 * 1024)
    for ext in candidate.extensions:
        try:
            check_extension(ext, "build")
            src_root = _write_sources(ext, work / "src" / ext.name)
            plans = [plan_unit(ext, rel, toolchain, src_root, work / "obj" / ext.name / object_name(rel))
                     for rel in ext.compile_units]
            _refuse_shared_objects(ext, plans)
        except (ToolchainError, CandidateError) as exc:
            return BuildResult(ok=False, backend=toolchain.backend, key="", error=str(exc))
        if any(p.pch for p in plans) and "future" not in pch_state:
            # On its own thread, so the kernels compile while the header does (the first build of a
            # toolchain); the glue units wait for it.
            pch_state["pool"] = ThreadPoolExecutor(max_workers=1)
            pch_state["future"] = pch_state["pool"].submit(_ensure_pch, toolchain, work, sandbox, limits, objects, logs,
                                                           pch_state)
        workers = max(1, min(len(plans) or 1, jobs or usable_cpus()))

        def run_unit(plan: UnitPlan) -> tuple[UnitPlan, UnitOutcome]:
            header = pch_state["future"].result() if plan.pch else None
            if plan.pch and header is None:  # the header failed to build: parse the headers instead
                plan.pch = False
                plan.key = unit_key(ext, plan.rel, toolchain, False)
            return plan, _object(plan, toolchain, ext, src_root, header, work, sandbox, limits, objects)

        with ThreadPoolExecutor(max_workers=workers) as pool:
            outcomes = list(pool.map(run_unit, plans))
        failed = []
        for plan, outcome in outcomes:
            units_out.append({"extension": ext.name, "unit": plan.rel, "key": plan.key, "reused": outcome.reused,
                              "glue": plan.glue, "pch": plan.pch, "seconds": round(outcome.seconds, 3),
                              "cpu_s": None if outcome.cpu_s is None else round(outcome.cpu_s, 3)})
            result.cpu_s = _add_cpu(result.cpu_s, outcome.cpu_s)
            logs.append(f"$ compile {ext.name}/{plan.rel}" + (" (reused)" if outcome.reused else "") + f"\n{outcome.output}")
            result.diagnostics += parse_diagnostics(outcome.output, outcome.source_root + "/")
            if not outcome.ok:
                failed.append(f"{plan.rel} ({outcome.failure})")
        if failed:
            result.ok = False
            result.error = "compilation failed: " + ", ".join(failed)
            if not any(d.severity == "error" for d in result.diagnostics):
                result.diagnostics.append(Diagnostic("error", result.error))
            break
        if mode == "link":
            # The linker writes only its own directory: the placed objects are the cache's entries.
            output = work / "lib" / ext.name / f"{ext.name}.so"
            output.parent.mkdir(parents=True, exist_ok=True)
            try:
                argv = toolchain.link_command([p.obj for p in plans], output, ext.uses_cuda, ext.ldflags)
            except ToolchainError as exc:
                return BuildResult(ok=False, backend=toolchain.backend, key="", error=str(exc))
            proc = run_command(argv, cwd=output.parent, limits=limits, sandbox=sandbox, readable=(work,))
            result.cpu_s = _add_cpu(result.cpu_s, proc.cpu_s)
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


# -- one translation unit ---------------------------------------------------------------------------

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.M)
_OTHER_INCLUDE = re.compile(r'^[ \t]*#[ \t]*(include(?![ \t]*[<"])|include_next|import)|__has_include', re.M)
_DEFINE_FIRST = re.compile(r'^[ \t]*#[ \t]*(define|undef|pragma)\b', re.M)


def object_name(rel: str) -> str:
    """The object file of unit ``rel``: a readable stem and a hash of the whole relative path, so no
    two units of an extension share one (``kernels/x.cpp`` and a root ``kernels__x.cpp`` did)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", posixpath.basename(rel))[:64]
    return f"{stem}.{hashlib.sha256(rel.encode()).hexdigest()[:16]}.o"


def _refuse_shared_objects(ext: Extension, plans: list["UnitPlan"]) -> None:
    seen: dict[Path, str] = {}
    for plan in plans:
        if plan.obj in seen:
            raise ToolchainError(f"{ext.name}: units {seen[plan.obj]} and {plan.rel} would compile to the same object "
                                 f"{plan.obj.name}; rename one of them.")
        seen[plan.obj] = plan.rel


def _write_sources(ext: Extension, src_root: Path) -> Path:
    """Each source at ``src_root/rel``, refusing any that would land outside ``src_root`` (the paths
    were checked where they entered; this holds even where they were not)."""
    src_root.mkdir(parents=True, exist_ok=True)
    root = os.path.realpath(src_root)
    for rel, text in ext.sources.items():
        path = src_root / rel
        if not os.path.realpath(path).startswith(root + os.sep):
            raise CandidateError(f"{ext.name}: source path {rel!r} resolves outside the build's source directory; "
                                 "give a relative path inside the workspace layout.")
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.path.realpath(path.parent).startswith(root):
            raise CandidateError(f"{ext.name}: source path {rel!r} resolves outside the build's source directory.")
        path.write_text(text)
    return src_root


def is_glue(rel: str) -> bool:
    """The tensor-to-pointer glue of the workspace layout (SKILL.md): ``binding.cpp`` and
    ``*_binding.cpp``. Only these are compiled at GLUE_OPT; every other unit is a kernel (-O3)."""
    name = posixpath.basename(rel)
    return name == "binding.cpp" or name.endswith("_binding.cpp")


def included_sources(ext: Extension, rel: str) -> list[str]:
    """The candidate files ``rel`` may read, as g++ would find them (quoted: the includer's directory,
    then the source root; angled: the source root, which is on -I), followed transitively.

    Conservative where a scan cannot be exact: an include through a macro, ``#include_next`` or
    ``__has_include``, or an extension with its own -I/-include flags, makes every candidate file
    part of the key. Every file at the source root is always part of it: it is on -I ahead of the
    system's headers, so a system header could reach it by a plain name. An include found in a
    comment or a dead #if branch only adds a file to the key (a needless rebuild, never a stale one).
    """
    extra = (*ext.cflags, *ext.cuda_cflags)
    if any(f.startswith(("-I", "-include", "-isystem", "-iquote")) for f in extra):
        return sorted(p for p in ext.sources if p != rel)
    seen: set[str] = set()
    todo = [rel]
    while todo:
        current = todo.pop()
        text = ext.sources[current]
        if _OTHER_INCLUDE.search(text):
            return sorted(p for p in ext.sources if p != rel)
        for kind, name in _INCLUDE.findall(text):
            tries = [posixpath.join(posixpath.dirname(current), name)] if kind == '"' else []
            tries.append(name)
            for path in tries:
                path = posixpath.normpath(path)
                if path in ext.sources and path not in seen and path != rel:
                    seen.add(path)
                    todo.append(path)
                    break
    seen.update(p for p in ext.sources if "/" not in p and p != rel and not p.endswith(COMPILE_SUFFIXES))
    return sorted(seen)


def uses_pch(ext: Extension, rel: str) -> bool:
    """The precompiled header is force-included ahead of the unit, so only where that cannot change
    the unit's meaning or crash g++: a glue unit, no extra flags (the .gch must match the flags
    exactly), and no #define/#undef/#pragma before the unit's first #include (torch's headers would
    otherwise be seen before the candidate's settings)."""
    if not use_pch() or not is_glue(rel) or rel.endswith(".cu") or ext.cflags:
        return False
    text = ext.sources[rel]
    first_include = _INCLUDE.search(text)
    head = text[: first_include.start()] if first_include else text
    return _DEFINE_FIRST.search(head) is None


def use_pch() -> bool:
    """CUDA_AGENT_BUILD_PCH=0 turns the precompiled header off (the benchmark measures both)."""
    return os.environ.get("CUDA_AGENT_BUILD_PCH", "1") != "0"


_SRC = Path("/src")
_OBJ = Path("/obj.o")
_PCH = Path("/pch") / PCH_NAME


def _unit_argv(ext: Extension, rel: str, toolchain: Toolchain, src_root: Path, obj: Path, pch: Path | None, glue: bool) -> list[str]:
    if rel.endswith(".cu"):
        return toolchain.nvcc_command(src_root / rel, obj, ext.name, src_root, ext.cuda_cflags)
    opt = GLUE_OPT if glue else KERNEL_OPT
    return toolchain.cxx_command(src_root / rel, obj, ext.name, src_root, ext.cflags, opt=opt, pch=pch)


def unit_key(ext: Extension, rel: str, toolchain: Toolchain, pch: bool) -> str:
    """Everything that decides the object: the unit's text and path, the text of every candidate file
    it may include, the command line (flags, module name, opt level; paths replaced by placeholders)
    and the toolchain (compiler, torch, CUDA versions, architectures, recipe version)."""
    payload = {
        "toolchain": toolchain.fingerprint(),
        "argv": _unit_argv(ext, rel, toolchain, _SRC, _OBJ, _PCH if pch else None, is_glue(rel)),
        "pch": pch_key(toolchain) if pch else None,
        "unit": rel,
        "source": ext.sources[rel],
        "includes": [[p, ext.sources[p]] for p in included_sources(ext, rel)],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:40]


@dataclass
class UnitPlan:
    rel: str
    obj: Path
    glue: bool
    pch: bool
    key: str


@dataclass
class UnitOutcome:
    ok: bool
    reused: bool
    output: str
    source_root: str
    seconds: float = 0.0
    failure: str = ""
    cpu_s: float | None = 0.0  # 0 for a reused unit


def plan_unit(ext: Extension, rel: str, toolchain: Toolchain, src_root: Path, obj: Path) -> UnitPlan:
    if rel.endswith(".cu") and not toolchain.nvcc:
        raise ToolchainError("no nvcc found; install the CUDA toolkit or set CUDA_HOME.")
    pch = uses_pch(ext, rel)
    return UnitPlan(rel=rel, obj=obj, glue=is_glue(rel), pch=pch, key=unit_key(ext, rel, toolchain, pch))


def _object(
    plan: UnitPlan,
    toolchain: Toolchain,
    ext: Extension,
    src_root: Path,
    pch_header: Path | None,
    work: Path,
    sandbox: Sandbox,
    limits: Limits,
    objects: ObjectCache,
) -> UnitOutcome:
    """The unit's object at ``plan.obj``: reused from the cache, or compiled (once, under the key's
    lock) and published. A failed or timed-out compile is not stored."""
    plan.obj.parent.mkdir(parents=True, exist_ok=True)
    cached = objects.lookup(plan.key)
    if cached is None:
        with objects.lock(plan.key, wait_s=limits.timeout_s):
            cached = objects.lookup(plan.key)  # built by whoever held the lock
            if cached is None:
                # A directory of its own, the only one this compile's sandbox may write: no compile can
                # write another unit's object, the placed objects or the sources.
                private = Path(tempfile.mkdtemp(prefix="unit-", dir=_units_dir(work)))
                produced = private / "object.o"
                argv = _unit_argv(ext, plan.rel, toolchain, src_root, produced, pch_header if plan.pch else None, plan.glue)
                proc = run_command(argv, cwd=private, limits=limits, sandbox=sandbox, readable=(work,))
                if not proc.ok:
                    return UnitOutcome(False, False, proc.output, str(src_root), proc.seconds, proc.describe_failure(),
                                       proc.cpu_s)
                record = {"unit": plan.rel, "module": ext.name, "seconds": round(proc.seconds, 3),
                          "output": proc.output, "source_root": str(src_root)}
                try:
                    objects.place(objects.publish(plan.key, produced, record), plan.obj)
                except OSError:
                    # An unwritable cache costs reuse, not this build: the evaluator's own copy is linked.
                    shutil.copyfile(produced, plan.obj)
                return UnitOutcome(True, False, proc.output, str(src_root), proc.seconds, cpu_s=proc.cpu_s)
    objects.place(cached, plan.obj)
    # Warnings the compile printed are replayed, so a reused unit reports what a fresh one would.
    return UnitOutcome(True, True, cached.record.get("output", ""), cached.record.get("source_root", str(src_root)))


def _units_dir(work: Path) -> Path:
    units = work / "units"
    units.mkdir(exist_ok=True)
    return units


# -- the glue's precompiled header ------------------------------------------------------------------

def pch_key(toolchain: Toolchain) -> str:
    payload = {"toolchain": toolchain.fingerprint(), "argv": toolchain.pch_command(_PCH, _OBJ), "header": PCH_TEXT}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:40]


def _ensure_pch(toolchain: Toolchain, work: Path, sandbox: Sandbox, limits: Limits, objects: ObjectCache,
                logs: list[str], state: dict[str, Any] | None = None) -> Path | None:
    """``work/pch/cuda_agent_pch.h`` with its .gch beside it, built once per toolchain and shared
    through the object cache; None when it cannot be built (the glue then parses the headers)."""
    key = pch_key(toolchain)
    folder = work / "pch"  # read-only to every sandbox: the .gch placed here is the cache's entry
    folder.mkdir(parents=True, exist_ok=True)
    header = folder / PCH_NAME
    header.write_text(PCH_TEXT)
    gch = folder / (PCH_NAME + ".gch")
    cached = objects.lookup(key)
    if cached is None:
        with objects.lock(key, wait_s=limits.timeout_s):
            cached = objects.lookup(key)
            if cached is None:
                private = Path(tempfile.mkdtemp(prefix="pch-", dir=_units_dir(work)))
                own_header = private / PCH_NAME
                own_header.write_text(PCH_TEXT)
                produced = private / (PCH_NAME + ".gch")
                proc = run_command(toolchain.pch_command(own_header, produced), cwd=private, limits=limits,
                                   sandbox=sandbox, readable=(work,))
                if state is not None:
                    state["cpu_s"] = proc.cpu_s
                if not proc.ok:
                    logs.append(f"$ precompile {PCH_NAME} (failed; the glue parses the headers instead)\n{proc.output}")
                    return None
                logs.append(f"$ precompile {PCH_NAME}\n{proc.output}")
                try:
                    cached = objects.publish(key, produced, {"unit": PCH_NAME, "module": None,
                                                             "seconds": round(proc.seconds, 3), "output": proc.output,
                                                             "source_root": str(folder)})
                except OSError:
                    shutil.copyfile(produced, gch)
                    return header
    objects.place(cached, gch)
    return header


def _store(result: BuildResult, work: Path, final: Path) -> None:
    staged = work / "result"
    staged.mkdir()
    modules = {}
    for name, path in result.modules.items():
        target = staged / f"{name}.so"
        shutil.copy2(path, target)
        modules[name] = str(final / f"{name}.so")
    # units and cpu_s: what one call did, not the result
    record = result.to_dict() | {"modules": modules, "units": [], "cpu_s": 0.0}
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
