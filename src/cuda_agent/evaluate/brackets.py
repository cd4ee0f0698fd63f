"""The evaluator's side of one candidate's region brackets (``evaluate.protocol.regions``) for one evaluation.

It hands the candidate's process its end of the brackets before any candidate code loads, has it time
no-op regions through them while its harness is still pristine (the brackets' own cost), brackets every
timed region of the rounds, and on the CPU backend stops the process after each region and reads the
calls it chose there, in secret, from outside (``evaluate.protocol.outside``: on the CPU backend its memory, on a
GPU the allocations it exported after the region, read by the reference process). After the rounds, ``judge`` sets the
regions the candidate's process reported against the brackets.
"""

from __future__ import annotations

import contextlib
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

from cuda_agent.evaluate.protocol.channel import Stop
from cuda_agent.evaluate.protocol.outside import (Armed, Draw, GpuInputWriter, GpuMemory, InputWriter, OutsideError,
                                         OutsideReader, GpuRemote, ProcessMemory)
from cuda_agent.evaluate.protocol.messages import CallRecord
from cuda_agent.evaluate.protocol.records import RECORDED_PER_REGION
from cuda_agent.evaluate.protocol.timing import trial_seed
from cuda_agent.evaluate.region_clock import Overhead, RegionClock, judge, overhead, times
from cuda_agent.evaluate.protocol.regions import (
    Bell, BellError, BellFailed, BellUnreadable, Bracket, Chunk, decode_calls, thread_times,
)

# No-op regions timed before the candidate's code loads. Their median is taken off every region, so its error is the
# clock's uncertainty (``Overhead.error_ms``, 1/sqrt of the regions). Their spread on a GPU is tens of us, so a
# region that memory keeps short (two 2 GiB calls) needs many of them; a no-op region costs about 1 ms on a GPU
# (docs/CONSTANTS.md).
CALIBRATION_REGIONS = 66
# The first ones warm the path up and are left out of the brackets' cost: on a GPU the first region exports the
# task's memory (tens of descriptors), and a freshly started process's first regions run slower (their spread
# several times the later ones').
WARM_UP_REGIONS = 2
# The largest timed output the reference keeps a copy of through the rounds (GPU memory beside the candidate's):
# a larger one is handed over by the candidate's code after the rounds, as before (docs/SECURITY.md).
KEEP_MAX_BYTES = 2 << 30


def bracket_hold(setup: Any) -> float:
    """The hold of the no-op regions: the candidate's default one (a host clock, the CPU backend, holds none);
    a region with another hold is allowed the difference (``Overhead.for_hold``)."""
    return setup.timing.hold_us if setup.device == "cuda" else 0.0


@dataclass
class CandidateBrackets:
    bell: Bell
    device: str
    worker: Any  # sandbox.WorkerProcess: alive, pause, resume
    cost: Overhead | None = None
    reader: OutsideReader | None = None
    thread: Callable[[], tuple[int, int]] | None = None  # the harness thread's CPU time and wait (regions.thread_times)
    stopped_check: Callable[[], None] | None = None  # run once stopped, before anything is read (signal handlers)
    timed: list[tuple[Bracket, float]] = field(default_factory=list)  # each region, its reported time (ms)
    records: list[tuple[int, CallRecord]] = field(default_factory=list)  # (probe, record) read from outside
    # Whether timed calls are read from outside (``evaluate.protocol.outside``): always on the CPU backend; on a GPU
    # where the candidate's process can export its memory (``read_from``), else its harness records them.
    outside: bool = False
    # Where each region's input values are written from outside before GO (``write_inputs``), drawn from
    # ``trial_seed(inputs_base, call)``: a secret of the evaluator's, for the checks of those calls.
    writer: InputWriter | GpuInputWriter | None = None
    may_write: bool = True  # the policy's word (``Policy.writes_inputs``)
    inputs_base: int = field(default_factory=lambda: secrets.randbits(62))
    # The timed call whose output the reference keeps, copied out while the process was stopped after its region
    # (``GpuMemory.keep``): each round's last, so that the last round's is the evaluation's last timed call.
    kept_call: int | None = None
    # The probe asked for before a GPU region's GO (``_probes``), rung at its DONE (when: ``asked_ns``), its answer
    # collected in ``between``.
    armed: Armed | None = None
    asked_ns: int = 0

    @classmethod
    def open(cls, worker: Any, device: str, may_write: bool = True) -> "CandidateBrackets":
        bell = Bell()
        # The recorded ``cpu_ns`` counts from the let-go on the CPU backend (a record: what the region's time counts is
        # ``region_clock.span_ms``'s, from the let-go on both backends).
        bell.cpu_from_let_go = device == "cpu"
        try:
            bell.hand_over(worker.send_fd)
        except OSError as exc:
            bell.close()
            raise Stop("error", "load", f"candidate process: cannot take the region brackets: {exc}") from None
        return cls(bell, device, worker, outside=device == "cpu", may_write=may_write)

    def read_from(self, pid: int | None, gpu_export: str | None = None, remote: GpuRemote | None = None) -> None:
        """Watch the harness process's timing thread, and open its memory (CPU backend) or take the reader
        of what it exports (``remote``, on a GPU where ``gpu_export`` is "on"), while it is still the harness's
        alone."""
        if pid is not None:
            self.thread = thread_times(pid)
        if self.device == "cuda":
            self.outside = self.bell.chunked = self.bell.poll_done = gpu_export == "on" and remote is not None
            if self.outside:
                self.reader = GpuMemory(remote)  # type: ignore[arg-type]
            return
        if pid is None:
            raise Stop("error", "load", "the candidate's harness process was not found: its outputs cannot be read "
                       "from outside")
        try:
            self.reader = ProcessMemory(pid)
        except OSError as exc:
            raise Stop("error", "load", f"the candidate's memory cannot be read from outside: {exc}") from None

    def write_inputs(self, pid: int | None, draw: Draw | None = None, flush_bytes: int = 0) -> None:
        """Write every timed region's input values from outside, drawn by the reference process from seeds the
        candidate's process never sees: on the CPU backend through its memory (``draw``, ``outside.InputWriter``),
        on a GPU where its memory is read from outside, by the reference that reads it (``GpuInputWriter``)."""
        if self.device == "cuda":
            if isinstance(self.reader, GpuMemory):
                self.writer = GpuInputWriter(self.reader)
            return
        if pid is None or draw is None:
            raise Stop("error", "load", "the candidate's harness process was not found: its inputs cannot be written "
                       "from outside")
        try:
            self.writer = InputWriter(pid, draw, flush_bytes)
        except OSError as exc:
            raise Stop("error", "load", f"the candidate's memory cannot be written from outside: {exc}") from None

    def close(self) -> None:
        self.bell.close()
        if self.reader is not None:
            self.reader.close()
        if self.writer is not None:
            self.writer.close()

    # -- before the candidate's code -------------------------------------------------------
    def calibration_fields(self, hold_us: float, timing: dict[str, Any]) -> dict[str, Any]:
        return {"bell_regions": CALIBRATION_REGIONS, "bell_hold_us": hold_us, "bell_seed": secrets.randbits(62),
                "bell_written": self._announces_inputs, "timing": timing}

    @property
    def _announces_inputs(self) -> bool:
        """Whether the no-op regions describe their inputs at READY (on a GPU with the allocations they lie in):
        wherever the rounds' inputs may be written, which is known only once the reference has loaded."""
        return self.may_write and (self.device == "cpu" or isinstance(self.reader, GpuMemory))

    def serve_calibration(self, timeout_s: float) -> list[Bracket] | None:
        """The no-op regions' brackets; None where the worker failed first (its load reply says why).
        On a GPU the process is stopped between them and each region's call read from outside, as in the
        rounds: a region that follows a stop and a read starts on a GPU left idle meanwhile (its clock lowered,
        the hold's cycle count longer) and after another process's GPU read. Calibrated without them, honest
        sub-0.1 ms calls sit over their brackets' cost by several times as much and are refused now and then. On
        the CPU backend (no hold, no GPU) honest regions sit below their cost either way, and the stops would cost
        a warm evaluation about half a second on a 2-core host: not done there. Where the
        rounds' inputs are written from outside, these regions' are too: what the stop and the let-go before GO
        leave in a region is part of every region's cost."""
        probe = secrets.randbits(62) if self.device == "cuda" else None
        self.bell.ready_chunked = self.device == "cuda" and self._announces_inputs
        try:
            return self.bell.serve(CALIBRATION_REGIONS, timeout_s, self._alive, self._reader_for(0, 1, probe),
                                   self.thread, self._writer_for(0, 1, secrets.randbits(62)),
                                   *self._probes(probe, timeout_s))
        except BellFailed:
            return None
        except Stop as stop:  # no candidate code has run yet: the harness's failure, not the candidate's
            raise Stop("error", "load", f"the no-op regions before the candidate's code: {stop.reason}") from None
        except BellError as exc:
            if not self._alive():
                return None  # its death is read from the load reply
            raise Stop("failed", "load", f"the candidate's process broke the timing protocol before its code "
                       f"ran: {exc}", rule="forged-reply") from None
        finally:
            self._settle()

    def calibrate(self, brackets: list[Bracket] | None, reported_ms: list[float] | None, hold_us: float,
                  tail_ms: float = 0.0) -> None:
        if brackets is None or not reported_ms or len(reported_ms) != len(brackets):
            raise Stop("error", "load", "the candidate's process did not time the no-op regions before its code loaded")
        self.cost = overhead(brackets[WARM_UP_REGIONS:], reported_ms[WARM_UP_REGIONS:], hold_us, tail_ms)
        self.records.clear()

    # -- the checks before timing --------------------------------------------------------------
    @property
    def copies_checks(self) -> bool:
        """Whether the checks' outputs are copied out of the candidate's GPU memory by the reference
        (``keep_checked``) rather than handed over by its code through shared host memory."""
        return isinstance(self.reader, GpuMemory)

    def keep_checked(self, described: Any, timeout_s: float, max_bytes: int = KEEP_MAX_BYTES) -> None:
        """A checked call's output (``RunReply.described``; its allocations follow on the brackets) copied by the
        reference while the process tree is stopped, for ``CompareRequest(kept=True)``: 1 GiB through shared
        host memory costs tens of ms a check, a copy within the GPU's own memory a millisecond or two."""
        reader = self.reader
        assert isinstance(reader, GpuMemory)
        try:
            reader.take(self.bell.checked_chunks(timeout_s, self._alive))
        except BellUnreadable as exc:
            raise Stop("failed", "verify", f"a checked output's GPU memory: {exc}", rule="output-memory") from None
        except (BellError, BellFailed) as exc:
            raise Stop("failed", "verify", f"the candidate's process did not hand over its checked output's "
                       f"memory: {exc}", rule="forged-reply") from None
        except OutsideError as exc:
            raise Stop("failed", "verify", f"a checked output: {exc}", rule="output-memory") from None
        self._stop()
        try:
            if reader.keep(described, max_bytes) is None:
                raise Stop("failed", "verify", f"a checked output is larger than the {max_bytes / 2**30:.3g} GiB "
                           "the evaluator keeps a copy of (twice the task's expected output, at least 2 GiB)",
                           rule="wrong-output")
        except OutsideError as exc:
            raise Stop("failed", "verify", f"a checked output, read from outside the candidate's process: {exc}",
                       rule="output-memory") from None
        finally:
            self.worker.resume()

    # -- the rounds --------------------------------------------------------------------------
    def round(self, first: int, trials: int, calls: int, timeout_s: float) -> list[Bracket] | None:
        """Bracket one round the worker was just asked for; None where it failed (its reply says why)."""
        probe = secrets.randbits(62)
        self.bell.ready_chunked = self.device == "cuda" and self.writer is not None
        try:
            return self.bell.serve(trials, timeout_s, self._alive,
                                   self._reader_for(first, calls, probe, final=first + trials * calls - 1),
                                   self.thread, self._writer_for(first, calls, self.inputs_base),
                                   *self._probes(probe, timeout_s))
        except BellFailed:
            return None
        except BellUnreadable as exc:
            raise Stop("failed", "verify", f"a timed call's output cannot be read from outside the candidate's "
                       f"process: {exc}", rule="timed-output") from None
        except BellError as exc:
            if not self._alive():
                return None
            raise Stop("failed", "profile", f"the candidate's process broke the timing protocol: {exc}",
                       rule="forged-reply") from None
        finally:
            self._settle()

    def add(self, brackets: list[Bracket], samples: list[float], calls: int) -> None:
        self.timed.extend((bracket, sample * calls) for bracket, sample in zip(brackets, samples))

    def times(self, brackets: list[Bracket], hold_us: float) -> list[float]:
        """Each region's time by the evaluator's clock (``region_clock.times``): what the reward is computed from."""
        if self.cost is None:
            raise Stop("error", "profile", "the region brackets were not calibrated before the candidate's code loaded")
        return times(brackets, self.cost, hold_us, less_waits=self.device == "cpu")

    def judge(self, hold_us: float) -> RegionClock | None:
        if self.cost is None or not self.timed:
            return None
        return judge([b for b, _ in self.timed], [r for _, r in self.timed], self.cost, hold_us,
                     less_waits=self.device == "cpu")

    def _alive(self) -> bool:
        return self.worker.proc.poll() is None

    def _calls_of(self, region: int, first: int, calls: int, payload: bytes) -> list[Any]:
        """A region's calls as the worker described them, which must be the calls asked for."""
        described = decode_calls(payload)
        wanted = list(range(first + region * calls, first + (region + 1) * calls))
        if [c.get("i") if isinstance(c, dict) else None for c in described] != wanted:
            raise Stop("failed", "profile", f"timed region {region} described other calls than were asked for",
                       rule="forged-reply")
        return described

    def _stop(self) -> None:
        if not self.worker.pause(timeout_s=10.0):  # a busy host delivers SIGSTOP late; a refusal is not that
            raise Stop("failed", "profile", "the candidate's processes did not stop around a timed region",
                       rule="forged-reply")

    def _writer_for(self, first: int, calls: int,
                    base: int) -> Callable[[int, bytes, list[Chunk]], Callable[[], None] | None] | None:
        """After each READY: the allocations the inputs lie in taken (GPU), the process stopped, the region's inputs
        (as described) given the values of ``trial_seed(base, call)``'s draws; what it returns lets the process go
        on, just before the bracket opens (``Bell.serve``)."""
        writer = self.writer
        if writer is None and not self.bell.ready_chunked:
            return None

        def before(region: int, payload: bytes, chunks: list[Chunk]) -> Callable[[], None] | None:
            if isinstance(self.reader, GpuMemory):
                try:
                    self.reader.take(chunks)
                except OutsideError as exc:
                    raise _unreadable(exc) from None
            if writer is None:
                return None
            described = self._calls_of(region, first, calls, payload)
            self._stop()
            try:
                if self.stopped_check is not None:
                    self.stopped_check()
                writer.write(described, [trial_seed(base, c["i"]) for c in described])
            except OutsideError as exc:
                self.worker.resume()
                raise Stop("failed", "profile", f"a timed call's inputs cannot be written from outside the "
                           f"candidate's process: {exc}", rule="forged-reply") from None
            except BaseException:
                self.worker.resume()
                raise
            return self.worker.resume
        return before

    def _settle(self) -> None:
        """A probe asked for whose region went no further: called off and its answer taken, so that the reference's
        next reply is the next request's (a reference that does not answer is left to ``reference_process.idle``)."""
        if self.armed is not None:
            armed, self.armed = self.armed, None
            armed.call_off()
            with contextlib.suppress(Stop):
                armed.answer()

    def _probes(self, probe: int | None, within_s: float) -> tuple[Callable[[int], None] | None,
                                                                   Callable[[int], None] | None]:
        """On a GPU read from outside, ``Bell.serve``'s ``at_done`` and ``before_go``. Before GO the reference is asked
        for a probe; as soon as DONE is in it is rung (``quiet.Doorbell``) and the processes the last stop found are
        stopped at once (pidfds, no walk of the tree). DONE is the worker's word: a region can say it with its
        kernels still queued, and they run on after the stop (red team done-sent-early-gpu). The GPU time-slices
        between contexts, so the probe waits for what is left; work that ends before its launch is not seen
        (``Bracket.blind_ms``): the sooner, the less. So the probe is rung at DONE before anything waits (not after
        the tree is walked, nor by a request, whose wake-up and parse would be most of the window), and the
        evaluator polls for DONE (``Bell.poll_done``); what is left is the evaluator's and the reference's wake-up
        (docs/CONSTANTS.md, "the window")."""
        if probe is None or not isinstance(self.reader, GpuMemory):
            return None, None
        reader = self.reader

        def before_go(region: int) -> None:
            self._settle()
            self.armed = reader.after_done(within_s)

        def at_done(region: int) -> None:
            # Stopped first, then probed: whatever the candidate's threads launch after DONE (a helper thread, a
            # hook on the harness's own thread) is queued before the probe, which then waits for it.
            self.worker.stop_known()
            if self.armed is not None:
                self.asked_ns = self.armed.ring()
        return at_done, before_go

    def _reader_for(self, first: int, calls: int, probe: int | None,
                    final: int | None = None) -> Callable[[Bracket], None] | None:
        """After each region: on a GPU read from outside, the probe rung at DONE (``_probes``) collected
        (``Bracket.after_done_us``, judged by ``region_clock.judge``) and the stop awaited; the region's calls as
        described, checked against the calls asked for; then the process stopped and ``RECORDED_PER_REGION`` of them,
        drawn now, read from outside; on a GPU the output of call ``final`` (the round's last) kept by the reference
        too, where it is at most ``KEEP_MAX_BYTES``."""
        def between(bracket: Bracket) -> None:
            gpu = isinstance(self.reader, GpuMemory)
            stopped = False
            try:
                if gpu and probe is not None:
                    stopped = True
                    if self.armed is None:  # a region never asked for its probe: not one bracketed by ``serve``
                        raise Stop("error", "profile", f"timed region {bracket.region}: no probe after its DONE")
                    armed, self.armed = self.armed, None
                    bracket.asked_ns = self.asked_ns
                    bracket.after_done_us, bracket.probed_ns = armed.answer()
                    self._stop()  # any process started since the last stop found, and every one confirmed
                if gpu:
                    self.reader.take(bracket.chunks)  # type: ignore[union-attr]
                described = self._calls_of(bracket.region, first, calls, bracket.payload) if self.outside else []
                if probe is None or self.reader is None:
                    if stopped:
                        self._stopped_cpu(bracket)
                    return
                if not stopped:
                    self._stop()
                    stopped = True
                self._stopped_cpu(bracket)
                if self.stopped_check is not None:
                    self.stopped_check()
                chosen = secrets.SystemRandom().sample(described, min(len(described), RECORDED_PER_REGION))
                self.records.extend((probe, record) for record in self.reader.records(chosen, probe))
                if final is not None and gpu:
                    self._keep(next((c for c in described if c.get("i") == final), None))
            except OutsideError as exc:
                raise _unreadable(exc) from None
            finally:
                if stopped:
                    self.worker.resume()
        return between

    def _stopped_cpu(self, bracket: Bracket) -> None:
        """The timing thread's CPU time and run-queue waits up to its stop after DONE, where more than up to DONE:
        work its hooks did after the harness said DONE (asleep first, so that the read at DONE missed it) is the
        region's."""
        if self.thread is not None and bracket.cpu_start_ns:
            cpu, waited = self.thread()
            bracket.thread_cpu_ns = max(bracket.thread_cpu_ns, cpu - bracket.cpu_start_ns)
            bracket.thread_waited_ns = max(bracket.thread_waited_ns, waited - bracket.waited_start_ns)

    def _keep(self, call: dict[str, Any] | None) -> None:
        self.kept_call = None
        if call is not None and self.reader.keep(call, KEEP_MAX_BYTES) is not None:  # type: ignore[union-attr]
            self.kept_call = call["i"]


def _unreadable(exc: OutsideError) -> Stop:
    return Stop("failed", "verify", f"a timed call's output, read from outside the candidate's process: {exc}",
                rule="timed-output")
