"""The four stages as a user runs them: config files, tiny models saved as Hugging Face directories, the real
evaluator (CPU backend) where a reward is given, and a run killed and resumed."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from scripted_policy import write_solution  # noqa: E402
from tiny_lm import ScriptedSampler, save_tiny_model, solution_reply, tool_calls_text, train_tokenizer  # noqa: E402

from cuda_agent.evaluate import Evaluator  # noqa: E402
from cuda_agent.tasks import load_task  # noqa: E402
from cuda_agent.train.config import ConfigError, load_config, parse_config  # noqa: E402
from cuda_agent.train.episodes import EpisodeRunner  # noqa: E402
from cuda_agent.train.stages import run_collect, run_ppo, run_rft, run_value, tasks_for_step  # noqa: E402
from cuda_agent.train.warmup import keep_episode  # noqa: E402

SANDBOX = "auto"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "base", tokenizer)


def write_config(path: Path, values: dict) -> Path:
    path.write_text(json.dumps(values))
    return path


def cpu_evaluators(lock: threading.Lock) -> Evaluator:
    return Evaluator("cpu", sandbox=SANDBOX, timing_lock=lock)


# ----------------------------------------------------------------------------- config and task order

def test_config_errors_name_the_setting_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout: unknown setting\(s\) bacth; known: batch"):
        parse_config({"model": {"actor": "m"}, "tasks": {"source": "t"}, "rollout": {"bacth": 4}}, "ppo")
    with pytest.raises(ConfigError, match="stage rft needs data.trajectories"):
        parse_config({"model": {"actor": "m"}}, "rft")
    with pytest.raises(ConfigError, match="run `cuda-agent train value`"):
        parse_config({"stage": "value", "model": {"actor": "m"}}, "rft")
    with pytest.raises(ConfigError, match="ppo: PPOConfig.agg"):
        parse_config({"model": {"actor": "m"}, "tasks": {"source": "t"}, "ppo": {"agg": "sum"}}, "ppo")
    (tmp_path / "model").mkdir()
    config = load_config(write_config(tmp_path / "c.json", {"stage": "ppo", "model": {"actor": "model"},
                                                           "tasks": {"source": "org/hub-name", "levels": [1]}}), "ppo")
    assert config.model.actor == str(tmp_path / "model")  # relative to the file, where it exists
    assert config.tasks.source == "org/hub-name" and config.tasks.levels == (1,)
    assert config.context_tokens(single_turn=True) == 32_768 and config.context_tokens(single_turn=False) == 131_072
    with pytest.raises(ConfigError, match=r"model.actor \.\./runs/stage1/checkpoint/actor does not exist.*run the stage"):
        load_config(write_config(tmp_path / "rft.json", {"stage": "rft", "model": {"actor": "../runs/stage1/checkpoint/actor"},
                                                        "data": {"trajectories": ["model"]}}), "rft")


def test_examples_configs_parse():
    from cuda_agent.train.config import _resolve_paths, parse_config

    root = Path(__file__).resolve().parents[2] / "examples" / "train"
    stages = {p.name: p.read_text().split("stage: ")[1].split()[0] for p in root.glob("*.yaml")}
    assert set(stages.values()) == {"ppo", "collect", "rft", "value"}
    import yaml

    for name, stage in stages.items():  # the paths they name are written by the stages before them
        _resolve_paths(parse_config(yaml.safe_load((root / name).read_text()), stage), root)


def test_task_order_covers_each_epoch_and_is_the_same_on_resume():
    tasks = [f"t{i}" for i in range(5)]
    steps = [tasks_for_step(tasks, s, per_step=4, samples=2, seed=3) for s in range(1, 6)]
    assert all(len(s) == 4 and s[0] == s[1] and s[2] == s[3] for s in steps)
    firsts = [t for s in steps for t in s[::2]]
    assert sorted(firsts[:5]) == tasks and sorted(firsts[5:10]) == tasks  # every task once per epoch
    assert steps == [tasks_for_step(tasks, s, 4, 2, 3) for s in range(1, 6)]
    assert steps != [tasks_for_step(tasks, s, 4, 2, 4) for s in range(1, 6)]


# ----------------------------------------------------------------------------- rollouts in both modes

def sampled_ids(rollout) -> list[int]:
    return [i for i, m in zip(rollout.response_ids, rollout.response_mask) if m]


@pytest.mark.slow
def test_single_turn_and_agentic_rollouts_mask_exactly_the_sampled_ids_with_real_rewards(tokenizer, examples, tmp_path):
    task = load_task(examples / "cpu_swish" / "model.py")
    solution = examples / "cpu_swish" / "solution"

    single = ScriptedSampler(tokenizer, [solution_reply(solution)])
    runner = EpisodeRunner(single, tokenizer, single_turn=True, workdir=tmp_path / "s", make_evaluator=cpu_evaluators,
                           workers=2, sandbox=SANDBOX)
    good, = runner.run([task])
    runner.close()
    assert good.reward >= 1 and good.status == "correct", good.record.get("reason")
    rollout, = good.rollouts
    assert list(rollout.response_ids) == single.sampled[0] and all(rollout.response_mask)
    assert rollout.reward == good.reward and good.evaluate_seconds > 0

    agent = ScriptedSampler(tokenizer, [tool_calls_text(write_solution(solution)),
                                        tool_calls_text([("bash", {"command": "python utils/verify.py"})])])
    runner = EpisodeRunner(agent, tokenizer, single_turn=False, workdir=tmp_path / "a",
                           make_evaluator=cpu_evaluators, workers=2, sandbox=SANDBOX, max_new_tokens=4096)
    solved, = runner.run([task])
    runner.close()
    assert solved.reward >= 1 and solved.turns == 3, solved.status
    # Every rollout ends on its reward; together they hold exactly the ids the policy sampled, in order.
    assert [r.reward for r in solved.rollouts] == [solved.reward] * len(solved.rollouts)
    assert [i for r in solved.rollouts for i in sampled_ids(r)] == [i for ids in agent.sampled for i in ids]
    # Tool results are in the sequence but not sampled.
    assert any(not m for r in solved.rollouts for m in r.response_mask)


# ----------------------------------------------------------------------------- PPO: run, kill, resume

def ppo_config(tmp_path: Path, model_dir: Path, examples: Path, steps: int) -> Path:
    return write_config(tmp_path / "ppo.json", {
        "stage": "ppo", "model": {"actor": str(model_dir)}, "tasks": {"source": str(examples / "cpu_swish" / "model.py")},
        "rollout": {"batch": 3, "max_new_tokens": 12, "workers": 1, "context_tokens": 4096},
        "evaluator": {"device": "cpu", "sandbox": SANDBOX},
        "ppo": {"actor_lr": 1e-3, "critic_lr": 1e-3, "micro_batch": 2}, "steps": steps})


def test_single_turn_ppo_resumes_after_a_kill_with_the_same_next_step(model_dir, examples, tmp_path, monkeypatch):
    from cuda_agent.train.ppo import PPOTrainer

    quiet = lambda line: None  # noqa: E731
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    full = run_ppo(load_config(ppo_config(tmp_path / "a", model_dir, examples, 2), "ppo"), tmp_path / "a" / "run",
                   single_turn=True, say=quiet)
    assert len(full) == 2
    # The random tiny model writes no candidate: every episode gets the failure reward, and PPO still updates.
    assert full[0]["reward_mean"] == -1 and full[0]["statuses"] == {"no-candidate": 3}
    assert full[0]["sampled_tokens"] > 0 and full[0]["update_seconds"] > 0
    # The sampler's logprobs are the policy's own (no top-k truncation; fp32 on both sides).
    assert full[0]["logprob_mismatch"] < 1e-3

    # Killed during step 2's update, after its episodes: the resumed run redoes the update, not the episodes.
    real_step, calls = PPOTrainer.step, []

    def killed_on_the_second(self, batch):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step(self, batch)

    monkeypatch.setattr(PPOTrainer, "step", killed_on_the_second)
    config = load_config(ppo_config(tmp_path / "b", model_dir, examples, 2), "ppo")
    with pytest.raises(KeyboardInterrupt):
        run_ppo(config, tmp_path / "b" / "run", single_turn=True, say=quiet)
    monkeypatch.setattr(PPOTrainer, "step", real_step)
    assert (tmp_path / "b" / "run" / "rollouts" / "step-000002.jsonl").exists()
    said: list[str] = []
    resumed = run_ppo(config, tmp_path / "b" / "run", single_turn=True, say=said.append)
    assert [r["step"] for r in resumed] == [1, 2]
    assert any("saved before the interruption" in line for line in said)
    for key in ("reward_mean", "response_tokens", "policy_loss", "value_loss", "entropy", "logprob_mismatch"):
        assert resumed[1][key] == pytest.approx(full[1][key], rel=1e-4, abs=1e-6), key
    assert (tmp_path / "b" / "run" / "curves.png").exists()
    assert not list((tmp_path / "b" / "run" / "rollouts").glob("*.jsonl"))  # committed steps leave none behind
    checkpoint = tmp_path / "b" / "run" / "checkpoint" / "actor"
    assert transformers.AutoTokenizer.from_pretrained(checkpoint).chat_template  # a model directory of its own
    saved = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "run" / "checkpoint" / "actor")
    for (name, a), b in zip(saved.state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name

    # More steps continue the run; another setting is refused.
    longer = run_ppo(load_config(ppo_config(tmp_path / "b", model_dir, examples, 3), "ppo"), tmp_path / "b" / "run",
                     single_turn=True, say=quiet)
    assert [r["step"] for r in longer] == [1, 2, 3]
    changed = json.loads((tmp_path / "b" / "ppo.json").read_text()) | {"seed": 5}
    with pytest.raises(ValueError, match="another config .*seed: 0 -> 5"):
        run_ppo(load_config(write_config(tmp_path / "b" / "ppo.json", changed), "ppo"), tmp_path / "b" / "run",
                single_turn=True, say=quiet)


# ----------------------------------------------------------------------------- warm-up: filter, RFT, value

def trajectory(tokenizer, reward, calls, texts, seed=0) -> dict:
    """A hand-made agent trajectory record: a prompt, then per text a sampled reply and a tool result."""
    ids, mask = tokenizer.encode("<|im_start|>user\nwrite a kernel<|im_end|>\n<|im_start|>assistant\n"), None
    mask = [0] * len(ids)
    for text in texts:
        reply = tokenizer.encode(text) + [tokenizer.eos_token_id]
        tool = tokenizer.encode("\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n")
        ids, mask = ids + reply + tool, mask + [1] * len(reply) + [0] * len(tool)
    while not mask[-1]:
        ids, mask = ids[:-1], mask[:-1]
    turns = [{"turn": i, "tool_calls": [c]} for i, c in enumerate(calls)]
    return {"reward": reward, "turns": turns,
            "tokens": [{"ids": ids, "mask": mask, "logprobs": [-1.0 if m else 0.0 for m in mask]}]}


def test_rft_filter_keeps_rewarded_episodes_without_loops_or_invalid_calls(tokenizer):
    ok = {"name": "bash", "arguments": '{"command": "python utils/verify.py"}', "metadata": {}}
    same = dict(ok, arguments='{ "command":  "python utils/verify.py" }')  # the same call, written differently
    invalid = {"name": "nope", "arguments": "{}", "metadata": {"invalid_call": True}}
    assert keep_episode(trajectory(tokenizer, 2, [ok], ["a"])).keep
    assert "reward -1" in keep_episode(trajectory(tokenizer, -1, [ok], ["a"])).reason
    assert "redundant loop" in keep_episode(trajectory(tokenizer, 3, [ok, same, ok], ["a"])).reason
    assert keep_episode(trajectory(tokenizer, 3, [ok, same], ["a"])).keep
    assert "breaks the schema" in keep_episode(trajectory(tokenizer, 3, [ok, invalid], ["a"])).reason
    assert keep_episode(trajectory(tokenizer, 3, [ok, invalid], ["a"]), drop_invalid_calls=False).keep
    assert "no token trace" in keep_episode({"reward": 3, "turns": []}).reason


def test_rft_raises_the_sampled_tokens_and_value_learns_the_rewards(tokenizer, model_dir, tmp_path):
    texts = ["write the kernel", "run verify", "profile it now"]
    records = [trajectory(tokenizer, r, [], texts[: 1 + i % 3]) for i, r in enumerate([3, 1, 2, 3, 1, 2, -1, 3])]
    data = tmp_path / "collect"
    data.mkdir()
    (data / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    quiet = lambda line: None  # noqa: E731
    rft = run_rft(load_config(write_config(tmp_path / "rft.json", {
        "stage": "rft", "model": {"actor": str(model_dir)}, "data": {"trajectories": [str(data)]},
        "sft": {"lr": 3e-3, "batch": 4, "micro_batch": 2, "epochs": 3}}), "rft"), tmp_path / "rft", say=quiet)
    assert json.loads((tmp_path / "rft" / "filter.json").read_text())["kept"] == 7  # the -1 episode dropped
    assert len(rft) == 6 and rft[-1]["sft_loss"] < rft[0]["sft_loss"]

    before = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    after = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "rft" / "checkpoint" / "actor")
    from cuda_agent.train.models import policy_forward
    from cuda_agent.train.rollout import Rollout, RolloutBatch

    batch = RolloutBatch.collate([Rollout.from_segment(r["tokens"][0], r["reward"]) for r in records[:3]])
    with torch.no_grad():
        lp = [float((policy_forward(m, batch.ids, batch.attention)[0] * batch.mask).sum()) for m in (before, after)]
    assert lp[1] > lp[0] + 1.0

    value = run_value(load_config(write_config(tmp_path / "value.json", {
        "stage": "value", "model": {"actor": str(model_dir)}, "data": {"trajectories": [str(data)], "holdout": 0.3},
        "value": {"iterations": 6, "lr": 3e-3, "batch": 4, "micro_batch": 4}}), "value"), tmp_path / "value", say=quiet)
    start = json.loads((tmp_path / "value" / "before.json").read_text())
    assert value[0]["heldout_sequences"] == 2
    assert value[-1]["heldout_value_mse_mc"] < start["value_mse_mc"] / 2
    critic = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "value" / "checkpoint" / "critic")
    assert critic.config.num_labels == 1  # what verl loads as its critic


# ----------------------------------------------------------------------------- collect

@pytest.mark.slow
def test_collect_appends_trajectories_and_a_resume_runs_only_the_missing(tokenizer, model_dir, examples, tmp_path,
                                                                         monkeypatch):
    from cuda_agent.train import stages

    looping = tool_calls_text([("bash", {"command": "ls"})])
    sampler = ScriptedSampler(tokenizer, [looping] * 3)
    monkeypatch.setattr(stages, "_sampler", lambda *args: sampler)
    path = write_config(tmp_path / "collect.json", {
        "stage": "collect", "model": {"actor": str(model_dir)},
        "tasks": {"source": str(examples / "cpu_swish" / "model.py")},
        "rollout": {"batch": 2, "workers": 2, "max_turns": 4, "max_new_tokens": 64}, "steps": 1,
        "evaluator": {"device": "cpu", "sandbox": SANDBOX}})
    out = run_collect(load_config(path, "collect"), tmp_path / "c", say=lambda line: None, make_evaluator=cpu_evaluators)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["episode_index"] for r in rows) == [0, 1]
    assert all(r["tokens"] and len(r["turns"]) == 4 for r in rows)
    assert "redundant loop" in keep_episode(rows[0] | {"reward": 3}).reason
    calls = len(sampler.sampled)
    run_collect(load_config(path, "collect"), tmp_path / "c", say=lambda line: None, make_evaluator=cpu_evaluators)
    assert len(sampler.sampled) == calls and len(out.read_text().splitlines()) == 2


@pytest.mark.slow
def test_agentic_ppo_trains_on_the_agent_loops_sampled_tokens(tokenizer, model_dir, examples, tmp_path, monkeypatch):
    """Stage 3's path: the agent loop over TokenChat, the real evaluator's final reward, one PPO update on the
    sampled tokens of every turn (tool results in the sequence, masked out)."""
    from cuda_agent.train import stages

    solution = examples / "cpu_swish" / "solution"
    sampler = ScriptedSampler(tokenizer, [tool_calls_text(write_solution(solution))])
    monkeypatch.setattr(stages, "_sampler", lambda *args: sampler)
    config = write_config(tmp_path / "ppo.json", {
        "stage": "ppo", "model": {"actor": str(model_dir)}, "tasks": {"source": str(examples / "cpu_swish" / "model.py")},
        "rollout": {"batch": 2, "workers": 2, "max_turns": 3, "max_new_tokens": 2048},
        "evaluator": {"device": "cpu", "sandbox": SANDBOX}, "ppo": {"micro_batch": 1}, "steps": 1})
    row, = run_ppo(load_config(config, "ppo"), tmp_path / "run", single_turn=False, say=lambda line: None,
                   make_evaluator=cpu_evaluators)
    assert row["episodes"] == 2 and row["turns"] == 2 and row["pass_rate"] == 1.0, row["statuses"]
    assert row["sampled_tokens"] == sum(len(ids) for ids in sampler.sampled)
    assert row["evaluate_seconds"] > 0 and row["update_seconds"] > 0
