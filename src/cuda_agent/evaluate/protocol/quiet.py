"""The GPU quiet before a baseline's region and before the candidate's GO, seen from outside its process.

The candidate's processes are stopped outside its own regions, but the GPU goes on running what they left
queued, in any context: a kernel in a second context of its own (the harness's synchronise waits for the
primary one only) would slow the baselines or start on a region's inputs as soon as they are written. Without
MPS the GPU never runs two contexts' kernels at once; it time-slices between them (slices of milliseconds), so a
one-element kernel launched by the reference process waits while another context has work: ``probe_us`` measures
that wait, tens of microseconds with the other context idle and milliseconds while it has work, the same with its
process stopped (docs/CONSTANTS.md, ``QUIET_US``). So the median of a few probes says whether another context has
work (the least does not: one probe can fall between slices), and a candidate's work is told from another
process's by ending the candidate: its contexts go with its processes, another process's do not.

The reference probes (``probe_us``) before each baseline region and after it writes a region's inputs
(``TimeReply.busy_us``, ``WriteGpuReply.busy_us``); the evaluator judges the probes (``GpuQuiet``). After each of the
candidate's regions, asked for before GO and launched as soon as the evaluator rings the region's DONE (``Doorbell``),
one probe more (``after_done``) waits for what the region left queued: its wait is one of the region bounds
(``region_clock.judge``), since DONE is the worker's word."""

from __future__ import annotations

import fcntl
import mmap
import os
import statistics
import struct
import time
from typing import Any

from cuda_agent.evaluate.protocol.channel import Channel, Stop
from cuda_agent.evaluate.protocol.messages import QuietReply, QuietRequest

# The median probe above this: another context had work. Between the idle probe and a busy one by a wide margin on
# both sides; the first probe alone is not judged, since it may pay the switch from the context that ran last
# (docs/CONSTANTS.md).
QUIET_US = 1000.0
PROBES = 5  # the median of these is judged: one may follow a switch away from the context that ran last (the
# honest 0.22-0.27 ms, the others then 16-23 us), and one in a busy GPU's may land as a slice ends (0.29-0.36 ms)
PROBE_CAP_S = 0.05  # one probe is not waited for longer: a context that holds the GPU for good is busy
AFTER_END_S = 2.0  # how long the GPU may take to be quiet once the candidate's processes are ended


SETTLE_S = 5.0  # how long a timing waits for the GPU work of the evaluations it stopped to run out


def quiet_after_stops(setup: Any, reference: Channel) -> None:
    """Under the timing lock, where taking it stopped other evaluations' processes (``DeviceLock.pausable``):
    what they had queued on the GPU runs on, and a probe judged busy in this timing would end the candidate
    timed now as ``gpu-busy`` (its GPU quiet once it is ended), so that work is waited out first. Not quiet
    in ``SETTLE_S``: refused (``error``), never put on the candidate."""
    if setup.device != "cuda" or not getattr(setup.timing_lock, "paused", 0):
        return
    after = reference.ask_typed("profile", QuietRequest(within_s=SETTLE_S), QuietReply, setup.timeouts.check_s).after_ms
    if after is None:
        raise Stop("error", "profile", f"the GPU was not quiet {SETTLE_S:.0f} s after the processes of other "
                   "evaluations were stopped for this timing: evaluate again")


def probe_us(probes: int = PROBES, cap_s: float = PROBE_CAP_S) -> float:
    """The median wait, in us, of ``probes`` one-element kernels launched here one after another (in the calling
    process's current context, after everything it queued has finished), launch to completion: polled, not
    synchronised, so that a GPU held for good does not hang the caller."""
    import torch

    torch.cuda.synchronize()
    one = torch.empty(1, device="cuda")
    waits = [_wait_us(one, torch.cuda.Event(), cap_s) for _ in range(probes)]
    torch.cuda.synchronize()  # a capped probe's kernel is still queued: nothing of it is left in what follows
    return round(statistics.median(waits), 1)


def _wait_us(one: Any, done: Any, cap_s: float) -> float:
    """One probe: a one-element kernel launched on ``one`` and ``done`` recorded after it, polled until it has run
    (at most ``cap_s``); launch to completion, in us."""
    begin = time.perf_counter_ns()
    one.add_(1)
    done.record()
    while not done.query() and time.perf_counter_ns() - begin < cap_s * 1e9:
        pass
    return (time.perf_counter_ns() - begin) / 1e3


_AFTER_DONE: list[Any] = []  # the probe's tensor and event, made on first use: nothing allocated when it counts
RING = struct.Struct("<qq")  # a doorbell's words: the last region rung, the last one called off
_WORD = struct.Struct("<q")


class Doorbell:
    """How the evaluator tells the reference that a region said DONE without a request: one shared page (a sealed
    memfd of the evaluator's, never the candidate's) with two counters. The reference, asked before GO
    (``AfterDoneRequest``), waits on it and probes at once when its region's number is rung (or called off). A
    request read by the reference's loop would add its wake-up and the message's parse to the window in which work
    ending is not seen (docs/CONSTANTS.md, "the window")."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._page = mmap.mmap(fd, RING.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def create(cls) -> "Doorbell":
        fd = os.memfd_create("cuda-agent-doorbell", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, RING.size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            return cls(fd)
        except BaseException:
            os.close(fd)
            raise

    def ring(self, number: int) -> None:
        _WORD.pack_into(self._page, 0, number)

    def call_off(self, number: int) -> None:
        _WORD.pack_into(self._page, _WORD.size, number)

    def wait(self, number: int, within_s: float) -> bool:
        """Until ``number`` is rung (True), called off or ``within_s`` passed (False). Polled, yielding the CPU at
        each look: a wake-up is what it saves."""
        deadline = time.perf_counter_ns() + within_s * 1e9
        while True:
            rung, called_off = RING.unpack_from(self._page)
            if rung >= number:
                return True
            if called_off >= number or time.perf_counter_ns() > deadline:
                return False
            os.sched_yield()

    def close(self) -> None:
        self._page.close()
        os.close(self.fd)


def after_done(bell: Doorbell, number: int, within_s: float, cap_s: float = PROBE_CAP_S) -> tuple[float, int]:
    """One probe as soon as region ``number`` of a candidate's said DONE (``bell``, rung by the evaluator, which
    then stops the candidate's processes): its wait, in us, is the GPU work the region left queued (up to a time
    slice), and when it was launched (``time.time_ns``; 0, and no probe, where the region was called off). Work that
    ends before the launch is not seen, so nothing is done first that need not be."""
    import torch

    if not _AFTER_DONE:
        _AFTER_DONE.extend((torch.empty(1, device="cuda"), torch.cuda.Event()))
    one, done = _AFTER_DONE
    if not bell.wait(number, within_s):
        return 0.0, 0
    launched_ns = time.time_ns()
    wait_us = _wait_us(one, done, cap_s)
    torch.cuda.synchronize()
    return round(wait_us, 1), launched_ns


def quiet_within(within_s: float) -> float | None:
    """Probe until the GPU is quiet: ms it took, or None if it was not within ``within_s``."""
    begin = time.perf_counter()
    while True:
        if probe_us() <= QUIET_US:
            return round((time.perf_counter() - begin) * 1e3, 1)
        if time.perf_counter() - begin > within_s:
            return None
        time.sleep(0.001)


class GpuQuiet:
    """Judges the reference's probes for one evaluation. ``candidate``: the worker of the candidate's processes
    once its code has loaded (before that, and for baselines measured alone, work found on the GPU is another
    process's). Busy where the candidate's code has run: its processes are ended (they are stopped; the
    evaluation fails either way) and the GPU probed again: quiet within ``AFTER_END_S``, the work was the
    candidate's (``gpu-busy``); still busy, it was another process's, and the evaluation is refused (``error``)."""

    def __init__(self, reference: Channel, timeout_s: float) -> None:
        self.reference, self.timeout_s = reference, timeout_s
        self.candidate: Any = None
        self.most_us: float | None = None  # the longest probe judged: the margin below ``QUIET_US`` (reported)

    def judge(self, busy_us: float | None, when: str) -> None:
        if busy_us is None:
            return
        self.most_us = max(self.most_us or 0.0, busy_us)
        if busy_us <= QUIET_US:
            return
        found = (f"the GPU had other work {when}: a one-element kernel of the reference process waited "
                 f"{busy_us / 1e3:.2f} ms to run (quiet: under {QUIET_US / 1e3:.2f} ms)")
        if self.candidate is not None:
            self.candidate.kill()  # its GPU contexts end with its processes, and what runs in them
            after = self.reference.ask_typed("profile", QuietRequest(within_s=AFTER_END_S), QuietReply,
                                             self.timeout_s).after_ms
            if after is not None:
                raise Stop("failed", "profile", f"{found}, and was quiet {after:.0f} ms after the candidate's "
                           "processes were ended: work the candidate left queued on the GPU (in a context of its "
                           "own) ran outside its timed regions", rule="gpu-busy")
        raise Stop("error", "profile", f"{found}, work of another process than the candidate's: evaluate again when "
                   "the GPU runs nothing else")
