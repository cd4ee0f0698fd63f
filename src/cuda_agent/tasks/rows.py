"""A task as the flat columns of a dataset row, and back: the one row shape every RL stack's dataset carries
(TRL's and verifiers' rows hold the columns directly; verl's rows hold them in ``extra_info``)."""

from __future__ import annotations

from typing import Any, Mapping

from cuda_agent.candidates.triton import check_language
from cuda_agent.tasks.task import Task, TaskError

TASK_COLUMNS = ("name", "code", "source", "level", "problem_id")  # the columns a row carries its task in


def task_columns(task: Task) -> dict[str, Any]:
    """The task as flat columns of a dataset row (``task_from_row`` reads them back)."""
    return {column: getattr(task, column) for column in TASK_COLUMNS}


def task_from_row(row: Mapping[str, Any] | None) -> Task:
    """The task a row's columns carry: ``name`` and ``code`` at least, directly or in ``extra_info`` (verl's
    rows, and what verl hands an agent loop or a reward function)."""
    row = row if isinstance(row, Mapping) else {}
    if not row.get("code") and isinstance(row.get("extra_info"), Mapping):
        row = row["extra_info"]
    if not row.get("code") or not row.get("name"):
        raise TaskError("the row carries no task: it needs the task's name and code columns "
                        "(write the dataset with `cuda-agent export`)")

    def optional_int(value: Any) -> int | None:
        return None if value is None else int(value)

    return Task(name=str(row["name"]), code=str(row["code"]), source=str(row.get("source") or row["name"]),
                level=optional_int(row.get("level")), problem_id=optional_int(row.get("problem_id")))


def row_language(row: Any) -> str:
    """The kernel language a dataset row (or verl's ``extra_info``) asks for: ``cuda`` where it says none or is no
    mapping; an unknown one is an error naming it."""
    language = (row.get("language") if isinstance(row, Mapping) else None) or "cuda"
    check_language(language)
    return language
