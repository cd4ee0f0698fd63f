"""Token traces into rollouts and padded batches: masks select exactly the sampled ids, rewards sit on
each sequence's last sampled token."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cuda_agent.agent.tokens import token_trace  # noqa: E402
from cuda_agent.train import Rollout, RolloutBatch, RolloutError, rollouts_from_trace  # noqa: E402


def turns():
    # Turn 1 samples 4, 5; the tool's result (6, 7) and turn 2's sampled 8 continue the same prompt;
    # turn 3's prompt starts over (the loop dropped turns for the context budget): a new segment.
    return [
        {"prompt_ids": [1, 2, 3], "ids": [4, 5], "logprobs": [-0.1, -0.2]},
        {"prompt_ids": [1, 2, 3, 4, 5, 6, 7], "ids": [8, 99], "logprobs": [-0.3, -0.4]},
        {"prompt_ids": [1, 2, 9], "ids": [10], "logprobs": [-0.5]},
    ]


def test_each_segment_becomes_a_rollout_with_the_episode_reward():
    rollouts = rollouts_from_trace(token_trace(turns()), reward=3.0, evaluations=[{"reward": 3.0}])
    assert len(rollouts) == 2
    first, second = rollouts
    assert first.prompt_ids == (1, 2, 3)
    assert first.response_ids == (4, 5, 6, 7, 8, 99)
    assert first.response_mask == (1, 1, 0, 0, 1, 1)
    assert first.logprobs == pytest.approx((-0.1, -0.2, 0.0, 0.0, -0.3, -0.4))
    assert (second.prompt_ids, second.response_ids, second.response_mask) == ((1, 2, 9), (10,), (1,))
    assert first.reward == second.reward == 3.0 and first.evaluations == ({"reward": 3.0},)


def test_trailing_unsampled_tokens_are_trimmed_so_the_reward_lands_on_a_sampled_one():
    segment = {"ids": [10, 11, 12, 13, 14, 15, 16], "mask": [0, 0, 1, 1, 0, 1, 0],
               "logprobs": [0, 0, -0.1, -0.2, 0, -0.3, 0]}
    rollout = Rollout.from_segment(segment, reward=1.0)
    assert rollout.response_ids == (12, 13, 14, 15) and rollout.ids == (10, 11, 12, 13, 14, 15)
    with pytest.raises(RolloutError, match="no sampled token"):
        Rollout.from_segment({"ids": [1, 2], "mask": [0, 0], "logprobs": [0, 0]}, reward=1.0)
    with pytest.raises(RolloutError, match="start and end on a sampled token"):
        Rollout((1,), (2, 3), (1, 0), (-0.1, 0.0), reward=1.0)


def test_a_padded_batch_selects_exactly_the_sampled_ids():
    rollouts = rollouts_from_trace(token_trace(turns()), reward=2.0)
    rollouts.append(Rollout((7,), (8,), (1,), (-0.9,), reward=-1.0))
    batch = RolloutBatch.collate(rollouts, pad_id=0)
    assert batch.ids.shape == (3, 9)
    sampled = [batch.ids[row][batch.mask[row].bool()].tolist() for row in range(3)]
    assert sampled == [[4, 5, 8, 99], [10], [8]]
    assert batch.old_logprobs[batch.mask.bool()].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5, -0.9])
    assert batch.attention.sum(-1).tolist() == [9, 4, 2]
    # The reward is on each row's last sampled token, nowhere else.
    assert batch.rewards.nonzero().tolist() == [[0, 8], [1, 3], [2, 1]]
    assert batch.rewards[batch.rewards != 0].tolist() == [2.0, 2.0, -1.0]
    with pytest.raises(RolloutError, match="empty batch"):
        RolloutBatch.collate([])
