"""JSONL files that long runs append to as they go (synthesis, baselines, benchmark runs)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

# Set by a command stopped by Ctrl-C (``cli.main._on_interrupt``) before it kills its workers: a thread that then sees
# its worker die must not record that as the entry's result, or a resumed run would skip the entry as failed.
_FROZEN = threading.Event()


def freeze() -> None:
    """No row is appended from now on (``append_jsonl``, which every long run's rows go through)."""
    _FROZEN.set()


def frozen() -> bool:
    return _FROZEN.is_set()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file. A half-written last line (a run killed mid-write) is dropped from
    the file, so the next append starts on a line of its own."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number != len(lines):
                raise ValueError(f"{path}:{number}: not a JSON line; the file is damaged.") from None
            path.write_text("".join(f"{kept}\n" for kept in lines[:-1]))
            break
    else:
        if text and not text.endswith("\n"):
            path.write_text(text + "\n")
    return rows


def append_jsonl(path: Path, *rows: dict[str, Any]) -> bool:
    """A line per row, in one write, on disk before this returns (a kill right after it keeps them); nothing once
    ``frozen``. Whether they were written."""
    if frozen():
        return False
    with Path(path).open("a") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
        f.flush()
        os.fsync(f.fileno())
    return True
