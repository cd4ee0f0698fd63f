"""How long each side's timing waited for a CPU: on the CPU backend a side's time is the host's to give, and
other work that takes the core its calls run on makes it longer by as much.

Each side's calls run in one thread (``protocol.policy.CPU_THREADS``): the candidate's harness thread, the
reference's request thread. Both sleep between rounds (the candidate stopped, the reference waiting for its
next request), so the kernel's account of the thread (``/proc/PID/task/TID/schedstat``: the time it waited
runnable for a CPU, read from outside, ``protocol.regions.thread_times``) before and after a round is what that
round waited. The host's own pressure (``/proc/pressure/cpu``, any task waiting) serves the retry's wait for a
quieter host (``evaluate.retry``). Where the kernel keeps no schedstat, nothing is measured and nothing is
decided by it.
"""

from __future__ import annotations

import statistics
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


class ThreadWaits:
    """Each side's waits for a CPU and wall time, round by round, over the calls it wraps (``wrap``)."""

    def __init__(self) -> None:
        self.rounds: dict[str, list[tuple[int, int]]] = {}  # per side: (waited ns, wall ns) of each round

    def wrap(self, side: str, call: Callable[..., list[float]],
             thread: Callable[[], tuple[int, int]] | None) -> Callable[..., list[float]]:
        """``call`` timed by the wall clock and by ``thread`` (a reader of the CPU time and wait of the thread that
        runs it, ``thread_times``); ``call`` itself where there is no reader."""
        if thread is None:
            return call

        def timed(*args: int) -> list[float]:
            before, started = thread()[1], time.monotonic_ns()
            try:
                return call(*args)
            finally:
                after, ended = thread()[1], time.monotonic_ns()
                self.rounds.setdefault(side, []).append((max(0, after - before), ended - started))
        return timed

    def shares(self) -> dict[str, float]:
        """Per side: the share of its median round in which its thread waited for a CPU. A side's time is the median
        of its rounds', so waits that come in a few bursts move it less than their total would say."""
        return {side: round(statistics.median(w / wall for w, wall in rounds if wall > 0), 4)
                for side, rounds in self.rounds.items() if any(wall > 0 for _, wall in rounds)}

    def totals(self) -> dict[str, float]:
        """Per side: the share of all its timing in which its thread waited for a CPU (a diagnostic)."""
        return {side: round(sum(w for w, _ in rounds) / sum(wall for _, wall in rounds), 4)
                for side, rounds in self.rounds.items() if sum(wall for _, wall in rounds) > 0}
