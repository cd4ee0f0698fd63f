"""Training on the GPU: episodes of both modes with the CUDA evaluator (a scripted token policy writes the
row-softmax solution), and the single-turn PPO stage with a tiny model on the GPU (bf16 autocast, chunked
scoring, gradient checkpointing)."""

import json
import sys
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripted_policy import write_solution  # noqa: E402
from tiny_lm import ScriptedSampler, save_tiny_model, solution_reply, tool_calls_text, torchrun, train_tokenizer  # noqa: E402

from cuda_agent.evaluate.evaluator import Evaluator  # noqa: E402
from cuda_agent.tasks import load_task  # noqa: E402
from cuda_agent.train.config import load_config  # noqa: E402
from cuda_agent.train.episodes import EpisodeRunner  # noqa: E402
from cuda_agent.train.stages import run_ppo  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cuda_row_softmax"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def test_episodes_of_both_modes_get_the_cuda_evaluators_reward(tokenizer, tmp_path, cache_dir):
    task = load_task(EXAMPLE / "model.py")
    solution = EXAMPLE / "solution"

    def evaluators(lock: threading.Lock) -> Evaluator:
        return Evaluator("cuda", cache_dir=cache_dir, timing_lock=lock)

    single = ScriptedSampler(tokenizer, [solution_reply(solution)])
    runner = EpisodeRunner(single, tokenizer, single_turn=True, workdir=tmp_path / "s", make_evaluator=evaluators)
    agent = ScriptedSampler(tokenizer, [tool_calls_text(write_solution(solution)),
                                        tool_calls_text([("bash", {"command": "python utils/verify.py"})])])
    agentic = EpisodeRunner(agent, tokenizer, single_turn=False, workdir=tmp_path / "a", make_evaluator=evaluators)
    try:
        (one,), (many,) = runner.run([task]), agentic.run([task])
    finally:
        runner.close()
        agentic.close()
    print(f"\nsingle-turn: reward {one.reward} ({one.status}), evaluation {one.evaluate_seconds:.1f} s")
    print(f"agentic: reward {many.reward} ({many.status}), {many.turns} turns, evaluations {many.evaluate_seconds:.1f} s")
    assert one.reward >= 1 and many.reward >= 1
    assert [i for r in many.rollouts for i, m in zip(r.response_ids, r.response_mask) if m] == \
        [i for ids in agent.sampled for i in ids]


def test_single_turn_ppo_stage_trains_on_the_gpu(tokenizer, tmp_path):
    model_dir = save_tiny_model(tmp_path / "base", tokenizer)
    config = tmp_path / "ppo.json"
    config.write_text(json.dumps({
        "stage": "ppo", "model": {"actor": str(model_dir), "precision": "bf16", "gradient_checkpointing": True,
                                  "logits_chunk": 64},
        "tasks": {"source": str(EXAMPLE / "model.py")}, "rollout": {"batch": 4, "max_new_tokens": 200, "workers": 2},
        "evaluator": {"device": "cuda"}, "ppo": {"actor_lr": 1e-3, "critic_lr": 1e-3, "micro_batch": 2}, "steps": 2}))
    rows = run_ppo(load_config(config, "ppo"), tmp_path / "run", single_turn=True)
    print("\n" + "\n".join(json.dumps({k: r[k] for k in ("step", "reward_mean", "entropy", "logprob_mismatch",
                                                          "generate_tokens_per_s", "update_seconds")}) for r in rows))
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["sampled_tokens"] > 0 and rows[0]["logprob_mismatch"] < 0.5  # logged; bf16 on both sides
    assert (tmp_path / "run" / "curves.png").exists()


def test_ppo_through_fsdp2_on_the_gpu_resumes(tokenizer, tmp_path):
    """The FSDP2 path (``model.fsdp``: a group of one on this GPU, NCCL): sharded actor and critic, the chunked
    head inside the sharded forward, the sampling copy refreshed after each update, gathered checkpoints, and
    a resume that loads the sharded optimisers."""
    model_dir = save_tiny_model(tmp_path / "base", tokenizer)
    values = {"stage": "ppo", "model": {"actor": str(model_dir), "precision": "bf16", "fsdp": True,
                                        "gradient_checkpointing": True, "logits_chunk": 16},
              "tasks": {"source": str(EXAMPLE / "model.py")}, "rollout": {"batch": 4, "max_new_tokens": 64},
              "evaluator": {"device": "cuda"}, "ppo": {"actor_lr": 1e-3, "critic_lr": 1e-3, "micro_batch": 2},
              "steps": 1}
    config = tmp_path / "ppo.json"
    config.write_text(json.dumps(values))
    run_ppo(load_config(config, "ppo"), tmp_path / "run", single_turn=True)
    config.write_text(json.dumps(values | {"steps": 2}))
    rows = run_ppo(load_config(config, "ppo"), tmp_path / "run", single_turn=True)
    print("\n" + "\n".join(json.dumps({k: r[k] for k in ("step", "entropy", "logprob_mismatch", "actor_grad_norm",
                                                          "update_seconds")}) for r in rows))
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["sampled_tokens"] > 0
    assert rows[1]["logprob_mismatch"] < 0.05  # the sampling copy holds the updated weights
    saved = json.loads((tmp_path / "run" / "checkpoint" / "actor" / "config.json").read_text())
    assert saved["architectures"] == ["Qwen2ForCausalLM"]
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint" / "actor")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_ppo_across_the_gpus_of_the_node_with_torchrun(tokenizer, tmp_path):
    """One rank per GPU (NCCL): each runs its share of the episodes with evaluators on its own GPU, FSDP2
    shards actor and critic across them, and a second launch resumes the run."""
    ranks = torch.cuda.device_count()
    model_dir = save_tiny_model(tmp_path / "base", tokenizer)
    values = {"stage": "ppo", "model": {"actor": str(model_dir), "precision": "bf16", "logits_chunk": 16},
              "tasks": {"source": str(EXAMPLE / "model.py")}, "rollout": {"batch": 2 * ranks, "max_new_tokens": 64},
              "evaluator": {"device": "cuda"}, "ppo": {"micro_batch": 1}, "steps": 1}
    config = tmp_path / "ppo.json"
    config.write_text(json.dumps(values))
    torchrun(ranks, "ppo", "--single-turn", "--config", str(config), "--out", str(tmp_path / "run"), cwd=tmp_path)
    config.write_text(json.dumps(values | {"steps": 2}))
    log = torchrun(ranks, "ppo", "--single-turn", "--config", str(config), "--out", str(tmp_path / "run"), cwd=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    print("\n" + "\n".join(json.dumps({k: r[k] for k in ("step", "episodes", "sampled_tokens", "logprob_mismatch",
                                                          "update_seconds")}) for r in rows))
    assert "resuming" in log and [r["step"] for r in rows] == [1, 2]
    assert all(r["episodes"] == 2 * ranks for r in rows) and rows[1]["logprob_mismatch"] < 0.05
