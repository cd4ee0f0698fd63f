"""The paper's warm-up between single-turn PPO and agentic PPO: rejection fine-tuning of the actor on the
agent trajectories worth imitating (2a), then value pretraining of the critic on them (2b).

``keep_episode`` is the rejection filter: the final reward must be above ``min_reward`` (the paper:
> 0), and two rubrics drop degenerate behaviour the paper names: a redundant loop (the same tool call,
name and arguments, ``max_repeats`` times in a row) and a tool call that breaks the tool schema (an
unknown tool or arguments its schema refuses; the toolbox marks these ``invalid_call``).

``SFTTrainer.step`` is one optimiser step of negative log-likelihood on the sampled tokens only (the
mask of the token trace; prompts and tool results are not learned), averaged over the batch's tokens
as verl's SFT trainer does. ``ValueTrainer`` fits the critic to GAE targets computed from its own
values: each step computes its batch's targets with the critic as it is then (bootstrapped, as PPO will
compute them), so the targets move as the critic learns; ``iterations`` passes over the data. verl has no offline critic stage, so this one is ours
on every engine.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from cuda_agent.train.algo import explained_variance, gae, masked_mean, value_loss
from cuda_agent.train.models import compute_precision, policy_forward, prepare_for_training, value_forward
from cuda_agent.train.rollout import Rollout, RolloutBatch, RolloutError, row_slices, rollouts_from_trace


@dataclass(frozen=True)
class Verdict:
    keep: bool
    reason: str  # "kept", or why the episode was dropped


def _calls(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [call for turn in record.get("turns", []) for call in turn.get("tool_calls", [])]


def keep_episode(record: dict[str, Any], min_reward: float = 0.0, max_repeats: int = 3,
                 drop_invalid_calls: bool = True) -> Verdict:
    """Whether an agent trajectory (a ``run_episode`` record) goes into RFT, and why not."""
    if not record.get("tokens"):
        return Verdict(False, "no token trace (the episode was not run with a token backend)")
    reward = record.get("reward")
    if reward is None or reward <= min_reward:
        return Verdict(False, f"reward {reward} is not above {min_reward}")
    calls = _calls(record)
    if drop_invalid_calls:
        bad = next((c for c in calls if (c.get("metadata") or {}).get("invalid_call")), None)
        if bad is not None:
            return Verdict(False, f"a tool call breaks the schema ({bad.get('name') or 'no name'})")
    run, previous = 0, None
    for call in calls:
        key = (call.get("name"), _canonical(call.get("arguments")))
        run = run + 1 if key == previous else 1
        previous = key
        if max_repeats and run >= max_repeats:
            return Verdict(False, f"a redundant loop: {call.get('name')} with the same arguments {run} times in a row")
    return Verdict(True, "kept")


def _canonical(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def episode_rollouts(records: Iterable[dict[str, Any]]) -> list[list[Rollout]]:
    """Each record's rollouts (one per token-trace segment), with its final reward."""
    out = []
    for record in records:
        try:
            out.append(rollouts_from_trace(record["tokens"], float(record["reward"])))
        except (RolloutError, KeyError, TypeError):
            out.append([])
    return out


def _batch(rollouts: Sequence[Rollout] | RolloutBatch, pad_id: int) -> RolloutBatch:
    return rollouts if isinstance(rollouts, RolloutBatch) else RolloutBatch.collate(rollouts, pad_id)


class SFTTrainer:
    """Rejection fine-tuning's update: NLL of the sampled tokens, one optimiser step per ``step``."""

    def __init__(self, actor: Any, lr: float, *, micro_batch: int = 2, max_grad_norm: float = 1.0,
                 precision: str = "fp32", logits_chunk: int = 0, gradient_checkpointing: bool = False):
        self.actor, self.micro_batch, self.max_grad_norm = actor, micro_batch, max_grad_norm
        self.precision, self.logits_chunk = precision, logits_chunk
        prepare_for_training(actor, gradient_checkpointing)
        self.device = next(actor.parameters()).device
        self.optimizer = torch.optim.AdamW(actor.parameters(), lr=lr)

    def step(self, rollouts: Sequence[Rollout] | RolloutBatch, pad_id: int = 0) -> dict[str, float]:
        started = time.perf_counter()
        batch = _batch(rollouts, pad_id).to(self.device)
        self.actor.train()
        tokens = batch.mask.sum().clamp(min=1)
        self.optimizer.zero_grad(set_to_none=True)
        total, correct = 0.0, 0.0
        for part in row_slices(batch.ids.shape[0], self.micro_batch):
            with compute_precision(self.precision, self.device):
                logprobs, _ = policy_forward(self.actor, batch.ids[part], batch.attention[part], self.logits_chunk)
            loss = -(logprobs * batch.mask[part]).sum() / tokens  # token-mean over the whole batch
            loss.backward()
            total += float(loss.detach())
            correct += float(((logprobs.detach() > -0.6931) * batch.mask[part]).sum())  # p > 1/2: the argmax
        norm = float(torch.nn.utils.clip_grad_norm_(self.actor.parameters(), self.max_grad_norm))
        self.optimizer.step()
        seconds = time.perf_counter() - started
        return {"sft_loss": total, "sampled_tokens": float(tokens), "token_accuracy": correct / float(tokens),
                "actor_grad_norm": norm, "update_seconds": seconds, "update_tokens_per_s": float(tokens) / seconds}


class ValueTrainer:
    """Critic pretraining: MSE to GAE targets bootstrapped from the critic's own values."""

    def __init__(self, critic: Any, lr: float, *, gamma: float = 1.0, lam: float = 0.95, micro_batch: int = 2,
                 max_grad_norm: float = 1.0, value_clip: float | None = None, precision: str = "fp32",
                 gradient_checkpointing: bool = False):
        self.critic, self.gamma, self.lam = critic, gamma, lam
        self.micro_batch, self.max_grad_norm, self.value_clip, self.precision = micro_batch, max_grad_norm, value_clip, precision
        prepare_for_training(critic, gradient_checkpointing)
        self.device = next(critic.parameters()).device
        self.optimizer = torch.optim.AdamW(critic.parameters(), lr=lr)

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        out = []
        with torch.no_grad(), compute_precision(self.precision, self.device):
            for part in row_slices(batch.ids.shape[0], self.micro_batch):
                out.append(value_forward(self.critic, batch.ids[part], batch.attention[part]))
        return torch.cat(out)

    def targets(self, rollouts: Sequence[Rollout] | RolloutBatch,
                pad_id: int = 0) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor]:
        """The batch, the critic's current values and the GAE returns they give."""
        batch = _batch(rollouts, pad_id).to(self.device)
        values = self.values(batch)
        _, returns = gae(batch.rewards, values, batch.mask, self.gamma, self.lam)
        return batch, values, returns

    def evaluate(self, rollouts: Sequence[Rollout], pad_id: int = 0) -> dict[str, float]:
        """Explained variance of the critic on ``rollouts``: against the GAE targets it implies (what PPO's
        metric reports) and against the Monte Carlo returns (with gamma 1, the outcome reward itself)."""
        batch, values, returns = self.targets(rollouts, pad_id)
        monte_carlo = batch.rewards.flip(-1).cumsum(-1).flip(-1)
        return {"explained_variance": explained_variance(values, returns, batch.mask),
                "explained_variance_mc": explained_variance(values, monte_carlo, batch.mask),
                "value_mse_mc": float(masked_mean((values - monte_carlo) ** 2, batch.mask))}

    def step(self, rollouts: Sequence[Rollout] | RolloutBatch, pad_id: int = 0) -> dict[str, float]:
        """One optimiser step toward the targets the current critic gives ``rollouts``."""
        started = time.perf_counter()
        batch, old_values, returns = self.targets(rollouts, pad_id)
        self.critic.train()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = batch.mask.sum().clamp(min=1)
        total = 0.0
        for part in row_slices(batch.ids.shape[0], self.micro_batch):
            with compute_precision(self.precision, self.device):
                values = value_forward(self.critic, batch.ids[part], batch.attention[part])
            loss, _ = value_loss(values, old_values[part], returns[part], batch.mask[part], self.value_clip, "token-mean")
            share = float(batch.mask[part].sum() / tokens)
            (loss * share).backward()
            total += float(loss.detach()) * share
        norm = float(torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.max_grad_norm))
        self.optimizer.step()
        return {"value_loss": total, "critic_grad_norm": norm, "sampled_tokens": float(tokens),
                "update_seconds": time.perf_counter() - started}
