"""The PPO pieces against values worked out by hand (comments show the arithmetic)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from cuda_agent.train import (  # noqa: E402
    aggregate, explained_variance, gae, masked_whiten, ppo_policy_loss, token_entropy, token_logprobs, value_loss,
)


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, rows):
    torch.testing.assert_close(actual, t(rows), atol=1e-5, rtol=1e-5)


def test_gae_steps_over_unsampled_positions_and_ends_at_zero():
    # Row 0, gamma 1, lam 0.5, backwards over the sampled positions 4, 2, 1 (0 and 3 are prompt / tool):
    #   t=4: delta = 1 + 0 - 3 = -2                      A = -2
    #   t=2: delta = 0 + 3 - 2 = 1 (next value: t=4's)    A = 1 + 0.5 * -2 = 0
    #   t=1: delta = 0 + 2 - 1 = 1                        A = 1 + 0.5 * 0 = 1
    # Row 1 (padding after t=1): t=1: 3 - 0.25 = 2.75; t=0: 0.25 - 0.5 + 0.5 * 2.75 = 1.125.
    rewards = t([[0, 0, 0, 0, 1], [0, 3, 0, 0, 0]])
    values = t([[9, 1, 2, 9, 3], [0.5, 0.25, 7, 7, 7]])
    mask = t([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    close(advantages, [[0, 1, 0, 0, -2], [1.125, 2.75, 0, 0, 0]])
    close(returns, (advantages + values).tolist())


def test_gae_discounts_with_gamma():
    # gamma 0.9, lam 0.5 on row 0 above: t=4: -2; t=2: 0.9*3 - 2 = 0.7, + 0.45 * -2 = -0.2;
    # t=1: 0.9*2 - 1 = 0.8, + 0.45 * -0.2 = 0.71.
    advantages, _ = gae(t([[0, 0, 0, 0, 1]]), t([[9, 1, 2, 9, 3]]), t([[0, 1, 1, 0, 1]]), gamma=0.9, lam=0.5)
    close(advantages, [[0, 0.71, -0.2, 0, -2]])


def test_gae_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        gae(t([[0, 1]]), t([[0, 1, 2]]), t([[1, 1]]))


def ratios_batch():
    # Row 0: A=1 at r=1.5 (clipped at 1.28), A=-1 at r=0.5 (clipped at 0.8), then a masked token that
    # would dominate. Row 1: A=2 at r=1, A=-1 at r=1.2 (inside the clip), A=0.5 at r=1.1.
    ratio = t([[1.5, 0.5, 3.0], [1.0, 1.2, 1.1]])
    old = t([[-1.0, -2.0, -0.5], [-0.7, -1.5, -0.3]])
    advantages = t([[1, -1, 100], [2, -1, 0.5]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    return old + torch.log(ratio), old, advantages, mask


def test_ppo_policy_loss_clips_asymmetrically_and_aggregates_per_sequence():
    logprobs, old, advantages, mask = ratios_batch()
    # Per token: row 0: max(-1.5, -1.28) = -1.28, max(0.5, 0.8) = 0.8; row 1: -2, max(1.2, 1.2) = 1.2, -0.55.
    # seq-mean-token-mean: ((-1.28 + 0.8) / 2 + (-2 + 1.2 - 0.55) / 3) / 2 = (-0.24 - 0.45) / 2 = -0.345
    loss, stats = ppo_policy_loss(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    assert float(loss) == pytest.approx(-0.345, abs=1e-6)
    # token-mean: (-1.28 + 0.8 - 2 + 1.2 - 0.55) / 5 = -0.366
    loss, _ = ppo_policy_loss(logprobs, old, advantages, mask, 0.2, 0.28, agg="token-mean")
    assert float(loss) == pytest.approx(-0.366, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(2 / 5)  # the two clipped tokens of row 0
    # approx KL: mean of old - new = -mean(log r) over the five sampled tokens.
    expected_kl = -sum(math.log(r) for r in (1.5, 0.5, 1.0, 1.2, 1.1)) / 5
    assert stats["approx_kl"] == pytest.approx(expected_kl, abs=1e-6)
    assert stats["ratio_max"] == pytest.approx(1.5)  # the masked 3.0 is not counted


def test_ppo_gradient_is_zero_where_clipped_and_raises_good_tokens():
    logprobs, old, advantages, mask = ratios_batch()
    logprobs = logprobs.clone().requires_grad_(True)
    loss, _ = ppo_policy_loss(logprobs, old, advantages, mask, 0.2, 0.28)
    loss.backward()
    grad = logprobs.grad
    assert grad[0, 0] == 0 and grad[0, 1] == 0 and grad[0, 2] == 0  # clipped, clipped, masked
    # d/dlogp of -A r over a 3-token sequence's mean, halved over 2 sequences: -2 * 1.0 / 3 / 2.
    assert float(grad[1, 0]) == pytest.approx(-1 / 3, abs=1e-6)
    assert float(grad[1, 1]) > 0  # negative advantage: descent lowers its logprob


def test_unknown_aggregation_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean"):
        aggregate(t([[1.0]]), t([[1.0]]), "sum")


def test_value_loss_with_and_without_clipping():
    # a: V=1, old 1.5, R=3: (1-3)^2 = 4 vs clipped V 1.3: 2.89 -> 4.
    # b: V=1.4, old 1, R=1.5: 0.01 vs clipped V 1.2: 0.09 -> 0.09 (clipped wins).
    values, old, returns, mask = t([[1.0, 1.4, 5.0]]), t([[1.5, 1.0, 0.0]]), t([[3.0, 1.5, 0.0]]), t([[1, 1, 0]])
    loss, stats = value_loss(values, old, returns, mask, clip=0.2)
    assert float(loss) == pytest.approx(0.5 * (4 + 0.09) / 2, abs=1e-6)
    assert stats["value_clip_fraction"] == pytest.approx(0.5)
    loss, _ = value_loss(values, old, returns, mask)
    assert float(loss) == pytest.approx(0.5 * (4 + 0.01) / 2, abs=1e-6)


def test_token_logprobs_and_entropy_are_aligned_to_the_predicted_token():
    # Position 1 is predicted by logits[0] = [0, ln 3] -> p = (1/4, 3/4); position 2 by logits[1], uniform.
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0], [5.0, -5.0]]])
    ids = torch.tensor([[1, 1, 0]])
    close(token_logprobs(logits, ids), [[0.0, math.log(0.75), math.log(0.5)]])
    h1 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    close(token_entropy(logits), [[0.0, h1, math.log(2.0)]])


def test_explained_variance_and_whitening():
    returns, mask = t([[1, 2, 3, 100]]), t([[1, 1, 1, 0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(t([[2, 2, 2, 0]]), returns, mask) == pytest.approx(0.0)
    assert math.isnan(explained_variance(t([[0, 0, 0, 0]]), t([[1, 1, 1, 5]]), mask))
    white = masked_whiten(returns, mask)
    # mean 2, variance 2/3 over the masked three; the masked-out position becomes 0.
    close(white, [[-(1.5 ** 0.5), 0.0, 1.5 ** 0.5, 0.0]])
