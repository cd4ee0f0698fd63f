"""The workspace commands' other end: a Unix socket served by the process that owns the evaluator.

``python utils/verify.py`` in the agent's sandboxed shell connects here; the
server snapshots the workspace as a candidate (``load_workspace``), hands it to
the trusted evaluator and answers with a short text. The socket lives outside
the workspace, in a directory the sandbox shows read-only, so the agent can
reach it but not replace it. Every evaluation is recorded (``evaluations``)
and the best correct one is kept with its files (``best``), since the
paper's evaluation takes the best solution of a trajectory.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cuda_agent.evaluate.interface import EvaluatorLike
from cuda_agent.agent.workspace import workspace_candidate
from cuda_agent.candidates import CandidateError
from cuda_agent.candidates.triton import TRITON_COMPILE_NOTE
from cuda_agent.guard import check_candidate
from cuda_agent.candidates.candidate import Candidate
from cuda_agent.evaluate.counters import times_of, unavailable
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.tasks.task import Task

MAX_REQUEST_BYTES = 4096


@dataclass
class Evaluation:
    """One evaluation the agent asked for: when, which command, the result and the files judged."""

    command: str
    turn: int
    seconds: float
    result: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)

    def rank(self) -> tuple[float, float, float]:
        r = self.result
        return (r.get("reward") or -2.0, r.get("speedup_compile") or 0.0, r.get("speedup_eager") or 0.0)


def candidate_files(candidate: Candidate) -> dict[str, str]:
    """The agent's files of a workspace candidate (the fixed ones come from the project)."""
    from cuda_agent.candidates.candidate import FIXED_FILES

    files = {"model_new.py": candidate.model_new}
    for extension in candidate.extensions:
        files.update({k: v for k, v in extension.sources.items() if k not in FIXED_FILES})
    return files


def better(a: Evaluation | None, b: Evaluation) -> bool:
    """Whether ``b`` is a better correct solution than ``a``."""
    return b.result.get("status") == "correct" and (a is None or b.rank() > a.rank())


class CommandServer:
    """Serves compile / verify / profile for one workspace; ``turn`` is set by the loop."""

    def __init__(self, workspace: Path, task: Task, evaluator: EvaluatorLike,
                 on_evaluation: Callable[[Evaluation], None] | None = None, counters: bool = True,
                 language: str = "cuda"):
        self.workspace = Path(workspace)
        self.language = language
        # profile ends with the hardware counters of a correct candidate (GPU; the CPU says it has none)
        self.counters = counters
        self.task = task
        self.evaluator = evaluator
        self.on_evaluation = on_evaluation
        self.turn = 0
        self.evaluations: list[Evaluation] = []
        self.best: Evaluation | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="cuda-agent-cmd-"))
        self.socket_path = self._dir / "commands.sock"
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(str(self.socket_path))
        # The sandbox runs the shell as another user: it must be able to connect.
        os.chmod(self._dir, 0o755)
        os.chmod(self.socket_path, 0o777)
        self._server.listen(4)
        self._lock = threading.Lock()  # one evaluation at a time: timings must not overlap
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def directory(self) -> Path:
        return self._dir

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                line = conn.makefile("rb").readline(MAX_REQUEST_BYTES)
                request = json.loads(line)
            except (ValueError, OSError) as exc:
                text, code = f"bad request: {exc}", 2
            else:
                command = str(request.get("command"))
                try:
                    text, code = self.run(command)
                except Exception as exc:  # noqa: BLE001 - the command in the shell must get an answer, not a closed socket
                    # The evaluator itself failed (the service down or refusing, a harness error): not the
                    # candidate's result, so said as such, with the evaluator's own words.
                    text, code = f"{command}: the evaluator could not answer: {type(exc).__name__}: {exc}", 3
            try:
                conn.sendall(json.dumps({"text": text, "exit_code": code}).encode() + b"\n")
            except OSError:
                pass  # the client went away (a killed command)

    def run(self, command: str) -> tuple[str, int]:
        """The text a command prints and its exit code."""
        if command not in ("compile", "verify", "profile"):
            return f"unknown command {command!r}; use compile, verify or profile", 2
        try:
            candidate = workspace_candidate(self.workspace, self.language)
        except CandidateError as exc:
            return f"{command}: {exc}", 1
        with self._lock:
            if command == "compile" and candidate.language == "triton":
                problems = check_candidate(candidate, self.evaluator.policy.code_policy())
                return ("\n".join(["compile: FAILED (static checks)"] + [f"  {v.describe()}" for v in problems])
                        if problems else f"compile: ok ({TRITON_COMPILE_NOTE})"), 1 if problems else 0
            if command == "compile":
                built = self.evaluator.build(candidate)
                return compile_text(built), 0 if built.ok else 1
            clock = time.monotonic()
            # verify asks only "is it correct": the checks without the timing rounds.
            judge = self.evaluator.verify if command == "verify" else self.evaluator.evaluate
            result = judge(self.task, candidate)
            report = None
            if command == "profile" and self.counters and result.status == "correct":
                try:
                    report = self.evaluator.counters(self.task, candidate, times_of(result))
                except Exception as exc:  # noqa: BLE001 - advice: its failure must not cost the agent its times
                    report = unavailable(f"the profile under Nsight Compute failed: {type(exc).__name__}: {exc}")
                result.counters = report.to_dict()  # into the trajectory, structured
            evaluation = Evaluation(command, self.turn, round(time.monotonic() - clock, 3), result.to_dict(),
                                    candidate_files(candidate))
            self.record(evaluation)
        text = result_text(command, result) + (f"\n{report.text()}" if report is not None else "")
        return text, 0 if result.status == "correct" else 1

    def record(self, evaluation: Evaluation) -> None:
        self.evaluations.append(evaluation)
        if better(self.best, evaluation):
            self.best = evaluation
        if self.on_evaluation:
            self.on_evaluation(evaluation)

    def close(self) -> None:
        try:
            self._server.close()
        finally:
            for path in (self.socket_path, self._dir):
                try:
                    path.unlink() if path.is_socket() else path.rmdir()
                except OSError:
                    pass

    def __enter__(self) -> "CommandServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def compile_text(built: Any) -> str:
    if built.ok:
        return f"compile: ok ({'cached' if built.cached else f'{built.seconds:.1f} s'})"
    lines = ["compile: FAILED"]
    errors = [d for d in built.diagnostics if d.severity == "error"] or built.diagnostics
    for d in errors[:20]:
        where = f"{d.file}:{d.line}" if d.file else "<build>"
        lines.append(f"  {where}: {d.severity}: {d.message}")
    if not built.diagnostics:
        lines.append((built.error or built.log or "")[-3000:])
    return "\n".join(lines)


def result_text(command: str, result: EvalResult) -> str:
    """verify prints correctness only; profile the times, speedups and reward as well."""
    lines = result.summary().splitlines()
    if command == "verify":
        keep = ("status:", "build:", "  ", "check ", "timed output", "note:")
        lines = [line for line in lines if line.startswith(keep)]
        if result.status == "correct":
            lines.append("verify: correct (run utils/profile.py for times)")
    return "\n".join(lines)
