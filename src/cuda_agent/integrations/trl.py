"""TRL (``trl``, its ``GRPOTrainer``): the kernel reward for single-turn GRPO, and the agentic episode as a TRL
environment for multi-turn GRPO. Checked against trl 1.16.0 (docs/INTEGRATIONS.md).

    tasks_to_dataset    tasks (a file, a folder, KernelBench, JSONL/parquet, a hub dataset) as a ``datasets``
                        dataset: ``prompt`` (conversational) and the task columns, which TRL passes to reward
                        functions and to an environment's ``reset`` as keyword arguments (``cuda-agent export
                        --format trl`` writes it to disk, with the reward's settings in ``reward_settings``)
    kernel_reward       the reward *function* ``trl grpo --reward_funcs cuda_agent.integrations.trl.kernel_reward``
                        loads as it is: configured from the environment (``CUDA_AGENT_SERVICE``,
                        ``CUDA_AGENT_REWARD_*``) over the dataset's ``reward_settings`` column; a ``KernelReward``
                        per setting, made on first use
    KernelReward        a reward function: ``(prompts, completions, **columns) -> rewards``; each completion
                        parsed into a candidate and evaluated for the task of its row (local evaluators, or the
                        service), ``workers`` at a time; ``None`` for a sample whose evaluation has no verdict
                        (TRL leaves a sample every reward function gave None out of the group's baseline, with
                        advantage 0), the reason logged
    KernelEnvironment   for ``GRPOTrainer(environment_factory=KernelEnvironment.factory(...))``, TRL's documented
                        path for multi-turn tool episodes: ``reset(**row)`` opens the task's workspace and returns
                        SKILL.md and the task (appended to the prompt's user message), our tools are its methods,
                        ``get_reward()`` closes the tools and evaluates (the reward ``run_episode`` gives); the
                        first ``get_reward`` of a batch starts the closing evaluations of every sibling instance at
                        once, so a batch's rollouts are evaluated concurrently (through the service, or local
                        evaluators sharing one timing lock)

From TRL's command line (a dataset written by ``cuda-agent export``)::

    cuda-agent export examples/ --format trl --out data/
    CUDA_AGENT_SERVICE=http://HOST:PORT trl grpo --model_name_or_path MODEL --dataset_name data/ \
        --reward_funcs cuda_agent.integrations.trl.kernel_reward

Single-turn::

    trainer = GRPOTrainer(model=..., reward_funcs=KernelReward(service="http://HOST:PORT"),
                          train_dataset=tasks_to_dataset("examples/"), args=GRPOConfig(...))

Multi-turn::

    trainer = GRPOTrainer(model=..., environment_factory=KernelEnvironment.factory(service=...),
                          train_dataset=tasks_to_dataset("examples/", multi_turn=True), args=GRPOConfig(...))
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Sequence

try:
    import datasets
except ImportError as exc:  # pragma: no cover - the message is the point
    from cuda_agent.paths import install_hint
    raise ImportError(f"the TRL adapter needs trl and datasets ({exc}): {install_hint('trl')}") from exc

from cuda_agent.agent.session import SYSTEM_PROMPT, TRITON_SYSTEM_PROMPT, AgentConfig
from cuda_agent.integrations.core import (FAILURE_REWARD, TASK_COLUMNS, EvaluatorOptions, ToolEpisode, load_task_rows,
                                          row_language, score_outcomes, shareable, task_from_row)
from cuda_agent.integrations.tool_functions import tool_function, tool_schemas
from cuda_agent.train.evaluators import options_from_settings

log = logging.getLogger(__name__)
WORKERS_ENV = "CUDA_AGENT_REWARD_WORKERS"  # evaluations at once per reward call (default 4)


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
                 sandbox: str = "auto", evaluator: Any = None, workers: int = 4, time_compile: bool = True):
        self.options = EvaluatorOptions(service, device, policy, sandbox, evaluator, time_compile)
        self.workers = workers
        self.no_verdict = 0  # samples given no reward so far
        self.reasons: list[str] = []  # why, the latest last (the last 100)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float | None]:
        keys = [k for k in (*TASK_COLUMNS, "extra_info") if k in columns]
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


_rewards: dict[tuple, KernelReward] = {}
_rewards_lock = threading.Lock()


def kernel_reward(prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float | None]:
    """TRL's reward function, by dotted path: ``trl grpo --reward_funcs cuda_agent.integrations.trl.kernel_reward``.
    Each completion is evaluated for its row's task (the failure reward, -1, for a reply without a usable
    candidate; ``None``, TRL's "not scored", where the evaluation has no verdict). Where evaluations go comes from
    the environment (``CUDA_AGENT_SERVICE``, ``CUDA_AGENT_REWARD_DEVICE|POLICY|SANDBOX|TIME_COMPILE``), else from the
    row's ``reward_settings`` column (``cuda-agent export`` writes it), else the defaults (local evaluators, the
    fair policy); ``CUDA_AGENT_REWARD_WORKERS`` evaluations at a time."""
    settings = columns.get("reward_settings") or [None] * len(completions)
    rewards: list[float | None] = [None] * len(completions)
    groups: dict[EvaluatorOptions, list[int]] = {}
    for i, row_settings in enumerate(settings):
        groups.setdefault(options_from_settings(row_settings), []).append(i)
    for options, rows in groups.items():
        reward = _reward_for(options)
        part = {k: [v[i] for i in rows] for k, v in columns.items() if isinstance(v, (list, tuple))
                and len(v) == len(completions)}
        for i, value in zip(rows, reward([prompts[i] for i in rows], [completions[i] for i in rows], **part)):
            rewards[i] = value
    return rewards


def _reward_for(options: EvaluatorOptions) -> KernelReward:
    """The process's ``KernelReward`` for ``options`` (its counts of no-verdicts live across calls)."""
    text = os.environ.get(WORKERS_ENV) or "4"
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{WORKERS_ENV}={text!r} is not a count of evaluations: set it to 1 or more")
    workers = int(text)
    with _rewards_lock:
        key = (options, workers)
        if key not in _rewards:
            _rewards[key] = KernelReward(service=options.service, device=options.device, policy=options.policy,
                                         sandbox=options.sandbox, workers=workers, time_compile=options.time_compile)
        return _rewards[key]


class _Siblings:
    """The instances one ``environment_factory`` made: TRL asks each for its reward in turn, so the first ask starts
    every open episode's closing evaluation at once (``workers`` at a time) and the later asks find theirs under way."""

    def __init__(self, workers: int):
        self.members: "weakref.WeakSet[KernelEnvironment]" = weakref.WeakSet()
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="cuda-agent-reward")
        self.lock = threading.Lock()

    def finish_all(self) -> None:
        with self.lock:
            for member in list(self.members):
                episode = member.episode
                # A caller's own local Evaluator serves one evaluation at a time: its episodes close in turn.
                concurrent = member.options.evaluator is None or shareable(member.options.evaluator)
                if concurrent and episode is not None and episode.outcome is None and member._closing is None:
                    member._closing = self.pool.submit(episode.finish)


class KernelEnvironment:
    """One agentic episode per rollout, for TRL's ``environment_factory``. TRL makes instances once and reuses
    them (``reset`` between rollouts); it lists an environment's tools from its class's public methods, so the
    tools are set on the class from their schemas (``tool_functions``) when this module is imported."""

    def __init__(self, *, service: str | None = None, device: str = "auto", policy: str = "fair",
                 sandbox: str = "auto", evaluator: Any = None, max_output_chars: int = 20_000,
                 command_timeout_s: float = 300.0, workdir: str | None = None, time_compile: bool = True,
                 siblings: _Siblings | None = None):
        self.options = EvaluatorOptions(service, device, policy, sandbox, evaluator, time_compile)
        self.config = AgentConfig(max_output_chars=max_output_chars, command_timeout_s=command_timeout_s)
        self.workdir = workdir
        self.episode: ToolEpisode | None = None
        self._closing: Future | None = None
        self.siblings = siblings or _Siblings(1)
        self.siblings.members.add(self)

    @classmethod
    def factory(cls, *, workers: int = 8, **options: Any):
        """The ``environment_factory`` TRL calls (no arguments) for each instance it needs; the instances it makes
        are evaluated ``workers`` at a time at the end of a batch."""
        siblings = _Siblings(workers)
        return lambda: cls(siblings=siblings, **options)

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
        self.siblings.finish_all()
        if self._closing is not None:
            self._closing.result()  # the closing evaluation's errors surface here, as a synchronous finish's would
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
        if self._closing is not None:
            self._closing.result()
            self._closing = None
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
