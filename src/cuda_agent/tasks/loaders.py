"""Loaders for every place tasks come from.

``load_tasks(source)`` dispatches on what ``source`` is: a ``.py`` file, a
KernelBench checkout (or its ``levelN`` folders), a folder of task files (as
``examples/`` holds them), a ``cuda-agent synth`` output directory, a JSONL / parquet table in
the KernelBench or CUDA-Agent-Ops-6K shape or the task rows ``cuda-agent export`` writes, or a Hugging Face
dataset name.
Every task is checked statically before it is returned.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

from cuda_agent.paths import read_text
from cuda_agent.tasks.rows import TASK_COLUMNS, task_from_row
from cuda_agent.tasks.task import Task, TaskError, check_task_source

KERNELBENCH_COLUMNS = ("level", "problem_id", "name", "code")
OPS6K_COLUMNS = ("code", "ops", "data_source")
_LEVEL_DIR = re.compile(r"^level(\d+)$")
_PROBLEM_FILE = re.compile(r"^(\d+)_.*\.py$")


def load_task(source: str | Path) -> Task:
    """Load exactly one task (a file, or a ``table.jsonl#name`` / ``#level/id`` selector)."""
    tasks = load_tasks(source)
    if _split_selector(source) is not None and len(tasks) != 1:
        raise TaskError(
            f"{source}: selector {_split_selector(source)[1]!r} matched {len(tasks)} tasks; use a task name "
            "or LEVEL/PROBLEM_ID (for example `kernelbench.jsonl#1/19`)."
        )
    if len(tasks) != 1:
        raise TaskError(
            f"{source}: holds {len(tasks)} tasks; pick one with `PATH#NAME` or `PATH#LEVEL/PROBLEM_ID`."
        )
    return tasks[0]


def load_tasks(source: str | Path, levels: Iterable[int] | None = None) -> list[Task]:
    """Load every task from ``source`` (optionally only the given KernelBench levels); ``SOURCE#NAME``
    or ``SOURCE#LEVEL/PROBLEM_ID`` keeps the tasks the selector names."""
    selected = _split_selector(source)
    if selected is not None:
        table, selector = selected
        tasks = [t for t in load_tasks(table, levels) if _matches(t, selector)]
        if not tasks:
            raise TaskError(
                f"{source}: selector {selector!r} matched 0 tasks; use a task name or LEVEL/PROBLEM_ID "
                "(for example `kernelbench.jsonl#1/19`); `cuda-agent tasks TABLE` lists them."
            )
        return tasks
    path = Path(source)
    if path.is_file() and path.suffix == ".py":
        tasks = [load_task_file(path)]
    elif path.is_dir() and (path / "tasks.jsonl").is_file():
        tasks = load_table(path / "tasks.jsonl")  # a `cuda-agent synth` output directory
    elif path.is_dir() and _kernelbench_levels(path):
        tasks = load_kernelbench_dir(path)
    elif path.is_dir():
        tasks = load_task_folder(path)
    elif path.is_file() and path.suffix in (".jsonl", ".json", ".parquet"):
        tasks = load_table(path)
    elif path.exists():
        raise TaskError(
            f"{source}: unsupported task source; give a .py file, a KernelBench directory, "
            "a .jsonl/.parquet table or a Hugging Face dataset name."
        )
    elif _looks_like_hub_name(str(source)):
        tasks = load_hf_dataset(str(source))
    else:
        raise TaskError(f"{source}: no such file or directory.")
    if levels is not None:
        wanted = set(levels)
        tasks = [t for t in tasks if t.level in wanted]
    return tasks


def _kernelbench_levels(root: Path) -> bool:
    """Whether ``root`` is a KernelBench checkout, its ``KernelBench/`` folder or a ``levelN`` folder."""
    return any(_LEVEL_DIR.match(base.name) or any(d.is_dir() and _LEVEL_DIR.match(d.name) for d in base.glob("level*"))
               for base in (root, root / "KernelBench"))


def load_task_folder(root: str | Path) -> list[Task]:
    """A folder of task files: every ``model.py`` below it (a task per folder, as ``examples/`` holds them, named
    by its folder) and the other ``.py`` files directly in it (a flat folder of tasks). Solutions beside a task
    (``model_new.py``, ``kernels/``) are not tasks and are not read."""
    root = Path(root)
    files = sorted({*root.rglob("model.py"), *(p for p in root.glob("*.py") if p.name != "model_new.py")})
    if not files:
        raise TaskError(f"{root}: no task files here (model.py in a folder per task, or .py files in the folder) "
                        "and not a KernelBench checkout (no levelN/ folders).")
    return [load_task_file(p) for p in files]


def load_task_file(path: str | Path) -> Task:
    path = Path(path)
    code = read_text(path, TaskError)
    check_task_source(code, str(path))
    level = None
    match = _LEVEL_DIR.match(path.parent.name)
    if match:
        level = int(match.group(1))
    problem = _PROBLEM_FILE.match(path.name)
    if level is not None:
        name = f"level{level}/{path.stem}"
    else:
        # A workspace's task is usually `model.py`: its folder names it better.
        name = path.parent.name if path.stem == "model" and path.parent.name else path.stem
    return Task(
        name=name,
        code=code,
        source=str(path),
        level=level,
        problem_id=int(problem.group(1)) if problem and level is not None else None,
    )


def load_kernelbench_dir(root: str | Path) -> list[Task]:
    """A KernelBench checkout, its ``KernelBench/`` folder, or one ``levelN`` folder."""
    root = Path(root)
    candidates = [root, root / "KernelBench"]
    level_dirs: list[Path] = []
    for base in candidates:
        if _LEVEL_DIR.match(base.name):
            level_dirs = [base]
            break
        found = sorted(
            (d for d in base.glob("level*") if d.is_dir() and _LEVEL_DIR.match(d.name)),
            key=lambda d: int(_LEVEL_DIR.match(d.name).group(1)),
        )
        if found:
            level_dirs = found
            break
    if not level_dirs:
        raise TaskError(
            f"{root}: not a KernelBench checkout (no levelN/ folders here or under KernelBench/)."
        )
    tasks = []
    for level_dir in level_dirs:
        files = [p for p in level_dir.glob("*.py") if _PROBLEM_FILE.match(p.name)]
        files.sort(key=lambda p: int(_PROBLEM_FILE.match(p.name).group(1)))
        tasks.extend(load_task_file(p) for p in files)
    return tasks


def load_table(path: str | Path) -> list[Task]:
    """A JSONL or parquet file in the KernelBench or Ops-6K shape."""
    path = Path(path)
    rows = list(_read_rows(path))
    return tasks_from_rows(rows, str(path))


def load_hf_dataset(name: str, split: str | None = None) -> list[Task]:
    """A dataset on the Hugging Face hub (needs the optional ``datasets`` package)."""
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        from cuda_agent.paths import install_hint
        raise TaskError(
            f"{name}: loading a Hugging Face dataset needs the `datasets` package; "
            f"install it with {install_hint('data')}."
        ) from None
    try:
        loaded = datasets.load_dataset(name, split=split)
    except Exception as exc:  # the hub raises many types; the message is what matters
        raise TaskError(f"{name}: could not load the Hugging Face dataset: {exc}") from None
    splits = loaded.items() if isinstance(loaded, dict) else [(split or "data", loaded)]
    tasks: list[Task] = []
    for split_name, rows in splits:
        tasks.extend(tasks_from_rows(list(rows), f"{name}[{split_name}]"))
    return tasks


def tasks_from_rows(rows: list[dict[str, Any]], source: str) -> list[Task]:
    if not rows:
        raise TaskError(f"{source}: the table is empty.")
    columns = set(rows[0])
    if set(TASK_COLUMNS) <= columns:
        make = _task_row  # rows `cuda-agent export` wrote: the task's own columns, its name kept
    elif set(KERNELBENCH_COLUMNS) <= columns:
        make = _kernelbench_row
    elif set(OPS6K_COLUMNS) <= columns:
        make = _ops6k_row
    else:
        raise TaskError(
            f"{source}: unknown table columns {sorted(columns)}; expected "
            f"{list(KERNELBENCH_COLUMNS)} (KernelBench), {list(OPS6K_COLUMNS)} (CUDA-Agent-Ops-6K) or "
            f"{list(TASK_COLUMNS)} (`cuda-agent export`)."
        )
    tasks = []
    for index, row in enumerate(rows):
        where = f"{source}:{index + 1}"
        code = row.get("code")
        if not isinstance(code, str) or not code.strip():
            raise TaskError(f"{where}: the `code` column is empty.")
        task = make(row, index, where)
        check_task_source(code, where)
        tasks.append(task)
    return tasks


def _task_row(row: dict[str, Any], index: int, where: str) -> Task:
    return task_from_row(row)


def _kernelbench_row(row: dict[str, Any], index: int, where: str) -> Task:
    level, problem_id = int(row["level"]), int(row["problem_id"])
    return Task(
        name=f"level{level}/{row['name']}",
        code=row["code"],
        source=where,
        level=level,
        problem_id=problem_id,
    )


def _ops6k_row(row: dict[str, Any], index: int, where: str) -> Task:
    ops = row["ops"]
    if isinstance(ops, str):
        try:
            ops = json.loads(ops)
        except json.JSONDecodeError:
            ops = [ops]
    return Task(
        name=f"ops6k/{index}",
        code=row["code"],
        source=where,
        metadata={"ops": list(ops), "data_source": row["data_source"],
                  **({"language": row["language"]} if row.get("language") else {})},
    )


def _read_rows(path: Path) -> Iterator[dict[str, Any]]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            from cuda_agent.paths import install_hint
            raise TaskError(
                f"{path}: reading parquet needs `pyarrow`; install it with {install_hint('data')}."
            ) from None
        yield from pq.read_table(path).to_pylist()
        return
    # Split on newlines only: str.splitlines would also cut at U+2028 inside a JSON string
    for number, line in enumerate(read_text(path, TaskError).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskError(f"{path}:{number}: invalid JSON ({exc.msg}).") from None
        if not isinstance(row, dict):
            raise TaskError(f"{path}:{number}: each line must be a JSON object.")
        yield row


def _split_selector(source: str | Path) -> tuple[str, str] | None:
    """``(table, selector)`` for ``TABLE#SELECTOR``; None for a plain source (a path holding ``#`` is a path)."""
    text = str(source)
    if "#" in text and not Path(text).exists():
        table, selector = text.rsplit("#", 1)
        return table, selector
    return None


def _matches(task: Task, selector: str) -> bool:
    if "/" in selector:
        level, _, pid = selector.partition("/")
        if level.isdigit() and pid.isdigit():
            return task.level == int(level) and task.problem_id == int(pid)
    return task.name == selector or task.name.split("/")[-1] == selector


def _looks_like_hub_name(text: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", text))
