"""TRL (``trl``, its ``GRPOTrainer``): the kernel reward for single-turn GRPO, and the agentic episode as a TRL
environment for multi-turn GRPO. Checked against trl 1.16.0 (docs/INTEGRATIONS.md).

    tasks_to_dataset    tasks (a file, a folder, KernelBench, JSONL/parquet, a hub dataset) as a ``datasets``
                        dataset: ``prompt`` (conversational) and the task columns, which TRL passes to reward
                        functions and to an environment's ``reset`` as keyword arguments
    KernelReward        a reward function: ``(prompts, completions, **columns) -> rewards``; each completion
                        parsed into a candidate and evaluated for the task of its row (local evaluators, or the
                        service), ``workers`` at a time; ``None`` for a sample whose evaluation has no verdict
                        (TRL leaves a sample every reward function gave None out of the group's baseline, with
                        advantage 0), the reason logged
    KernelEnvironment   for ``GRPOTrainer(environment_factory=KernelEnvironment.factory(...))``, TRL's documented
                        path for multi-turn tool episodes: ``reset(**row)`` opens the task's workspace and returns
                        SKILL.md and the task (appended to the prompt's user message), our tools are its methods,
                        ``get_reward()`` closes the tools and evaluates (the reward ``run_episode`` gives)

Single-turn::

    trainer = GRPOTrainer(model=..., reward_funcs=KernelReward(service="http://HOST:PORT"),
                          train_dataset=tasks_to_dataset("examples/"), args=GRPOConfig(...))

Multi-turn::

    trainer = GRPOTrainer(model=..., environment_factory=KernelEnvironment.factory(service=...),
                          train_dataset=tasks_to_dataset("examples/", multi_turn=True), args=GRPOConfig(...))
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable, Sequence

try:
    import datasets
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(f"the TRL adapter needs trl and datasets ({exc}): pip install 'cuda-agent[trl]'") from exc

from cuda_agent.agent.session import SYSTEM_PROMPT, TRITON_SYSTEM_PROMPT, AgentConfig
import logging

from cuda_agent.integrations.core import (FAILURE_REWARD, EvaluatorOptions, ToolEpisode, load_task_rows,
                                          row_language, score_outcomes, task_from_row)

log = logging.getLogger(__name__)
from cuda_agent.integrations.tool_functions import tool_function, tool_schemas


def tasks_to_dataset(source: str | Path, *, levels: Iterable[int] | None = None,
                     multi_turn: bool = False, language: str | None = None) -> "datasets.Dataset":
    """The tasks of ``source`` as TRL's prompt dataset (conversational format). Single-turn: the prompt asks for
    the whole solution in one reply. ``multi_turn``: the prompt is our system prompt and an empty user message;
    the environment's ``reset`` fills the user message with SKILL.md and the task, as our loop's opens.
    ``language``: the kernels asked for (``cuda`` or ``triton``; None: as each task says, else cuda), a column
    the reward and environment read."""
    rows = load_task_rows(source, levels, language)
    if multi_turn:
        for row in rows:
            system = TRITON_SYSTEM_PROMPT if row["language"] == "triton" else SYSTEM_PROMPT
            row["prompt"] = [{"role": "system", "content": system}, {"role": "user", "content": ""}]
    return datasets.Dataset.from_list(rows)


class KernelReward:
    """TRL's custom reward function: called as ``reward(prompts=..., completions=..., name=[...], code=[...],
    ...)`` with the batch's dataset columns; returns one float per completion (the failure reward, -1, for a
    reply without a usable candidate), or ``None`` for one whose evaluation has no verdict: TRL's convention for
    a sample a reward function does not score. ``no_verdict`` counts them; each reason is logged."""

    __name__ = "kernel_reward"  # TRL logs each reward function under its __name__

    def __init__(self, *, service: str | None = None, device: str = "auto", policy: str = "fair",
                 sandbox: str = "auto", evaluator: Any = None, workers: int = 4):
        self.options = EvaluatorOptions(service, device, policy, sandbox, evaluator)
        self.workers = workers
        self.no_verdict = 0  # samples given no reward so far
        self.reasons: list[str] = []  # why, the latest last (the last 100)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float | None]:
        keys = [k for k in ("name", "code", "source", "level", "problem_id", "extra_info") if k in columns]
        tasks = [task_from_row({k: columns[k][i] for k in keys}) for i in range(len(completions))]
        languages = [row_language({"language": columns["language"][i]}) if "language" in columns else None
                     for i in range(len(completions))]
        outcomes = score_outcomes(tasks, completions, self.options, workers=self.workers, languages=languages)
        for task, outcome in zip(tasks, outcomes):
            if outcome.no_verdict:
                self.no_verdict += 1
                self.reasons = (self.reasons + [f"{task.name}: {outcome.reason}"])[-100:]
                log.warning("kernel_reward: no reward for a completion of %s: %s", task.name, outcome.reason)
        return [outcome.reward for outcome in outcomes]


class KernelEnvironment:
    """One agentic episode per rollout, for TRL's ``environment_factory``. TRL makes instances once and reuses
    them (``reset`` between rollouts); it lists an environment's tools from its class's public methods, so the
    tools are set on the class from their schemas (``tool_functions``) when this module is imported."""

    def __init__(self, *, service: str | None = None, device: str = "auto", policy: str = "fair",
                 sandbox: str = "auto", evaluator: Any = None, max_output_chars: int = 20_000,
                 command_timeout_s: float = 300.0, workdir: str | None = None):
        self.options = EvaluatorOptions(service, device, policy, sandbox, evaluator)
        self.config = AgentConfig(max_output_chars=max_output_chars, command_timeout_s=command_timeout_s)
        self.workdir = workdir
        self.episode: ToolEpisode | None = None

    @classmethod
    def factory(cls, **options: Any):
        """The ``environment_factory`` TRL calls (no arguments) for each instance it needs."""
        return lambda: cls(**options)

    def reset(self, **row: Any) -> str:
        """Start the episode of the row's task (the previous one, if any, is closed): the user message our loop
        opens with (SKILL.md, the task, the workspace)."""
        self._close()
        config = dataclasses.replace(self.config, language=row_language(row))
        self.episode = ToolEpisode(task_from_row(row), self.options, config, self.workdir)
        messages = self.episode.open()
        return messages[-1]["content"]

    def get_reward(self) -> float | None:
        """The episode's reward: the tools are closed and the workspace evaluated (the failure reward, -1, for a
        workspace that does not load or a ModelNew that is not correct; None, TRL's "not scored", where the
        evaluation has no verdict: ``reason`` says why)."""
        if self.episode is None:
            return FAILURE_REWARD
        reward = self.episode.reward
        if reward is None:
            log.warning("KernelEnvironment: no reward for the episode of %s: %s", self.episode.task.name,
                        self.episode.reason)
        return reward

    @property
    def reason(self) -> str | None:
        """Why the last episode earned what it did (a no-verdict's reason among them)."""
        return self.episode.reason if self.episode is not None and self.episode.outcome is not None else None

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        if self.episode is None:
            raise RuntimeError("no episode: TRL calls reset() before the tools")
        return self.episode.call(name, arguments)

    def _close(self) -> None:
        if self.episode is not None:
            self.episode.close()
            self.episode = None

    def __del__(self) -> None:
        # TRL keeps its pooled instances to the end and never closes them: the last episode's shell and
        # scratch folder go with the instance (quietly at interpreter exit, when modules may be gone).
        try:
            self._close()
        except Exception:
            pass


for _schema in tool_schemas():
    setattr(KernelEnvironment, _schema["function"]["name"],
            tool_function(_schema, lambda self, name, arguments: self._call(name, arguments), method=True))
