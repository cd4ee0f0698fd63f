"""The normalised candidate: Python source of ``ModelNew`` and extension sources, in memory."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from cuda_agent.paths import read_text

WORKSPACE_MODULE = "cuda_extension"
FIXED_FILES = ("binding.cpp", "binding_registry.h")
COMPILE_SUFFIXES = (".cu", ".cpp", ".cc", ".cxx")
SOURCE_SUFFIXES = COMPILE_SUFFIXES + (".h", ".hpp", ".cuh", ".inl")
MAX_SOURCE_BYTES = 4 * 1024 * 1024
# Bounds on what a candidate may carry (over the service's wire above all): generous for any real
# extension, small enough that a job cannot exhaust the builder's disk or a path's length limits.
MAX_SOURCE_FILES = 256
MAX_EXTENSIONS = 16
MAX_PATH_CHARS = 200
MAX_PATH_PARTS = 8
MAX_FLAGS = 64
MAX_FLAG_CHARS = 512


class CandidateError(ValueError):
    """A candidate that cannot be evaluated; the message names the file and the fix."""


@dataclass(frozen=True)
class Extension:
    """One importable module: its name and every file the compiler may read."""

    name: str
    sources: dict[str, str]
    cflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()

    @property
    def compile_units(self) -> list[str]:
        return sorted(p for p in self.sources if p.endswith(COMPILE_SUFFIXES))

    @property
    def uses_cuda(self) -> bool:
        return any(p.endswith(".cu") for p in self.sources)

    def fingerprint(self) -> list:
        """Everything about the extension that changes what gets built."""
        return [self.name, sorted(self.sources.items()), self.cflags, self.cuda_cflags, self.ldflags]


@dataclass(frozen=True)
class Candidate:
    """What the evaluator builds and runs.

    ``kind`` is ``workspace`` (the paper's layout), ``inline`` (a KernelBench
    generation carrying ``load_inline`` sources), ``python`` (no extension) or
    ``triton`` (``model_new.py`` launching ``@triton.jit`` kernels, ``candidates.triton``).
    ``language`` is ``cuda`` (C++/CUDA extensions) or ``triton``.
    """

    model_new: str
    extensions: tuple[Extension, ...]
    kind: str
    origin: str
    notes: tuple[str, ...] = field(default=(), compare=False)
    language: str = "cuda"

    @property
    def uses_cuda(self) -> bool:
        return any(ext.uses_cuda for ext in self.extensions)

    @property
    def digest(self) -> str:
        payload = {
            "model_new": self.model_new,
            "extensions": [e.fingerprint() for e in self.extensions],
        }
        if self.language != "cuda":
            payload["language"] = self.language
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "language": self.language,
            "origin": self.origin,
            "digest": self.digest,
            "extensions": {e.name: e.compile_units for e in self.extensions},
            "notes": list(self.notes),
        }


def check_source_path(rel: Any, where: str = "candidate") -> str:
    """``rel`` when it names a file inside an extension's source root: a relative POSIX path of at most
    MAX_PATH_PARTS plain parts (no ``..``, ``.``, empty part, backslash, NUL or control character, no
    leading ``/`` or ``~``) with a source suffix. The builder writes each source at ``src_root/rel``, so
    anything else could write outside the build's directory."""
    if not isinstance(rel, str) or not rel:
        raise CandidateError(f"{where}: a source path must be a non-empty string, got {rel!r}.")
    problem = None
    parts = rel.split("/")
    if len(rel) > MAX_PATH_CHARS:
        problem = f"longer than {MAX_PATH_CHARS} characters"
    elif rel.startswith(("/", "~")):
        problem = "absolute"
    elif any(ord(c) < 32 or c in "\\\x7f" for c in rel):
        problem = "holds a NUL, control character or backslash"
    elif any(part in ("", ".", "..") for part in parts):
        problem = "has an empty, '.' or '..' part"
    elif len(parts) > MAX_PATH_PARTS:
        problem = f"is more than {MAX_PATH_PARTS} directories deep"
    elif not rel.endswith(SOURCE_SUFFIXES):
        problem = f"does not end in one of {', '.join(SOURCE_SUFFIXES)}"
    if problem:
        raise CandidateError(f"{where}: source path {rel[:MAX_PATH_CHARS]!r} {problem}; give a relative path inside "
                             "the workspace layout, e.g. kernels/my_kernel.cu.")
    return rel


def check_extension(ext: Extension, where: str = "candidate") -> Extension:
    """``ext`` when its name is a Python identifier (it names the module, its build and library
    directories) and its sources and flags are within the bounds; raises CandidateError naming the
    problem otherwise."""
    if not isinstance(ext.name, str) or not ext.name.isidentifier() or not ext.name.isascii() or len(ext.name) > 64:
        raise CandidateError(f"{where}: extension name {str(ext.name)[:80]!r} must be an ASCII Python identifier of at "
                             "most 64 characters (it is the module's name).")
    if not isinstance(ext.sources, dict) or not ext.sources:
        raise CandidateError(f"{where}: extension {ext.name} has no sources.")
    if len(ext.sources) > MAX_SOURCE_FILES:
        raise CandidateError(f"{where}: extension {ext.name} has {len(ext.sources)} sources, over {MAX_SOURCE_FILES}.")
    total = 0
    for rel, text in ext.sources.items():
        check_source_path(rel, f"{where}: extension {ext.name}")
        if not isinstance(text, str):
            raise CandidateError(f"{where}: source {rel} of {ext.name} must be text, got {type(text).__name__}.")
        total += len(text)
    if total > MAX_SOURCE_BYTES:
        raise CandidateError(f"{where}: extension {ext.name}'s sources total {total} characters, over {MAX_SOURCE_BYTES}.")
    for kind in ("cflags", "cuda_cflags", "ldflags"):
        flags = getattr(ext, kind)
        if len(flags) > MAX_FLAGS or not all(isinstance(f, str) and len(f) <= MAX_FLAG_CHARS and "\x00" not in f
                                             for f in flags):
            raise CandidateError(f"{where}: extension {ext.name}'s {kind} must be at most {MAX_FLAGS} strings of at most "
                                 f"{MAX_FLAG_CHARS} characters without NUL.")
    return ext


def check_candidate(candidate: Candidate, where: str = "candidate") -> Candidate:
    """``candidate`` when every extension passes ``check_extension``, there are at most MAX_EXTENSIONS
    of them with distinct names, and ``model_new`` is text within MAX_SOURCE_BYTES."""
    if not isinstance(candidate.model_new, str) or len(candidate.model_new) > MAX_SOURCE_BYTES:
        raise CandidateError(f"{where}: model_new must be text of at most {MAX_SOURCE_BYTES} characters.")
    if len(candidate.extensions) > MAX_EXTENSIONS:
        raise CandidateError(f"{where}: {len(candidate.extensions)} extensions, over {MAX_EXTENSIONS}.")
    names = [e.name for e in candidate.extensions]
    if len(set(names)) != len(names):
        raise CandidateError(f"{where}: two extensions share a name ({', '.join(sorted(names))}); each names its module.")
    for ext in candidate.extensions:
        check_extension(ext, where)
    return candidate


def fixed_file(name: str) -> str:
    """The project's own binding.cpp / binding_registry.h."""
    return resources.files("cuda_agent.candidates").joinpath("fixed", name).read_text()


def load_candidate(path: str | Path, language: str | None = None) -> Candidate:
    """A workspace directory, or a single KernelBench-style ``ModelNew`` file. ``language`` (``cuda`` or
    ``triton``) says which kind of candidate it must be; None reads it from the source: a ``model_new.py``
    with ``@triton.jit`` kernels and no C++/CUDA sources is a Triton candidate."""
    from cuda_agent.candidates.triton import check_language, triton_candidate, triton_kernels

    path = Path(path)
    check_language(language)
    if path.is_dir():
        model_path = path / "model_new.py"
        if not model_path.is_file():
            return load_workspace(path)  # which says what a candidate directory holds
        code = read_text(model_path, CandidateError)
        check_model_new(code, str(model_path))
        native = _native_files(path)
        if language == "triton" or (language is None and not native and triton_kernels(code)):
            return triton_candidate(code, str(model_path))
        if not native and language == "cuda":
            raise CandidateError(f"{path}: declared a CUDA candidate but has no .cu/.cpp sources under kernels/; add "
                                 "them (or declare the candidate's language as triton).")
        if not native:
            raise CandidateError(f"{path}: neither a CUDA candidate (no .cu/.cpp sources under kernels/) nor a Triton "
                                 "one (no @triton.jit kernel in model_new.py); add the kernel sources, or the Triton "
                                 "kernel.")
        return load_workspace(path)
    if path.is_file() and path.suffix == ".py":
        from cuda_agent.candidates.inline import load_inline_file

        code = read_text(path, CandidateError)
        if language == "triton" or (language is None and "load_inline" not in code and triton_kernels(code)):
            return triton_candidate(code, str(path))
        return load_inline_file(path)
    if not path.exists():
        raise CandidateError(f"{path}: no such file or directory.")
    raise CandidateError(
        f"{path}: a candidate is a directory (model_new.py + kernels/) or a .py file with ModelNew."
    )


def _native_files(root: Path) -> list[Path]:
    """The C++/CUDA sources of a workspace (the fixed binding files aside)."""
    files = [p for p in root.glob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES]
    if (root / "kernels").is_dir():
        files += [p for p in (root / "kernels").rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES]
    return [p for p in files if p.relative_to(root).as_posix() not in FIXED_FILES]


def load_workspace(root: str | Path) -> Candidate:
    """The paper's layout: ``model_new.py`` and ``kernels/``; fixed files come from the project."""
    root = Path(root)
    model_path = root / "model_new.py"
    if not model_path.is_file():
        raise CandidateError(
            f"{root}: missing model_new.py; a candidate directory holds model_new.py (class ModelNew) "
            "and kernels/ with the .cu/.cpp sources."
        )
    model_new = read_text(model_path, CandidateError)
    check_model_new(model_new, str(model_path))
    sources: dict[str, str] = {}
    notes: list[str] = []
    files = [p for p in root.glob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES]
    kernels = root / "kernels"
    if kernels.is_dir():
        files += [p for p in kernels.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES]
    total = 0
    for file in sorted(files):
        rel = file.relative_to(root).as_posix()
        if rel in FIXED_FILES:
            if file.read_text() != fixed_file(rel):
                notes.append(f"{rel} differs from the project's copy and was replaced by it")
            continue
        text = file.read_text(errors="replace")
        total += len(text)
        sources[rel] = text
    if total > MAX_SOURCE_BYTES:
        raise CandidateError(f"{root}: sources total {total} bytes, over the {MAX_SOURCE_BYTES} byte limit.")
    for name in FIXED_FILES:
        sources[name] = fixed_file(name)
    extension = Extension(name=WORKSPACE_MODULE, sources=sources)
    return Candidate(
        model_new=model_new,
        extensions=(extension,),
        kind="workspace",
        origin=str(root),
        notes=tuple(notes),
    )


def check_model_new(code: str, where: str) -> None:
    import ast

    try:
        tree = ast.parse(code, filename=where)
    except SyntaxError as exc:
        raise CandidateError(f"{where}: syntax error at line {exc.lineno}: {exc.msg}.") from None
    if not any(isinstance(n, ast.ClassDef) and n.name == "ModelNew" for n in tree.body):
        raise CandidateError(f"{where}: no `class ModelNew` at module level.")
