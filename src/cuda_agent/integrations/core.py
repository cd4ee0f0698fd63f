"""The episode core every RL-stack adapter stands on: tasks as dataset rows, the single-turn reward, and a
tool-at-a-time agentic episode with its evaluator. Nothing here imports an RL library.

    task_columns / task_from_row  a task as flat dataset columns and back (``tasks.rows``: verl's rows carry the
                                  same columns in ``extra_info``, read by the same function)
    score_completion              one single-turn reply scored for its task (``train.single_turn``): TRL's,
                                  verl's, verifiers' and OpenEnv's single-turn rewards all come from it
    score_completions             the single-turn reward of many replies at once, each with its task,
                                  ``workers`` evaluations at a time
    ToolEpisode                   one agentic episode driven from outside: ``agent.session.EpisodeSession``
                                  (the workspace, tools and closing evaluation ``run_episode`` uses) with an
                                  evaluator lent for its lifetime and a scratch folder it removes; each tool
                                  call's feedback (the evaluations it asked for) beside its text

Evaluators come from ``train.evaluators`` (``EvaluatorOptions.lend``): an ``EvaluatorLike`` given by the caller,
else the evaluation service (``service=URL`` or ``$CUDA_AGENT_SERVICE``), else local evaluators lent one per
caller at a time, sharing one timing lock. So every adapter can send its evaluations to one GPU pool. The
pieces verl's reward and data share with these adapters live below both (``tasks.rows``, ``train.single_turn``,
``train.evaluators``), so nothing is written twice and ``train`` never imports ``integrations``.
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

from cuda_agent.agent.commands import Evaluation
from cuda_agent.agent.session import AgentConfig, EpisodeSession, SessionOutcome
from cuda_agent.evaluate.result import no_reward_reason
from cuda_agent.tasks import Task, load_tasks
from cuda_agent.tasks.rows import TASK_COLUMNS, row_language, task_columns, task_from_row
from cuda_agent.train.evaluators import EvaluatorOptions
from cuda_agent.train.single_turn import (FAILURE_REWARD, SingleTurnOutcome, completion_text, score_completion,
                                          single_turn_messages)

__all__ = ["FAILURE_REWARD", "TASK_COLUMNS", "EvaluatorOptions", "ToolEpisode", "completion_text", "feedback",
           "load_task_rows", "rollout_metrics", "row_language", "score_completion", "score_completions",
           "score_outcomes", "shareable", "single_turn_messages", "task_columns", "task_from_row"]


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


def score_completions(tasks: Sequence[Task], completions: Sequence[Any], options: EvaluatorOptions,
                      workers: int = 4, languages: Sequence[str | None] | None = None) -> list[float | None]:
    """The single-turn reward of each completion for its task (the failure reward when it writes no usable
    candidate, None without a verdict), ``workers`` at a time: builds and checks overlap; timed regions never
    do (one timing lock, or the service's scheduling)."""
    return [outcome.reward for outcome in score_outcomes(tasks, completions, options, workers, languages)]


def score_outcomes(tasks: Sequence[Task], completions: Sequence[Any], options: EvaluatorOptions,
                   workers: int = 4, languages: Sequence[str | None] | None = None) -> list[SingleTurnOutcome]:
    """``score_completions`` with each outcome whole: its reward and the reason (a no-verdict's among them). The
    same reply to the same task is evaluated once and shares its outcome (a group of samples often repeats one).
    ``languages``: the kernel language each completion was asked for (None: read from the reply)."""
    if len(tasks) != len(completions):
        raise ValueError(f"{len(tasks)} tasks for {len(completions)} completions")
    asked = list(languages) if languages is not None else [None] * len(tasks)
    keys = [(task.digest, completion_text(completion), language)
            for task, completion, language in zip(tasks, completions, asked)]
    first = {key: (task, completion, language)
             for key, task, completion, language in reversed(list(zip(keys, tasks, completions, asked)))}

    def one(item: tuple[Task, Any, str | None]) -> SingleTurnOutcome:
        return score_completion(item[0], item[1], options, item[2])

    if options.evaluator is not None and not shareable(options.evaluator):
        workers = 1  # a local Evaluator keeps per-evaluation processes: one caller at a time
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(first)))) as pool:
        outcomes = dict(zip(first, pool.map(one, first.values())))
    return [outcomes[key] for key in keys]


def shareable(evaluator: Any) -> bool:
    """Whether threads may call ``evaluator`` at once: the service's client may (each call is its own request), and
    any evaluator that says so (``shareable = True``)."""
    from cuda_agent.service import RemoteEvaluator

    return isinstance(evaluator, RemoteEvaluator) or getattr(evaluator, "shareable", False) is True


FEEDBACK_KEYS = ("status", "stage", "reward", "speedup_eager", "speedup_compile", "rule", "reason")


def feedback(evaluation: Evaluation) -> dict[str, Any]:
    """One evaluation a tool call asked for (``utils/compile.py``, ``verify.py``, ``profile.py`` in the workspace), in
    brief: which command, the status and stage it reached (a compile error's reason among them), the speedups and
    reward where it timed, the rule a rejected candidate broke, and the no-verdict reason where it could not decide.
    The agent read the same result as the command's text; this is it as data, for a trainer's per-turn signal."""
    result = evaluation.result
    brief = {"command": evaluation.command, "turn": evaluation.turn,
             **{k: result[k] for k in FEEDBACK_KEYS if result.get(k) is not None}}
    if result.get("status") == "error":
        brief["no_verdict"], brief["reason"] = True, no_reward_reason(result)
    if result.get("counters"):
        brief["profile"] = result["counters"]
    return brief


FAST_P = (0, 1, 2)  # KernelBench's fast_p thresholds reported per rollout


def rollout_metrics(final: Mapping[str, Any] | None) -> dict[str, float]:
    """One rollout's metrics from its closing evaluation (``EvalResult.to_dict()``; None where no candidate was
    evaluated), every one a number so that a trainer can average them: ``correct``; ``fast_0``/``fast_1``/``fast_2``
    (KernelBench's fast_p for this one task: correct with a speedup over eager above p); ``speedup_eager`` and
    ``speedup_compile`` (0 where not correct or not timed); the milestone reward's parts ``beats_eager`` and
    ``beats_compile`` (the evaluator's decision: -1 + 2 correct + beats_eager + beats_compile); ``no_verdict``."""
    final = final or {}
    correct = final.get("status") == "correct"
    eager, compiled = final.get("speedup_eager"), final.get("speedup_compile")
    decided = ((final.get("decision") or {}).get("speedups") or {})
    metrics = {"correct": float(correct), "no_verdict": float(final.get("status") == "error"),
               "speedup_eager": float(eager) if correct and eager else 0.0,
               "speedup_compile": float(compiled) if correct and compiled else 0.0,
               "beats_eager": float(correct and bool((decided.get("eager") or {}).get("beats"))),
               "beats_compile": float(correct and bool((decided.get("compile") or {}).get("beats")))}
    metrics.update({f"fast_{p}": float(correct and eager is not None and eager > p) for p in FAST_P})
    return metrics


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
    evaluations: list[Evaluation] = field(default_factory=list)  # every evaluation the tools asked for, in order

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
                self.task, evaluator, self.folder, config=self.config, sandbox=self.options.sandbox,
                on_evaluation=self.evaluations.append))
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
        seen = len(self.evaluations)
        result = session.call(name, arguments if isinstance(arguments, str) else dict(arguments or {}))
        text = arguments if isinstance(arguments, str) else json.dumps(arguments or {})
        self.calls.append({"name": name, "arguments": text, "error": result.error,
                           "feedback": [feedback(e) for e in self.evaluations[seen:]]})
        return result.content

    @property
    def last_feedback(self) -> list[dict[str, Any]]:
        """What the last tool call's evaluations said (``feedback``): empty where it ran none."""
        return self.calls[-1]["feedback"] if self.calls else []

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
