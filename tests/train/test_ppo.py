"""One PPO update on a tiny randomly initialised model: it moves the policy toward rewarded tokens,
the critic toward the returns, and micro-batching does not change the gradient."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cuda_agent.train import Rollout, RolloutBatch  # noqa: E402
from cuda_agent.train.models import critic_from_actor, policy_forward, value_forward  # noqa: E402
from cuda_agent.train.ppo import PPOConfig, PPOTrainer  # noqa: E402

VOCAB = 48


def tiny_actor(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(config)


def sampled_rollouts(actor, rewards, prompt=(1, 2, 3), length=6):
    """Responses sampled from ``actor`` (so the sampler's logprobs are the trainer's), with tool tokens
    (mask 0) in the middle, one per reward."""
    rollouts = []
    generator = torch.Generator().manual_seed(7)
    for reward in rewards:
        ids = list(prompt)
        mask, logprobs = [], []
        for position in range(length):
            with torch.no_grad():
                logits = actor(input_ids=torch.tensor([ids])).logits[0, -1]
            if position == 2:  # a tool result the policy did not choose
                token, lp, m = 5, 0.0, 0
            else:
                probs = torch.softmax(logits.float(), -1)
                token = int(torch.multinomial(probs, 1, generator=generator))
                lp, m = float(torch.log(probs[token])), 1
            ids.append(token)
            mask.append(m)
            logprobs.append(lp)
        rollouts.append(Rollout(tuple(prompt), tuple(ids[len(prompt):]), tuple(mask), tuple(logprobs), reward))
    return rollouts


def sampled_logprob_sums(actor, batch):
    with torch.no_grad():
        logprobs, _ = policy_forward(actor, batch.ids, batch.attention)
    return (logprobs * batch.mask).sum(-1)


def test_one_step_moves_the_policy_toward_rewarded_tokens_and_the_critic_toward_returns():
    actor = tiny_actor()
    critic = critic_from_actor(actor)
    batch = RolloutBatch.collate(sampled_rollouts(actor, [3.0, -1.0, 3.0, -1.0]))
    before = sampled_logprob_sums(actor, batch)
    with torch.no_grad():
        values_before = value_forward(critic, batch.ids, batch.attention)
    trainer = PPOTrainer(actor, critic, PPOConfig(actor_lr=3e-3, critic_lr=3e-3, micro_batch=2))
    metrics = trainer.step(batch)
    after = sampled_logprob_sums(actor, batch)
    change = (after - before).tolist()
    assert change[0] > 0 and change[2] > 0, change  # rewarded responses became likelier
    assert change[1] < 0 and change[3] < 0, change  # punished ones less likely
    # The sampler's logprobs were the trainer's: the mismatch is float noise only.
    assert metrics["logprob_mismatch"] < 1e-4 and metrics["reward_mean"] == pytest.approx(1.0)
    assert metrics["sampled_tokens"] == 4 * 5 and metrics["entropy"] > 0
    # The critic moved toward each token's return (gamma 1: the outcome), on the sampled tokens.
    with torch.no_grad():
        values_after = value_forward(critic, batch.ids, batch.attention)
    target = batch.rewards.sum(-1, keepdim=True).expand_as(batch.mask)
    sampled = batch.mask.bool()
    error_before = (values_before - target)[sampled].abs().mean()
    error_after = (values_after - target)[sampled].abs().mean()
    assert error_after < error_before


def test_micro_batches_accumulate_to_the_whole_batch_gradient():
    """The gradient norms (taken before clipping) are the same whether the batch is one forward or
    several: each micro-batch's loss is weighted by its share of the sequences (or tokens)."""
    actor = tiny_actor(seed=1)
    critic = critic_from_actor(actor)
    rollouts = sampled_rollouts(actor, [3.0, -1.0, 1.0])
    rollouts.append(Rollout((1,), (9, 9, 4), (1, 0, 1), (-3.0, 0.0, -3.0), 2.0))  # another length, for padding
    batch = RolloutBatch.collate(rollouts)
    for agg in ("seq-mean-token-mean", "token-mean"):
        norms = []
        for micro in (4, 1, 3):
            trainer = PPOTrainer(copy.deepcopy(actor), copy.deepcopy(critic),
                                 PPOConfig(micro_batch=micro, agg=agg, max_grad_norm=1e9))
            metrics = trainer.step(batch)
            norms.append((metrics["actor_grad_norm"], metrics["critic_grad_norm"]))
        for actor_norm, critic_norm in norms[1:]:
            assert actor_norm == pytest.approx(norms[0][0], rel=1e-4)
            assert critic_norm == pytest.approx(norms[0][1], rel=1e-4)


def test_the_critic_starts_from_the_actors_backbone():
    actor = tiny_actor(seed=2)
    critic = critic_from_actor(actor)
    assert type(critic).__name__.endswith("ForTokenClassification") and critic.config.num_labels == 1
    for (name, mine), (_, theirs) in zip(critic.model.named_parameters(), actor.model.named_parameters()):
        assert torch.equal(mine, theirs), name


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="agg"):
        PPOConfig(agg="sum")
    with pytest.raises(ValueError, match="micro_batch"):
        PPOConfig(micro_batch=0)


def test_several_updates_per_batch_move_the_ratio_off_one_and_the_clip_acts():
    """One update per batch (the paper's default) takes the ratio at exactly 1; split into mini-batches
    and epochs, the later updates see a moved policy: KL and ratio leave their neutral values."""
    actor = tiny_actor(seed=3)
    critic = critic_from_actor(actor)
    batch = RolloutBatch.collate(sampled_rollouts(actor, [3.0, -1.0, 3.0, -1.0]))
    once = PPOTrainer(copy.deepcopy(actor), copy.deepcopy(critic), PPOConfig(actor_lr=1e-2)).step(batch)
    assert once["optimizer_steps"] == 1 and once["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert once["ratio_max"] == pytest.approx(1.0, abs=1e-5) and once["clip_fraction"] == 0.0
    split = PPOTrainer(copy.deepcopy(actor), copy.deepcopy(critic),
                       PPOConfig(actor_lr=1e-2, mini_batches=2, epochs=3)).step(batch)
    assert split["optimizer_steps"] == 6
    assert abs(split["approx_kl"]) > 1e-4 and split["ratio_max"] > 1.01


def test_chunked_scoring_gives_the_same_logprobs_entropy_and_gradients():
    actor = tiny_actor()
    ids = torch.randint(0, VOCAB, (2, 23))
    attention = torch.ones_like(ids)
    attention[1, 19:] = 0
    whole = policy_forward(actor, ids, attention)
    (whole[0].sum() + whole[1].sum()).backward()
    expected = [p.grad.clone() for p in actor.parameters()]
    actor.zero_grad()
    chunked = policy_forward(actor, ids, attention, chunk=5)  # 22 predicted positions: 4 full chunks and 2
    (chunked[0].sum() + chunked[1].sum()).backward()
    assert torch.allclose(whole[0], chunked[0], atol=1e-5) and torch.allclose(whole[1], chunked[1], atol=1e-5)
    for got, want in zip((p.grad for p in actor.parameters()), expected):
        assert torch.allclose(got, want, atol=1e-5)


def test_gradient_checkpointing_gives_the_same_update():
    """Checkpointing recomputes activations in the backward pass; the step it takes must be the same."""
    rewards = [3.0, -1.0, 2.0, -1.0]
    params = []
    for checkpointing in (False, True):
        actor = tiny_actor()
        trainer = PPOTrainer(actor, critic_from_actor(actor), PPOConfig(actor_lr=1e-2, critic_lr=1e-2),
                             gradient_checkpointing=checkpointing)
        trainer.step(RolloutBatch.collate(sampled_rollouts(tiny_actor(), rewards)))
        params.append(torch.cat([p.detach().flatten() for p in actor.parameters()]))
    assert getattr(actor, "is_activation_checkpointing", None) or actor.is_gradient_checkpointing
    assert torch.allclose(params[0], params[1], atol=1e-5)
