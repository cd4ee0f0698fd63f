"""The evaluation service's scheduler: a bounded queue of jobs in front of evaluation slots.

A slot owns one ``Evaluator`` (one GPU, or one CPU slot) and answers one job at a time: in this
process (``LocalSlot``) or in a Ray actor (``service.ray_backend``). The service gives each slot a
thread that takes the next job, so the code that schedules, retries and counts is the same on one
machine and on a cluster. What it promises a client:

- **back-pressure**: at most ``queue_size`` jobs wait; past that ``submit`` waits or refuses
  (``overloaded``), so a burst cannot grow memory without bound;
- **a job is never lost**: a slot that dies with a job (its actor or node gone, ``SlotLost``) is
  replaced and the job goes back to the front of the queue, up to ``retries`` times;
- **no verdict is given up on lightly**: an evaluation without a verdict for a busy host (``result.BUSY``) goes
  back to the queue after a back-off, up to ``verdict_retries`` times, for another slot where there is one; its
  result's ``attempts`` counts the evaluations. The slots' evaluators do not retry themselves (``RetryPolicy.none``),
  so a slot never sits in a back-off while the queue waits;
- **and never answered twice**: a job's future is set once; a late answer from a slot given up
  on (timed out, lost) is dropped;
- **per-job timeouts**: a job a slot holds past ``job_timeout_s`` fails as ``timeout`` and the slot
  is replaced (the evaluator's own timeouts should have ended a hung candidate long before);
- **live counters** (``stats()``): queue depth, in flight, done, evaluations per second, each
  slot's busy share;
- **task affinity**: a free slot prefers a waiting job of a task it served recently, whose reference
  process its evaluator still holds (docs/SCALE.md: worth about 5x at 30 evaluations an episode);
- **one job of a task at a time** (``one_per_task``, where slots share their reference processes): a free
  slot passes over jobs of a task another slot is evaluating, and waits where there are only such jobs.
  Taken, such a job would wait in its slot for the task's one reference (up to a minute), then start a
  second one, and candidates of the same task filling every slot would wait that long in turn.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from cuda_agent.evaluate.result import BUSY, no_verdict_kind
from cuda_agent.service.messages import Job, Reply, ServiceError

RATE_WINDOW_S = 60.0  # evaluations per second are counted over this window
# Task affinity: a free slot takes a waiting job of a task it served recently (its evaluator still holds
# that task's reference process: a warm evaluation costs a sixth of one with a reference start, docs/SCALE.md),
# scanning this far into the queue; the head job is taken anyway once it has waited AFFINITY_WAIT_S.
AFFINITY_SCAN = 64
AFFINITY_TASKS = 8  # tasks a slot is taken to hold (the evaluator's reference pool keeps a few)
AFFINITY_WAIT_S = 10.0
VERDICT_RETRIES = 2  # evaluations again of a job without a verdict for a busy host
VERDICT_BACKOFF_S = 5.0  # before the first of them; doubled for each one after


class SlotLost(RuntimeError):
    """The slot itself died (its process, actor or node), not the job's candidate."""


class Slot(Protocol):
    name: str

    def run(self, job: Job, built: Any = None) -> Any:
        """The job's result as JSON (``execute``); raises ``SlotLost`` if the slot died."""

    def close(self) -> None:
        """Stop what the slot holds (its evaluator's processes, its actor)."""


def execute(evaluator: Any, job: Job, built: Any = None) -> Any:
    """Run ``job`` on an ``EvaluatorLike`` and return its result as JSON: the one place a job's op
    becomes a method call (local slots and Ray actors both use it)."""
    if job.op == "evaluate":
        return evaluator.evaluate(job.task, job.candidate, built, timed=job.timed).to_dict()
    if job.op == "verify":
        return evaluator.verify(job.task, job.candidate, built).to_dict()
    if job.op == "build":
        return evaluator.build(job.candidate).to_dict()
    if job.op == "baseline":
        return evaluator.baseline(job.task, refresh=job.refresh, degenerate=job.degenerate)
    if job.op == "counters":
        return evaluator.counters(job.task, job.candidate, job.times).to_dict()
    return evaluator.check_degenerate(job.task, draws=job.draws).to_dict()


class LocalSlot:
    """A slot in this process: one ``Evaluator``."""

    def __init__(self, name: str, evaluator: Any):
        self.name = name
        self.evaluator = evaluator

    def run(self, job: Job, built: Any = None) -> Any:
        return execute(self.evaluator, job, built)

    def close(self) -> None:
        self.evaluator.close()


@dataclass
class _Entry:
    job: Job
    future: "Future[Reply]"
    submitted: float
    built: Any = None
    attempts: int = 0
    evaluations: int = 0  # of an evaluate or verify job: its evaluations so far
    undecided: int = 0  # those that ended without a verdict for a busy host
    avoid: str | None = None  # the slot whose evaluation had no verdict: another one takes it where there is one
    requeued: float = 0.0


@dataclass
class _SlotState:
    slot: Slot
    busy_s: float = 0.0
    started: float = field(default_factory=time.monotonic)
    job: str | None = None
    task: str | None = None  # the task digest of the job it runs
    since: float = 0.0
    done: int = 0
    lost: int = 0
    tasks: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # recent task digests


class EvalService:
    """Jobs in, replies out (``submit`` returns a future of a ``Reply``)."""

    def __init__(self, make_slot: Callable[[int], Slot], slots: int, *, queue_size: int = 64,
                 job_timeout_s: float = 3600.0, retries: int = 2,
                 builder: Callable[[Any], Any] | None = None, build_workers: int = 0,
                 info: dict[str, Any] | None = None, on_reply: Callable[[Job, Reply], None] | None = None,
                 one_per_task: bool = False, verdict_retries: int = VERDICT_RETRIES,
                 verdict_backoff_s: float = VERDICT_BACKOFF_S):
        if slots < 1:
            raise ValueError("the service needs at least one slot")
        if queue_size < 1:
            raise ValueError("queue_size must be at least 1")
        self.make_slot = make_slot
        self.queue_size = queue_size
        self.job_timeout_s = job_timeout_s
        self.retries = retries
        self.verdict_retries, self.verdict_backoff_s = verdict_retries, verdict_backoff_s
        self.info = dict(info or {})
        self.on_reply = on_reply or (lambda job, reply: None)
        self.one_per_task = one_per_task
        self._lock = threading.Condition()
        self._pending: collections.deque[_Entry] = collections.deque()
        self._building = 0
        self._closed = False
        self._started = time.monotonic()
        self._finished: collections.deque[float] = collections.deque()  # when each job was answered
        self.counts = collections.Counter()
        # Compiles need no GPU: with a builder, evaluate/verify jobs are built on CPU threads while
        # the slots evaluate earlier ones (the slot then finds the build cached).
        self._builder = builder
        self._build_pool = ThreadPoolExecutor(build_workers, thread_name_prefix="build") if builder and build_workers else None
        self._slots: list[_SlotState] = []
        for index in range(slots):
            self._slots.append(_SlotState(make_slot(index)))
        self._threads = [threading.Thread(target=self._serve, args=(i,), name=f"slot-{i}", daemon=True)
                         for i in range(slots)]
        for thread in self._threads:
            thread.start()

    # -- clients ---------------------------------------------------------------------
    def submit(self, job: Job, block: bool = True, timeout: float | None = None) -> "Future[Reply]":
        """Queue ``job``. With ``queue_size`` jobs already waiting, wait for room (``block``, up to
        ``timeout``) or raise ``ServiceError(kind="overloaded")``."""
        entry = _Entry(job, Future(), time.monotonic())
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._waiting() >= self.queue_size:
                left = None if deadline is None else deadline - time.monotonic()
                if self._closed or not block or (left is not None and left <= 0):
                    self.counts["refused"] += 1
                    raise ServiceError(f"the service is full ({self.queue_size} jobs waiting); try again later",
                                       "overloaded")
                self._lock.wait(left)
            if self._closed:
                raise ServiceError("the service is closed", "lost")
            self.counts["submitted"] += 1
            if self._build_pool is not None and job.op in ("evaluate", "verify"):
                self._building += 1
                self._build_pool.submit(self._build, entry)
            else:
                self._pending.append(entry)
                self._lock.notify_all()
        return entry.future

    def run(self, job: Job, timeout: float | None = None) -> Reply:
        return self.submit(job).result(timeout)

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            while self._finished and self._finished[0] < now - RATE_WINDOW_S:
                self._finished.popleft()
            window = min(RATE_WINDOW_S, now - self._started)
            slots = [{"name": s.slot.name, "busy": s.job is not None, "job": s.job, "done": s.done, "lost": s.lost,
                      "busy_share": round((s.busy_s + (now - s.since if s.job else 0.0)) / max(now - s.started, 1e-9), 4)}
                     for s in self._slots]
            return self.info | {
                "queue": len(self._pending), "building": self._building,
                "in_flight": sum(1 for s in self._slots if s.job is not None),
                "per_second": round(len(self._finished) / window, 4) if window > 0 else 0.0,
                "uptime_s": round(now - self._started, 1),
                "busy_share": round(sum(x["busy_share"] for x in slots) / len(slots), 4),
                "counts": dict(self.counts), "slots": slots,
            }

    def close(self) -> None:
        with self._lock:
            self._closed = True
            left = list(self._pending)
            self._pending.clear()
            self._lock.notify_all()
        for entry in left:
            self._answer(entry, Reply(entry.job.id, False, error="the service closed before the job ran", kind="lost"))
        if self._build_pool is not None:
            self._build_pool.shutdown(wait=False, cancel_futures=True)
        for thread in self._threads:
            thread.join(timeout=5)
        for state in self._slots:
            try:
                state.slot.close()
            except Exception:  # noqa: BLE001 - closing what may already be gone
                pass

    def __enter__(self) -> "EvalService":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- inside ----------------------------------------------------------------------
    def _waiting(self) -> int:
        return len(self._pending) + self._building

    def _build(self, entry: _Entry) -> None:
        try:
            entry.built = self._builder(entry.job.candidate)
        except Exception:  # noqa: BLE001 - the slot builds again and reports the failure as a result
            entry.built = None
        with self._lock:
            self._building -= 1
            closed = self._closed
            if not closed:
                self._pending.append(entry)
            self._lock.notify_all()
        if closed:
            self._answer(entry, Reply(entry.job.id, False, error="the service closed before the job ran", kind="lost"))

    def _answer(self, entry: _Entry, reply: Reply) -> bool:
        """Set the job's reply unless it has one: every job is answered exactly once."""
        with self._lock:
            if entry.future.done():
                return False
            entry.future.set_result(reply)
            self._finished.append(time.monotonic())
            self.counts["done" if reply.ok else f"failed_{reply.kind}"] += 1
            self._lock.notify_all()
        self.on_reply(entry.job, reply)
        return True

    def _serve(self, index: int) -> None:
        while True:
            with self._lock:
                state = self._slots[index]
                entry = None
                while not self._closed and (entry := self._take(state) if self._pending else None) is None:
                    # Woken at least each second while jobs wait: one passed over here may become this slot's.
                    self._lock.wait(1.0 if self._pending else None)
                if entry is None:
                    return
                state.job, state.since = entry.job.describe(), time.monotonic()
                state.task = entry.job.task.digest if entry.job.task is not None else None
                self._lock.notify_all()  # room in the queue
            entry.attempts += 1
            outcome = self._run_with_timeout(state.slot, entry)
            with self._lock:
                state.busy_s += time.monotonic() - state.since
                state.job = state.task = None
                self._lock.notify_all()  # its task's next job may go now (``one_per_task``)
            if outcome is None:
                continue
            kind, value = outcome
            if kind == "ok" and self._undecided(entry, value):
                if entry.undecided <= self.verdict_retries:
                    self.counts["no_verdict_retried"] += 1
                    entry.avoid = state.slot.name
                    delay = self.verdict_backoff_s * 2 ** (entry.undecided - 1)
                    timer = threading.Timer(delay, self._requeue, args=(entry,))
                    timer.daemon = True
                    timer.start()
                    continue
            if kind == "ok" and entry.evaluations > 1:
                value["attempts"] = entry.evaluations
            if kind == "ok":
                state.done += 1
                self._answer(entry, Reply(entry.job.id, True, result=value, slot=state.slot.name,
                                          attempts=entry.attempts, seconds=round(time.monotonic() - entry.submitted, 3)))
                continue
            if kind == "error":
                self._answer(entry, Reply(entry.job.id, False, error=value, kind="internal", slot=state.slot.name,
                                          attempts=entry.attempts))
                continue
            # The slot is gone (lost) or given up on (timeout): replace it before taking another job.
            state.lost += 1
            self.counts[f"slot_{kind}"] += 1
            if kind == "lost" and entry.attempts <= self.retries:
                self.counts["retried"] += 1
                with self._lock:
                    self._pending.appendleft(entry)
                    self._lock.notify_all()
            else:
                why = (f"no answer within {self.job_timeout_s:.0f} s" if kind == "timeout"
                       else f"its slot died {entry.attempts} time(s): {value}")
                self._answer(entry, Reply(entry.job.id, False, error=why, kind=kind, slot=state.slot.name,
                                          attempts=entry.attempts))
            if not self._replace(index):
                return

    @staticmethod
    def _undecided(entry: _Entry, value: Any) -> bool:
        """Whether an evaluation's result has no verdict for a busy host (counted on the entry)."""
        if entry.job.op not in ("evaluate", "verify") or not isinstance(value, dict):
            return False
        entry.evaluations += 1
        if no_verdict_kind(value.get("status"), value.get("reason")) != BUSY:
            return False
        entry.undecided += 1
        return True

    def _requeue(self, entry: _Entry) -> None:
        """A job whose evaluation had no verdict, back at the front of the queue after its back-off."""
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                entry.requeued = time.monotonic()
                self._pending.appendleft(entry)
                self._lock.notify_all()
        if closed:
            self._answer(entry, Reply(entry.job.id, False, error="the service closed before the job ran", kind="lost"))

    def _take(self, state: _SlotState) -> _Entry | None:
        """The next job for a free slot (lock held): one of a task it served recently, else the first; with
        ``one_per_task``, none of a task another slot is evaluating (None: only such jobs wait)."""
        busy = {s.task for s in self._slots if s.task is not None} if self.one_per_task else set()
        others = len(self._slots) > 1
        free = [(position, entry) for position, entry in itertools.islice(enumerate(self._pending), AFFINITY_SCAN)
                if (entry.job.task is None or entry.job.task.digest not in busy)
                # a job without a verdict here goes to another slot, unless none has taken it for a while
                and not (others and entry.avoid == state.slot.name
                         and time.monotonic() - entry.requeued < AFFINITY_WAIT_S)]
        if not free:
            return None  # only jobs of busy tasks wait (``one_per_task``), or ones this slot had no verdict for
        if state.tasks and time.monotonic() - free[0][1].submitted < AFFINITY_WAIT_S:
            for position, entry in free:
                if entry.job.task is not None and entry.job.task.digest in state.tasks:
                    del self._pending[position]
                    self.counts["affine"] += 1
                    return self._served(state, entry)
        position, entry = free[0]
        del self._pending[position]
        return self._served(state, entry)

    @staticmethod
    def _served(state: _SlotState, entry: _Entry) -> _Entry:
        if entry.job.task is not None:
            state.tasks[entry.job.task.digest] = True
            state.tasks.move_to_end(entry.job.task.digest)
            while len(state.tasks) > AFFINITY_TASKS:
                state.tasks.popitem(last=False)
        return entry

    def _run_with_timeout(self, slot: Slot, entry: _Entry) -> tuple[str, Any] | None:
        box: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                box["value"] = ("ok", slot.run(entry.job, entry.built))
            except SlotLost as exc:
                box["value"] = ("lost", str(exc))
            except Exception as exc:  # noqa: BLE001 - a harness error in the slot is the job's answer
                box["value"] = ("error", f"{type(exc).__name__}: {exc}")
            done.set()

        threading.Thread(target=work, name=f"job-{entry.job.id[:8]}", daemon=True).start()
        if not done.wait(self.job_timeout_s):
            try:
                slot.close()  # ends its processes, so the abandoned call returns too
            except Exception:  # noqa: BLE001
                pass
            return ("timeout", None)
        return box["value"]

    def _replace(self, index: int) -> bool:
        old = self._slots[index].slot
        try:
            old.close()
        except Exception:  # noqa: BLE001 - it is being replaced because it failed
            pass
        last: Exception | None = None
        for attempt in range(3):
            if self._closed:
                return False
            try:
                fresh = self.make_slot(index)
            except Exception as exc:  # noqa: BLE001
                self.counts["slot_start_failed"] += 1
                last = exc
                time.sleep(2.0 * (attempt + 1))
                continue
            with self._lock:
                self._slots[index] = _SlotState(fresh, lost=self._slots[index].lost, done=self._slots[index].done)
            return True
        with self._lock:
            self.counts["slots_gone"] += 1
            alive = self.counts["slots_gone"] < len(self._slots)
            left = list(self._pending) if not alive else []
            if left:
                self._pending.clear()
        for entry in left:
            self._answer(entry, Reply(entry.job.id, False, kind="lost",
                                      error=f"every slot of the service is gone (the last start failed: {last})"))
        return False
