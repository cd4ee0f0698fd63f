"""The paper's four training stages as functions of a config and a run directory (``cuda-agent train ...``).

    ppo --single-turn  stage 1: the base model writes the kernels in one reply, no tools; PPO.
    collect            agent trajectories (token traces included) from a checkpoint, for the warm-up.
    rft                stage 2a: the trajectories worth imitating (``warmup.keep_episode``), SFT on the
                       sampled tokens; the actor for stage 3 is RUN/checkpoint/actor.
    value              stage 2b: the critic pretrained on the same trajectories, GAE targets from itself;
                       the critic for stage 3 is RUN/checkpoint/critic (verl loads it as its critic).
    ppo                stage 3: agentic PPO from the RFT actor and the pretrained critic.

Every stage writes RUN/config.json, RUN/metrics.jsonl (one line per step) and plots, and resumes where it
was killed (``run.RunDir``). PPO also keeps each step's rollouts in RUN/rollouts/ until the step is
committed: a run killed during an update redoes the update, not the episodes. Task order, data order and
held-out episodes are functions of the seed and the step, so a resumed run takes the same next batch.
"""

from __future__ import annotations

import json
import math
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

import torch

from cuda_agent.jsonl import append_jsonl, read_jsonl
from cuda_agent.tasks import Task, load_tasks
from cuda_agent.train.config import ConfigError, StageConfig
from cuda_agent.train.distributed import (
    Dist, SavedModel, SavedOptimizer, full_optimizer_state, full_state_dict, init_distributed, load_optimizer_state,
    pad_rows, shard,
)
from cuda_agent.train.episodes import EpisodeOutcome, EpisodeRunner
from cuda_agent.train.models import resolve_precision
from cuda_agent.train.rollout import Rollout, RolloutBatch
from cuda_agent.train.run import RunDir, RunError, plot_metrics, write_atomic

Say = Callable[[str], None]
REWARDS = (-1, 1, 2, 3)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- shared pieces

def select_tasks(config: StageConfig) -> list[Task]:
    tasks = load_tasks(config.tasks.source, config.tasks.levels)
    if config.tasks.limit:
        tasks = tasks[:config.tasks.limit]
    if not tasks:
        raise RunError(f"tasks.source {config.tasks.source} (levels {config.tasks.levels}) holds no task")
    return tasks


def _order(n: int, epoch: int, seed: int) -> list[int]:
    """``range(n)`` shuffled by the seed and the pass over the data, the same on every resume."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def tasks_for_step(tasks: list[Task], step: int, per_step: int, samples: int, seed: int) -> list[Task]:
    """The episodes' tasks of ``step`` (1-based): the tasks in an order shuffled per epoch by the seed,
    ``per_step // samples`` of them, each ``samples`` times; the same for the same step on every resume."""
    distinct = max(per_step // samples, 1)
    chosen = []
    for k in range((step - 1) * distinct, step * distinct):
        epoch, position = divmod(k, len(tasks))
        chosen.append(tasks[_order(len(tasks), epoch, seed)[position]])
    return [task for task in chosen for _ in range(samples)]


def batch_for_step(items: list[Any], step: int, size: int, seed: int) -> tuple[int, list[Any]]:
    """The pass over ``items`` that ``step`` (1-based) is in and its batch of ``size``: passes of
    ``ceil(len / size)`` steps, each over an order shuffled by the seed and the pass."""
    per_pass = math.ceil(len(items) / size)
    index, position = divmod(step - 1, per_pass)
    order = _order(len(items), index, seed)
    return index, [items[i] for i in order[position * size:(position + 1) * size]]


def _seed(seed: int) -> None:
    """Before any model is built: a new critic head (and sampling) then depend on the config alone."""
    random.seed(seed)
    torch.manual_seed(seed)


def load_tokenizer(config: StageConfig) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer or config.model.actor)
    if tokenizer.chat_template is None:
        raise RunError(f"the tokenizer of {config.model.tokenizer or config.model.actor} has no chat template; "
                       "episodes are rendered through it (give model.tokenizer one that has)")
    return tokenizer


def _load(kind: str, path: str, device: str) -> Any:
    """fp32 weights (the optimiser's master copy; bf16 runs through autocast, ``models.compute_precision``)."""
    import transformers

    cls = transformers.AutoModelForCausalLM if kind == "actor" else transformers.AutoModelForTokenClassification
    options = {} if kind == "actor" else {"num_labels": 1}
    return cls.from_pretrained(path, dtype=torch.float32, **options).to(device)


class Trainables:
    """A stage's models on this rank: loaded (fp32 masters), restored from the run's checkpoint when it is
    resumed, sharded with FSDP2 under ``torchrun``, and committed (gathered, then written by rank 0)."""

    def __init__(self, run: RunDir, dist: Dist, done: int, specs: dict[str, tuple[str, str]], precision: str,
                 sampled: tuple[str, ...] = ()):
        import copy

        self.run, self.dist, self.done = run, dist, done
        device = dist.device()
        # Resumed: every rank loads the checkpoint's weights (once, before sharding them), not the base's.
        self.models = {name: _load(kind, str(run.checkpoint / name) if done else path, device)
                       for name, (kind, path) in specs.items()}
        # Sharded models sample from a full copy of their own, taken before sharding (``refresh`` updates it).
        self.copies = {name: copy.deepcopy(self.models[name]) for name in sampled} if dist.sharded else {}
        if dist.sharded:
            for model in self.models.values():
                shard(model, precision)

    def sampler_model(self, name: str) -> Any:
        """The model to sample from: the model itself unless it is sharded, then its full copy."""
        return self.copies.get(name, self.models[name])

    def refresh(self, name: str) -> None:
        """The sampling copy takes the model's weights after an update (a collective)."""
        if name in self.copies:
            self.copies[name].load_state_dict(full_state_dict(self.models[name], self.dist))

    def restore_optimizers(self, optimizers: dict[str, Any]) -> None:
        if self.done:
            states = self.run.optimizer_states()
            for name, optimizer in optimizers.items():
                load_optimizer_state(self.models[name], optimizer, states[name], self.dist)

    def commit(self, step: int, line: dict[str, Any], optimizers: dict[str, Any]) -> None:
        if not self.dist.sharded:
            self.run.commit(step, line, self.models, optimizers)
            return
        weights = {n: SavedModel(m, full_state_dict(m, self.dist)) for n, m in self.models.items()}
        states = {n: SavedOptimizer(full_optimizer_state(self.models[n], o, self.dist)) for n, o in optimizers.items()}
        if self.dist.main:
            self.run.commit(step, line, weights, states)
        self.dist.barrier()


def open_run(out: Path, identity: dict[str, Any], dist: Dist, **options: Any) -> tuple[RunDir, int]:
    """The run directory (created or checked by rank 0) and the steps already done, on every rank."""
    run = RunDir(out, identity, **options)
    done = dist.broadcast(run.open() if dist.main else None)
    return run, done


@dataclass
class Start:
    """What every training stage begins with: its ranks, reporting (rank 0 only), its run directory and the
    steps already done, precision and tokenizer (saved with every checkpoint)."""

    dist: Dist
    say: Say
    run: RunDir
    done: int
    precision: str
    tokenizer: Any

    @property
    def autocast(self) -> str:
        """The trainers' autocast: none where FSDP's mixed precision already casts the parameters."""
        return "fp32" if self.dist.sharded else self.precision

    @property
    def pad(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id


def start_stage(config: StageConfig, out: Path, identity: dict[str, Any], say: Say) -> Start:
    dist = init_distributed(config.model.fsdp)
    run, done = open_run(out, identity | _identity(config), dist)
    _seed(config.seed)
    tokenizer = load_tokenizer(config)
    if dist.main:
        run.tokenizer = tokenizer
    return Start(dist, say if dist.main else (lambda line: None), run, done,
                 resolve_precision(config.model.precision, dist.device()), tokenizer)


def make_evaluator_factory(config: StageConfig, dist: Dist = Dist()) -> Callable[[threading.Lock], Any]:
    """Evaluators on this rank's GPU (``gpu_index``), all of a rank sharing its timing lock; with
    ``evaluator.remote``, the evaluation service at that URL for every episode of every rank (its pool
    owns its GPUs and times one job per GPU, so no lock is needed here)."""
    from cuda_agent.evaluate import Evaluator, long_lived, resolve_device
    from cuda_agent.evaluate.protocol.policy import Policy

    if config.evaluator.remote:
        from cuda_agent.service import RemoteEvaluator

        remote = RemoteEvaluator(config.evaluator.remote)
        remote.require_policy(Policy.preset(config.evaluator.policy), "evaluator.policy")
        return lambda lock: remote
    device = resolve_device(config.evaluator.device)

    def make(lock: threading.Lock) -> Any:
        return Evaluator(device, policy=Policy.preset(config.evaluator.policy), sandbox=config.evaluator.sandbox,
                         timing_lock=lock, **long_lived(device),
                         gpu_index=dist.local_rank if device == "cuda" and dist.world > 1 else None)
    return make


def _sampler(actor: Any, tokenizer: Any, config: StageConfig, precision: str) -> Any:
    from cuda_agent.agent.tokens import TransformersBackend

    return _PrecisionBackend(TransformersBackend(actor, tokenizer, temperature=config.rollout.temperature,
                                                 top_p=config.rollout.top_p), precision)


class _PrecisionBackend:
    """The sampler under the trainer's compute precision, so that sampler and trainer differ only by what
    generation's kernels do differently (the mismatch PPO logs as ``logprob_mismatch``)."""

    def __init__(self, backend: Any, precision: str):
        self.backend, self.precision = backend, precision

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Any:
        return self.generate_batch([prompt_ids], max_new_tokens)[0]

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> Any:
        from cuda_agent.train.models import compute_precision

        with compute_precision(self.precision, next(self.backend.model.parameters()).device):
            return self.backend.generate_batch(prompts, max_new_tokens)


def episode_metrics(outcomes: list[EpisodeOutcome]) -> dict[str, Any]:
    """The step's episode metrics. Episodes without a verdict (reward None) are counted (``no_verdict``) and left
    out of every reward figure: they have no reward, and no rollout trains on them."""
    rewards = [o.reward for o in outcomes if o.reward is not None]
    n = max(len(rewards), 1)
    return {
        "episodes": len(outcomes),
        "no_verdict": len(outcomes) - len(rewards),
        "reward_mean": sum(rewards) / n,
        "reward_shares": {str(v): sum(r == v for r in rewards) / n for v in REWARDS},
        "pass_rate": sum(r > 0 for r in rewards) / n,
        "statuses": dict(Counter(o.status for o in outcomes)),
        "response_tokens": sum(o.generated_tokens for o in outcomes) / n,
        "clipped_share": sum(o.clipped for o in outcomes) / n,
        "turns": sum(o.turns for o in outcomes) / n,
        "generate_seconds": sum(o.generate_seconds for o in outcomes),
        "evaluate_seconds": sum(o.evaluate_seconds for o in outcomes),
    }


def _reward(outcome: EpisodeOutcome) -> str:
    """An episode's reward as a progress line says it: none where it had no verdict."""
    return "none (no verdict: not trained on)" if outcome.reward is None else f"{outcome.reward:+g}"


def _identity(config: StageConfig) -> dict[str, Any]:
    """What makes a run the same run: everything but its length (a finished run may be continued with more
    steps, as verl allows raising total_training_steps)."""
    values = config.to_dict()
    values.pop("steps")
    return values


def _plot(out: Path, say: Say) -> None:
    try:
        plot_metrics(out)
    except ImportError:
        from cuda_agent.paths import install_hint
        say(f"no plots: matplotlib is not installed ({install_hint('train')})")


# ----------------------------------------------------------------------------- stage 1 and 3: PPO

def _save_rollouts(path: Path, outcomes: list[EpisodeOutcome]) -> None:
    """A step's episodes without their trajectories (what the update and the metrics need)."""
    rows = [{f.name: getattr(o, f.name) for f in fields(o) if f.name not in ("rollouts", "record")}
            | {"rollouts": [r.to_dict() for r in o.rollouts]} for o in outcomes]
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def _load_rollouts(path: Path) -> list[EpisodeOutcome]:
    return [EpisodeOutcome(**(row | {"rollouts": [Rollout.from_dict(r) for r in row["rollouts"]]}))
            for row in read_jsonl(path)]


def _seed_step(seed: int, step: int, rank: int) -> None:
    """Sampling of a step depends on the seed, the step and the rank alone: a resumed run samples what the
    uninterrupted one would have, and ranks sample apart."""
    _seed(seed * 1_000_003 + step * 1_009 + rank)


def _summary(outcome: EpisodeOutcome) -> EpisodeOutcome:
    """What the metrics need of an episode, without its rollouts and trajectory (sent between ranks)."""
    return replace(outcome, rollouts=[], record={})


def _local_batch(rollouts: list[Rollout], pad: int, dist: Dist) -> RolloutBatch | None:
    """This rank's rollouts as a batch with as many rows as the largest rank's (FSDP runs every micro-batch
    on every rank); None when no rank has any."""
    rows = max(dist.gather(len(rollouts)))
    if rows == 0:
        return None
    if not rollouts:
        empty = RolloutBatch(*(torch.zeros((0, 1), dtype=d) for d in (torch.long, torch.long, torch.float32,
                                                                       torch.float32, torch.float32)))
        return pad_rows(empty, rows)
    return pad_rows(RolloutBatch.collate(rollouts, pad_id=pad), rows)


def run_ppo(config: StageConfig, out: Path, single_turn: bool, *, say: Say = _stderr,
            make_evaluator: Callable[[threading.Lock], Any] | None = None) -> list[dict[str, Any]]:
    """Stage 1 (``single_turn``) or stage 3: ``config.steps`` PPO steps of ``rollout.batch`` episodes each
    (under ``torchrun``, each rank runs its share and FSDP2 shards the models)."""
    from cuda_agent.train.ppo import PPOTrainer

    begin = start_stage(config, out, {"stage": "ppo", "single_turn": single_turn}, say)
    dist, say, run, done, precision, tokenizer = begin.dist, begin.say, begin.run, begin.done, begin.precision, \
        begin.tokenizer
    if config.rollout.batch % dist.world:
        raise ConfigError(f"rollout.batch {config.rollout.batch} does not split over {dist.world} ranks")
    tasks = select_tasks(config)
    models = Trainables(run, dist, done, {"actor": ("actor", config.model.actor),
                                          "critic": ("critic", config.model.critic or config.model.actor)}, precision,
                        sampled=("actor",))
    actor, critic = models.models["actor"], models.models["critic"]
    trainer = PPOTrainer(actor, critic, config.ppo, precision=begin.autocast,
                         logits_chunk=config.model.logits_chunk,
                         gradient_checkpointing=config.model.gradient_checkpointing)
    optimizers = {"actor": trainer.actor_optimizer, "critic": trainer.critic_optimizer}
    models.restore_optimizers(optimizers)
    if done:
        say(f"resuming {out} after step {done}")
    rollouts_dir = out / "rollouts"
    rollouts_dir.mkdir(parents=True, exist_ok=True)
    evaluators = make_evaluator or make_evaluator_factory(config, dist)
    runner = EpisodeRunner(_sampler(models.sampler_model("actor"), tokenizer, config, precision), tokenizer,
                           single_turn=single_turn, workdir=out / "work" / f"rank-{dist.rank}", make_evaluator=evaluators,
                           workers=config.rollout.workers, max_new_tokens=config.rollout.max_new_tokens,
                           generate_batch=config.rollout.generate_batch,
                           context_tokens=config.context_tokens(single_turn), max_turns=config.rollout.max_turns,
                           wall_clock_s=config.rollout.wall_clock_s, sandbox=config.evaluator.sandbox,
                           model_name=config.model.actor, language=config.rollout.language)
    pad = begin.pad
    try:
        for step in range(done + 1, config.steps + 1):
            started = time.perf_counter()
            _seed_step(config.seed, step, dist.rank)
            saved = rollouts_dir / (f"step-{step:06d}.jsonl" if dist.world == 1 else f"step-{step:06d}.rank-{dist.rank}.jsonl")
            if saved.exists():
                outcomes = _load_rollouts(saved)  # rolled out before a kill; only the update is redone
                say(f"step {step}: the rollouts saved before the interruption")
            else:
                step_tasks = dist.share(tasks_for_step(tasks, step, config.rollout.batch,
                                                       config.rollout.samples_per_task, config.seed))
                finished = [0]

                def show(index: int, outcome: EpisodeOutcome) -> None:
                    finished[0] += 1
                    say(f"step {step} episode {finished[0]}/{len(step_tasks)}: {outcome.task} reward {_reward(outcome)} "
                        f"({outcome.status}, {outcome.generated_tokens} tokens, {outcome.turns} turn(s))")

                outcomes = [o for o in runner.run(step_tasks, show) if o is not None]
                _save_rollouts(saved, outcomes)
            rollout_seconds = max(dist.gather(time.perf_counter() - started))
            everyone = [o for part in dist.gather([_summary(o) for o in outcomes]) for o in part]
            line = episode_metrics(everyone) | {"rollout_seconds": rollout_seconds}
            batch = _local_batch([r for o in outcomes for r in o.rollouts], pad, dist)
            if batch is not None:
                line |= dist.mean(trainer.step(batch))
                line["update_tokens_per_s"] = line["sampled_tokens"] / max(line["update_seconds"], 1e-9)
                models.refresh("actor")
            else:
                say(f"step {step}: no episode produced a sampled token; no update")
            line["generate_tokens_per_s"] = (sum(o.generated_tokens for o in everyone)
                                             / max(line["generate_seconds"], 1e-9))
            line["step_seconds"] = time.perf_counter() - started
            models.commit(step, line, optimizers)
            saved.unlink(missing_ok=True)  # committed: the checkpoint holds what they taught
            say(f"step {step}/{config.steps}: reward {line['reward_mean']:+.2f}  pass {line['pass_rate']:.0%}  "
                f"entropy {line.get('entropy', float('nan')):.3f}  ev {line.get('explained_variance', float('nan')):.2f}  "
                f"{line['step_seconds']:.0f}s")
    finally:
        runner.close()
    rows = run.metrics()
    if rows and dist.main:
        _plot(out, say)
    return rows


# ----------------------------------------------------------------------------- collect

def run_collect(config: StageConfig, out: Path, *, say: Say = _stderr,
                make_evaluator: Callable[[threading.Lock], Any] | None = None) -> Path:
    """Agentic episodes from ``model.actor``: ``steps`` rounds of ``rollout.batch`` episodes, each appended to
    OUT/trajectories.jsonl as it ends (with ``episode_index``); a resumed run runs only the missing ones.
    One process: more episodes at once come from ``rollout.workers``, not from ranks."""
    if init_distributed().sharded:
        raise ConfigError("train collect runs in one process (no torchrun): raise rollout.workers for more "
                          "episodes at once")
    run = RunDir(out, {"stage": "collect"} | _identity(config), checkpoints=False)
    run.open()
    _seed(config.seed + len(run.metrics()))  # a resumed collection does not replay the first one's samples
    tasks = select_tasks(config)
    device = Dist().device()
    precision = resolve_precision(config.model.precision, device)
    tokenizer = load_tokenizer(config)
    actor = _load("actor", config.model.actor, device)
    path = out / "trajectories.jsonl"
    done = {row["episode_index"] for row in read_jsonl(path)}
    runner = EpisodeRunner(_sampler(actor, tokenizer, config, precision), tokenizer, single_turn=False,
                           workdir=out / "work", make_evaluator=make_evaluator or make_evaluator_factory(config),
                           workers=config.rollout.workers, max_new_tokens=config.rollout.max_new_tokens,
                           context_tokens=config.context_tokens(False), max_turns=config.rollout.max_turns,
                           wall_clock_s=config.rollout.wall_clock_s, sandbox=config.evaluator.sandbox,
                           model_name=config.model.actor, language=config.rollout.language)
    lock = threading.Lock()
    recorded = len(run.metrics())
    try:
        for step in range(1, config.steps + 1):
            base = (step - 1) * config.rollout.batch
            step_tasks = tasks_for_step(tasks, step, config.rollout.batch, config.rollout.samples_per_task, config.seed)
            skip = {i for i in range(len(step_tasks)) if base + i in done}
            if len(skip) == len(step_tasks) and step <= recorded:
                continue
            started = time.perf_counter()

            def keep(index: int, outcome: EpisodeOutcome) -> None:
                with lock:
                    append_jsonl(path, outcome.record | {"episode_index": base + index})
                say(f"round {step} episode {base + index}: {outcome.task} reward {_reward(outcome)} "
                    f"({outcome.status}, {outcome.turns} turns)")

            outcomes = [o for o in runner.run(step_tasks, keep, skip=skip) if o is not None]
            if step > recorded:
                run.record({"step": step} | episode_metrics(outcomes) | {"rollout_seconds": time.perf_counter() - started})
    finally:
        runner.close()
    say(f"{len(read_jsonl(path))} trajectories in {path}")
    return path


# ----------------------------------------------------------------------------- stage 2a and 2b: the warm-up

def read_trajectory_files(sources: tuple[str, ...]) -> list[dict[str, Any]]:
    records = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            path = path / "trajectories.jsonl"
        if not path.is_file():
            raise RunError(f"data.trajectories: {source} is not a trajectories.jsonl (or a `train collect` output)")
        records += read_jsonl(path)
    return records


def filtered_rollouts(config: StageConfig, say: Say) -> tuple[list[list[Rollout]], dict[str, int]]:
    from cuda_agent.train.warmup import episode_rollouts, keep_episode

    records = read_trajectory_files(config.data.trajectories)
    verdicts = [keep_episode(r, config.data.min_reward, config.data.max_repeats, config.data.drop_invalid_calls)
                for r in records]
    reasons = Counter(v.reason.split(":")[0].split(" (")[0] for v in verdicts)
    kept = [r for r, v in zip(records, verdicts) if v.keep]
    episodes = [e for e in episode_rollouts(kept) if e]
    # The verdicts' reasons count the kept ones too ("kept"), already said first.
    say(f"{len(records)} trajectories: {len(episodes)} kept; "
        + "; ".join(f"{n} {why}" for why, n in reasons.items() if why != "kept"))
    if not episodes:
        raise RunError(f"no trajectory in {', '.join(config.data.trajectories)} passes the filter (reward above "
                       f"{config.data.min_reward}, no redundant loop, no invalid tool call); collect more")
    return episodes, dict(reasons)


def run_rft(config: StageConfig, out: Path, *, say: Say = _stderr) -> list[dict[str, Any]]:
    """Stage 2a: SFT of ``model.actor`` on the kept trajectories' sampled tokens, ``sft.epochs`` passes of
    ``sft.batch`` sequences per step (under ``torchrun``, each rank takes its share of every batch)."""
    from cuda_agent.train.warmup import SFTTrainer

    begin = start_stage(config, out, {"stage": "rft"}, say)
    dist, say, run, done, precision = begin.dist, begin.say, begin.run, begin.done, begin.precision
    episodes, reasons = filtered_rollouts(config, say)
    if dist.main:
        (out / "filter.json").write_text(json.dumps({"kept": len(episodes), "reasons": reasons}, indent=1))
    sequences = [r for e in episodes for r in e]
    steps = math.ceil(len(sequences) / config.sft.batch) * config.sft.epochs
    models = Trainables(run, dist, done, {"actor": ("actor", config.model.actor)}, precision)
    trainer = SFTTrainer(models.models["actor"], config.sft.lr, micro_batch=config.sft.micro_batch,
                         max_grad_norm=config.sft.max_grad_norm, precision=begin.autocast,
                         logits_chunk=config.model.logits_chunk,
                         gradient_checkpointing=config.model.gradient_checkpointing)
    optimizers = {"actor": trainer.optimizer}
    models.restore_optimizers(optimizers)
    if done:
        say(f"resuming {out} after step {done}")
    pad = begin.pad
    for step in range(done + 1, steps + 1):
        epoch, batch = batch_for_step(sequences, step, config.sft.batch, config.seed)
        line = {"epoch": epoch + 1} | dist.mean(trainer.step(_local_batch(dist.share(batch), pad, dist), pad))
        models.commit(step, line, optimizers)
        say(f"step {step}/{steps}: loss {line['sft_loss']:.4f}  token accuracy {line['token_accuracy']:.2f}")
    if dist.main:
        _plot(out, say)
    return run.metrics()


def split_holdout(episodes: list[list[Rollout]], share: float, seed: int) -> tuple[list[Rollout], list[Rollout]]:
    """Whole episodes held out (their segments share a reward): the training and the held-out sequences."""
    order = _order(len(episodes), -1, seed)
    held = set(order[:round(share * len(episodes))]) if len(episodes) > 1 else set()
    train = [r for i, e in enumerate(episodes) if i not in held for r in e]
    return train, [r for i, e in enumerate(episodes) if i in held for r in e]


def run_value(config: StageConfig, out: Path, *, say: Say = _stderr) -> list[dict[str, Any]]:
    """Stage 2b: the critic (``model.critic``, or a new head on ``model.actor``) fitted to GAE targets from
    itself over ``value.iterations`` passes; held-out explained variance after every step."""
    from cuda_agent.train.warmup import ValueTrainer

    begin = start_stage(config, out, {"stage": "value"}, say)
    dist, say, run, done, precision = begin.dist, begin.say, begin.run, begin.done, begin.precision
    episodes, reasons = filtered_rollouts(config, say)
    train, held = split_holdout(episodes, config.data.holdout, config.seed)
    steps = math.ceil(len(train) / config.value.batch) * config.value.iterations
    models = Trainables(run, dist, done, {"critic": ("critic", config.model.critic or config.model.actor)}, precision)
    trainer = ValueTrainer(models.models["critic"], config.value.lr, gamma=config.ppo.gamma, lam=config.ppo.lam,
                           micro_batch=config.value.micro_batch, max_grad_norm=config.value.max_grad_norm,
                           value_clip=config.value.value_clip, precision=begin.autocast,
                           gradient_checkpointing=config.model.gradient_checkpointing)
    optimizers = {"critic": trainer.optimizer}
    models.restore_optimizers(optimizers)
    if done:
        say(f"resuming {out} after step {done}")
    pad = begin.pad
    evaluated = held or train  # every rank scores all of it: a sharded forward is a collective
    if done == 0:
        before = trainer.evaluate(evaluated, pad)
        if dist.main:
            (out / "before.json").write_text(json.dumps(before, indent=1))
        say(f"before: held-out explained variance {before['explained_variance']:.3f} "
            f"(Monte Carlo {before['explained_variance_mc']:.3f})")
    for step in range(done + 1, steps + 1):
        iteration, batch = batch_for_step(train, step, config.value.batch, config.seed)
        line = {"iteration": iteration + 1, "heldout_sequences": len(held)}
        line |= dist.mean(trainer.step(_local_batch(dist.share(batch), pad, dist), pad))
        line |= {f"heldout_{k}": v for k, v in trainer.evaluate(evaluated, pad).items()}
        line["explained_variance"] = line["heldout_explained_variance"]
        models.commit(step, line, optimizers)
        say(f"step {step}/{steps}: value loss {line['value_loss']:.4f}  held-out explained variance "
            f"{line['heldout_explained_variance']:.3f} (Monte Carlo {line['heldout_explained_variance_mc']:.3f})")
    if dist.main:
        _plot(out, say)
    return run.metrics()
