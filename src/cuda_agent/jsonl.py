"""JSONL files that long runs append to as they go (synthesis, baselines, benchmark runs)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


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


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """One line, on disk before this returns (a kill right after it keeps the line)."""
    with Path(path).open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
