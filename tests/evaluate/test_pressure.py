"""Each side's waits for a CPU over its timing (evaluate.pressure), from the kernel's account of the thread
that runs its calls."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from cuda_agent.evaluate.pressure import ThreadWaits, cpu_stall_us
from cuda_agent.evaluate.protocol.regions import thread_times


def test_a_sides_share_is_its_threads_wait_over_its_own_calls():
    waits = ThreadWaits()
    account = {"eager": [0, 0], "candidate": [0, 0]}

    def call_of(side: str, waited_ns: int):
        def call(first: int, trials: int, calls: int) -> list[float]:
            time.sleep(0.02)
            account[side][1] += waited_ns  # waited this long of at least 20 ms
            return [1.0] * trials
        return call

    sides = {side: waits.wrap(side, call_of(side, waited), lambda side=side: tuple(account[side]))
             for side, waited in (("eager", 5_000_000), ("candidate", 0))}
    for _ in range(3):
        assert sides["eager"](0, 2, 1) == [1.0, 1.0] and sides["candidate"](0, 2, 1) == [1.0, 1.0]
    shares = waits.shares()
    assert 0.05 < shares["eager"] <= 0.25 and shares["candidate"] == 0.0


def test_no_reader_measures_nothing():
    waits = ThreadWaits()

    def side(first: int, trials: int, calls: int) -> list[float]:
        return [1.0]
    assert waits.wrap("eager", side, None) is side and waits.shares() == {}


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat"),
                    reason="the kernel keeps no schedstat")
def test_a_thread_sharing_its_core_is_seen_waiting_and_one_alone_is_not():
    """What the CPU backend's decision rests on, with real threads pinned to one core: a busy loop alone waits for
    almost nothing; beside another busy process on its core it waits about half the time."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    core = {sorted(os.sched_getaffinity(0))[0]}
    spin = "import os, time\nos.sched_setaffinity(0, %r)\nend = time.monotonic() + %f\nwhile time.monotonic() < end: pass"

    def share(seconds: float, beside: bool) -> float:
        timed = None
        other = subprocess.Popen([sys.executable, "-c", spin % (core, seconds + 2)]) if beside else None
        try:
            time.sleep(0.3 if beside else 0)
            timed = subprocess.Popen([sys.executable, "-c", spin % (core, seconds + 2)])
            waits = ThreadWaits()
            call = waits.wrap("eager", lambda *args: [time.sleep(seconds) or 1.0], thread_times(timed.pid))
            time.sleep(0.3)  # started and spinning: read while it runs
            call(0, 1, 1)
            return waits.shares().get("eager", 0.0)
        finally:
            for proc in (timed, other):
                if proc is not None:
                    proc.kill()
                    proc.wait()

    assert share(0.6, beside=False) < 0.1
    assert share(0.6, beside=True) > 0.3
    assert cpu_stall_us() is None or cpu_stall_us() >= 0
