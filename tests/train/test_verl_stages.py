"""The paper's stages on verl: our override files composed with verl 0.9.1's own configs, the command lines that
run them, and stage 2a's dataset (our trajectories, the RFT filter, the sampled-token mask) as verl's SFT
trainer builds, collates and trains on it."""

from __future__ import annotations

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install 'cuda-agent[verl]' to run the verl integration "
                                   "tests")

import inspect  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import verl  # noqa: E402
import yaml  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from omegaconf.errors import InterpolationResolutionError  # noqa: E402
from verl.trainer.ppo.reward import get_custom_reward_fn  # noqa: E402
from verl.trainer.ppo.utils import need_critic, need_reference_policy  # noqa: E402
from verl.trainer.sft_trainer import create_sft_dataset  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass, validate_config  # noqa: E402
from verl.utils.dataset.dataset_utils import SFTTensorCollator  # noqa: E402

from tiny_lm import save_tiny_model, train_tokenizer  # noqa: E402

from cuda_agent.train.run import RunError  # noqa: E402
from cuda_agent.train.verl.agent_loop import CudaAgentLoop  # noqa: E402
from cuda_agent.train.verl.data import AGENT_NAME  # noqa: E402
from cuda_agent.train.verl.launch import CONFIGS, STAGES, default_config, verl_command  # noqa: E402
from cuda_agent.train.verl.reward import compute_score  # noqa: E402
from cuda_agent.train.verl.sft import TrajectorySFTDataset  # noqa: E402

VERL_CONFIGS = Path(verl.__file__).parent / "trainer" / "config"
# Keys our files set that verl's composed config does not declare: read by our own code.
OURS = {"sft_rft": ("data.rft_filter",)}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "base", tokenizer)


def compose_in(folder: Path, name: str, overrides: list[str] = ()):
    with initialize_config_dir(config_dir=str(folder), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def leaves(values: dict, prefix: str = ""):
    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def declared(config, dotted: str) -> bool:
    """Whether verl's config has the key (``???`` values included, which OmegaConf.select would hide)."""
    parent, _, last = dotted.rpartition(".")
    node = OmegaConf.select(config, parent) if parent else config
    return node is not None and OmegaConf.is_dict(node) and last in node.keys()


# ----------------------------------------------------------------------------- the override files

def fills(name: str, model: Path) -> list[str]:
    """What a user must give each file (its ``???``), here the tiny model and placeholder data."""
    return {"ppo_single_turn": [f"actor_rollout_ref.model.path={model}", "data.train_files=t.parquet",
                                "data.val_files=v.parquet"],
            "ppo_agentic": [f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}",
                            "data.train_files=t.parquet", "data.val_files=v.parquet",
                            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={CONFIGS / 'agent_loops.yaml'}"],
            "sft_rft": [f"model.path={model}", "data.train_files=[t.jsonl]"]}[name]


@pytest.mark.parametrize("name, base", [("ppo_single_turn", "ppo_trainer"), ("ppo_agentic", "ppo_trainer"),
                                        ("sft_rft", "sft_trainer_engine")])
def test_every_key_of_our_files_is_one_of_verls(name, base, monkeypatch):
    verls = compose_in(VERL_CONFIGS, base)
    ours = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    assert ours.pop("defaults") == [base, "_self_"]
    assert ours.pop("hydra") == {"searchpath": ["pkg://verl.trainer.config"]}
    extra = OURS.get(name, ())
    unknown = [k for k in leaves(ours) if not declared(verls, k) and not k.startswith(extra)]
    assert unknown == []
    # What a run must be given is exactly what is left to the environment: the models, the data (and the agent
    # loops' file, which verl_command passes). Unset, it stops the run naming the key, where verl's sample
    # defaults would otherwise stand.
    needed = sorted(o.split("=")[0] for o in fills(name, Path("m")))
    written = composed_raw(name)
    assert sorted(k for k in leaves(ours) if str(raw(written, k)).startswith("${oc.env:")) == needed
    for key in needed:
        variable = raw(written, key)[len("${oc.env:"):-1]
        monkeypatch.delenv(variable, raising=False)
        with pytest.raises(InterpolationResolutionError, match=rf"'{variable}' not found[\s\S]*{key}"):
            OmegaConf.select(compose_in(CONFIGS, name), key, throw_on_resolution_failure=True)


def composed_raw(name: str) -> dict:
    """Our file composed with verl's, interpolations left as written."""
    return OmegaConf.to_container(compose_in(CONFIGS, name), resolve=False)


def raw(values: dict, dotted: str):
    for part in dotted.split("."):
        values = values[part]
    return values


@pytest.mark.parametrize("name", ["ppo_single_turn", "ppo_agentic"])
def test_the_ppo_files_hold_the_papers_settings_and_pass_verls_validation(name, model_dir):
    config = compose_in(CONFIGS, name, fills(name, model_dir))
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    assert need_critic(config)  # GAE: the critic trains
    algorithm, actor = config.algorithm, config.actor_rollout_ref.actor
    assert (algorithm.adv_estimator, algorithm.gamma, algorithm.lam) == ("gae", 1.0, 0.95)
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.28)
    assert config.data.train_batch_size == actor.ppo_mini_batch_size == config.critic.ppo_mini_batch_size == 1024
    assert (actor.optim.lr, config.critic.optim.lr) == (3e-6, 6e-6)
    rollout = config.actor_rollout_ref.rollout
    context = {"ppo_single_turn": 32_768, "ppo_agentic": 131_072}[name]
    assert rollout.prompt_length + rollout.response_length == context
    assert actor.ppo_max_token_len_per_gpu >= context and config.critic.ppo_max_token_len_per_gpu >= context
    assert "hf_model" in actor.checkpoint.save_contents  # the next stage loads the actor in Hugging Face format
    if name == "ppo_single_turn":
        assert rollout.agent.default_agent_loop == "single_turn_agent"
        assert config.critic.model.path == config.actor_rollout_ref.model.path
        score = get_custom_reward_fn(config)  # as verl's reward loop loads it
        assert score.args[0] is compute_score
    else:
        assert rollout.agent.default_agent_loop == AGENT_NAME and config.trainer.total_training_steps == 150
        assert get_custom_reward_fn(config) is None  # the agent loop sets the episode's reward itself


RECIPE = CONFIGS.parent / "recipe"


def test_the_one_node_recipe_passes_verls_validation_with_the_service_as_reward(model_dir, monkeypatch):
    """The PPO recipe for one GPU node: composed with verl's own config from what its launcher exports, every key
    one of verl's, checked by verl's validate_config; the reward is compute_score with the service's URL."""
    monkeypatch.setenv("CUDA_AGENT_ACTOR", str(model_dir))
    monkeypatch.setenv("CUDA_AGENT_TRAIN_FILES", "t.parquet")
    monkeypatch.setenv("CUDA_AGENT_VAL_FILES", "v.parquet")
    monkeypatch.setenv("CUDA_AGENT_SERVICE", "http://127.0.0.1:8470")
    monkeypatch.setenv("CUDA_AGENT_GPUS_TRAIN", "7")
    ours = yaml.safe_load((RECIPE / "ppo_one_node.yaml").read_text())
    assert ours.pop("defaults") == ["ppo_trainer", "_self_"]
    ours.pop("hydra")
    verls = compose_in(VERL_CONFIGS, "ppo_trainer")
    free_form = "reward.custom_reward_function.reward_kwargs."  # verl passes this dict to the function as it is
    assert [k for k in leaves(ours) if not declared(verls, k) and not k.startswith(free_form)] == []
    config = compose_in(RECIPE, "ppo_one_node")
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    assert need_critic(config) and config.algorithm.adv_estimator == "gae"
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (1, 7)
    assert config.actor_rollout_ref.rollout.name == "vllm"  # what a CPU machine lacks: the recipe runs on GPUs only
    assert config.reward.custom_reward_function.reward_kwargs.service == "http://127.0.0.1:8470"
    score = get_custom_reward_fn(config)  # as verl's reward loop loads it
    assert score.args[0] is compute_score and score.args[1] == {"service": "http://127.0.0.1:8470"}
    launcher = (RECIPE / "run_ppo_one_node.sh").read_text()
    assert "--config-name ppo_one_node" in launcher and "--format verl" in launcher
    assert subprocess.run(["bash", "-n", str(RECIPE / "run_ppo_one_node.sh")]).returncode == 0


def test_the_rft_file_holds_our_dataset_and_verls_sections_build(model_dir):
    config = compose_in(CONFIGS, "sft_rft", fills("sft_rft", model_dir))
    # As SFTTrainer._build_config turns them into verl's dataclasses.
    for section in ("model", "engine", "optim", "checkpoint", "profiler"):
        omega_conf_to_dataclass(config[section])
    assert config.optim.lr == 1e-5  # set: verl's default of 1e-3 would wreck the model
    assert config.data.pad_mode == "no_padding" and config.data.max_length == 131_072
    assert "hf_model" in config.checkpoint.save_contents
    from verl.utils.import_utils import load_extern_object

    assert load_extern_object(config.data.custom_cls.path, config.data.custom_cls.name) is TrajectorySFTDataset


def test_agent_loops_yaml_names_our_loop_and_its_options(monkeypatch):
    (entry,) = OmegaConf.load(CONFIGS / "agent_loops.yaml")
    assert entry.name == AGENT_NAME and entry._target_ == "cuda_agent.train.verl.agent_loop.CudaAgentLoop"
    options = set(inspect.signature(CudaAgentLoop.__init__).parameters)
    assert set(entry) - {"name", "_target_"} <= options and entry.max_turns == 150
    # verl instantiates the entry in its workers: the service URL comes from their environment.
    monkeypatch.setenv("CUDA_AGENT_SERVICE", "http://evaluator:8000")
    assert OmegaConf.to_container(entry, resolve=True)["service"] == "http://evaluator:8000"
    monkeypatch.delenv("CUDA_AGENT_SERVICE")
    with pytest.raises(Exception, match="CUDA_AGENT_SERVICE"):
        OmegaConf.to_container(entry, resolve=True)


# ----------------------------------------------------------------------------- command lines

def test_verl_command_builds_each_stages_command_line(tmp_path):
    python = sys.executable
    hydra = ["--config-path", str(CONFIGS), "--config-name"]
    out = f"trainer.default_local_dir={tmp_path / 'out'}"
    assert verl_command("ppo-single-turn", None, tmp_path / "out", ["trainer.nnodes=4"]) == [
        python, "-m", "verl.trainer.main_ppo", *hydra, "ppo_single_turn", out, "trainer.nnodes=4"]
    assert verl_command("rft", default_config("rft"), tmp_path / "out", nproc_per_node=8,
                        torchrun_args=["--nnodes", "2"]) == [
        python, "-m", "torch.distributed.run", "--nproc_per_node", "8", "--nnodes", "2", "-m",
        "verl.trainer.sft_trainer", *hydra, "sft_rft", out]
    assert verl_command("ppo-agentic", None, tmp_path / "out") == [
        python, "-m", "verl.trainer.main_ppo", *hydra, "ppo_agentic", out,
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={CONFIGS / 'agent_loops.yaml'}"]
    # The caller's own agent-loop file is left alone.
    mine = "actor_rollout_ref.rollout.agent.agent_loop_config_path=/srv/loops.yaml"
    assert verl_command("ppo-agentic", None, tmp_path / "out", [mine])[-2:] == [out, mine]


def test_verl_command_refuses_what_it_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="the stages are ppo-single-turn, rft, ppo-agentic.*cuda-agent train value"):
        verl_command("value", None, tmp_path)
    with pytest.raises(ValueError, match="no such verl config file"):
        verl_command("rft", tmp_path / "nope.yaml", tmp_path)
    copy = tmp_path / "mine" / "ppo_agentic.yaml"
    copy.parent.mkdir()
    copy.write_text((CONFIGS / "ppo_agentic.yaml").read_text())
    with pytest.raises(ValueError, match="no agent_loops.yaml beside it"):
        verl_command("ppo-agentic", copy, tmp_path)


def test_verls_own_entry_points_compose_the_commands(tmp_path):
    """Each command as verl's hydra mains read it (``--cfg job`` prints the composed config and stops)."""
    runs = {}
    for stage in STAGES:
        command = verl_command(stage, None, tmp_path / stage, ["trainer.nnodes=2"])
        if stage == "rft":  # the module torchrun would start, without the launcher
            command = [sys.executable] + command[command.index("-m", 2):]
        runs[stage] = subprocess.Popen(command + ["--cfg", "job"], cwd=tmp_path, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=_env())
    configs = {}
    for stage, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        configs[stage] = yaml.safe_load(out)
        assert configs[stage]["trainer"]["default_local_dir"] == str(tmp_path / stage)
        assert configs[stage]["trainer"]["nnodes"] == 2
    agent = configs["ppo-agentic"]["actor_rollout_ref"]["rollout"]["agent"]
    assert agent["agent_loop_config_path"] == str(CONFIGS / "agent_loops.yaml")
    assert configs["rft"]["data"]["custom_cls"]["name"] == "TrajectorySFTDataset"
    assert configs["ppo-single-turn"]["reward"]["custom_reward_function"]["path"] == "pkg://cuda_agent.train.verl.reward"


def _env(*paths: Path, **extra: str) -> dict[str, str]:
    """This checkout's package (and ``paths``) importable in verl's processes; nothing fetched or reported."""
    src = Path(__file__).resolve().parents[2] / "src"
    return dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (src, *paths)), HF_HUB_OFFLINE="1",
                WANDB_MODE="disabled", OMP_NUM_THREADS="1", **extra)


# ----------------------------------------------------------------------------- stage 2a's dataset

def segment(tokenizer, texts: list[str], *, tail: bool = True) -> dict:
    """A token-trace segment: a prompt, then per text a sampled reply and a tool result (``tail``: the last tool
    result too, as a trace does when the episode ended after a tool call)."""
    ids = tokenizer.encode("<|im_start|>user\nwrite a kernel<|im_end|>\n<|im_start|>assistant\n")
    mask = [0] * len(ids)
    for text in texts:
        reply = tokenizer.encode(text) + [tokenizer.eos_token_id]
        tool = tokenizer.encode("\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n")
        ids, mask = ids + reply + tool, mask + [1] * len(reply) + [0] * len(tool)
    while not tail and not mask[-1]:
        ids, mask = ids[:-1], mask[:-1]
    return {"ids": ids, "mask": mask, "logprobs": [-1.0 if m else 0.0 for m in mask]}


def record(reward: float, segments: list[dict], calls: list[dict] = ()) -> dict:
    return {"reward": reward, "turns": [{"turn": i, "tool_calls": [c]} for i, c in enumerate(calls)],
            "tokens": segments}


OK = {"name": "bash", "arguments": '{"command": "python utils/verify.py"}', "metadata": {}}
INVALID = {"name": "nope", "arguments": "{}", "metadata": {"invalid_call": True}}


@pytest.fixture
def trajectories(tokenizer, tmp_path) -> tuple[Path, list[dict]]:
    """A `train collect` folder: two episodes worth imitating (one of two token sequences, as after dropped
    turns), and one each that the filter drops: no reward, a redundant loop, an invalid tool call."""
    kept = [record(3, [segment(tokenizer, ["write the kernel", "run verify"])], [OK]),
            record(1, [segment(tokenizer, ["profile it"]), segment(tokenizer, ["now fuse", "done"], tail=False)])]
    dropped = [record(-1, [segment(tokenizer, ["give up"])]),
               record(2, [segment(tokenizer, ["again"])], [OK, OK, OK]),
               record(2, [segment(tokenizer, ["call"])], [OK, INVALID])]
    folder = tmp_path / "collect"
    folder.mkdir()
    rows = [kept[0], dropped[0], kept[1], dropped[1], dropped[2]]
    (folder / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, [s for r in kept for s in r["tokens"]]


def sft_data(tmp_path: Path, model: Path, train_files, *overrides: str):
    return compose_in(CONFIGS, "sft_rft", [f"model.path={model}", f"data.train_files={train_files}",
                                           *overrides]).data


def test_the_dataset_yields_the_sampled_token_mask_of_the_kept_episodes(trajectories, tokenizer, model_dir, tmp_path,
                                                                         capsys):
    folder, kept = trajectories
    data = sft_data(tmp_path, model_dir, f"[{folder}]")
    dataset = create_sft_dataset(data.train_files, data, tokenizer, None)  # as verl's SFT trainer makes it
    assert isinstance(dataset, TrajectorySFTDataset) and len(dataset) == len(kept) == 3
    assert "5 trajectories: 2 kept" in capsys.readouterr().err
    assert dataset.reasons["reward -1 is not above 0.0"] == 1 and sum(dataset.reasons.values()) == 5
    for item, trace in zip(dataset, kept):
        last = max(i for i, m in enumerate(trace["mask"]) if m) + 1  # trailing tool tokens are no target
        assert item["input_ids"].tolist() == trace["ids"][:last]  # the trace's ids, not re-encoded text
        assert item["loss_mask"].tolist() == trace["mask"][:last]  # 1 exactly where the policy sampled
        assert item["position_ids"].tolist() == list(range(last))
        assert set(item) == {"input_ids", "position_ids", "loss_mask"} and item["loss_mask"].dtype == torch.long
    # verl's collator takes the samples as they are (unpadded, nested).
    batch = SFTTensorCollator(data.pad_mode)([dataset[0], dataset[1]])
    assert batch["input_ids"].is_nested and batch["loss_mask"].values().sum() == sum(sum(t["mask"]) for t in kept[:2])


def test_the_filter_settings_come_from_the_config(trajectories, tokenizer, model_dir, tmp_path):
    folder, _ = trajectories
    strict = sft_data(tmp_path, model_dir, f"[{folder}]", "data.rft_filter.min_reward=2")
    assert len(TrajectorySFTDataset(strict.train_files, tokenizer, strict)) == 1  # the reward-1 episode goes too
    lenient = sft_data(tmp_path, model_dir, f"[{folder}]", "data.rft_filter.max_repeats=0",
                       "data.rft_filter.drop_invalid_calls=false")
    assert len(TrajectorySFTDataset(lenient.train_files, tokenizer, lenient)) == 5
    limited = TrajectorySFTDataset(lenient.train_files, tokenizer, lenient, max_samples=2)
    assert len(limited) == 2
    nothing = sft_data(tmp_path, model_dir, f"[{folder}]", "data.rft_filter.min_reward=5")
    with pytest.raises(RunError, match="passes the filter"):
        TrajectorySFTDataset(nothing.train_files, tokenizer, nothing)


def test_lengths_and_layouts_verl_cannot_train_are_refused_by_name(trajectories, tokenizer, model_dir, tmp_path):
    folder, kept = trajectories
    longest = max(max(i for i, m in enumerate(t["mask"]) if m) + 1 for t in kept)
    short = sft_data(tmp_path, model_dir, f"[{folder}]", "data.max_length=20")
    with pytest.raises(ValueError, match=rf"data.max_length=20 \(the longest: {longest} tokens\): raise "
                                         rf"data.max_length to {longest}, or set data.truncation=right"):
        TrajectorySFTDataset(short.train_files, tokenizer, short)
    cut = sft_data(tmp_path, model_dir, f"[{folder}]", "data.max_length=20", "data.truncation=right")
    items = list(TrajectorySFTDataset(cut.train_files, tokenizer, cut))
    assert items and all(len(i["input_ids"]) <= 20 and i["loss_mask"].sum() > 0 for i in items)
    with pytest.raises(ValueError, match="data.truncation=left: .*error, right"):
        TrajectorySFTDataset(folder, tokenizer, sft_data(tmp_path, model_dir, f"[{folder}]", "data.truncation=left"))
    with pytest.raises(ValueError, match="data.pad_mode=right: .*set data.pad_mode=no_padding"):
        TrajectorySFTDataset(folder, tokenizer, sft_data(tmp_path, model_dir, f"[{folder}]", "data.pad_mode=right"))
    with pytest.raises(RunError, match="data.train_files: .* is not a trajectories.jsonl"):
        TrajectorySFTDataset(tmp_path / "nothing", tokenizer, short)


# ----------------------------------------------------------------------------- verl's SFT trainer on the CPU

# verl 0.9.1 knows no CPU platform: on a machine without a GPU it falls back to 'nvidia' and its process group
# asks for NCCL ("Distributed package doesn't have NCCL built in"). This plugin (verl loads it through
# VERL_USE_EXTERNAL_MODULES) makes the CPU a platform of gloo and no device memory, for this test only.
CPU_PLATFORM = '''
import contextlib
import os
from datetime import timedelta

import torch
import verl.utils.distributed
from verl.plugin.platform.platform_cuda import PlatformCUDA
from verl.plugin.platform.platform_manager import PlatformRegistry


class _CPUDevice:
    def __getattr__(self, name):
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name == "get_device_name":
            return lambda *a, **k: "CPU"
        if name == "mem_get_info":
            return lambda *a, **k: (0, 0)
        if name.startswith(("memory_", "max_memory_", "reset_")) or name in ("empty_cache", "ipc_collect"):
            return lambda *a, **k: 0
        raise AttributeError(name)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformCUDA):
    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: _CPUDevice())
    def is_available(self): return True
    def is_platform_available(self, use_smi_check=False): return True
    def current_device(self): return torch.device("cpu")
    def device_count(self): return 1
    def set_device(self, index): pass
    def synchronize(self, index=None): pass
    def manual_seed(self, seed): torch.manual_seed(seed)
    def manual_seed_all(self, seed): torch.manual_seed(seed)
    def set_allocator_settings(self, settings): pass
    def empty_cache(self): pass
    def get_device_capability(self, index=0): return None, None
    def communication_backend_name(self): return "gloo"
    @contextlib.contextmanager
    def nvtx_range(self, msg): yield
    def profiler_start(self): pass
    def profiler_stop(self): pass


def _gloo(timeout_second=36000):
    # verl's own asks for "cpu:gloo,<device>:<backend>", which names the CPU twice here.
    torch.distributed.init_process_group(backend="gloo", timeout=timedelta(seconds=timeout_second))
    return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


verl.utils.distributed.initialize_global_process_group = _gloo
'''


@pytest.mark.slow
def test_verls_sft_trainer_takes_its_loss_on_the_sampled_tokens(trajectories, tokenizer, model_dir, tmp_path):
    """One step of verl's SFT trainer on our dataset: its loss is the mean NLL of exactly the sampled tokens.
    The model's logits are sharpened so that other masks (every token, the mask one token off) give losses
    more than one percent away; verl's bf16 loss must be the nearest to the
    sampled tokens' loss and within one percent of it."""
    import re

    import transformers

    from cuda_agent.train.models import policy_forward
    from cuda_agent.train.rollout import Rollout, RolloutBatch

    folder, kept = trajectories
    batch = RolloutBatch.collate([Rollout.from_segment(t, 1.0) for t in kept])
    every = batch.attention.float()
    every[:, 0] = 0  # the first token has no logprob
    shifted = torch.zeros_like(batch.mask)
    shifted[:, 1:] = batch.mask[:, :-1]
    # How far the other masks' losses land from the sampled tokens' depends on the trained tokenizer and the
    # packages (transformers 5.10: 1.7% and 4.9%; a fresh CI venv once put the every-token loss 0.5% off, at any
    # sharpening, which scales every loss alike): the first of a few seeded reshapings of the final norm that puts
    # both more than 1% away is used. verl logs its bf16 loss, rounded to bf16's 8 significant bits (at most 0.4%
    # off), so apart by more than twice that, the nearest is told apart.
    for seed in range(16):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        with torch.no_grad():
            shape = torch.randn(model.model.norm.weight.shape, generator=torch.Generator().manual_seed(seed))
            model.model.norm.weight.mul_(100.0 * torch.exp(shape if seed else torch.zeros_like(shape)))
            logprobs = policy_forward(model, batch.ids, batch.attention)[0]
        expected, *others = [float(-(logprobs * m).sum() / m.sum()) for m in (batch.mask, every, shifted)]
        if all(abs(other / expected - 1) > 0.01 for other in others):
            break
    assert all(abs(other / expected - 1) > 0.01 for other in others), (expected, others)
    sharp = tmp_path / "sharp"
    model.save_pretrained(sharp)
    tokenizer.save_pretrained(sharp)

    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "verl_cpu_platform.py").write_text(CPU_PLATFORM)
    out = tmp_path / "rft"
    command = verl_command("rft", None, out, [
        f"model.path={sharp}", f"data.train_files=[{folder}]", "data.train_batch_size=3",  # all 3 samples at once
        "data.micro_batch_size_per_gpu=2", "trainer.total_training_steps=1", "trainer.device=cpu",
        # No flash-attention and no torch.compile on the CPU; FSDP2 places parameters where the platform says.
        "+model.override_config.attn_implementation=sdpa", "engine.use_torch_compile=false", "engine.strategy=fsdp2",
    ], nproc_per_node=1, torchrun_args=["--standalone"])
    env = _env(plugin, VERL_USE_EXTERNAL_MODULES="verl_cpu_platform", VERL_PLATFORM="cpu",
               VERL_ENGINE_DEVICE="cuda")  # verl's FSDP engine is registered for cuda and npu devices
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    assert "5 trajectories: 2 kept" in done.stderr
    (loss,) = [float(x) for x in re.findall(r"train/loss:([-0-9.e]+)", done.stdout)]
    assert loss == pytest.approx(expected, rel=0.01)
    assert min([expected, *others], key=lambda candidate: abs(candidate - loss)) == expected, (loss, expected, others)
    # The checkpoint stage 3 loads: a Hugging Face model with the tokenizer.
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    transformers.AutoModelForCausalLM.from_pretrained(out / "global_step_1" / "huggingface")
    transformers.AutoTokenizer.from_pretrained(out / "global_step_1" / "huggingface")
