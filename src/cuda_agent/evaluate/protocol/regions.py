"""The timed-region protocol, both ends: the evaluator opens each timed region and its own clock closes it.

Every timed region of a worker is bracketed by datagrams on a socket pair the evaluator made (no
JSON, no pipe on the timed path): the worker says READY when the region's inputs are drawn, the
evaluator reads its clock and says GO, the worker runs the calls (on a GPU, up to the synchronise
after them; then sends the allocations they lie in) and says DONE, then waits for CONT. DONE is stamped
by the kernel when it is sent (``SO_TIMESTAMPNS`` on the evaluator's end), so the evaluator can sleep in
``recv`` and still know when the region ended, by a clock no code in the worker can reach. Between DONE and CONT the
evaluator may stop the worker and read what the region left from outside (``evaluate.protocol.outside``).

``evaluate.region_clock`` turns what the brackets measured into each region's time; the worker's own report is a
diagnostic.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from cuda_agent.evaluate.protocol.vmm import MAX_CHUNKS

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux; Python names it only on some builds
HEADER = struct.Struct("<4sIq")  # what, region number, a value (unused: 0)
READY, GO, DONE, CONT, FAIL = b"RDY_", b"GO__", b"DONE", b"CONT", b"FAIL"
# Before DONE, on a GPU: the allocations the region's tensors span (evaluate.protocol.vmm), as descriptors, up to
# FDS_PER_DATAGRAM a datagram; its value is 1 on the last, -1 where they could not be exported.
FDS = b"FDS_"
FDS_PER_DATAGRAM = 200  # the kernel carries at most 253 descriptors a message
MAX_DATAGRAM = 1 << 20  # DONE carries the region's output descriptors (evaluate.protocol.outside)
STAMP = struct.Struct("qq")
# The number the FDS datagrams of a checked call's output carry (``RunRequest.outside``): no region's.
CHECK_REGION = 0xFFFFFFF0


class BellError(Exception):
    """The worker broke the region protocol (a datagram out of turn, or none in time)."""


class BellUnreadable(BellError):
    """The worker could not export a GPU region's memory (its tensors are not memory another process can map)."""


class BellFailed(Exception):
    """The worker said FAIL: its round raised, and its reply says why."""


@dataclass
class Chunk:
    """One allocation a GPU region's tensors lie in, at ``base`` in the worker's address space, and the
    evaluator's descriptor of it."""

    base: int
    size: int
    fd: int


@dataclass
class Bracket:
    """One region as the evaluator saw it, in its clock's nanoseconds (``time.time_ns``, the clock the
    kernel stamps datagrams with). ``prep``: from CONT (or the round's start) to READY, the worker
    drawing the region's inputs."""

    region: int
    start_ns: int  # when the worker was let go on (CONT of the region before, or the request)
    ready_ns: int
    go_ns: int
    done_ns: int
    payload: bytes = b""
    # The worker's timing thread within the bracket, by the kernel's account (schedstat): time it spent
    # runnable but waiting for a CPU (a busy host, not the worker, made the bracket that much longer), and
    # time it ran on a CPU (which no wall clock of a region can be shorter than).
    waited_ns: int = 0
    cpu_ns: int = 0
    # The evaluator's own work after the region while the worker waited for CONT (on the CPU backend:
    # stopping it and reading its outputs from outside), and before GO (writing its inputs): part of the
    # round's wall, none of it the worker's.
    held_ns: int = 0
    # On a GPU: how many allocations the worker looked up at the region's end, before DONE (those it had not looked
    # up before the region), and how many it exported anew (``chunks``: their descriptors, for ``between`` to take
    # or close).
    looked_up: int = 0
    new_chunks: int = 0
    chunks: list[Chunk] = field(default_factory=list)
    # Where its inputs were written from outside: from letting the stopped worker go to GO (its timing thread
    # asleep again: 0.06-0.1 ms), time its code could use outside the bracket; and the timing thread's CPU time
    # meanwhile (in ``cpu_ns`` too where the bell counts from the let-go: ``Bell.cpu_from_let_go``).
    let_go_ns: int = 0
    let_go_cpu_ns: int = 0
    let_go_waited_ns: int = 0  # the timing thread's run-queue wait meanwhile
    # The timing thread's CPU time from the let-go (GO where nothing was written) to its stop after DONE (to DONE
    # until the stop is read: ``cpu_start_ns`` is where it counts from, the thread's total then), and its run-queue
    # waits over the same span (from ``waited_start_ns``). Work the harness's own thread does after its DONE, before
    # the stop, is in them.
    thread_cpu_ns: int = 0
    cpu_start_ns: int = 0
    thread_waited_ns: int = 0
    waited_start_ns: int = 0
    # On a GPU read from outside: the reference's probe once the worker was stopped after DONE (``quiet.after_done``),
    # its wait (the region's GPU work still queued, up to a time slice) and when it was launched. Work that ended
    # between DONE and the launch is not seen (``blind_ms``).
    after_done_us: float = 0.0
    probed_ns: int = 0
    asked_ns: int = 0  # when the evaluator asked for the probe (of the blind window, the part before the reference)

    @property
    def outside_ms(self) -> float:
        return (self.done_ns - self.go_ns) / 1e6

    @property
    def prep_ms(self) -> float:
        return (self.ready_ns - self.start_ns) / 1e6

    @property
    def wall_ms(self) -> float:
        """The bracket less the run-queue wait."""
        return self.outside_ms - self.waited_ns / 1e6

    @property
    def cpu_ms(self) -> float:
        return self.cpu_ns / 1e6

    @property
    def asked_ms(self) -> float:
        """From DONE to the evaluator's asking for the probe (the rest: the reference's)."""
        return max(0.0, self.asked_ns - self.done_ns) / 1e6 if self.asked_ns else 0.0

    @property
    def blind_ms(self) -> float:
        """From DONE to the probe after it: where GPU work the region left queued could end unseen."""
        return max(0.0, self.probed_ns - self.done_ns) / 1e6 if self.probed_ns else 0.0


class Bell:
    """The evaluator's end of one worker's region brackets."""

    def __init__(self, chunked: bool = False) -> None:
        self.chunked = chunked  # each DONE is followed by the region's allocations (FDS datagrams)
        self.ready_chunked = False  # and each READY by those its inputs lie in (their values written before GO)
        # ``Bracket.cpu_ns`` counted from the let-go rather than GO (a record only: the region's time counts the
        # timing thread from the let-go either way, ``Bracket.thread_cpu_ns``).
        self.cpu_from_let_go = False
        # From GO to DONE, the socket polled rather than slept on: on a GPU read from outside, the probe after DONE
        # sees only work still queued when it is launched, and the evaluator's wake-up on DONE would be most of the
        # time before it (docs/CONSTANTS.md, "the window"). A core of the host while
        # a region runs; not on the CPU backend, where the evaluator's core would compete with the side it times.
        self.poll_done = False
        self._polling = False
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.ours.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, MAX_DATAGRAM * 2)

    def hand_over(self, send_fd: Callable[[int], None]) -> None:
        """Give the worker its end (a descriptor over its fd channel); ours keeps no copy of it."""
        send_fd(self.theirs.fileno())
        self.theirs.close()

    def close(self) -> None:
        self.ours.close()
        if self.theirs.fileno() >= 0:
            self.theirs.close()

    def serve(self, regions: int, timeout_s: float, alive: Callable[[], bool],
              between: Callable[[Bracket], None] | None = None,
              thread: Callable[[], tuple[int, int]] | None = None,
              before: Callable[[int, bytes, list[Chunk]], Callable[[], None] | None] | None = None,
              at_done: Callable[[int], None] | None = None,
              before_go: Callable[[int], None] | None = None) -> list[Bracket]:
        """Bracket ``regions`` regions of the round the worker was just asked for (``drain`` before asking).
        ``between(bracket)`` runs after each DONE and before CONT, while the worker waits (or is stopped
        by it). ``thread()``: the worker's timing thread's CPU time and run-queue wait so far, in ns.
        ``before(region, payload, chunks)`` runs after each READY (its payload: the region's inputs described; with
        ``ready_chunked``, the allocations they lie in that the worker had not sent before, for it to take) and may
        stop the worker; what it returns lets it go on, and the bracket opens then (``Bracket.let_go_ns``).
        ``before_go(region)`` runs once ``before`` is done, before the worker is let go (on a GPU: the probe after
        DONE asked for); ``at_done(region)`` as soon as DONE is in, before anything else (the probe rung, the worker
        stopped)."""
        deadline = time.monotonic() + timeout_s
        brackets: list[Bracket] = []
        thread = thread or (lambda: (0, 0))
        start = time.time_ns()
        for region in range(regions):
            ready_ns, described = self._expect(READY, region, deadline, alive)
            written_from = time.time_ns()
            inputs = self._chunks(region, deadline, alive)[0] if self.ready_chunked else []
            try:
                let_go = before(region, described, inputs) if before is not None else None
            finally:
                for chunk in inputs:  # those ``before`` did not take
                    os.close(chunk.fd)
            # A stopped process let go wakes every thread it has. Let go with GO, those wake-ups would run into the
            # regions and spread the no-op regions' wall time several-fold, enough to refuse honest sub-millisecond
            # regions. So it is let go first and GO waits until its timing thread is asleep again
            # (``thread()``). That wait (``Bracket.let_go_ns``, about 0.1 ms a region) is the region's: its time by the
            # evaluator's clock starts at the let-go (``region_clock.span_ms``).
            if before_go is not None:
                before_go(region)
            let_go_ns = 0
            let_go_cpu = let_go_waited = None
            if let_go is not None:
                let_go_cpu, let_go_waited = thread()  # stopped: the kernel's account of it is up to date
                let_go()
                let_go_ns = time.time_ns()
            cpu_before, waited_before = thread()
            go_ns = time.time_ns()
            self.ours.send(HEADER.pack(GO, region, 0))
            chunks, looked_up = [], 0
            try:
                self._polling = self.poll_done
                try:
                    if self.chunked:
                        # The export runs in the worker's process, where the candidate's code could do work of its
                        # own meanwhile: it is part of the region, before DONE.
                        chunks, looked_up = self._chunks(region, deadline, alive)
                    done_ns, payload = self._expect(DONE, region, deadline, alive)
                finally:
                    self._polling = False
                if at_done is not None:
                    at_done(region)
                cpu_after, waited_after = thread()
                cpu_from = let_go_cpu if let_go_cpu is not None and self.cpu_from_let_go else cpu_before
                # The region's own account of its timing thread starts at the let-go where there is one.
                cpu_start, waited_start = ((let_go_cpu, let_go_waited) if let_go_cpu is not None
                                           else (cpu_before, waited_before))
                bracket = Bracket(region, start, ready_ns, go_ns, done_ns, payload, waited_after - waited_before,
                                  cpu_after - cpu_from, looked_up=looked_up,
                                  new_chunks=len(chunks), chunks=chunks,
                                  let_go_ns=go_ns - let_go_ns if let_go_ns else 0,
                                  let_go_cpu_ns=cpu_before - let_go_cpu if let_go_cpu is not None else 0,
                                  let_go_waited_ns=waited_before - let_go_waited if let_go_waited is not None else 0,
                                  thread_cpu_ns=cpu_after - cpu_start, cpu_start_ns=cpu_start,
                                  thread_waited_ns=waited_after - waited_start, waited_start_ns=waited_start)
                brackets.append(bracket)
                held_from = time.time_ns()
                if between is not None:
                    between(bracket)  # takes the descriptors it keeps out of ``chunks`` (the bracket's list)
            finally:
                for chunk in chunks:
                    os.close(chunk.fd)
                chunks.clear()
            bracket.held_ns = time.time_ns() - held_from + (let_go_ns - written_from if let_go_ns else 0)
            start = time.time_ns()
            self.ours.send(HEADER.pack(CONT, region, 0))
        return brackets

    def checked_chunks(self, timeout_s: float, alive: Callable[[], bool]) -> list[Chunk]:
        """The allocations a checked call's output lies in that the worker had not sent before (``CHECK_REGION``)."""
        return self._chunks(CHECK_REGION, time.monotonic() + timeout_s, alive)[0]

    def _chunks(self, region: int, deadline: float, alive: Callable[[], bool]) -> tuple[list[Chunk], int]:
        """The FDS datagrams that end a region (before its DONE), or a checked call's: the allocations its tensors
        span that were not sent before, each with a descriptor; how many allocations the worker looked up at the
        end."""
        chunks: list[Chunk] = []
        try:
            while True:
                _, data, fds = self._receive(region, deadline, alive, FDS_PER_DATAGRAM)
                kind, number, last = HEADER.unpack_from(data) if len(data) >= HEADER.size else (b"", -1, 0)
                try:
                    if kind == FAIL:
                        raise BellFailed(f"the worker's round failed in region {number}")
                    if kind != FDS or number != region:
                        raise BellError(f"{kind!r} for region {number} where the allocations of region {region} "
                                        "were due")
                    if last == -1:
                        raise BellUnreadable("its tensors' GPU memory could not be exported: "
                                             + data[HEADER.size:HEADER.size + 500].decode(errors="replace"))
                    message = json.loads(data[HEADER.size:])
                    table = message.get("chunks") if isinstance(message, dict) else None
                    looked_up = message.get("looked_up") if isinstance(message, dict) else None
                    if not isinstance(table, list) or len(table) != len(fds) or not all(
                            isinstance(e, list) and len(e) == 2 and all(isinstance(v, int) and v > 0 for v in e)
                            for e in table) or not isinstance(looked_up, int) or not 0 <= looked_up <= MAX_CHUNKS:
                        raise BellError(f"region {region}: an allocation table that does not match its descriptors")
                except (BellError, BellFailed, ValueError):
                    for fd in fds:
                        os.close(fd)
                    raise
                chunks.extend(Chunk(base, size, fd) for (base, size), fd in zip(table, fds))
                if len(chunks) > MAX_CHUNKS:
                    raise BellError(f"region {region}: more than {MAX_CHUNKS} allocations")
                if last == 1:
                    return chunks, looked_up
        except BaseException:
            for chunk in chunks:
                os.close(chunk.fd)
            raise

    def _receive(self, region: int, deadline: float, alive: Callable[[], bool], fds: int = 0,
                 what: str = "datagram") -> tuple[int, bytes, list[int]]:
        """The kernel's send stamp of the next datagram, the datagram, and the descriptors it carried (at most
        ``fds``; more are closed by the kernel)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BellError(f"no {what} for timed region {region} in time")
            ancillary_size = socket.CMSG_SPACE(STAMP.size) + socket.CMSG_SPACE(4 * max(fds, 1))
            try:
                if self._polling:
                    data, ancillary = self._poll(min(left, 1.0), ancillary_size)
                else:
                    self.ours.settimeout(min(left, 1.0))
                    data, ancillary, _, _ = self.ours.recvmsg(MAX_DATAGRAM, ancillary_size)
            except socket.timeout:
                if not alive():
                    raise BellError(f"the worker died in timed region {region}") from None
                continue
            received: list[int] = []
            stamp = None
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received.extend(struct.unpack(f"{len(payload) // 4}i", payload[:len(payload) - len(payload) % 4]))
                elif level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    seconds, nanoseconds = STAMP.unpack(payload[:STAMP.size])
                    stamp = seconds * 1_000_000_000 + nanoseconds
            if stamp is None or (not fds and received):
                for fd in received:
                    os.close(fd)
                raise BellError("the kernel gave no send time for a datagram (SO_TIMESTAMPNS)" if stamp is None
                                else f"descriptors where none were due in timed region {region}")
            return stamp, data, received

    def drain(self) -> None:
        """Datagrams left from a round that stopped early are not the next round's: drop them before
        asking for it (after, they could be its first READY)."""
        self.ours.setblocking(False)
        try:
            while True:
                self.ours.recv(MAX_DATAGRAM)
        except (BlockingIOError, InterruptedError):
            pass
        finally:
            self.ours.setblocking(True)

    def _poll(self, within_s: float, ancillary_size: int) -> tuple[bytes, list[Any]]:
        """The next datagram, looked for without sleeping (yielding the CPU at each look); socket.timeout after
        ``within_s``."""
        until = time.monotonic() + within_s
        self.ours.setblocking(False)
        while True:
            try:
                data, ancillary, _, _ = self.ours.recvmsg(MAX_DATAGRAM, ancillary_size)
                return data, ancillary
            except BlockingIOError:
                if time.monotonic() > until:
                    raise socket.timeout from None
                os.sched_yield()

    def _expect(self, what: bytes, region: int, deadline: float, alive: Callable[[], bool]) -> tuple[int, bytes]:
        """The kernel's send stamp and the payload of the next datagram, which must be ``what`` for
        ``region``."""
        stamp, data, _ = self._receive(region, deadline, alive, what=what.decode().strip("_"))
        if len(data) < HEADER.size:
            raise BellError(f"a malformed datagram in timed region {region}")
        kind, number, _ = HEADER.unpack_from(data)
        if kind == FAIL:
            raise BellFailed(f"the worker's round failed in region {number}")
        if kind != what or number != region:
            raise BellError(f"{kind!r} for region {number} where {what!r} for region {region} was due")
        return stamp, data[HEADER.size:]


class Ringer:
    """The worker's end. Everything it calls is bound when it is made, before any candidate code
    loads: no name is looked up on the timed path."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send = sock.send
        self._recv = sock.recv
        self._pack = HEADER.pack
        self._unpack = HEADER.unpack_from
        self._sendmsg = sock.sendmsg
        self._close = os.close
        self._dumps = json.dumps
        self._ints = array.array

    def ready(self, region: int, payload: bytes = b"") -> None:
        self._send(self._pack(READY, region, 0) + payload)

    def wait(self, what: bytes, region: int) -> None:
        """Blocking, not spinning: the evaluator reads the kernel's account of this thread (``thread_times``)
        while it sleeps here, when that account is exact; a thread that runs is accounted only at the
        scheduler's next tick. Its wake-up after GO is in the bracket, and on a busy host in its run-queue
        wait, which the evaluator takes off."""
        data = self._recv(64)
        kind, number, _ = self._unpack(data)
        if kind != what or number != region:
            raise RuntimeError(f"region protocol: {kind!r} for region {number} where {what!r} for {region} was due")

    def done(self, region: int, payload: bytes = b"") -> None:
        self._send(self._pack(DONE, region, 0) + payload)

    def chunks(self, region: int, chunks: list[tuple[int, int]], fds: list[int], looked_up: int) -> None:
        """Before DONE: the region's allocations not sent before and a descriptor of each (closed here once
        sent), and how many allocations were looked up at the region's end."""
        try:
            for at in range(0, max(len(fds), 1), FDS_PER_DATAGRAM):
                last = int(at + FDS_PER_DATAGRAM >= len(fds))
                part = fds[at:at + FDS_PER_DATAGRAM]
                table = self._dumps({"chunks": chunks[at:at + FDS_PER_DATAGRAM], "looked_up": looked_up}).encode()
                self._sendmsg([self._pack(FDS, region, last) + table],
                              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, self._ints("i", part))] if part else [])
        finally:
            for fd in fds:
                self._close(fd)

    def chunks_failed(self, region: int, reason: str) -> None:
        self._send(self._pack(FDS, region, -1) + reason.encode()[:500])

    def fail(self, region: int) -> None:
        try:
            self._send(self._pack(FAIL, region, 0))
        except OSError:
            pass


def encode_calls(calls: list[dict[str, Any]]) -> bytes:
    """The region's calls' tensors as DONE's payload (``evaluate.protocol.outside.describe``)."""
    return json.dumps(calls, separators=(",", ":")).encode()


def decode_calls(payload: bytes) -> list[dict[str, Any]]:
    try:
        calls = json.loads(payload) if payload else []
    except ValueError:
        raise BellError("the region's output descriptors are not readable") from None
    if not isinstance(calls, list):
        raise BellError("the region's output descriptors are not a list")
    return calls


def thread_times(pid: int, tid: int | None = None) -> Callable[[], tuple[int, int]]:
    """A reader of thread ``tid`` of ``pid`` (its main thread by default): its CPU time and how long it has
    waited runnable for a CPU, in ns (the kernel's schedstat), or zeros where the kernel keeps neither.
    Read once the thread sleeps (it blocks for GO and for CONT, ``Ringer.wait``): the kernel brings a
    thread's CPU time up to date when it stops running, and only at its ticks while it runs (up to
    milliseconds behind, which read before a region and not after it would add a tick to the region)."""
    stat = f"/proc/{pid}/task/{tid or pid}/stat"
    schedstat = f"/proc/{pid}/task/{tid or pid}/schedstat"

    def times() -> tuple[int, int]:
        try:
            deadline = time.monotonic() + SETTLE_S
            while True:
                with open(stat, "rb") as handle:
                    state = handle.read().rsplit(b")", 1)[1].split()[0]
                if state != b"R" or time.monotonic() >= deadline:
                    break
                # Asleep between looks, not spinning: the thread waited for may need this CPU to get there (on a
                # 2-core host, spinning makes the wait before GO ten times longer now and then).
                time.sleep(SETTLE_POLL_S)
            with open(schedstat, "rb") as handle:
                fields = handle.read().split()
            return int(fields[0]), int(fields[1])
        except (OSError, IndexError, ValueError):
            return 0, 0
    return times


SETTLE_S = 0.005  # the longest a bracket waits for the worker's thread to go to sleep before reading it
SETTLE_POLL_S = 20e-6
