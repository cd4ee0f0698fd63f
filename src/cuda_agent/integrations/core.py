"""The episode core every RL-stack adapter stands on: tasks as dataset rows, the single-turn reward, and a
tool-at-a-time agentic episode with its evaluator. Nothing here imports an RL library.

    task_columns / task_from_row  a task as flat dataset columns (TRL, verifiers) and back; verl's rows carry
                                  the same fields in ``extra_info`` (``train.verl.data``)
    score_completion              one single-turn reply scored for its task (``train.single_turn.score_reply``
                                  with an evaluator lent for the call): TRL's, verl's, verifiers' and OpenEnv's
                                  single-turn rewards all come from it
    score_completions             the single-turn reward of many replies at once, each with its task,
                                  ``workers`` evaluations at a time
    ToolEpisode                   one agentic episode driven from outside: ``agent.session.EpisodeSession``
                                  (the workspace, tools and closing evaluation ``run_episode`` uses) with an
                                  evaluator lent for its lifetime and a scratch folder it removes

Evaluators come from ``train.verl.evaluators.lend_evaluator``: an ``EvaluatorLike`` given by the caller, else
the evaluation service (``service=URL`` or ``$CUDA_AGENT_SERVICE``), else local evaluators lent one per
caller at a time, sharing one timing lock. So every adapter can send its evaluations to one GPU pool.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from cuda_agent.agent.session import AgentConfig, EpisodeSession, SessionOutcome
from cuda_agent.evaluate.result import no_reward_reason
from cuda_agent.tasks import Task, TaskError, load_tasks
from cuda_agent.candidates.triton import check_language
from cuda_agent.train.single_turn import FAILURE_REWARD, SingleTurnOutcome, score_reply, single_turn_messages
from cuda_agent.train.verl.evaluators import lend_evaluator

__all__ = ["FAILURE_REWARD", "TASK_COLUMNS", "EvaluatorOptions", "ToolEpisode", "completion_text", "load_task_rows",
           "row_language",
           "score_completion", "score_completions", "score_outcomes", "single_turn_messages", "task_columns", "task_from_row"]

TASK_COLUMNS = ("name", "code", "source", "level", "problem_id")  # the columns a row carries its task in


def task_columns(task: Task) -> dict[str, Any]:
    """The task as flat columns of a dataset row (``task_from_row`` reads them back)."""
    return {"name": task.name, "code": task.code, "source": task.source, "level": task.level,
            "problem_id": task.problem_id}


def task_from_row(row: Mapping[str, Any]) -> Task:
    """The task a row's columns carry: ``name`` and ``code`` at least (``extra_info`` too, verl's shape)."""
    if not row.get("code") and isinstance(row.get("extra_info"), Mapping):
        row = row["extra_info"]
    if not row.get("code") or not row.get("name"):
        raise TaskError("the row carries no task: it needs the task's name and code columns "
                        "(write the dataset with cuda_agent.integrations' converters)")

    def optional_int(value: Any) -> int | None:
        return None if value is None else int(value)

    return Task(name=str(row["name"]), code=str(row["code"]), source=str(row.get("source") or row["name"]),
                level=optional_int(row.get("level")), problem_id=optional_int(row.get("problem_id")))


def load_task_rows(source: str | Path, levels: Iterable[int] | None = None,
                   language: str | None = None) -> list[dict[str, Any]]:
    """Every task of ``source`` (a task file, a folder of them, a KernelBench tree, JSONL/parquet, a hub
    dataset: ``tasks.load_tasks``) as rows: the single-turn ``prompt`` (chat messages) asking for kernels in
    ``language`` (None: the language a synthesised task names, else cuda), the task columns and ``language``
    (which the rewards read back: ``row_language``)."""
    rows = []
    for task in load_tasks(source, levels):
        wanted = language or row_language(task.metadata)
        rows.append({"prompt": single_turn_messages(task, wanted), **task_columns(task), "language": wanted})
    return rows


def row_language(row: Mapping[str, Any]) -> str:
    """The kernel language a row asks for (``cuda`` where it says none); an unknown one is an error naming it."""
    language = row.get("language") or "cuda"
    check_language(language)
    return language


@dataclass(frozen=True)
class EvaluatorOptions:
    """Where evaluations go: ``evaluator`` (an ``EvaluatorLike`` safe to share), else ``service`` (a URL, or
    ``$CUDA_AGENT_SERVICE``), else local evaluators with ``device``, ``policy`` and ``sandbox``."""

    service: str | None = None
    device: str = "auto"
    policy: str = "fair"
    sandbox: str = "auto"
    evaluator: Any = None

    def lend(self):
        return lend_evaluator(self.service, device=self.device, policy=self.policy, sandbox=self.sandbox,
                              evaluator=self.evaluator)


def completion_text(completion: Any) -> str:
    """A completion as text: a string (standard format) or chat messages (conversational format: the
    assistant's contents joined)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return str(completion.get("content") or "")
    return "\n".join(str(m.get("content") or "") for m in completion if m.get("role", "assistant") == "assistant")


def score_completion(task: Task, completion: Any, options: EvaluatorOptions,
                     language: str | None = None) -> SingleTurnOutcome:
    """One single-turn reply (text or chat messages) scored for ``task``: parsed into a candidate and evaluated
    (``score_reply``) by an evaluator lent for the call, in a scratch folder removed afterwards. Its ``reward``
    is the failure reward when the reply writes no usable candidate, None when the evaluation has no verdict."""
    with options.lend() as evaluator, tempfile.TemporaryDirectory(prefix="cuda-agent-reply-") as where:
        return score_reply(task, completion_text(completion), evaluator, Path(where), language)


def score_completions(tasks: Sequence[Task], completions: Sequence[Any], options: EvaluatorOptions,
                      workers: int = 4, languages: Sequence[str | None] | None = None) -> list[float | None]:
    """The single-turn reward of each completion for its task (the failure reward when it writes no usable
    candidate, None without a verdict), ``workers`` at a time: builds and checks overlap; timed regions never
    do (one timing lock, or the service's scheduling)."""
    return [outcome.reward for outcome in score_outcomes(tasks, completions, options, workers, languages)]


def score_outcomes(tasks: Sequence[Task], completions: Sequence[Any], options: EvaluatorOptions,
                   workers: int = 4, languages: Sequence[str | None] | None = None) -> list[SingleTurnOutcome]:
    """``score_completions`` with each outcome whole: its reward and the reason (a no-verdict's among them).
    ``languages``: the kernel language each completion was asked for (None: read from the reply)."""
    if len(tasks) != len(completions):
        raise ValueError(f"{len(tasks)} tasks for {len(completions)} completions")
    asked = list(languages) if languages is not None else [None] * len(tasks)

    def one(item: tuple[Task, Any, str | None]) -> SingleTurnOutcome:
        return score_completion(item[0], item[1], options, item[2])

    if options.evaluator is not None and not _shareable(options.evaluator):
        workers = 1  # a local Evaluator keeps per-evaluation processes: one caller at a time
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(tasks)))) as pool:
        return list(pool.map(one, zip(tasks, completions, asked)))


def _shareable(evaluator: Any) -> bool:
    """Whether threads may call ``evaluator`` at once: the service's client may (each call is its own request)."""
    from cuda_agent.service import RemoteEvaluator

    return isinstance(evaluator, RemoteEvaluator)


@dataclass
class ToolEpisode:
    """One agentic episode a tool call at a time, for stacks that own the loop (OpenEnv, verifiers, TRL's
    environments). ``open`` makes the workspace; ``call`` runs a tool and returns its text (errors are text
    too, as our loop sends them); ``finish`` closes the tools and evaluates: its ``reward`` is the one
    ``run_episode`` gives for the same tool calls. ``close`` removes the scratch folder (after ``finish``,
    or to abandon the episode)."""

    task: Task
    options: EvaluatorOptions = field(default_factory=EvaluatorOptions)
    config: AgentConfig = field(default_factory=AgentConfig)
    workdir: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    session: EpisodeSession | None = None
    outcome: SessionOutcome | None = None

    def open(self) -> list[dict[str, Any]]:
        """Make the workspace; returns the opening messages (system prompt, SKILL.md and the task)."""
        if self.session is not None:
            raise RuntimeError("the episode is open already")
        self._stack = ExitStack()
        try:
            self.folder = Path(tempfile.mkdtemp(prefix="cuda-agent-episode-", dir=self.workdir))
            self._stack.callback(shutil.rmtree, self.folder, ignore_errors=True)
            # The evaluator is held for the whole episode: its command server evaluates with it.
            evaluator = self._stack.enter_context(self.options.lend())
            self.session = self._stack.enter_context(EpisodeSession(
                self.task, evaluator, self.folder, config=self.config, sandbox=self.options.sandbox))
        except BaseException:
            self._stack.close()
            raise
        return [dict(m) for m in self.session.messages]

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tools' schemas, OpenAI function format."""
        return self._open().tools

    def _open(self) -> EpisodeSession:
        if self.session is None:
            raise RuntimeError("the episode is not open: call open() first")
        return self.session

    def call(self, name: str, arguments: str | Mapping[str, Any] | None = None) -> str:
        """Run one tool call; its result as the model would see it."""
        session = self._open()
        session.turn = len(self.calls)
        result = session.call(name, arguments if isinstance(arguments, str) else dict(arguments or {}))
        text = arguments if isinstance(arguments, str) else json.dumps(arguments or {})
        self.calls.append({"name": name, "arguments": text, "error": result.error})
        return result.content

    def finish(self) -> SessionOutcome:
        """Close the tools and evaluate the workspace (once)."""
        if self.outcome is None:
            self.outcome = self._open().finish(turn=len(self.calls))
        return self.outcome

    @property
    def reward(self) -> float | None:
        """The episode's reward: the final evaluation's (the failure reward for a workspace that does not load);
        None where that evaluation has no verdict (``reason`` says why)."""
        final = self.finish().final
        if final.get("status") == "error":
            return None
        reward = final.get("reward")
        return FAILURE_REWARD if reward is None else float(reward)

    @property
    def no_verdict(self) -> bool:
        return self.reward is None

    @property
    def reason(self) -> str:
        """Why the episode earned what it did: the final evaluation's status, or why it has no reward."""
        final = self.finish().final
        if final.get("status") == "error":
            return no_reward_reason(final)
        return str(final.get("status")) + (f" ({final['rule']})" if final.get("rule") else "")

    def close(self) -> None:
        stack = getattr(self, "_stack", None)
        if stack is not None:
            stack.close()

    def __enter__(self) -> "ToolEpisode":
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
