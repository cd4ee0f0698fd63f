"""The scratch folders this process made in the temporary directory (evaluation jobs, reference homes, synth
scratch), so that a command stopped by Ctrl-C removes them on its way out (``cli._on_interrupt``): it exits at
once, without unwinding, and the ``finally`` blocks that remove them on a normal finish never run."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

RETRIES = 5  # removals of a folder that something still wrote into
PRUNE_AT = 256  # the record is pruned of folders already removed once it holds this many
_made: set[Path] = set()
_lock = threading.Lock()


def made(path: Path) -> Path:
    """Record ``path`` (a folder just made) as this process's scratch; returns it."""
    with _lock:
        if len(_made) >= PRUNE_AT:
            _made.difference_update([p for p in _made if not p.exists()])
        _made.add(Path(path))
    return Path(path)


def remove_all() -> list[Path]:
    """Remove every recorded folder still there; the ones removed."""
    with _lock:
        paths, _ = list(_made), _made.clear()
    gone = [p for p in paths if p.exists()]
    for path in gone:
        # Another thread of this process may still add a file while the tree is removed (its top folder then
        # is not empty when it is removed): removed again, a few times.
        for _ in range(RETRIES):
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                break
            time.sleep(0.05)
    return gone
