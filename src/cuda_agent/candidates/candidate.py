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
    generation carrying ``load_inline`` sources) or ``python`` (no extension).
    """

    model_new: str
    extensions: tuple[Extension, ...]
    kind: str
    origin: str
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def uses_cuda(self) -> bool:
        return any(ext.uses_cuda for ext in self.extensions)

    @property
    def digest(self) -> str:
        payload = {
            "model_new": self.model_new,
            "extensions": [e.fingerprint() for e in self.extensions],
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "origin": self.origin,
            "digest": self.digest,
            "extensions": {e.name: e.compile_units for e in self.extensions},
            "notes": list(self.notes),
        }


def fixed_file(name: str) -> str:
    """The project's own binding.cpp / binding_registry.h."""
    return resources.files("cuda_agent.candidates").joinpath("fixed", name).read_text()


def load_candidate(path: str | Path) -> Candidate:
    """A workspace directory, or a single KernelBench-style ``ModelNew`` file."""
    path = Path(path)
    if path.is_dir():
        return load_workspace(path)
    if path.is_file() and path.suffix == ".py":
        from cuda_agent.candidates.inline import load_inline_file

        return load_inline_file(path)
    if not path.exists():
        raise CandidateError(f"{path}: no such file or directory.")
    raise CandidateError(
        f"{path}: a candidate is a directory (model_new.py + kernels/) or a .py file with ModelNew."
    )


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
