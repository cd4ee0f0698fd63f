"""Episodes as the trainer sees them: ``Rollout`` per token sequence, ``RolloutBatch`` of padded tensors.

An episode's token trace (``agent.tokens.token_trace``) holds one segment per context: usually one, more
where the agent loop dropped old turns to fit the context budget and the prompt started over. Each
segment becomes one ``Rollout``; each carries the episode's outcome reward on its own last sampled
token. (Giving it to the last segment only would leave the earlier ones to learn from the critic's
guesses alone: with gamma 1 nothing else reaches them.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch


class RolloutError(ValueError):
    """A trace that cannot be trained on (no sampled token, lengths that disagree)."""


@dataclass(frozen=True)
class Rollout:
    """One token sequence of an episode. ``prompt_ids`` come before the first sampled token;
    ``response_ids`` run from it to the last sampled token (trailing tool or template tokens trimmed,
    so the outcome reward lands on a token the policy chose). ``response_mask`` is 1 exactly on sampled
    tokens; ``logprobs`` are their sampling logprobs (0.0 elsewhere)."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    response_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    reward: float
    evaluations: tuple[dict[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if not (len(self.response_mask) == len(self.logprobs) == n):
            raise RolloutError(f"rollout: {n} response ids, {len(self.response_mask)} mask values and "
                               f"{len(self.logprobs)} logprobs; they must be as many")
        if n == 0 or not self.response_mask[0] or not self.response_mask[-1]:
            raise RolloutError("rollout: the response must start and end on a sampled token")

    @property
    def ids(self) -> tuple[int, ...]:
        return self.prompt_ids + self.response_ids

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_ids": list(self.prompt_ids), "response_ids": list(self.response_ids),
                "response_mask": list(self.response_mask), "logprobs": list(self.logprobs), "reward": self.reward,
                "evaluations": list(self.evaluations)}

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> "Rollout":
        return cls(tuple(row["prompt_ids"]), tuple(row["response_ids"]), tuple(row["response_mask"]),
                   tuple(row["logprobs"]), float(row["reward"]), tuple(row.get("evaluations", ())))

    @classmethod
    def from_segment(cls, segment: dict[str, list], reward: float,
                     evaluations: Sequence[dict[str, Any]] = ()) -> "Rollout":
        """A ``token_trace`` segment (``{"ids", "mask", "logprobs"}``) with the episode's outcome reward."""
        ids, mask, logprobs = segment["ids"], segment["mask"], segment["logprobs"]
        if not (len(ids) == len(mask) == len(logprobs)):
            raise RolloutError(f"token trace segment: {len(ids)} ids, {len(mask)} mask values, "
                               f"{len(logprobs)} logprobs")
        sampled = [i for i, m in enumerate(mask) if m]
        if not sampled:
            raise RolloutError("token trace segment has no sampled token: nothing to train on")
        first, last = sampled[0], sampled[-1] + 1
        return cls(tuple(ids[:first]), tuple(ids[first:last]), tuple(int(m) for m in mask[first:last]),
                   tuple(float(x) if m else 0.0 for x, m in zip(logprobs[first:last], mask[first:last])),
                   float(reward), tuple(evaluations))


def rollouts_from_trace(trace: Sequence[dict[str, list]], reward: float,
                        evaluations: Sequence[dict[str, Any]] = ()) -> list[Rollout]:
    """One ``Rollout`` per segment of an episode's token trace that holds any sampled token."""
    return [Rollout.from_segment(segment, reward, evaluations) for segment in trace if any(segment["mask"])]


@dataclass
class RolloutBatch:
    """Rollouts right-padded into ``[batch, tokens]`` tensors over whole sequences (prompt + response):
    ``ids``, ``attention`` (1 on real tokens), ``mask`` (1 on sampled tokens), ``old_logprobs`` (the
    sampler's, 0 elsewhere) and ``rewards`` (the outcome on each sequence's last sampled token)."""

    ids: torch.Tensor
    attention: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    rewards: torch.Tensor

    @classmethod
    def collate(cls, rollouts: Sequence[Rollout], pad_id: int = 0) -> "RolloutBatch":
        if not rollouts:
            raise RolloutError("an empty batch of rollouts")
        width = max(len(r.ids) for r in rollouts)
        ids = torch.full((len(rollouts), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(rollouts), width), dtype=torch.long)
        mask = torch.zeros((len(rollouts), width), dtype=torch.float32)
        logprobs = torch.zeros((len(rollouts), width), dtype=torch.float32)
        rewards = torch.zeros((len(rollouts), width), dtype=torch.float32)
        for row, rollout in enumerate(rollouts):
            start, end = len(rollout.prompt_ids), len(rollout.ids)
            ids[row, :end] = torch.tensor(rollout.ids, dtype=torch.long)
            attention[row, :end] = 1
            mask[row, start:end] = torch.tensor(rollout.response_mask, dtype=torch.float32)
            logprobs[row, start:end] = torch.tensor(rollout.logprobs, dtype=torch.float32)
            rewards[row, end - 1] = rollout.reward  # the response ends on a sampled token
        return cls(ids, attention, mask, logprobs, rewards)

    def to(self, device: str | torch.device) -> "RolloutBatch":
        return RolloutBatch(*(t.to(device) for t in (self.ids, self.attention, self.mask, self.old_logprobs,
                                                      self.rewards)))


def row_slices(rows: int, size: int) -> Iterator[slice]:
    """``rows`` split into consecutive slices of at most ``size`` (micro- and mini-batches)."""
    for start in range(0, rows, size):
        yield slice(start, min(start + size, rows))
