"""Run directories: a restart with another config is refused by name; a run killed between its
checkpoint and its metrics line resumes without losing or repeating the step; restore brings back
weights, optimiser and random state."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cuda_agent.train.run import RunDir, RunError, plot_metrics  # noqa: E402


def tiny():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_once(model, optimizer):
    loss = model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_a_run_resumes_with_its_weights_optimiser_and_random_state(tmp_path):
    model, optimizer = tiny()
    run = RunDir(tmp_path / "run", {"lr": 1e-2})
    assert run.open() == 0
    for step in (1, 2):
        train_once(model, optimizer)
        run.commit(step, {"loss": float(step)}, {"actor": model}, {"actor": optimizer})
    expected_draw = torch.rand(3)  # what the run would draw next
    expected_weight = next(model.parameters()).detach().clone()

    fresh, fresh_optimizer = tiny()
    again = RunDir(tmp_path / "run", {"lr": 1e-2})
    assert again.open() == 2
    again.restore({"actor": fresh}, {"actor": fresh_optimizer})
    assert torch.equal(next(fresh.parameters()), expected_weight)
    assert torch.equal(torch.rand(3), expected_draw)
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 2  # Adam's moments came back too
    assert [row["step"] for row in again.metrics()] == [1, 2]


def test_another_config_is_refused_naming_what_changed(tmp_path):
    RunDir(tmp_path, {"lr": 1e-2, "batch": 4}).open()
    with pytest.raises(RunError, match=r"batch: 4 -> 8.*new --out"):
        RunDir(tmp_path, {"lr": 1e-2, "batch": 8}).open()


def test_a_kill_between_checkpoint_and_metrics_loses_no_step(tmp_path):
    model, optimizer = tiny()
    run = RunDir(tmp_path, {"x": 1})
    run.open()
    run.commit(1, {"loss": 1.0}, {"actor": model}, {"actor": optimizer})
    run.save(2, {"step": 2, "loss": 0.5}, {"actor": model}, {"actor": optimizer})  # killed before record()
    assert RunDir(tmp_path, {"x": 1}).open() == 2
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    # Metrics ahead of the checkpoint cannot be resumed honestly.
    (tmp_path / "metrics.jsonl").write_text((tmp_path / "metrics.jsonl").read_text() + '{"step": 3}\n')
    with pytest.raises(RunError, match="damaged"):
        RunDir(tmp_path, {"x": 1}).open()


def test_plots_are_written_from_the_metrics(tmp_path):
    with pytest.raises(RunError, match="no metrics"):
        plot_metrics(tmp_path)
    rows = [{"step": s, "reward_mean": s / 3, "entropy": 1 - s / 10, "reward_shares": {"-1": 0.5, "3": 0.5}}
            for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = plot_metrics(tmp_path)
    assert [p.name for p in written] == ["curves.png", "rewards.png"]
    assert all(p.stat().st_size > 1000 for p in written)
