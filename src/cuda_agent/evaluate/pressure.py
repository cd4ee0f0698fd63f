"""How much of each side's timing the host's CPUs were contended, by the kernel's pressure stall
information (``/proc/pressure/cpu``: the time in which some runnable task waited for a CPU).

On the CPU backend a side's time is the host's to give: a host busy with other work slows eager's
threads (one per core) more than a single-threaded kernel, and a speedup measured then is not the one
measured on a quiet host (an honest candidate gets reward 2-3 instead of 1 while other evaluations run). Where the kernel does not expose pressure (before Linux 4.20, or disabled), nothing is
measured and nothing is decided by it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

CPU_PRESSURE = Path("/proc/pressure/cpu")


def cpu_stall_us(path: Path = CPU_PRESSURE) -> int | None:
    """The host's cumulative "some" CPU stall in microseconds, or None where it cannot be read."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("some "):
                return int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class Pressure:
    """Each side's stall and wall time over the calls it wraps (``wrap``)."""

    def __init__(self, path: Path = CPU_PRESSURE):
        self.path = path
        self.stall_us: dict[str, int] = {}
        self.wall_us: dict[str, int] = {}
        self.readable = cpu_stall_us(path) is not None

    def wrap(self, side: str, call: Callable[..., list[float]]) -> Callable[..., list[float]]:
        if not self.readable:
            return call

        def timed(*args: int) -> list[float]:
            before, started = cpu_stall_us(self.path), time.monotonic_ns()
            try:
                return call(*args)
            finally:
                after, ended = cpu_stall_us(self.path), time.monotonic_ns()
                if before is not None and after is not None:
                    self.stall_us[side] = self.stall_us.get(side, 0) + after - before
                    self.wall_us[side] = self.wall_us.get(side, 0) + (ended - started) // 1000
        return timed

    def shares(self) -> dict[str, float]:
        """Per side: the share of its timing in which some task waited for a CPU."""
        return {side: round(self.stall_us[side] / wall, 4) for side, wall in self.wall_us.items() if wall > 0}
