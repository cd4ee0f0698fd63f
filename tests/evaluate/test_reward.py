import pytest

from cuda_agent.evaluate import Policy, compute_reward, milestone_reward


@pytest.mark.parametrize(
    "correct, t, eager, compiled, expected",
    [
        (False, 1.0, 10.0, 10.0, -1.0),
        (True, None, 10.0, 10.0, -1.0),
        (True, 0.5, 1.0, 1.0, 3.0),
        (True, 0.5, 1.0, 0.53, 3.0),  # 0.5 < 0.95 * 0.53
        (True, 0.5, 1.0, 0.526, 2.0),  # 0.5 is not < 0.95 * 0.526 = 0.4997
        (True, 0.94, 1.0, 0.5, 2.0),
        (True, 0.96, 1.0, 0.5, 1.0),  # 0.96 >= 0.95: not faster than eager by 5%
        (True, 2.0, 1.0, 1.0, 1.0),
        (True, 0.5, 1.0, None, 2.0),  # torch.compile baseline unavailable
    ],
)
def test_milestone_reward(correct, t, eager, compiled, expected):
    assert milestone_reward(correct, t, eager, compiled) == expected


def test_speedup_reward():
    policy = Policy(reward="speedup")
    assert compute_reward(policy, True, 0.5, 1.0, 2.0) == 4.0
    assert compute_reward(policy, False, 0.5, 1.0, 2.0) == -1.0


def test_policy_validation():
    with pytest.raises(ValueError, match="checks"):
        Policy(checks=0)
    with pytest.raises(ValueError, match="unknown reward"):
        Policy(reward="lines-of-code")
