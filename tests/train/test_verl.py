"""verl integration: our agentic episode as a verl agent loop, tasks as verl's parquet, the single-turn reward.

The loop is made the way verl's agent-loop worker makes it (the registry entry a user's YAML names, through
hydra), fed a row verl's own RLHFDataset read from our parquet, and driven by a scripted token-level server
manager; its output must be exactly the token sequence, mask, logprobs and reward that the same scripted
episode gives when run directly (run_episode over TokenChat, then train.rollout)."""

from __future__ import annotations

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install 'cuda-agent[verl]' to run the verl integration "
                                   "tests")

import asyncio  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry  # noqa: E402
from verl.trainer.ppo.reward import get_custom_reward_fn  # noqa: E402
from verl.utils.dataset.rl_dataset import RLHFDataset  # noqa: E402
from verl.workers.rollout.replica import TokenOutput as ServerOutput  # noqa: E402

from scripted_policy import write_solution  # noqa: E402
from tiny_lm import ScriptedSampler, solution_reply, tool_calls_text, train_tokenizer  # noqa: E402

from cuda_agent.agent.loop import AgentConfig, run_episode  # noqa: E402
from cuda_agent.agent.tokens import TokenChat, TokenOutput  # noqa: E402
from cuda_agent.build import BuildResult  # noqa: E402
from cuda_agent.evaluate import Policy, TimingConfig  # noqa: E402
from cuda_agent.evaluate.counters import unavailable  # noqa: E402
from cuda_agent.evaluate.protocol.degenerate import DegenerateReport  # noqa: E402
from cuda_agent.evaluate.interface import EvaluatorLike  # noqa: E402
from cuda_agent.evaluate.result import EvalResult  # noqa: E402
from cuda_agent.service import ServiceError  # noqa: E402
from cuda_agent.tasks import load_task  # noqa: E402
from cuda_agent.train.rollout import rollouts_from_trace  # noqa: E402
from cuda_agent.train.single_turn import FAILURE_REWARD, single_turn_messages  # noqa: E402
from cuda_agent.train.verl.agent_loop import CudaAgentLoop  # noqa: E402
from cuda_agent.tasks.rows import task_from_row  # noqa: E402
from cuda_agent.train.verl.data import AGENT_NAME, tasks_to_parquet  # noqa: E402
from cuda_agent.train.verl.reward import compute_score  # noqa: E402

SANDBOX = "auto"
# The loop's episodes run the agent's shell in bubblewrap ("auto" never falls back to no sandbox): where it is
# missing, those tests skip and say so rather than fail.
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap (bwrap) is not installed: the episodes' shell runs in it")
SOLVED = 2.5  # the scripted evaluator's reward for the example's solution
SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)  # as verl's worker sends


class SolutionChecker:
    """An evaluator double: the example's solution in the workspace earns ``SOLVED``, anything else is incorrect."""

    device = "cpu"
    policy = Policy()
    timing = TimingConfig().resolved("cpu")

    def __init__(self, solution: Path):
        self.expected = (solution / "model_new.py").read_text()
        self.seen: list[str] = []

    def evaluate(self, task, candidate, build_result=None, *, timed=True):
        self.seen.append(candidate.model_new)
        good = candidate.model_new.strip() == self.expected.strip()
        return EvalResult(task=task.to_dict(), candidate=candidate.to_dict(), device="cpu", policy={}, timing={},
                          status="correct" if good else "incorrect", correct=good,
                          reward=(SOLVED if good else -1.0) if timed else None)

    def verify(self, task, candidate, build_result=None):
        return self.evaluate(task, candidate, timed=False)

    def build(self, candidate):
        return BuildResult(ok=True, backend="cpu", key=candidate.digest[:16], modules={}, diagnostics=[])

    def baseline(self, task, refresh=False, degenerate=False):
        return {}

    def check_degenerate(self, task, draws=3):
        return DegenerateReport(task=task.name, policy="fair", passing=[])

    def counters(self, task, candidate, times=None):
        return unavailable("the scripted evaluator reads no hardware counters", times)

    def close(self):
        pass


class ScriptedServer:
    """verl's server manager, scripted per assistant turn (``ScriptedSampler``), with logprobs that differ from
    token to token so that a shifted copy would show; records every request."""

    def __init__(self, tokenizer, turns: list[str]):
        self.sampler = ScriptedSampler(tokenizer, turns)
        self.requests: list[dict] = []

    def sample(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        ids = self.sampler.generate(prompt_ids, 0).ids
        return ids, [-(1 + (7 * i + token) % 13) / 10 for i, token in enumerate(ids)]

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        self.requests.append({"request_id": request_id, "params": dict(sampling_params), "prompt": list(prompt_ids),
                              "loop": asyncio.get_running_loop(), "thread": threading.current_thread()})
        ids, logprobs = self.sample(prompt_ids)
        return ServerOutput(token_ids=ids, log_probs=logprobs, num_preempted=0)

    def backend(self):
        """The same policy as a plain ``TokenBackend``, for the episode run without verl."""
        server = self

        class Direct:
            def generate(self, prompt_ids, max_new_tokens):
                ids, logprobs = server.sample(prompt_ids)
                return TokenOutput(ids, logprobs, "stop")

        return Direct()


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def task(examples):
    return load_task(examples / "cpu_swish" / "model.py")


@pytest.fixture
def checker(examples):
    return SolutionChecker(examples / "cpu_swish" / "solution")


def turns(examples) -> list[str]:
    solution = examples / "cpu_swish" / "solution"
    return [tool_calls_text(write_solution(solution)),
            tool_calls_text([("read", {"path": "model_new.py", "limit": 3})]),
            "The kernel fuses the sigmoid and the scale."]


def dataset_row(path: Path, tokenizer, tmp_path: Path, monkeypatch) -> dict:
    """Row 0 as verl's RLHFDataset hands it to the agent-loop worker (tensors aside)."""
    import datasets

    # RLHFDataset reads parquet through `datasets`, which would cache it under the home directory.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    config = OmegaConf.create({"max_prompt_length": 4096, "cache_dir": str(tmp_path / "verl-cache")})
    dataset = RLHFDataset(data_files=[str(path)], tokenizer=tokenizer, config=config)
    return {k: v for k, v in dataset[0].items() if k != "dummy_tensor"}


def run_loop(row: dict, server, tokenizer, evaluator, tmp_path: Path, *, prompt_length: int, response_length: int,
             episodes: int = 1):
    """``CudaAgentLoop.run`` as verl's AgentLoopWorker calls it: the class its registry names, made through hydra
    from a YAML entry of agent_loop_config_path, a loop object per sample, ``episodes`` samples at once on one
    running event loop. Returns the outputs (one, or a list) and the event loop."""
    (tmp_path / "agent_loops.yaml").write_text(
        f"- name: {AGENT_NAME}\n  _target_: cuda_agent.train.verl.agent_loop.CudaAgentLoop\n"
        f"  sandbox: {SANDBOX}\n  max_turns: 6\n  workdir: {tmp_path / 'episodes'}\n")
    entry, = OmegaConf.load(tmp_path / "agent_loops.yaml")
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": prompt_length,
                                                                 "response_length": response_length,
                                                                 "full_determinism": False},
                                                     "model": {"path": "tiny"}},
                               "data": {}})
    kwargs = dict(row)
    assert kwargs.pop("agent_name") == entry.name  # the row selects the loop

    async def one():
        agent_loop = hydra.utils.instantiate(config=entry, trainer_config=DictConfigWrap(config), server_manager=server,
                                             tokenizer=tokenizer, processor=None, hf_model_type=None,
                                             dataset_cls=RLHFDataset, data_config=DictConfigWrap(config.data),
                                             tools=ToolListWrap([]), evaluator=evaluator)
        assert isinstance(agent_loop, CudaAgentLoop)
        return await agent_loop.run(dict(SAMPLING), **kwargs)

    async def main():
        outputs = await asyncio.gather(*(one() for _ in range(episodes)))
        return outputs if episodes > 1 else outputs[0], asyncio.get_running_loop()

    return asyncio.run(main())


@pytest.fixture
def row(task, tokenizer, tmp_path, monkeypatch):
    return dataset_row(tasks_to_parquet(task.source, tmp_path / "tasks.parquet"), tokenizer, tmp_path, monkeypatch)


@needs_bwrap
def test_the_verl_loop_returns_our_episode_token_for_token(row, task, tokenizer, checker, examples, tmp_path):
    assert isinstance(checker, EvaluatorLike)
    assert _agent_loop_registry[AGENT_NAME] == {"_target_": "cuda_agent.train.verl.agent_loop.CudaAgentLoop"}
    server = ScriptedServer(tokenizer, turns(examples))
    output, loop = run_loop(row, server, tokenizer, checker, tmp_path, prompt_length=8192, response_length=16384)

    # Generation went to verl's event loop (not the episode's thread), one request id for the episode, verl's
    # sampling parameters passed on with the room left in the response as the token limit.
    assert len(server.requests) == 3
    assert all(r["loop"] is loop and r["thread"] is threading.main_thread() for r in server.requests)
    assert len({r["request_id"] for r in server.requests}) == 1
    first = server.requests[0]["prompt"]
    for r in server.requests:
        assert {k: r["params"][k] for k in SAMPLING} == SAMPLING
        assert r["params"]["max_tokens"] == 16384 - (len(r["prompt"]) - len(first))
    assert output.reward_score == SOLVED and checker.seen[-1].strip() == checker.expected.strip()
    assert output.extra_fields["end_reason"] == "done" and output.extra_fields["status"] == "correct"

    # The same scripted episode, run directly in the same workspace (its path is in the prompt), gives the
    # very same sequence.
    workspace = re.search(r"The workspace is your current directory: (\S+)", tokenizer.decode(first))[1]
    assert not Path(workspace).exists()  # the loop cleaned up after itself
    sampled = list(server.sampler.sampled)
    episode = run_episode(task, TokenChat(server.backend(), tokenizer, max_new_tokens=16384), checker,
                          Path(workspace).parent, config=AgentConfig(max_turns=6), sandbox=SANDBOX)
    rollout, = rollouts_from_trace(episode.record["tokens"], episode.reward)
    assert output.prompt_ids == list(rollout.prompt_ids) == first
    assert output.response_ids == list(rollout.response_ids)
    assert output.response_mask == list(rollout.response_mask)
    assert output.response_logprobs == list(rollout.logprobs)
    assert output.reward_score == rollout.reward == episode.reward
    assert output.num_turns == len(episode.record["messages"]) - 1  # user, assistant and tool messages

    # Exactly the sampled ids carry the mask, tool results sit between them, and the sequence ends on the last
    # sampled token, where verl puts the reward.
    mask = output.response_mask
    assert [i for i, m in zip(output.response_ids, mask) if m] == [i for ids in sampled for i in ids]
    assert 0 in mask and mask[0] == mask[-1] == 1 and output.response_ids[-1] == tokenizer.eos_token_id
    assert all(lp == 0.0 for lp, m in zip(output.response_logprobs, mask) if not m)
    scores = output.as_dict()["rm_scores"]
    assert float(scores[-1]) == SOLVED and float(scores.abs().sum()) == SOLVED


@needs_bwrap
def test_episodes_run_at_once_each_on_its_own_sequence(row, tokenizer, checker, examples, tmp_path):
    server = ScriptedServer(tokenizer, turns(examples))
    outputs, _ = run_loop(row, server, tokenizer, checker, tmp_path, prompt_length=8192, response_length=16384,
                          episodes=3)
    assert len(server.requests) == 9 and len({r["request_id"] for r in server.requests}) == 3
    # Each episode in a workspace of its own (the path is in its prompt), each solved.
    assert len({tuple(o.prompt_ids) for o in outputs}) == 3
    assert [o.reward_score for o in outputs] == [SOLVED] * 3
    replies = [tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id] for text in turns(examples)]
    for output in outputs:
        assert [i for i, m in zip(output.response_ids, output.response_mask) if m] == [i for r in replies for i in r]


@needs_bwrap
def test_an_episode_ends_where_the_response_budget_is_spent(row, tokenizer, checker, examples, tmp_path):
    script = turns(examples)
    first_reply = len(tokenizer.encode(script[0], add_special_tokens=False)) + 1
    server = ScriptedServer(tokenizer, script)
    output, _ = run_loop(row, server, tokenizer, checker, tmp_path, prompt_length=8192,
                         response_length=first_reply + 5)  # the reply fits, its tool results do not leave room
    assert len(server.requests) == 1
    assert "response budget is spent" in output.extra_fields["end_reason"]
    # The trailing tool results are trimmed: the sequence is the one reply, all sampled, and it still earns the
    # final evaluation's reward (the files it wrote are the solution).
    assert output.response_ids == server.sampler.sampled[0] and set(output.response_mask) == {1}
    assert output.reward_score == SOLVED


@needs_bwrap
def test_a_first_prompt_longer_than_verls_prompt_length_names_the_setting(row, tokenizer, checker, examples, tmp_path):
    server = ScriptedServer(tokenizer, turns(examples))
    with pytest.raises(ValueError, match=r"prompt_length=64: set it to at least \d+"):
        run_loop(row, server, tokenizer, checker, tmp_path, prompt_length=64, response_length=1024)
    assert server.requests == []


def test_tasks_become_the_rows_verls_dataset_reads(task, tokenizer, tmp_path, monkeypatch):
    path = tasks_to_parquet(task.source, tmp_path / "data" / "tasks.parquet")
    rows = pq.read_table(path).to_pylist()
    assert len(rows) == 1
    (stored,) = rows
    assert stored["data_source"] == "cuda_agent" and stored["ability"] == "cuda" and stored["agent_name"] == AGENT_NAME
    assert stored["prompt"] == single_turn_messages(task)
    assert stored["reward_model"] == {"style": "rule", "ground_truth": task.digest}
    assert stored["extra_info"]["code"] == task.code and stored["extra_info"]["name"] == task.name
    # verl's own dataset: the chat messages become raw_prompt, extra_info comes through, the task round-trips.
    row = dataset_row(path, tokenizer, tmp_path, monkeypatch)
    assert row["raw_prompt"] == single_turn_messages(task) and row["agent_name"] == AGENT_NAME
    assert row["index"] == 0 and task_from_row(row["extra_info"]) == task
    single = pq.read_table(tasks_to_parquet(task.source, tmp_path / "single.parquet",
                                            agent_name="single_turn_agent")).to_pylist()
    assert single[0]["agent_name"] == "single_turn_agent"
    with pytest.raises(ValueError, match="needs the task.s name and code"):
        task_from_row({"index": 0})


def test_the_reward_function_scores_a_reply_as_verl_calls_it(task, checker, examples, tmp_path):
    extra_info = pq.read_table(tasks_to_parquet(task.source, tmp_path / "t.parquet")).to_pylist()[0]["extra_info"]
    config = OmegaConf.create({"reward": {"custom_reward_function": {"path": "pkg://cuda_agent.train.verl.reward",
                                                                     "name": "compute_score", "reward_kwargs": {}}}})
    score = get_custom_reward_fn(config)  # how verl loads a custom reward function
    good = score(data_source="cuda_agent", solution_str=solution_reply(examples / "cpu_swish" / "solution"),
                 ground_truth=task.digest, extra_info=dict(extra_info), evaluator=checker)
    # Every sample carries the same keys (verl gathers them per batch): ``no_verdict`` too, 0.0 for a verdict.
    assert good == {"score": SOLVED, "acc": 1.0, "no_verdict": 0.0} and len(checker.seen) == 1
    none = score(data_source="cuda_agent", solution_str="I would fuse the two operations.", ground_truth=task.digest,
                 extra_info=dict(extra_info), evaluator=checker)
    # Nothing to evaluate: a failure, not a no-verdict.
    assert none == {"score": FAILURE_REWARD, "acc": 0.0, "no_verdict": 0.0} and len(checker.seen) == 1


def test_the_service_url_comes_from_the_environment(task, monkeypatch, tmp_path):
    extra_info = pq.read_table(tasks_to_parquet(task.source, tmp_path / "t.parquet")).to_pylist()[0]["extra_info"]
    monkeypatch.setenv("CUDA_AGENT_SERVICE", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ServiceError, match=r"no evaluation service at http://127.0.0.1:9"):
        compute_score("cuda_agent", "### model_new.py\n```python\nclass ModelNew: pass\n```", task.digest, extra_info)
