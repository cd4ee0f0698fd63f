"""What travels between a client and the evaluation service, typed in one place.

A ``Job`` is one call of the evaluator interface (``evaluate.interface.EvaluatorLike``) with its task
and candidate carried whole (sources, not paths: the service may run on other machines); a ``Reply``
is its answer, the same JSON that ``cuda-agent eval --json`` prints for an evaluation. The HTTP front,
the Ray actors and the local slots all speak these, so there is one wire format.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any

from cuda_agent.candidates import Candidate, check_candidate
from cuda_agent.candidates.candidate import MAX_EXTENSIONS, MAX_SOURCE_BYTES, Extension
from cuda_agent.candidates.triton import LANGUAGES
from cuda_agent.tasks import Task

__all__ = ["TOKEN_ENV", "OPS", "ERROR_KINDS", "task_to_wire", "MAX_NAME_CHARS", "task_from_wire", "candidate_to_wire",
           "candidate_from_wire", "Job", "Reply", "ServiceError"]

# The bearer token a service bound beyond the loopback requires (``serve --token`` or this variable) and its
# clients send (``RemoteEvaluator(token=...)`` or this variable). Never passed to a sandboxed process
# (``paths.PASSED_ENV``).
TOKEN_ENV = "CUDA_AGENT_SERVICE_TOKEN"

OPS = ("evaluate", "verify", "build", "baseline", "degenerate", "counters")
# What a failed reply's ``kind`` says, so a client can tell what to do about it.
ERROR_KINDS = ("input", "overloaded", "timeout", "lost", "internal")


def task_to_wire(task: Task) -> dict[str, Any]:
    return {"name": task.name, "code": task.code, "source": task.source, "level": task.level,
            "problem_id": task.problem_id, "metadata": task.metadata}


MAX_NAME_CHARS = 1024  # a task's name, source and a candidate's kind and origin: labels, never paths


def task_from_wire(data: dict[str, Any]) -> Task:
    _require(data, ("name", "code", "source"), "task")
    _text(data, ("name", "source"), "task", MAX_NAME_CHARS)
    _text(data, ("code",), "task", MAX_SOURCE_BYTES)
    return Task(name=data["name"], code=data["code"], source=data["source"], level=data.get("level"),
                problem_id=data.get("problem_id"), metadata=dict(data.get("metadata") or {}))


def candidate_to_wire(candidate: Candidate) -> dict[str, Any]:
    return {"model_new": candidate.model_new, "kind": candidate.kind, "origin": candidate.origin,
            "notes": list(candidate.notes), "extensions": [dataclasses.asdict(e) for e in candidate.extensions],
            "language": candidate.language}


def candidate_from_wire(data: dict[str, Any]) -> Candidate:
    """The candidate a job carries, every path and name in it checked (``candidates.check_candidate``:
    relative source paths inside the layout, identifiers for extension names, bounded sizes and counts):
    the builder writes each source under its own directory, so a path is what a job could aim with."""
    _require(data, ("model_new", "kind", "origin", "extensions"), "candidate")
    _text(data, ("kind", "origin"), "candidate", MAX_NAME_CHARS)
    wire = data["extensions"]
    if not isinstance(wire, list) or len(wire) > MAX_EXTENSIONS:
        raise ValueError(f"a job's candidate extensions must be a list of at most {MAX_EXTENSIONS} objects")
    extensions = []
    for e in wire:
        _require(e, ("name", "sources"), "candidate extension")
        if not isinstance(e["sources"], dict):
            raise ValueError("a candidate extension's 'sources' maps relative paths to source text")
        flags = {k: e.get(k, ()) for k in ("cflags", "cuda_cflags", "ldflags")}
        if not all(isinstance(v, (list, tuple)) for v in flags.values()):
            raise ValueError("a candidate extension's cflags, cuda_cflags and ldflags are lists of strings")
        extensions.append(Extension(name=e["name"], sources=dict(e["sources"]),
                                    **{k: tuple(v) for k, v in flags.items()}))
    language = data.get("language", "cuda")
    if language not in LANGUAGES:
        raise ValueError(f"a job's candidate language must be one of {', '.join(LANGUAGES)}, "
                         f"got {str(language)[:40]!r}")
    notes = data.get("notes", ())
    if not isinstance(notes, (list, tuple)) or len(notes) > 64 or not all(isinstance(n, str) for n in notes):
        raise ValueError("a job's candidate notes are a list of at most 64 strings")
    return check_candidate(Candidate(model_new=data["model_new"], extensions=tuple(extensions), kind=data["kind"],
                                     origin=data["origin"], notes=tuple(n[:MAX_NAME_CHARS] for n in notes),
                                     language=language), "a job's candidate")


def _require(data: Any, keys: tuple[str, ...], what: str) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"a job's {what} must be a JSON object, got {type(data).__name__}")
    missing = [k for k in keys if k not in data]
    if missing:
        raise ValueError(f"a job's {what} lacks {', '.join(missing)}; send what service.messages.{what}_to_wire writes")


def _text(data: dict[str, Any], keys: tuple[str, ...], what: str, limit: int) -> None:
    for key in keys:
        value = data[key]
        if not isinstance(value, str) or len(value) > limit or "\x00" in value:
            raise ValueError(f"a job's {what} {key} must be a string of at most {limit} characters without NUL")


def _times(data: Any) -> dict[str, float] | None:
    if data is None:
        return None
    if not isinstance(data, dict) or not all(isinstance(v, (int, float)) for v in data.values()):
        raise ValueError("a counters job's 'times' maps candidate/eager/compile to milliseconds")
    return {str(k): float(v) for k, v in data.items()}


@dataclass
class Job:
    """One request: ``op`` is an ``EvaluatorLike`` method; ``id`` names it across retries, so a job run
    again after its slot died is still answered once."""

    op: str
    task: Task | None = None
    candidate: Candidate | None = None
    timed: bool = True  # evaluate
    refresh: bool = False  # baseline
    degenerate: bool = False  # baseline
    draws: int = 3  # degenerate
    times: dict[str, float] | None = None  # counters: the evaluation's median times
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown job op {self.op!r}; use one of {', '.join(OPS)}")
        needs_task = self.op != "build"
        needs_candidate = self.op in ("evaluate", "verify", "build", "counters")
        if needs_task and self.task is None:
            raise ValueError(f"a {self.op!r} job needs a task")
        if needs_candidate and self.candidate is None:
            raise ValueError(f"a {self.op!r} job needs a candidate")

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "id": self.id, "timed": self.timed, "refresh": self.refresh,
                "degenerate": self.degenerate, "draws": self.draws, "times": self.times,
                "task": task_to_wire(self.task) if self.task is not None else None,
                "candidate": candidate_to_wire(self.candidate) if self.candidate is not None else None}

    @classmethod
    def from_dict(cls, data: Any) -> "Job":
        if not isinstance(data, dict) or "op" not in data:
            raise ValueError("a job is a JSON object with an 'op' (and its task and candidate); see service.messages.Job")
        return cls(op=data["op"], id=str(data.get("id") or uuid.uuid4().hex), timed=bool(data.get("timed", True)),
                   refresh=bool(data.get("refresh", False)), degenerate=bool(data.get("degenerate", False)),
                   draws=int(data.get("draws", 3)), times=_times(data.get("times")),
                   task=task_from_wire(data["task"]) if data.get("task") is not None else None,
                   candidate=candidate_from_wire(data["candidate"]) if data.get("candidate") is not None else None)

    def describe(self) -> str:
        what = self.task.name if self.task is not None else (self.candidate.origin if self.candidate else "")
        return f"{self.op} {what} [{self.id[:8]}]"


@dataclass
class Reply:
    """A job's answer: ``result`` is what the evaluator method returned, as JSON (an ``EvalResult``'s
    ``to_dict()`` for evaluate/verify); a failed reply has ``error`` and its ``kind``."""

    id: str
    ok: bool
    result: Any = None
    error: str | None = None
    kind: str | None = None
    slot: str | None = None  # which slot answered
    attempts: int = 1  # slots it was sent to (more than 1 after a slot died with it)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Reply":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


class ServiceError(RuntimeError):
    """A job the service could not answer (not a candidate's failure: that is a result)."""

    def __init__(self, message: str, kind: str = "internal"):
        super().__init__(message)
        self.kind = kind
