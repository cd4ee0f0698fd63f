"""One PPO update from one batch of rollouts: what every stage that trains with rewards runs.

By default the batch is the mini-batch (the paper: one update per rollout batch); ``mini_batches`` and
``epochs`` split it into several updates, as verl's ``ppo_mini_batch_size`` and ``ppo_epochs`` do.
Before the update the trainer recomputes the logprobs of the sampled tokens itself: the ratio is
taken against the trainer's own numbers, never the sampler's, so a precision mismatch between the two
(the paper's collapse) cannot blow the ratio up; the mismatch is logged (``logprob_mismatch``). Advantages come from GAE over the
critic's values, whitened over the batch's sampled tokens as verl does.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from cuda_agent.train.algo import (
    AGGREGATIONS, explained_variance, gae, masked_mean, masked_whiten, ppo_policy_loss, value_loss,
)
from cuda_agent.train.models import compute_precision, policy_forward, prepare_for_training, value_forward
from cuda_agent.train.rollout import RolloutBatch, row_slices


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
    micro_batch: int = 8  # sequences per forward; gradients accumulate over the mini-batch
    mini_batches: int = 1  # optimiser steps per pass over the batch (the paper: 1, batch = mini-batch)
    epochs: int = 1  # passes over the batch (verl's ppo_epochs)

    def __post_init__(self) -> None:
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"PPOConfig.agg {self.agg!r}: choose one of {', '.join(AGGREGATIONS)}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError("PPOConfig: clip_low must be in [0, 1) and clip_high >= 0")
        for name in ("micro_batch", "mini_batches", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"PPOConfig.{name} must be at least 1")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _share(mask: torch.Tensor, part: slice, agg: str) -> float:
    """The weight of a micro-batch's aggregated loss in the whole batch's, so that accumulated gradients
    equal those of one pass over the batch."""
    if agg == "token-mean":
        return float(mask[part].sum() / mask.sum().clamp(min=1))
    has_tokens = mask.sum(-1) > 0
    return float(has_tokens[part].sum() / has_tokens.sum().clamp(min=1))


class PPOTrainer:
    """Actor, critic and their optimisers; ``step(batch)`` is one PPO update and returns its metrics."""

    def __init__(self, actor: Any, critic: Any, config: PPOConfig = PPOConfig(), *, precision: str = "fp32",
                 logits_chunk: int = 0, gradient_checkpointing: bool = False):
        self.actor, self.critic, self.config = actor, critic, config
        self.precision, self.logits_chunk = precision, logits_chunk
        prepare_for_training(actor, gradient_checkpointing)
        prepare_for_training(critic, gradient_checkpointing)
        self.device = next(actor.parameters()).device
        self.actor_optimizer = torch.optim.AdamW(actor.parameters(), lr=config.actor_lr)
        self.critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=config.critic_lr)

    def _score(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The trainer's own logprobs of the sampled tokens and the critic's values, before any update."""
        logprobs, values = [], []
        with torch.no_grad(), compute_precision(self.precision, self.device):
            for part in row_slices(batch.ids.shape[0], self.config.micro_batch):
                logprobs.append(policy_forward(self.actor, batch.ids[part], batch.attention[part], self.logits_chunk)[0])
                values.append(value_forward(self.critic, batch.ids[part], batch.attention[part]))
        return torch.cat(logprobs), torch.cat(values)

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        config = self.config
        batch = batch.to(self.device)
        self.actor.train()  # the sampler puts it in eval mode; checkpointing needs training mode
        self.critic.train()
        mask = batch.mask
        started = time.perf_counter()
        old_logprobs, old_values = self._score(batch)
        advantages, returns = gae(batch.rewards, old_values, mask, config.gamma, config.lam)
        if config.whiten_advantages:
            advantages = masked_whiten(advantages, mask)

        # Each mini-batch is one optimiser step; the first one's ratio is 1 (the trainer's own logprobs), the
        # later ones' are not, which is where the clip acts.
        batch_size = batch.ids.shape[0]
        rows = -(-batch_size // config.mini_batches)
        policy_sums, value_sums, stats, actor_norms, critic_norms = [], [], [], [], []
        entropy_total = 0.0
        for _ in range(config.epochs):
            for mini in row_slices(batch_size, rows):
                ids, attention, part_mask = batch.ids[mini], batch.attention[mini], mask[mini]
                self.actor_optimizer.zero_grad(set_to_none=True)
                policy_total = 0.0
                for part in row_slices(ids.shape[0], config.micro_batch):
                    with compute_precision(self.precision, self.device):
                        logprobs, entropy = policy_forward(self.actor, ids[part], attention[part], self.logits_chunk)
                    loss, part_stats = ppo_policy_loss(logprobs, old_logprobs[mini][part], advantages[mini][part],
                                                       part_mask[part], config.clip_low, config.clip_high, config.agg)
                    share = _share(part_mask, part, config.agg)
                    (loss * share).backward()
                    policy_total += float(loss.detach()) * share
                    tokens_here = float(part_mask[part].sum())
                    entropy_total += float(masked_mean(entropy.detach(), part_mask[part])) * tokens_here
                    stats.append((part_stats, tokens_here))
                actor_norms.append(float(torch.nn.utils.clip_grad_norm_(self.actor.parameters(), config.max_grad_norm)))
                self.actor_optimizer.step()
                policy_sums.append(policy_total)

                self.critic_optimizer.zero_grad(set_to_none=True)
                value_total = 0.0
                for part in row_slices(ids.shape[0], config.micro_batch):
                    with compute_precision(self.precision, self.device):
                        values = value_forward(self.critic, ids[part], attention[part])
                    loss, _ = value_loss(values, old_values[mini][part], returns[mini][part], part_mask[part],
                                         config.value_clip, "token-mean")
                    share = _share(part_mask, part, "token-mean")
                    (loss * share).backward()
                    value_total += float(loss.detach()) * share
                critic_norms.append(float(torch.nn.utils.clip_grad_norm_(self.critic.parameters(), config.max_grad_norm)))
                self.critic_optimizer.step()
                value_sums.append(value_total)

        tokens = float(mask.sum())
        seen = max(sum(n for _, n in stats), 1.0)  # sampled tokens over every pass
        sampled = mask.bool()
        rewards = batch.rewards.sum(-1)
        return {
            "reward_mean": float(rewards.mean()),
            "policy_loss": sum(policy_sums) / len(policy_sums),
            "value_loss": sum(value_sums) / len(value_sums),
            "entropy": entropy_total / seen,
            "approx_kl": sum(s["approx_kl"] * n for s, n in stats) / seen,
            "clip_fraction": sum(s["clip_fraction"] * n for s, n in stats) / seen,
            "ratio_max": max(s["ratio_max"] for s, _ in stats),
            "explained_variance": explained_variance(old_values, returns, mask),
            "logprob_mismatch": float((old_logprobs - batch.old_logprobs)[sampled].abs().mean()) if sampled.any() else 0.0,
            "actor_grad_norm": sum(actor_norms) / len(actor_norms),
            "critic_grad_norm": sum(critic_norms) / len(critic_norms),
            "optimizer_steps": len(actor_norms),
            "sampled_tokens": tokens,
            "update_seconds": time.perf_counter() - started,
        }
