"""Which solution belongs to which KernelBench task.

A solution set is a directory. Its entries are candidates: a directory holding
``model_new.py`` (the paper's workspace layout) or a ``.py`` file with
``ModelNew`` (a KernelBench-style generation). An entry belongs to a task by
the first part of its path that names a level and a problem:

- ``level_1_problem_19_sample_0_kernel.py``  (KernelBench's generation files)
- ``level1_19/`` or ``level1_19.py``, with any number of samples below it
  (an agent run: ``level1_19/step_12/``)
- ``level1/19_ReLU.py`` or ``level1/19_ReLU/``  (the task's own file name)

Several entries for one task are samples of it; the benchmark counts the best.
Entries that name no task are listed, not guessed at.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from cuda_agent.tasks.task import Task

__all__ = ["SolutionSet", "task_of", "candidate_entries", "find_solutions"]

_FLAT = (re.compile(r"^level_?(\d+)_problem_?(\d+)(?:_|\.|$)"), re.compile(r"^level_?(\d+)_(\d+)(?:_|\.|$)"))
_LEVEL = re.compile(r"^level_?(\d+)$")
_PROBLEM = re.compile(r"^(\d+)(?:_|\.|$)")


@dataclass
class SolutionSet:
    root: Path
    by_task: dict[str, list[Path]] = field(default_factory=dict)  # task name -> entries, sorted
    unmatched: list[Path] = field(default_factory=list)  # entries that name no task of the set

    def entries(self) -> list[tuple[str, Path]]:
        return [(name, path) for name, paths in self.by_task.items() for path in paths]


def task_of(relative: Path) -> tuple[int, int] | None:
    """(level, problem_id) named by a path relative to the solution set's root."""
    parts = relative.parts
    for i, part in enumerate(parts):
        for pattern in _FLAT:
            match = pattern.match(part)
            if match:
                return int(match.group(1)), int(match.group(2))
        level = _LEVEL.match(part)
        if level and i + 1 < len(parts):
            problem = _PROBLEM.match(parts[i + 1])
            if problem:
                return int(level.group(1)), int(problem.group(1))
    return None


def candidate_entries(root: Path) -> list[Path]:
    """Every candidate under ``root``: workspace directories (not looked into further) and
    ``.py`` files defining ``ModelNew`` outside them."""
    found: list[Path] = []

    def walk(directory: Path) -> None:
        for path in sorted(directory.iterdir()):
            if path.name.startswith("."):
                continue
            if path.is_dir():
                if (path / "model_new.py").is_file():
                    found.append(path)
                else:
                    walk(path)
            elif path.suffix == ".py" and "ModelNew" in path.read_text(errors="replace"):
                found.append(path)

    if (root / "model_new.py").is_file():
        raise ValueError(f"{root} is one candidate, not a solution set: give the directory that holds "
                         "one entry per task (for example level1_19/ with model_new.py inside).")
    walk(root)
    return found


def find_solutions(tasks: list[Task], root: Path) -> SolutionSet:
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such solutions directory.")
    names = {(t.level, t.problem_id): t.name for t in tasks if t.level is not None and t.problem_id is not None}
    found = SolutionSet(root)
    for entry in candidate_entries(root):
        name = names.get(task_of(entry.relative_to(root)) or (None, None))
        if name is None:
            found.unmatched.append(entry)
        else:
            found.by_task.setdefault(name, []).append(entry)
    return found
