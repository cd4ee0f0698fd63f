"""JSONL files long runs append to (``cuda_agent.jsonl``): a half-written last line is dropped, and once a stopped
command froze its writes (``cli.main._on_interrupt``), no writer appends a row."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cuda_agent.jsonl import append_jsonl, read_jsonl

SRC = Path(__file__).resolve().parents[1] / "src"


def test_a_half_written_last_line_is_dropped_and_the_next_append_starts_a_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": ')
    assert read_jsonl(path) == [{"a": 1}]
    append_jsonl(path, {"a": 2}, {"a": 3})
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}, {"a": 3}]


def test_after_a_freeze_no_writer_appends_a_row(tmp_path):
    """In a process of its own: the freeze is for the rest of a process's life."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from cuda_agent import jsonl\n"
        "out = Path(sys.argv[1])\n"
        "assert jsonl.append_jsonl(out / 'before.jsonl', {'kept': True})\n"
        "jsonl.freeze()\n"
        "assert not jsonl.append_jsonl(out / 'after.jsonl', {'status': 'failed', 'reason': 'killed by SIGKILL'},\n"
        "                              {'status': 'correct'})\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, env=os.environ | {"PYTHONPATH": str(SRC)})
    assert read_jsonl(tmp_path / "before.jsonl") == [{"kept": True}]
    assert not (tmp_path / "after.jsonl").exists()
