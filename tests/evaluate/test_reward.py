import pytest

from cuda_agent.evaluate import Policy, compute_reward, milestone_reward
from cuda_agent.evaluate.decide import speedup
from cuda_agent.evaluate.reward import reward_line, speedup_reward


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


@pytest.mark.parametrize("reward", ["milestone", "speedup"])
@pytest.mark.parametrize("t, eager, compiled", [(0.5, 1.0, 1.0), (0.5, 1.0, 0.53), (0.5, 1.0, 0.526), (0.94, 1.0, 0.5),
                                                (0.96, 1.0, 0.5), (2.0, 1.0, 1.0), (0.5, 1.0, None), (0.5, None, 2.0)])
def test_one_rule_from_times_from_speedups_and_in_the_decision(reward, t, eager, compiled):
    """The verdict's reward (from speedups), the reward from times and the decision's "beats its line" agree."""
    policy = Policy(reward=reward)
    speedups = [None if base is None else base / t for base in (eager, compiled)]
    assert speedup_reward(policy, *speedups) == compute_reward(policy, True, t, eager, compiled)
    if reward == "milestone":
        assert compute_reward(policy, True, t, eager, compiled) == milestone_reward(True, t, eager, compiled)
        decided = [s is not None and speedup("side", [s], reward_line(policy), 0.95).beats for s in speedups]
        assert speedup_reward(policy, *speedups) == {(True, True): 3.0, (True, False): 2.0}.get(tuple(decided), 1.0)


def test_speedup_reward():
    policy = Policy(reward="speedup")
    assert compute_reward(policy, True, 0.5, 1.0, 2.0) == 4.0
    assert compute_reward(policy, False, 0.5, 1.0, 2.0) == -1.0


def test_policy_validation():
    with pytest.raises(ValueError, match="checks"):
        Policy(checks=0)
    with pytest.raises(ValueError, match="unknown reward"):
        Policy(reward="lines-of-code")
