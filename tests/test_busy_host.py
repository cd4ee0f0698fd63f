"""Under a load the tests make themselves (busy processes beside the evaluations), no honest candidate gets the
failure reward from any path: the CLI's exit status, an RL adapter's reward, a training stage's metrics. Each
either has its verdict or says it has none."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cuda_agent.cli import main
from cuda_agent.evaluate import Evaluator
from cuda_agent.evaluate.retry import RetryPolicy
from cuda_agent.train.single_turn import FAILURE_REWARD

pytestmark = pytest.mark.evaluates
BUSY = 2  # processes beside the evaluations: as many as this CI host has cores


@pytest.fixture
def busy_host():
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BUSY)]
    yield
    for hog in hogs:
        hog.kill()
        hog.wait()


def test_cli_never_fails_an_honest_candidate_on_a_busy_host(busy_host, examples, cache_dir, capsys):
    code = main(["eval", str(examples / "cpu_swish" / "model.py"), str(examples / "cpu_swish" / "solution"),
                 "--device", "cpu", "--cache-dir", str(cache_dir), "--json", "--retries", "0"])
    record = json.loads(capsys.readouterr().out)
    assert code in (0, 3) and record["status"] in ("correct", "error"), record.get("reason")
    assert (code == 3) == (record["reward"] is None)
    assert record["reward"] != FAILURE_REWARD


def test_rl_rewards_never_fail_an_honest_candidate_on_a_busy_host(busy_host, examples, cache_dir):
    pytest.importorskip("trl")
    from cuda_agent.integrations.core import task_columns
    from cuda_agent.integrations.trl import KernelReward
    from cuda_agent.tasks import load_task

    task = load_task(examples / "cpu_swish" / "model.py")
    solution = examples / "cpu_swish" / "solution"
    files = [solution / "model_new.py", *sorted((solution / "kernels").iterdir())]
    text = "\n".join(f"### {f.relative_to(solution)}\n```\n{f.read_text()}\n```" for f in files)
    with Evaluator("cpu", cache_dir=cache_dir, retry=RetryPolicy.none()) as evaluator:
        reward = KernelReward(evaluator=evaluator, workers=1)
        (value,) = reward(["p"], [text], **{k: [v] for k, v in task_columns(task).items()})
    assert value != FAILURE_REWARD and (value is None) == (reward.no_verdict == 1)
