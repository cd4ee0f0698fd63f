"""Shared by the RL-stack adapter tests: a real CPU evaluator whose rewards do not depend on timing, the scripted
episodes (tool calls, as tests/scripted_policy.py replays them) and the reward our own loop gives for them.

The evaluator's policy asks for a millionfold speedup before a correct candidate earns more than 1, so a
correct candidate earns exactly 1 and an incorrect one -1 on any host, busy or not: the adapters' rewards can
be compared with the loop's for equality without a timing window."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from openai_server import OpenAIServer  # noqa: E402
from scripted_policy import COMMANDS, scripted, write_solution  # noqa: E402

VERIFY = COMMANDS[1]  # python utils/verify.py

from cuda_agent.agent.llm import OpenAIChat  # noqa: E402
from cuda_agent.agent.loop import AgentConfig, run_episode  # noqa: E402
from cuda_agent.evaluate.evaluator import Evaluator  # noqa: E402
from cuda_agent.tasks import load_task  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from integration_setup import CORRECT, NEVER_FASTER, SANDBOX  # noqa: E402



@pytest.fixture(scope="session")
def evaluator(cache_dir):
    made = Evaluator("cpu", policy=NEVER_FASTER, cache_dir=cache_dir, sandbox=SANDBOX, time_compile=False)
    yield made
    made.close()


@pytest.fixture(scope="session")
def task(examples):
    return load_task(examples / "cpu_swish" / "model.py")


@pytest.fixture(scope="session")
def solved_calls(examples) -> list[tuple[str, dict]]:
    """An episode's tool calls, in order: write the example's solution, then verify it. (Not compile and profile
    too: each evaluation costs seconds on a busy 2-core host, and the closing evaluation times the candidate.)"""
    return [*write_solution(examples / "cpu_swish" / "solution"), *VERIFY]


@pytest.fixture(scope="session")
def loop_episode(task, evaluator, solved_calls, tmp_path_factory):
    """The same scripted episode through our own loop (one tool call per turn, then a closing reply)."""
    steps = [[call] for call in solved_calls] + ["The scaled swish kernel is verified."]
    with OpenAIServer(scripted(steps)) as server:
        episode = run_episode(task, OpenAIChat("scripted", base_url=server.url), evaluator,
                              tmp_path_factory.mktemp("loop"), config=AgentConfig(counters=False), sandbox=SANDBOX)
    assert episode.final["status"] == "correct", episode.final.get("reason")
    assert episode.reward == CORRECT
    return episode
