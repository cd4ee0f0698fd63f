"""One episode's environment, driven a tool call at a time: the workspace, its tools, the command server and
the closing evaluation, with no model in it.

``agent.loop.run_episode`` drives a session with a chat backend (the ReAct loop); the RL-stack adapters
(``cuda_agent.integrations``: TRL, OpenEnv, verifiers) drive the same session from their own loops. Both
get the same prompt, the same tools and the same reward for the same tool calls, because there is only this
one::

    session = EpisodeSession(task, evaluator, workdir)
    session.messages            # system prompt, then SKILL.md and the task
    session.tools               # the tools' JSON schemas (OpenAI function format)
    session.call("bash", {"command": "python utils/verify.py"})   # -> ToolResult
    outcome = session.finish()  # the shell is closed, then a fresh trusted evaluation of the workspace
    outcome.reward
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cuda_agent.agent.commands import CommandServer, Evaluation, better, candidate_files
from cuda_agent.agent.tools import Toolbox
from cuda_agent.agent.tools.registry import ToolResult
from cuda_agent.agent.workspace import SOCKET_ENV, Workspace, create_workspace, workspace_candidate
from cuda_agent.candidates import CandidateError
from cuda_agent.evaluate.interface import EvaluatorLike
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.tasks.task import Task

SYSTEM_PROMPT = """You are an expert CUDA performance engineer. You work alone in a sandboxed workspace \
through the tools you are given. Your goal: a ModelNew that is correct and faster than torch.compile, \
following SKILL.md exactly. Act, check the result of every action, and keep going until the goal is met; \
then reply with a short summary and no tool call."""

TRITON_SYSTEM_PROMPT = """You are an expert GPU performance engineer who writes Triton kernels. You work alone in a \
sandboxed workspace through the tools you are given. Your goal: a ModelNew whose forward launches your own \
@triton.jit kernels, correct and faster than torch.compile, following SKILL.md exactly. Act, check the result \
of every action, and keep going until the goal is met; then reply with a short summary and no tool call."""


@dataclass
class AgentConfig:
    max_turns: int = 150  # the paper: 150 in training, 200 for evaluation
    context_tokens: int = 128_000
    wall_clock_s: float | None = None
    command_timeout_s: float = 300.0
    max_output_chars: int = 20_000
    # utils/profile.py ends with the hardware counters of a correct candidate (GPU only; about 10 s more
    # per profile, docs/COUNTERS.md)
    counters: bool = True
    language: str = "cuda"  # the kernels' language: "cuda" (C++/CUDA extension) or "triton" (agent.workspace)


@dataclass
class SessionOutcome:
    """How a session ended: the final evaluation (its ``reward`` is the episode's) and the best correct
    solution evaluated on the way (the paper's evaluation takes the best of a trajectory)."""

    final: dict[str, Any]
    files: dict[str, str] | None  # the final workspace's files (None: it did not load as a candidate)
    best: Evaluation | None

    @property
    def reward(self) -> float | None:
        return self.final.get("reward")

    @property
    def best_reward(self) -> float | None:
        return self.best.result.get("reward") if self.best else None


def first_messages(task: Task, workspace: Workspace) -> list[dict[str, Any]]:
    """The episode's opening: the system prompt, then SKILL.md and the task."""
    skill = (workspace.root / "SKILL.md").read_text()
    return [
        {"role": "system", "content": TRITON_SYSTEM_PROMPT if workspace.language == "triton" else SYSTEM_PROMPT},
        {"role": "user", "content": f"{skill}\n\n# The task: model.py\n\n```python\n{task.code}\n```\n\n"
                                    f"The workspace is your current directory: {workspace.root}"},
    ]


class EpisodeSession:
    """A fresh workspace under ``workdir`` for ``task``, its command server and toolbox. ``turn`` is the
    turn the next evaluations are recorded under (the driver sets it). Use as a context manager, or call
    ``finish`` (then nothing is left open) or ``close``."""

    def __init__(self, task: Task, evaluator: EvaluatorLike, workdir: Path, *, config: AgentConfig | None = None,
                 sandbox: Any = "auto", on_evaluation: Callable[[Evaluation], None] | None = None):
        self.task, self.evaluator = task, evaluator
        self.config = config or AgentConfig()
        self.workspace = create_workspace(Path(workdir) / "workspace", task, evaluator.policy, evaluator.device,
                                          self.config.language)
        self.messages = first_messages(task, self.workspace)
        self.outcome: SessionOutcome | None = None
        self._stack = contextlib.ExitStack()
        try:
            self.server = self._stack.enter_context(CommandServer(
                self.workspace.root, task, evaluator, on_evaluation=on_evaluation, counters=self.config.counters,
                language=self.workspace.language))
            # Only what the commands need: the toolbox's own minimal environment keeps API keys out of the shell.
            env = {SOCKET_ENV: str(self.server.socket_path)}
            self.toolbox = self._stack.enter_context(Toolbox(
                self.workspace.root, protected=self.workspace.protected, sandbox=sandbox,
                gpu=evaluator.device == "cuda", env=env, readable=[self.server.directory],
                command_timeout_s=self.config.command_timeout_s, max_output_chars=self.config.max_output_chars))
        except BaseException:
            self._stack.close()
            raise
        self.tools: list[dict[str, Any]] = self.toolbox.schemas()

    @property
    def turn(self) -> int:
        return self.server.turn

    @turn.setter
    def turn(self, value: int) -> None:
        self.server.turn = value

    def call(self, name: str, arguments: str | dict[str, Any]) -> ToolResult:
        """One tool call; a bad call is an error result, never an exception (``Toolbox.call``)."""
        if self.outcome is not None:
            raise RuntimeError("the episode is finished: its tools are closed")
        return self.toolbox.call(name, arguments)

    def finish(self, turn: int | None = None) -> SessionOutcome:
        """Close the tools, then evaluate the workspace as the agent left it (once; later calls return the same).
        ``turn``: the closing evaluation's turn in the trajectory (default: the one after ``turn``)."""
        if self.outcome is not None:
            return self.outcome
        best = self.server.best
        # After the shell and its background jobs are gone: nothing may run beside the final timing.
        self._stack.close()
        final, files = final_evaluation(self.task, self.evaluator, self.workspace.root, self.workspace.language)
        if files is not None:
            closing = Evaluation("final", self.turn + 1 if turn is None else turn, 0.0, final, files)
            if better(best, closing):
                best = closing
        self.outcome = SessionOutcome(final, files, best)
        return self.outcome

    def close(self) -> None:
        """Close the tools without the final evaluation (an abandoned episode)."""
        self._stack.close()

    def __enter__(self) -> "EpisodeSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def final_evaluation(task: Task, evaluator: EvaluatorLike, root: Path,
                     language: str = "cuda") -> tuple[dict[str, Any], dict[str, str] | None]:
    """A fresh trusted evaluation of the workspace as the agent left it (and its files)."""
    try:
        candidate = workspace_candidate(root, language)
    except CandidateError as exc:
        result = EvalResult.unloadable(task.to_dict(), str(root), evaluator.device, evaluator.policy.to_dict(),
                                       evaluator.timing.to_dict(), str(exc))
        return result.to_dict(), None
    return evaluator.evaluate(task, candidate).to_dict(), candidate_files(candidate)
