"""verl's ``custom_reward_function`` for single-turn rows (the paper's stage 1): the reply's files -> a workspace
candidate -> the evaluator's reward (``single_turn.score_completion``, the single-turn reward of every stack).

In verl's config::

    reward:
      custom_reward_function:
        path: pkg://cuda_agent.train.verl.reward   # verl's load_module imports pkg:// paths by name
        name: compute_score
        reward_kwargs: {service: http://HOST:PORT}   # or CUDA_AGENT_SERVICE; without either, local evaluators

Each setting (``service``, ``device``, ``policy``, ``sandbox``, ``time_compile``) comes from ``reward_kwargs`` where
given, else the environment (``CUDA_AGENT_SERVICE``, ``CUDA_AGENT_REWARD_*``), else the row's
``extra_info.reward_settings`` (``cuda-agent export --format verl`` writes them), else the default.

verl's reward managers call it with keywords (``data_source``, ``solution_str``: the decoded response,
``ground_truth``, ``extra_info``: the row's, holding the task) plus ``reward_kwargs``, from worker threads.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from cuda_agent.tasks.rows import row_language, task_from_row
from cuda_agent.train.evaluators import options_from_settings
from cuda_agent.train.single_turn import score_completion

log = logging.getLogger(__name__)
NO_VERDICT_SCORE = 0.0  # verl needs a number: a no-verdict sample's, between the failure reward and any success


def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None,
                  *, service: str | None = None, device: str | None = None, policy: str | None = None,
                  sandbox: str | None = None, evaluator: Any = None, time_compile: bool | None = None,
                  **kwargs: Any) -> dict[str, float]:
    """``score``: the reward (the failure reward for a reply without a usable candidate); ``acc``: 1.0 when the
    candidate is correct (verl reports ``acc`` per data source); ``no_verdict``: 1.0 where the evaluation had
    no verdict. verl's reward managers write ``score`` into a tensor, so it must be a number: a no-verdict
    sample scores 0.0, neither the failure reward nor a success, and verl logs ``no_verdict`` per data source
    (the reason goes to the log)."""
    task = task_from_row(extra_info)
    given = {"service": service, "device": device, "policy": policy, "sandbox": sandbox, "time_compile": time_compile}
    options = options_from_settings((extra_info or {}).get("reward_settings"))
    options = replace(options, evaluator=evaluator, **{k: v for k, v in given.items() if v is not None})
    outcome = score_completion(task, solution_str, options, row_language(extra_info))
    correct = outcome.evaluation is not None and outcome.evaluation.get("status") == "correct"
    if outcome.no_verdict:
        log.warning("compute_score: no reward for a reply to %s: %s", task.name, outcome.reason)
    # Always every key: verl stacks each key of the reward's extra info across the whole batch.
    return {"score": NO_VERDICT_SCORE if outcome.no_verdict else outcome.reward, "acc": 1.0 if correct else 0.0,
            "no_verdict": 1.0 if outcome.no_verdict else 0.0}
