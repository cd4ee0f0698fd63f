"""One channel to a worker process: requests out, replies in, worker trouble mapped to a ``Stop``.

Harness or task trouble in the reference process is an ``error`` (no reward); anything that goes
wrong in the candidate's process is its ``failure`` (reward -1). Both ends of an evaluation, and the
persistent reference processes, speak through this one class.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any, TypeVar

from cuda_agent.sandbox import WorkerCrashed, WorkerForgedReply, WorkerProcess, WorkerTimeout

R = TypeVar("R")

_PREFIX = {"out_of_memory": "out of memory", "rule": "rule broken", "task": "task error"}


class Stop(Exception):
    """Ends an evaluation early with a status, the stage it reached and a reason."""

    def __init__(self, status: str, stage: str, reason: str, traceback: str | None = None, rule: str | None = None,
                 answered: bool = False, detail: str | None = None):
        super().__init__(reason)
        self.status, self.stage, self.reason, self.traceback, self.rule = status, stage, reason, traceback, rule
        self.answered = answered  # the worker itself replied with the error: it still serves requests
        self.detail = reason if detail is None else detail  # the worker's own words (its error, how it died)


@dataclass
class Channel:
    worker: WorkerProcess
    who: str  # "reference" or "candidate"

    @property
    def status(self) -> str:
        return "error" if self.who == "reference" else "failed"

    def ask(self, stage: str, request: Any, timeout_s: float) -> dict[str, Any]:
        """Send ``request`` (a ``protocol`` request, or a message dict) and return the raw reply."""
        self.send(stage, request)
        return self.receive(stage, timeout_s)

    def ask_typed(self, stage: str, request: Any, reply_type: type[R], timeout_s: float) -> R:
        """Send ``request`` and parse its reply as ``reply_type`` (a ``protocol`` reply)."""
        self.send(stage, request)
        return self.receive_typed(stage, reply_type, timeout_s)

    def send(self, stage: str, request: Any) -> None:
        message = request.to_message() if hasattr(request, "to_message") else request
        try:
            self.worker.send(message)
        except WorkerCrashed as exc:
            raise self._crashed(stage, exc) from None

    def receive(self, stage: str, timeout_s: float) -> dict[str, Any]:
        try:
            reply = self.worker.receive(timeout_s)
        except WorkerTimeout as exc:
            raise Stop(self.status, stage, f"{self.who} process: {exc}", detail=str(exc)) from None
        except WorkerCrashed as exc:
            raise self._crashed(stage, exc) from None
        if not reply.get("ok"):
            kind = reply.get("kind", "exception")
            rule = reply.get("rule") if self.who == "candidate" else None
            if kind == "out_of_memory" and self.who == "candidate":
                rule = "memory"
            raise Stop(self.status if kind != "task" else "error", stage,
                       f"{self.who}: {_PREFIX.get(kind, 'exception')}: {reply.get('error')}", reply.get("traceback"),
                       rule=rule, answered=True, detail=str(reply.get("error")))
        return reply

    def _crashed(self, stage: str, exc: WorkerCrashed) -> Stop:
        """The ``Stop`` for a worker that died or forged a reply. The candidate's process killed by ``SIGSYS``
        was ended by the kernel: from its load on, a new thread or process does that (``sandbox.nothreads``;
        a system call of a foreign ABI too, there and in the sandbox's own filter)."""
        if self.who == "candidate" and isinstance(exc, WorkerForgedReply):
            return Stop(self.status, stage, f"{self.who} process {exc}", rule="forged-reply", detail=str(exc))
        proc = getattr(self.worker, "proc", None)
        if self.who == "candidate" and proc is not None and proc.returncode == -signal.SIGSYS:
            return Stop(self.status, stage, "the candidate's code started a thread or process after load, which the "
                        f"kernel refused (seccomp): its process was {exc}", rule="thread", detail=str(exc))
        return Stop(self.status, stage, f"{self.who} process {exc}", detail=str(exc))

    def receive_typed(self, stage: str, reply_type: type[R], timeout_s: float) -> R:
        """The next reply, parsed as ``reply_type``. A reply of the wrong shape is forged (written by
        code under test in the candidate's process: rule ``forged-reply``), or in the reference's
        process a harness error; the process is not one to keep either way."""
        reply = self.receive(stage, timeout_s)
        try:
            return reply_type.from_reply(reply)  # type: ignore[attr-defined]
        except ValueError as exc:
            self.worker.kill()
            raise Stop(self.status, stage, f"{self.who} process sent an ill-formed reply: {exc}",
                       rule="forged-reply" if self.who == "candidate" else None) from None

    def drain(self, timeout_s: float) -> bool:
        """Read the replies of requests still unanswered (an evaluation that stopped early leaves
        some); whether the worker is left answering nothing, ready for the next request."""
        while self.worker.pending and self.worker.proc.poll() is None:
            try:
                self.receive("drain", timeout_s)
            except Stop as stop:
                if not stop.answered:
                    return False  # timed out, crashed or forged: not a process to keep
        return self.worker.proc.poll() is None
