"""A training stage's config file (YAML or JSON), read into typed sections.

One file shape for every stage, verl-style nested sections; a stage reads the sections it needs and
refuses keys it does not know (naming them and the ones it knows), so a typo cannot silently fall
back to a default. Paper defaults where the paper states them (``PPOConfig``; 32k single-turn and
128k agentic context; 150 turns); ``examples/train/*.yaml`` holds one file per stage.

    model:    actor (a Hugging Face name or directory), critic (a value stage's output), precision, ...
    tasks:    source (any task source: KernelBench dir, synth output, Ops-6K parquet), levels, limit
    rollout:  episodes per step, tokens, sampling, turns, parallel episodes
    evaluator: device, policy, sandbox
    ppo:      ``PPOConfig``                       (stage ppo)
    data:     trajectories and the RFT filter      (stages rft, value)
    sft:      optimiser settings of RFT            (stage rft)
    value:    critic pretraining settings         (stage value)
    steps, seed
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cuda_agent.train.ppo import PPOConfig

__all__ = ["STAGES", "PRECISIONS", "ConfigError", "ModelConfig", "TaskSource", "RolloutConfig", "EvaluatorConfig",
           "DataConfig", "SFTConfig", "ValueConfig", "StageConfig", "REQUIRED", "parse_config", "load_config",
           "check_models"]

STAGES = ("ppo", "collect", "rft", "value")
PRECISIONS = ("auto", "bf16", "fp32")


class ConfigError(ValueError):
    """A stage config that cannot be run as written."""


@dataclass(frozen=True)
class ModelConfig:
    actor: str = ""  # Hugging Face name or directory (the base model, or an RFT output's checkpoint/actor)
    critic: str | None = None  # a value stage's checkpoint/critic; None: a new head on the actor's backbone
    tokenizer: str | None = None  # default: the actor's
    # bf16: fp32 master weights, bf16 compute (autocast); fp32: no autocast; auto: bf16 on a GPU, fp32 on the CPU.
    precision: str = "auto"
    gradient_checkpointing: bool = False
    logits_chunk: int = 4096  # sequence positions per lm_head chunk when scoring (0: whole sequence at once)
    fsdp: bool = False  # shard with FSDP2 even in one process (under torchrun with several ranks: always)


@dataclass(frozen=True)
class TaskSource:
    source: str = ""
    levels: tuple[int, ...] | None = None
    limit: int | None = None  # the first N tasks of the source (after levels)


@dataclass(frozen=True)
class RolloutConfig:
    batch: int = 8  # episodes per step (the paper: 1024, equal to the PPO mini-batch)
    samples_per_task: int = 1  # episodes of the same task in one step
    max_new_tokens: int = 8192  # per reply
    context_tokens: int | None = None  # default: 32k single-turn, 128k agentic (the paper)
    max_turns: int = 150
    temperature: float = 1.0
    top_p: float = 1.0
    workers: int = 4  # episodes in flight at once (each with its own evaluator; they share one timing lock)
    generate_batch: int = 16  # single-turn replies sampled together in one generate call
    wall_clock_s: float | None = None  # per agentic episode
    language: str = "cuda"  # the kernels episodes ask for: "cuda" (C++/CUDA extensions) or "triton"


@dataclass(frozen=True)
class EvaluatorConfig:
    device: str = "auto"
    policy: str = "fair"
    sandbox: str = "auto"
    remote: str | None = None  # URL of an evaluation service (cuda-agent serve): rewards come from its pool


@dataclass(frozen=True)
class DataConfig:
    trajectories: tuple[str, ...] = ()  # JSONL files or `train collect` output directories
    min_reward: float = 0.0  # keep episodes whose final reward is above this (the paper: > 0)
    max_repeats: int = 3  # a tool call repeated this many times in a row marks a redundant loop
    drop_invalid_calls: bool = True  # drop episodes with a tool call that breaks the schema
    holdout: float = 0.1  # share of episodes held out (value stage: explained variance is reported on them)


@dataclass(frozen=True)
class SFTConfig:
    lr: float = 1e-5
    batch: int = 8  # sequences per optimiser step
    micro_batch: int = 2
    epochs: int = 1
    max_grad_norm: float = 1.0


@dataclass(frozen=True)
class ValueConfig:
    iterations: int = 4  # rounds of (targets from the current critic, then one pass of fitting)
    lr: float = 6e-6
    batch: int = 8
    micro_batch: int = 2
    max_grad_norm: float = 1.0
    value_clip: float | None = None


@dataclass(frozen=True)
class StageConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    tasks: TaskSource = field(default_factory=TaskSource)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    value: ValueConfig = field(default_factory=ValueConfig)
    steps: int = 150  # the paper's 150 agentic steps; collect: episodes
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def context_tokens(self, single_turn: bool) -> int:
        return self.rollout.context_tokens or (32_768 if single_turn else 131_072)


# What each stage needs written in its file (the rest has defaults).
REQUIRED = {"ppo": ("model.actor", "tasks.source"), "collect": ("model.actor", "tasks.source"),
            "rft": ("model.actor", "data.trajectories"), "value": ("model.actor", "data.trajectories")}


def _build(cls: type, values: Any, where: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{where or 'the config'}: expected a mapping of settings, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{where or 'the config'}: unknown setting(s) {', '.join(unknown)}; "
                          f"known: {', '.join(fields)}")
    kwargs = {}
    for name, value in values.items():
        default = fields[name].default_factory() if fields[name].default_factory is not dataclasses.MISSING \
            else fields[name].default
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build(type(default), value, f"{where}.{name}".lstrip("."))
        elif isinstance(value, list):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or 'the config'}: {exc}") from None


def parse_config(values: dict[str, Any], stage: str) -> StageConfig:
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; the stages are {', '.join(STAGES)}")
    values = dict(values or {})
    written = values.pop("stage", stage)
    if written != stage:
        raise ConfigError(f"the config is for stage {written!r}, not {stage!r}: run `cuda-agent train {written}`")
    config = _build(StageConfig, values, "")
    for dotted in REQUIRED[stage]:
        section, key = dotted.split(".")
        if not getattr(getattr(config, section), key):
            raise ConfigError(f"stage {stage} needs {dotted} in its config file")
    if config.model.precision not in PRECISIONS:
        raise ConfigError(f"model.precision {config.model.precision!r}: choose one of {', '.join(PRECISIONS)}")
    if config.steps < 1 or config.rollout.batch < 1 or config.rollout.workers < 1:
        raise ConfigError("steps, rollout.batch and rollout.workers must be at least 1")
    if not 0 <= config.data.holdout < 1:
        raise ConfigError("data.holdout must be in [0, 1)")
    return config


def load_config(path: Path, stage: str) -> StageConfig:
    """A stage's config from a YAML or JSON file; relative paths in it are relative to the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file (examples/train/ holds one per stage)")
    text = path.read_text()
    if path.suffix == ".json":
        values = json.loads(text)
    else:
        import yaml  # with transformers (the [train] extra)

        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    config = _resolve_paths(parse_config(values or {}, stage), path.parent)
    _check_local_paths(config, path)
    return config


def _check_local_paths(config: StageConfig, path: Path) -> None:
    """A model written as a path (``./``, ``../``, ``/``, ``~``) that is not there is a stage not yet run, not a
    Hugging Face hub name; say so before anything starts."""
    named = {"model.actor": config.model.actor, "model.critic": config.model.critic,
             "model.tokenizer": config.model.tokenizer}
    named |= {f"data.trajectories[{i}]": t for i, t in enumerate(config.data.trajectories)}
    for key, value in named.items():
        if value and value.startswith((".", "/", "~")) and not Path(value).expanduser().exists():
            raise ConfigError(f"{path}: {key} {value} does not exist (relative paths are read from the config "
                              "file's folder); run the stage that writes it first, or correct the path")


def check_models(config: StageConfig, path: Path, timeout_s: float = 5.0) -> None:
    """Every model the stage loads is a local folder, or a Hugging Face name that is in the local cache or
    can be fetched: checked before the run starts (and writes RUN/config.json), naming the config key.
    Left to transformers, a name with no network means a minute of retries and an error naming no key. The
    Hub is asked once, briefly, and not at all with HF_HUB_OFFLINE=1."""
    import os

    named = {"model.actor": config.model.actor, "model.critic": config.model.critic,
             "model.tokenizer": config.model.tokenizer}
    for key, value in named.items():
        if not value or Path(value).expanduser().is_dir():
            continue
        remedy = (f"set {key} in {path} to a local model folder (one with config.json and the weights), or "
                  f"download it first while online: hf download {value}")
        if Path(value).expanduser().exists():
            raise ConfigError(f"{path}: {key} {value} is a file; it takes a model folder or a Hugging Face name")
        try:
            from huggingface_hub import model_info, try_to_load_from_cache
            from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
        except ImportError:  # pragma: no cover - transformers brings it
            return
        try:
            if isinstance(try_to_load_from_cache(value, "config.json"), str):
                continue  # downloaded before: transformers reads it from the cache
        except HFValidationError:
            raise ConfigError(f"{path}: {key} {value!r} is neither a folder here nor a Hugging Face name; {remedy}") from None
        if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
            raise ConfigError(f"{path}: {key} {value} is not a local folder and not in the Hugging Face cache "
                              f"(HF_HUB_OFFLINE is set); {remedy}")
        try:
            model_info(value, timeout=timeout_s)
        except GatedRepoError:
            continue  # there, behind a licence: transformers asks with the user's token
        except RepositoryNotFoundError:
            raise ConfigError(f"{path}: {key} {value} is not a local folder and no Hugging Face model has that name "
                              f"(or it is private); {remedy}") from None
        except Exception as exc:  # noqa: BLE001 - any failure to reach the Hub is the same advice
            raise ConfigError(f"{path}: {key} {value} is not a local folder and not in the Hugging Face cache, and "
                              f"the Hub could not be reached ({type(exc).__name__}); {remedy}") from None


def _resolve_paths(config: StageConfig, base: Path) -> StageConfig:
    def local(value: str | None) -> str | None:
        # A Hugging Face hub name stays as written; a path that exists next to the file is made absolute.
        if value and not Path(value).is_absolute() and (base / value).exists():
            return str((base / value).resolve())
        return value

    model = dataclasses.replace(config.model, actor=local(config.model.actor) or "", critic=local(config.model.critic),
                                tokenizer=local(config.model.tokenizer))
    tasks = dataclasses.replace(config.tasks, source=local(config.tasks.source) or "")
    data = dataclasses.replace(config.data, trajectories=tuple(local(t) or t for t in config.data.trajectories))
    return dataclasses.replace(config, model=model, tasks=tasks, data=data)
