"""The learning test: PPO on a tiny model, rewards from the real evaluator (CPU backend), goes from
chance to the best prepared kernel; a run stopped and resumed takes the same next step."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers")

from cuda_agent.cli import main  # noqa: E402
from cuda_agent.train.demo import DemoConfig, run_demo  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = 30


@pytest.fixture(scope="module")
def learned(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("demo") / "run"
    # The menu's candidates share one task: one reference process (started and torch.compile'd once) serves them.
    rows = run_demo(out, steps=STEPS, config=DemoConfig(device="cpu"), quiet=True,
                    evaluator_options={"cache_dir": cache_dir, "references": 1})
    return out, rows


def test_ppo_learns_to_pick_the_best_kernel_the_evaluator_rewards(learned):
    out, rows = learned
    menu = json.loads((out / "menu.json").read_text())
    # The real evaluator's verdicts on the four prepared candidates.
    assert menu["wrong"]["rule"] == "wrong-output" and menu["torch"]["rule"] == "torch-compute"
    # The reward is the speedup over torch.compile: slow does four times fast's work, on any machine.
    assert menu["fast"]["reward"] > 2 * menu["slow"]["reward"] > 0, menu
    best = max(entry["reward"] for entry in menu.values())
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    start = sum(r["reward_mean"] for r in rows[:3]) / 3
    end = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert start < 0, start  # chance: most words name nothing, and two candidates fail
    assert end >= best - 0.75, (end, best)  # near the best
    assert rows[-1]["answers"].get("fast", 0) > 0.6
    assert (out / "curves.png").exists() and (out / "rewards.png").exists()


def test_a_stopped_run_resumes_to_the_same_next_step(learned, tmp_path):
    out, rows = learned
    again = tmp_path / "run"
    again.mkdir()
    shutil.copy(out / "menu.json", again / "menu.json")  # the evaluator's verdicts, kept in the run as it goes
    # Through the command a user runs: two steps, stopped; then continued to three.
    assert main(["train", "demo", "--device", "cpu", "--out", str(again), "--steps", "2", "--quiet"]) == 0
    assert main(["train", "demo", "--device", "cpu", "--out", str(again), "--steps", "3", "--quiet"]) == 0
    resumed = [json.loads(line) for line in (again / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in ("reward_mean", "answers", "policy_loss", "value_loss", "entropy"):
        assert resumed[2][key] == pytest.approx(rows[2][key], rel=1e-5, abs=1e-6), key
    # Another config is refused, naming the setting.
    assert main(["train", "demo", "--device", "cpu", "--out", str(again), "--steps", "4", "--batch", "8",
                 "--quiet"]) == 2


def test_menu_rewards_keep_only_verdicts_and_drop_an_older_runs_none(tmp_path, monkeypatch):
    """A no-verdict is no reward for that answer in this step, evaluated again in the next, and never stored; a
    None an older run stored is dropped on reading, so a rerun goes on."""
    from cuda_agent.evaluate.result import EvalResult
    from cuda_agent.train.demo import MenuRewards

    path = tmp_path / "menu.json"
    older = json.dumps({"fast": {"reward": None, "status": "error"}, "slow": {"reward": 1.0, "status": "correct"}})
    path.write_text(older)
    answers = iter(["error", "correct"])

    class Scripted:
        def evaluate(self, task, candidate):
            status = next(answers)
            return EvalResult(task={}, candidate={}, device="cpu", policy={}, timing={}, status=status,
                              reward=None if status == "error" else 3.0,
                              reason="busy: evaluate again when the host is quieter" if status == "error" else None)

    menu = {"fast": tmp_path, "slow": tmp_path}
    rewards = MenuRewards(path, None, menu, Scripted)
    monkeypatch.setattr("cuda_agent.train.demo.load_candidate", lambda path: None)
    assert rewards.reward("slow") == 1.0
    assert rewards.reward("fast") is None and rewards.reward("fast") is None  # asked once in the step
    assert path.read_text() == older  # nothing written for a no-verdict
    rewards.next_step()
    assert rewards.reward("fast") == 3.0 and json.loads(path.read_text())["fast"]["reward"] == 3.0
