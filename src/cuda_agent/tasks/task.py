"""The task record and its static checks."""

from __future__ import annotations

import ast
import hashlib
import types
from dataclasses import dataclass, field
from typing import Any

REQUIRED_NAMES = ("Model", "get_inputs", "get_init_inputs")


class TaskError(ValueError):
    """A task that cannot be used; the message names the source and the problem."""


@dataclass(frozen=True)
class Task:
    """One KernelBench-format program.

    ``source`` says where it came from (a path, or ``file.jsonl:LINE``) so every
    error can point back at it.
    """

    name: str
    code: str
    source: str
    level: int | None = None
    problem_id: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def digest(self) -> str:
        """Content hash: baselines and results are keyed by it, never by name."""
        return hashlib.sha256(self.code.encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "level": self.level,
            "problem_id": self.problem_id,
            "digest": self.digest,
        }


def check_task_source(code: str, source: str) -> None:
    """Reject programs that cannot be a task, without running them."""
    try:
        tree = ast.parse(code, filename=source)
    except SyntaxError as exc:
        raise TaskError(
            f"{source}: syntax error at line {exc.lineno}: {exc.msg}. Fix the Python source of the task."
        ) from None
    defined: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            defined[node.name] = "class"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defined[node.name] = "function"
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    defined.setdefault(target.id, "assignment")
    missing = [name for name in REQUIRED_NAMES if name not in defined]
    if missing:
        raise TaskError(
            f"{source}: missing {', '.join(missing)} at module level. A task must define "
            "`class Model(nn.Module)`, `get_inputs()` and `get_init_inputs()` (KernelBench format)."
        )
    if defined["Model"] != "class":
        raise TaskError(f"{source}: `Model` must be a class deriving from torch.nn.Module.")
    for fn in ("get_inputs", "get_init_inputs"):
        if defined[fn] != "function":
            raise TaskError(f"{source}: `{fn}` must be a function defined with `def`.")


def exec_task_module(task: Task, module_name: str = "task_module") -> types.ModuleType:
    """Execute the task's code in a fresh module (only ever in a worker process)."""
    module = types.ModuleType(module_name)
    module.__file__ = task.source
    code = compile(task.code, task.source, "exec")
    exec(code, module.__dict__)  # noqa: S102 - the task program is the thing we evaluate
    return module


def describe_inputs(values: Any, source: str, what: str) -> list[Any]:
    """Check that ``get_inputs()`` returned tensors (and plain scalars) only."""
    import torch

    if not isinstance(values, (list, tuple)):
        raise TaskError(f"{source}: {what}() must return a list, got {type(values).__name__}.")
    allowed_scalars = (bool, int, float)
    has_tensor = False
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            has_tensor = True
        elif not isinstance(value, allowed_scalars):
            raise TaskError(
                f"{source}: {what}() element {index} is a {type(value).__name__}; inputs must be "
                "torch tensors (or plain int/float/bool scalars)."
            )
    if what == "get_inputs" and not has_tensor:
        raise TaskError(f"{source}: get_inputs() returned no tensor; a task needs at least one tensor input.")
    return list(values)
