"""One PPO update from one batch of rollouts: what every stage that trains with rewards runs.

The batch is the mini-batch (the paper: one update per rollout batch). Before the update the trainer
recomputes the logprobs of the sampled tokens itself: the ratio is taken against the trainer's own
numbers, never the sampler's, so a precision mismatch between the two (the paper's collapse) cannot
blow the ratio up; the mismatch is logged (``logprob_mismatch``). Advantages come from GAE over the
critic's values, whitened over the batch's sampled tokens as verl does.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from cuda_agent.train.algo import (
    AGGREGATIONS, explained_variance, gae, masked_mean, masked_whiten, ppo_policy_loss, value_loss,
)
from cuda_agent.train.models import policy_forward, value_forward
from cuda_agent.train.rollout import RolloutBatch


@dataclass(frozen=True)
class PPOConfig:
    """The paper's settings where it states them (GAE gamma 1 / lambda 0.95, clip 0.2 / 0.28, lr 3e-6 actor /
    6e-6 critic); verl's defaults elsewhere (value clip 0.5, gradient norm 1)."""

    gamma: float = 1.0
    lam: float = 0.95
    clip_low: float = 0.2
    clip_high: float = 0.28
    value_clip: float | None = 0.5
    agg: str = "seq-mean-token-mean"
    actor_lr: float = 3e-6
    critic_lr: float = 6e-6
    max_grad_norm: float = 1.0
    whiten_advantages: bool = True
    micro_batch: int = 8  # sequences per forward; gradients accumulate over the batch

    def __post_init__(self) -> None:
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"PPOConfig.agg {self.agg!r}: choose one of {', '.join(AGGREGATIONS)}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError("PPOConfig: clip_low must be in [0, 1) and clip_high >= 0")
        if self.micro_batch < 1:
            raise ValueError("PPOConfig.micro_batch must be at least 1")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _slices(batch_size: int, size: int) -> Iterator[slice]:
    for start in range(0, batch_size, size):
        yield slice(start, min(start + size, batch_size))


def _share(mask: torch.Tensor, part: slice, agg: str) -> float:
    """The weight of a micro-batch's aggregated loss in the whole batch's, so that accumulated gradients
    equal those of one pass over the batch."""
    if agg == "token-mean":
        return float(mask[part].sum() / mask.sum().clamp(min=1))
    has_tokens = mask.sum(-1) > 0
    return float(has_tokens[part].sum() / has_tokens.sum().clamp(min=1))


class PPOTrainer:
    """Actor, critic and their optimisers; ``step(batch)`` is one PPO update and returns its metrics."""

    def __init__(self, actor: Any, critic: Any, config: PPOConfig = PPOConfig()):
        self.actor, self.critic, self.config = actor, critic, config
        # Dropout off in both (eval mode; gradients still flow): with it, the ratio would compare the policy
        # with a different random sub-network of itself, and the critic's head (0.1 in transformers'
        # token classifiers) would add noise to every target.
        actor.eval()
        critic.eval()
        self.actor_optimizer = torch.optim.AdamW(actor.parameters(), lr=config.actor_lr)
        self.critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=config.critic_lr)

    def _score(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The trainer's own logprobs of the sampled tokens and the critic's values, before any update."""
        logprobs, values = [], []
        with torch.no_grad():
            for part in _slices(batch.ids.shape[0], self.config.micro_batch):
                logprobs.append(policy_forward(self.actor, batch.ids[part], batch.attention[part])[0])
                values.append(value_forward(self.critic, batch.ids[part], batch.attention[part]))
        return torch.cat(logprobs), torch.cat(values)

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        config = self.config
        device = next(self.actor.parameters()).device
        batch = batch.to(device)
        mask = batch.mask
        started = time.perf_counter()
        old_logprobs, old_values = self._score(batch)
        advantages, returns = gae(batch.rewards, old_values, mask, config.gamma, config.lam)
        if config.whiten_advantages:
            advantages = masked_whiten(advantages, mask)

        self.actor_optimizer.zero_grad(set_to_none=True)
        policy_total, entropy_total, stats = 0.0, 0.0, []
        for part in _slices(batch.ids.shape[0], config.micro_batch):
            logprobs, entropy = policy_forward(self.actor, batch.ids[part], batch.attention[part])
            loss, part_stats = ppo_policy_loss(logprobs, old_logprobs[part], advantages[part], mask[part],
                                               config.clip_low, config.clip_high, config.agg)
            share = _share(mask, part, config.agg)
            (loss * share).backward()
            policy_total += float(loss.detach()) * share
            entropy_total += float(masked_mean(entropy.detach(), mask[part])) * float(mask[part].sum())
            stats.append((part_stats, float(mask[part].sum())))
        actor_norm = torch.nn.utils.clip_grad_norm_(self.actor.parameters(), config.max_grad_norm)
        self.actor_optimizer.step()

        self.critic_optimizer.zero_grad(set_to_none=True)
        value_total = 0.0
        for part in _slices(batch.ids.shape[0], config.micro_batch):
            values = value_forward(self.critic, batch.ids[part], batch.attention[part])
            loss, _ = value_loss(values, old_values[part], returns[part], mask[part], config.value_clip, "token-mean")
            share = _share(mask, part, "token-mean")
            (loss * share).backward()
            value_total += float(loss.detach()) * share
        critic_norm = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), config.max_grad_norm)
        self.critic_optimizer.step()

        tokens = float(mask.sum())
        sampled = mask.bool()
        rewards = batch.rewards.sum(-1)
        return {
            "reward_mean": float(rewards.mean()),
            "policy_loss": policy_total,
            "value_loss": value_total,
            "entropy": entropy_total / max(tokens, 1.0),
            "approx_kl": sum(s["approx_kl"] * n for s, n in stats) / max(tokens, 1.0),
            "clip_fraction": sum(s["clip_fraction"] * n for s, n in stats) / max(tokens, 1.0),
            "ratio_max": max(s["ratio_max"] for s, _ in stats),
            "explained_variance": explained_variance(old_values, returns, mask),
            "logprob_mismatch": float((old_logprobs - batch.old_logprobs)[sampled].abs().mean()) if sampled.any() else 0.0,
            "actor_grad_norm": float(actor_norm),
            "critic_grad_norm": float(critic_norm),
            "sampled_tokens": tokens,
            "update_seconds": time.perf_counter() - started,
        }
