"""RL training: rollouts as typed batches and the PPO pieces, in pure torch.

A client of the rest (agent, evaluate); nothing but the CLI imports it.
"""

from cuda_agent.train.algo import (
    aggregate, explained_variance, gae, masked_mean, masked_whiten, ppo_policy_loss, token_entropy, token_logprobs,
    value_loss,
)
from cuda_agent.train.rollout import Rollout, RolloutBatch, RolloutError, rollouts_from_trace

__all__ = [
    "Rollout",
    "RolloutBatch",
    "RolloutError",
    "aggregate",
    "explained_variance",
    "gae",
    "masked_mean",
    "masked_whiten",
    "ppo_policy_loss",
    "rollouts_from_trace",
    "token_entropy",
    "token_logprobs",
    "value_loss",
]
