"""One device shared by several evaluators: timing alone on it, everything else side by side.

A GPU node fed by a stream of new candidates idles while an evaluation loads, verifies and reads its
outputs, if evaluations run one at a time. Several evaluators may share one device through a
``DeviceLock``: every evaluation holds it *shared* while it uses the device (its processes start and
load, the checks run, the timed outputs are read), and *exclusively* where what it measures must not
be disturbed (the brackets' no-op regions and the timing rounds). An evaluation that holds it shared
and asks for it exclusively gives up its share first and takes it back after, so two evaluations that
both want to time never wait on each other's share. Waiting writers go first: a stream of new
evaluations cannot keep a timing round waiting. Not first before an evaluation apart (below) that asks for its
share: it waits for the timings that were waiting when it asked, and timings that ask after it wait for it (a
ticket each, in order of asking): behind every waiting timing, a turn of the memory-hungry chain (the stream's
critical path) could wait for a run of the small tasks' timings that came after it.

Used as a plain context manager (``with lock:``) it is the exclusive side, so it stands wherever the
evaluator takes its ``timing_lock``; ``shared_use`` gives the shared side of a ``DeviceLock`` and nothing
for any other lock. ``alone`` holds it exclusively for a whole evaluation (what it takes inside, shared or
exclusive, is already its own): an evaluation that ran out of device memory beside others ends up run
that way, so that its reward never depends on what else ran (``crowded`` says whether others did). An
evaluation that gave its share up to time still holds device memory, so ``alone`` first lets every
evaluation in progress finish (new ones wait), then takes the device: alone in memory, not only in time.

Before that, the cheaper try: ``apart`` runs it beside the others as usual but never beside another
evaluation ``apart``. The tasks that run out are the few with GB-sized inputs, and they run out beside each
other, while the small tasks' pass beside them, and reruns alone (each draining the card) would hold up every
small task's candidates. Only
where it runs out of memory apart as well is it run alone. Tasks are remembered at the step that served
them (``apart_keys``, ``alone_keys``) and start there from then on: a stream of them would otherwise run
out, and push others out, every time. A task need not run out first: one whose output is ``HUNGRY_SHARE`` of
the GPU's memory or more goes apart from its first candidate on, as soon as its reference has loaded (the
evaluator's ``_stop_if_hungry``, before the candidate's process has put anything on the device; its reference's
torch.compile is done there, beside the others, rather than in its apart turn). The apart turns are the stream's
critical path (every memory-hungry evaluation waits for the one apart), so an evaluation apart that wants to time
goes before the timings waiting beside it.

With ``pause`` on, a share need not hold timing off for its whole length. Inside ``pausable(workers)`` an
evaluation only waits for its reference process (its start, torch.compile): a slot that wants to time then stops
that evaluation's processes (SIGSTOP, as the spares are stopped) instead of waiting for its share to end, and
lets them go after: otherwise a small task's evaluation spends ten times its own work waiting for the exclusive
side behind neighbours' long shared phases (docs/DECISIONS.md, "Sharing a device").
What stopping must not change: nothing new starts on the device while another slot times (the thread of a
stopped evaluation runs on, but leaving its window waits for the timing to end, and it starts no process inside
one), and the GPU work the stopped processes had queued is waited out before the timing (``paused``: the timing
side asks its reference for a quiet GPU). On by default: with it every candidate of a stream gets the same reward
as alone (benchmarks/RESULTS.md, "An RL trainer's stream").

Compiles take the shared side too (``Evaluator.build``; the service gives its build workers every GPU's
lock): a compile beside a timing round slows the timed process's host side (enough to fail honest sub-ms
candidates as ``clock``), and timing waits for the compiles in flight.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

# A task whose call's output is at least this share of the GPU's memory is evaluated ``apart`` from its first
# candidate on, told by its reference's load (before the candidate's process puts anything on the device): its
# evaluation holds 7-8 outputs' worth at its worst moment (both processes), so two such evaluations are most of a
# card. On a 141 GB card the line falls at 2.2 GiB: KernelBench level 1's 4 and 6 GiB tasks above it, cuda_gelu's
# 1 GiB and every matmul's output below it. Learning it from running out instead costs each such task one attempt
# beside others, and where several run out together, a rerun with the GPU alone.
HUNGRY_SHARE = 1 / 64
MEMORY_HUNGRY = "memory-hungry"  # the rule of an attempt beside others given up for ``apart``


@dataclass
class _Window:
    """An evaluation's ``pausable`` stretch: its shares, the processes to stop, whether a timing stopped them."""

    shares: int
    workers: tuple[Any, ...]
    paused: bool = False


class DeviceLock:
    def __init__(self, trace: bool = False, pause: bool = True, apart: int = 1) -> None:
        if apart < 1:
            raise ValueError(f"DeviceLock: apart is how many memory-hungry evaluations may run at once, at least 1, "
                             f"not {apart}")
        self.pause = pause
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        # Tickets, in order of asking, of the timings waiting and of the evaluations apart waiting for a share:
        # between those two, first come first served.
        self._tickets = 0
        self._timing_tickets: set[int] = set()
        self._apart_waiting = 0  # of the timings waiting, evaluations apart: they go first
        self._apart_share_tickets: set[int] = set()
        self._mine = threading.local()  # this thread's shares (an evaluation's thread holds at most one)
        self._grants = 0  # shares ever taken: a change during a hold means another evaluation came
        self._occupants = 0  # outermost shared holds in progress, counted while their share is given up to time
        self._draining = 0  # ``alone`` callers waiting for those to finish: new outermost holds wait
        self._apart = threading.BoundedSemaphore(apart)  # held by the evaluations ``apart`` (at most ``apart``)
        self.apart_keys: dict[str, str] = {}  # tasks evaluated apart from the start (``apart``): why
        self.alone_keys: set[str] = set()  # tasks evaluated alone from the start (``alone``)
        # Every evaluator's spare candidate processes on this device: all of them stand still while any
        # evaluator times, not only its own (``processes.spares_stopped``).
        self.spares: list[list[Any]] = []
        self._windows: dict[int, _Window] = {}  # thread ident -> its ``pausable`` stretch, while in one
        self.stops = 0  # windows stopped for a timing, ever (for tests and benchmarks)
        # (thread name, "shared" | "exclusive", start, end) of every hold, for tests and benchmarks
        self.holds: list[tuple[str, str, float, float]] | None = [] if trace else None

    # -- the exclusive side ---------------------------------------------------------------
    def __enter__(self) -> "DeviceLock":
        self._acquire_exclusive()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release_exclusive()

    def _acquire_exclusive(self) -> None:
        if getattr(self._mine, "alone", 0):
            return
        asked = time.monotonic()
        with self._cond:
            if threading.get_ident() in self._windows:
                raise RuntimeError("DeviceLock: timing asked for inside a pausable window (it would stop itself)")
            given_up = getattr(self._mine, "shares", 0)
            if given_up:
                # Our own share would keep us waiting for ourselves.
                self._readers -= given_up
                self._mine.shares = 0
                self._record("shared", self._mine.share_since)
                self._cond.notify_all()
            self._mine.given_up = given_up
            apart = getattr(self._mine, "apart", False)
            self._apart_waiting += apart
            ticket = self._ticket(self._timing_tickets)
            try:
                # Shares held inside pausable stretches do not hold timing off: those are stopped instead. An
                # evaluation apart goes before other timings: the memory-hungry tasks wait for its turn to end.
                while (self._writer or self._readers - sum(w.shares for w in self._windows.values())
                       or (self._apart_waiting and not apart) or self._earlier(ticket, self._apart_share_tickets)):
                    self._cond.wait()
            finally:
                self._timing_tickets.discard(ticket)
                self._apart_waiting -= apart
            self._writer = True
            self._mine.since = time.monotonic()
            stopping = list(self._windows.values())
            for window in stopping:
                window.paused = True
            self.stops += len(stopping)
        # Outside the condition: stopping a process tree waits for each process to stop (milliseconds).
        for window in stopping:
            for worker in window.workers:
                worker.pause()
        self._mine.stopped = stopping
        self._mine.waited = getattr(self._mine, "waited", 0.0) + time.monotonic() - asked

    def _release_exclusive(self) -> None:
        if getattr(self._mine, "alone", 0):
            return
        stopped, self._mine.stopped = getattr(self._mine, "stopped", []), []
        for window in stopped:
            for worker in window.workers:
                worker.resume()
        with self._cond:
            for window in stopped:
                window.paused = False
            self._writer = False
            self._record("exclusive", self._mine.since)
            self._cond.notify_all()
            given_up = getattr(self._mine, "given_up", 0)
            self._mine.given_up = 0
            if given_up:
                self._take_share(given_up)

    # -- the shared side ------------------------------------------------------------------
    @contextlib.contextmanager
    def shared(self, occupy: bool = True) -> Iterator[None]:
        """The shared side. ``occupy``: the holder puts data on the device (an evaluation), so ``alone`` waits
        for it to finish; a compile does not occupy it and only waits for, and holds off, timing."""
        if getattr(self._mine, "alone", 0):
            yield
            return
        with self._cond:
            nested = getattr(self._mine, "shares", 0) > 0
            occupy = occupy and not nested
            if occupy:
                while self._draining:
                    self._cond.wait()
                self._occupants += 1
            self._take_share(1)
            self._grants += 1
            # Others holding it now, or taking it before we are done, shared the device with us.
            self._mine.crowded = (nested and self.crowded) or self._readers > self._mine.shares
            grants = self._grants
        try:
            yield
        finally:
            with self._cond:
                self._mine.crowded = self._mine.crowded or self._grants != grants
                self._mine.shares -= 1
                self._readers -= 1
                if occupy:
                    self._occupants -= 1
                self._record("shared", self._mine.share_since)
                self._cond.notify_all()

    @contextlib.contextmanager
    def pausable(self, *workers: Any) -> Iterator[None]:
        """Inside, this thread's share does not hold timing off: a slot that times stops ``workers`` (every
        process of this evaluation that can use the device: ``pause()``/``resume()``) and lets them go after.
        The thread starts no process inside, uses the device only through ``workers`` and neither stops nor
        lets go of them itself; leaving while they are stopped waits for that timing to end. Nothing where
        ``pause`` is off, outside a share, or nested."""
        ident = threading.get_ident()
        shares = getattr(self._mine, "shares", 0)
        if not self.pause or not shares or getattr(self._mine, "alone", 0) or ident in self._windows:
            yield
            return
        window = _Window(shares, tuple(w for w in workers if w is not None))
        with self._cond:
            self._windows[ident] = window
            self._cond.notify_all()  # a timing waiting for this share may go now
        try:
            yield
        finally:
            with self._cond:
                while window.paused:
                    self._cond.wait()
                del self._windows[ident]

    def take_waited(self) -> float:
        """Seconds this thread waited for the exclusive side (stops included) since it last asked: what an
        evaluation's timing and calibration waited for its neighbours (``durations["wait_timing"]``)."""
        waited, self._mine.waited = getattr(self._mine, "waited", 0.0), 0.0
        return round(waited, 3)

    def take_share_waited(self) -> float:
        """Seconds this thread waited to take a share since it last asked: behind timings holding or waiting for the
        exclusive side (waiting writers go first; for an evaluation apart, those that asked before it), at an
        evaluation's start and after each of its timings (``durations["wait_share"]``)."""
        waited, self._mine.share_waited = getattr(self._mine, "share_waited", 0.0), 0.0
        return round(waited, 3)

    @property
    def paused(self) -> int:
        """How many evaluations' processes this thread's timing stopped (their queued GPU work may still run)."""
        return len(getattr(self._mine, "stopped", []))

    @property
    def step(self) -> str:
        """This thread's memory step: "alone", "apart" or "shared" (beside anything)."""
        if getattr(self._mine, "alone", 0):
            return "alone"
        return "apart" if getattr(self._mine, "apart", False) else "shared"

    @property
    def crowded(self) -> bool:
        """Whether this thread's last shared hold overlapped another evaluation's."""
        return bool(getattr(self._mine, "crowded", False))

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """The device to this thread only, from here to the end of the block: every evaluation in progress
        (holding its share, or timing) finishes first, and none starts meanwhile. Called outside any share."""
        with self._cond:
            self._draining += 1
            try:
                while self._occupants:
                    self._cond.wait()
            finally:
                self._draining -= 1
                self._cond.notify_all()
        self._acquire_exclusive()
        self._mine.crowded = False  # nobody else from here on: an earlier hold's answer no longer applies
        self._mine.alone = getattr(self._mine, "alone", 0) + 1
        try:
            yield
        finally:
            self._mine.alone -= 1
            self._release_exclusive()

    @contextlib.contextmanager
    def apart(self) -> Iterator[None]:
        """Beside other evaluations as usual, but beside at most ``apart`` - 1 others apart (by default none):
        the memory-hungry tasks take turns while the others go on. Called outside any share (it waits holding
        none)."""
        with self._apart:
            self._mine.apart = True
            try:
                yield
            finally:
                self._mine.apart = False

    def _take_share(self, count: int) -> None:
        if getattr(self._mine, "shares", 0):
            # Already ours (a nested use): waiting behind a writer that waits for our share would never end.
            self._readers += count
            self._mine.shares += count
            return
        asked = time.monotonic()
        if getattr(self._mine, "apart", False):
            ticket = self._ticket(self._apart_share_tickets)
            try:
                while self._writer or self._earlier(ticket, self._timing_tickets):
                    self._cond.wait()
            finally:
                self._apart_share_tickets.discard(ticket)
                self._cond.notify_all()  # a timing that asked after it waits for this ticket, then for the share
        else:
            while self._writer or self._timing_tickets:
                self._cond.wait()
        self._mine.share_waited = getattr(self._mine, "share_waited", 0.0) + time.monotonic() - asked
        self._readers += count
        self._mine.shares = getattr(self._mine, "shares", 0) + count
        self._mine.share_since = time.monotonic()

    def _ticket(self, waiting: set[int]) -> int:
        self._tickets += 1
        waiting.add(self._tickets)
        return self._tickets

    @staticmethod
    def _earlier(ticket: int, waiting: set[int]) -> bool:
        return any(other < ticket for other in waiting)

    def _record(self, mode: str, since: float) -> None:
        if self.holds is not None:
            self.holds.append((threading.current_thread().name, mode, since, time.monotonic()))


def shared_use(lock: Any, occupy: bool = True) -> contextlib.AbstractContextManager:
    """The shared side of a ``DeviceLock`` (of each, for a list of them, taken in order); nothing for any
    other lock (a plain lock serialises only the timing, as it always did)."""
    if isinstance(lock, (list, tuple)):
        stack = contextlib.ExitStack()
        for each in lock:
            stack.enter_context(shared_use(each, occupy))
        return stack
    return lock.shared(occupy) if isinstance(lock, DeviceLock) else contextlib.nullcontext()
