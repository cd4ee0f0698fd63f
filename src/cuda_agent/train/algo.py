"""The PPO pieces, pure torch, every tensor ``[batch, tokens]`` over whole sequences.

``mask`` is 1 exactly on the tokens the policy sampled (``Rollout.response_mask``): prompts, tool
results and padding are 0 and neither earn nor carry advantage. An episode's outcome reward sits on
its last sampled token (``Rollout.token_rewards``). The conventions follow verl's ``core_algos``
(GAE that steps over unmasked positions, ``0.5 * max`` clipped value loss, asymmetric ratio clipping),
so a run here and a run on verl mean the same numbers.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1 (over ``dim``, or all); 0 where nothing is selected."""
    mask = mask.to(values.dtype)
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``values`` shifted and scaled to mean 0, variance 1 over the masked positions (others become 0)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    return (values - mean) * torch.rsqrt(variance + eps) * mask.to(values.dtype)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str = "seq-mean-token-mean") -> torch.Tensor:
    """One loss from per-token losses. ``seq-mean-token-mean``: each sequence's mean over its masked tokens,
    then the mean over sequences that have any (the paper's (1/T) sum per trajectory, so long episodes
    weigh no more than short ones); ``token-mean``: the mean over every masked token of the batch
    (verl's default)."""
    if agg == "token-mean":
        return masked_mean(per_token, mask)
    if agg == "seq-mean-token-mean":
        has_tokens = (mask.sum(-1) > 0).to(per_token.dtype)
        per_sequence = masked_mean(per_token, mask, dim=-1)
        return (per_sequence * has_tokens).sum() / has_tokens.sum().clamp(min=1)
    raise ValueError(f"unknown loss aggregation {agg!r}: choose one of {', '.join(AGGREGATIONS)}")


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over token positions; returns ``(advantages, returns)``.

    Positions where ``mask`` is 0 are stepped over: they neither change the running advantage nor supply
    the next value, so a tool result between two replies joins them as if it were not there. The value
    after the last sampled token is 0 (the episode ends there). ``returns = advantages + values``;
    advantages are 0 where the mask is 0.
    """
    if not rewards.shape == values.shape == mask.shape or rewards.dim() != 2:
        raise ValueError(f"gae: rewards, values and mask must share one [batch, tokens] shape, got "
                         f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}")
    rewards, values = rewards.float(), values.float()
    selected = mask.bool()
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        here = selected[:, t]
        running = torch.where(here, step, running)
        next_value = torch.where(here, values[:, t], next_value)
        advantages[:, t] = torch.where(here, step, torch.zeros_like(step))
    return advantages, advantages + values


def ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.28,
                    agg: str = "seq-mean-token-mean") -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate: per token ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` with
    ``r = exp(logprobs - old_logprobs)``, aggregated by ``agg``. The wider upper clip lets unlikely tokens
    with positive advantage grow faster than likely ones shrink (the paper's 0.2 / 0.28).

    Stats: ``clip_fraction`` (tokens where the clipped term won), ``approx_kl`` (mean of
    ``old - new`` logprob), ``ratio_mean``, ``ratio_max``."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = aggregate(per_token, mask, agg)
    selected = mask.bool()
    with torch.no_grad():
        stats = {
            "clip_fraction": float(masked_mean((clipped > unclipped).float(), mask)),
            "approx_kl": float(masked_mean(-log_ratio, mask)),
            "ratio_mean": float(masked_mean(ratio, mask)),
            "ratio_max": float(ratio[selected].max()) if selected.any() else 1.0,
        }
    return loss, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = None, agg: str = "token-mean") -> tuple[torch.Tensor, dict[str, float]]:
    """The critic's loss: ``0.5 * (V - R)^2``; with ``clip``, ``0.5 * max((V - R)^2, (V_c - R)^2)`` where
    ``V_c`` is ``V`` kept within ``clip`` of the values the rollout was scored with."""
    squared = (values - returns) ** 2
    clip_fraction = 0.0
    if clip is not None:
        kept = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = (kept - returns) ** 2
        with torch.no_grad():
            clip_fraction = float(masked_mean((clipped > squared).float(), mask))
        squared = torch.maximum(squared, clipped)
    loss = 0.5 * aggregate(squared, mask, agg)
    return loss, {"value_clip_fraction": clip_fraction}


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Logprob of each token under the logits that predicted it: ``[batch, tokens]``, position ``t`` from
    ``logits[:, t - 1]``; position 0 (nothing predicted it) is 0."""
    scores = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(scores[:, :1]), scores], dim=1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the distribution that predicted each token, aligned like ``token_logprobs``."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.cat([torch.zeros_like(entropy[:, :1]), entropy], dim=1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the masked positions: 1 for a perfect critic, 0 for one that
    predicts the mean, negative for worse; NaN when the returns do not vary."""
    residual = masked_mean((returns - values - masked_mean(returns - values, mask)) ** 2, mask)
    spread = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    return float(1.0 - residual / spread) if float(spread) > 0 else float("nan")

