"""The reward's settings as a dataset carries them and the environment overrides them (``train.evaluators``)."""

from __future__ import annotations

import json

import pytest

from cuda_agent.train.evaluators import SETTINGS_ENV, EvaluatorOptions, options_from_settings, settings_of


def test_the_environment_wins_over_the_dataset_and_bad_settings_say_how_to_fix_them():
    written = json.dumps(settings_of(EvaluatorOptions(device="cpu", policy="strict")))
    environ = {SETTINGS_ENV["policy"]: "paper", "CUDA_AGENT_SERVICE": "http://s"}
    options = options_from_settings(written, environ=environ)
    assert (options.device, options.policy, options.service) == ("cpu", "paper", "http://s")
    with pytest.raises(ValueError, match="unknown policy 'loose'.*fair"):
        options_from_settings({"policy": "loose"}, environ={})
    with pytest.raises(ValueError, match="CUDA_AGENT_REWARD_TIME_COMPILE='maybe' is not a yes/no"):
        options_from_settings(environ={SETTINGS_ENV["time_compile"]: "maybe"})
    with pytest.raises(ValueError, match="unknown reward setting"):
        options_from_settings({"gpus": 8}, environ={})
