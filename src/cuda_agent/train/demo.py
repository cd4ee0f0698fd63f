"""``cuda-agent train demo``: PPO on a tiny model learns to pick the fastest correct kernel, with
rewards from the real evaluator.

The task is the bundled example of the device (``cpu_swish`` on the CPU, ``cuda_gelu`` on a GPU). The
policy, a randomly initialised two-layer model with a word-level tokenizer trained at start-up, answers a
prompt with one word; four of its words name prepared candidates, built from the example's solution:

    fast   the solution as it is          (correct)
    slow   the same kernel run 4 times    (correct, 4 times the work)
    wrong  returns unwritten memory       (wrong-output: -1)
    torch  torch's own operators          (torch-compute: -1)

The reward is the evaluator's ``speedup`` reward (the speedup over torch.compile for a correct
candidate, -1 otherwise), not the paper's milestone reward: the example's kernel does not beat eager
torch on a CPU, so fast and slow would both score the milestone's 1, leaving only correctness to learn,
while slow's four times the work shows on any machine. So fast earns about four times slow's reward.

Any other answer is -1, as an unparseable single-turn reply is. Each candidate is evaluated once and
its result kept in ``RUN/menu.json`` (the policy can only ever write these four programs, so a reward
per name is the evaluator's reward); the run learns from chance to the fastest name in a few minutes
on two CPU cores. Metrics, checkpoints and resume are those of every training run (``train.run.RunDir``).
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from cuda_agent.candidates import load_candidate
from cuda_agent.evaluate import Evaluator, Policy, long_lived
from cuda_agent.evaluate.result import no_reward_reason
from cuda_agent.paths import EXAMPLES
from cuda_agent.tasks import load_task
from cuda_agent.train.models import critic_from_actor
from cuda_agent.train.ppo import PPOConfig, PPOTrainer
from cuda_agent.train.rollout import Rollout, RolloutBatch
from cuda_agent.train.run import RunDir, plot_metrics, write_atomic

__all__ = ["EXAMPLE", "PROMPT", "FILLER", "DemoConfig", "menu_forwards", "prepare_menu", "make_tokenizer", "make_actor",
           "NoVerdictStep", "MenuRewards", "run_demo"]

# The example per device, the call its solution makes, and torch's own version of it.
EXAMPLE = {
    "cpu": ("cpu_swish", "cuda_extension.scaled_swish(x, self.scale)", "self.scale * (x * torch.sigmoid(x))"),
    "cuda": ("cuda_gelu", "cuda_extension.gelu(x)", "torch.nn.functional.gelu(x)"),
}
PROMPT = "pick the kernel to ship :"
FILLER = "maybe none later again kernel fastest correct"  # words the policy may answer that name nothing


@dataclass(frozen=True)
class DemoConfig:
    device: str = "cpu"
    batch: int = 16
    seed: int = 0
    reward: str = "speedup"  # the evaluator's reward (Policy.reward): see the module's docstring
    max_new_tokens: int = 3
    actor_lr: float = 2e-3
    critic_lr: float = 2e-3

    def ppo(self) -> PPOConfig:
        return PPOConfig(actor_lr=self.actor_lr, critic_lr=self.critic_lr, micro_batch=self.batch)


def menu_forwards(call: str, fallback: str) -> dict[str, str]:
    """The forward body of each prepared candidate."""
    return {
        "fast": f"return {call}",
        "slow": f"y = {call}\n        for _ in range(3):\n            y = {call}\n        return y",
        "wrong": "return torch.empty_like(x)",
        "torch": f"return {fallback}",
    }


def prepare_menu(device: str, root: Path) -> tuple[Any, dict[str, Path]]:
    """The example task and one candidate directory per menu name under ``root``."""
    example, call, fallback = EXAMPLE[device]
    task = load_task(EXAMPLES / example / "model.py")
    solution = EXAMPLES / example / "solution"
    original = (solution / "model_new.py").read_text()
    line = f"        return {call}\n"
    if line not in original:
        raise ValueError(f"{solution}/model_new.py no longer contains {line.strip()!r}")
    menu = {}
    for name, body in menu_forwards(call, fallback).items():
        folder = root / name
        if not folder.exists():
            shutil.copytree(solution, folder)
            (folder / "model_new.py").write_text(original.replace(line, f"        {body}\n"))
        menu[name] = folder
    return task, menu


def make_tokenizer(words: list[str]) -> Any:
    """A word-level tokenizer trained on the demo's words (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(
        special_tokens=["<pad>", "<unk>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def make_actor(tokenizer: Any, seed: int) -> Any:
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    return transformers.AutoModelForCausalLM.from_config(config)


class NoVerdictStep(RuntimeError):
    """A step in which no sampled answer got a reward: every evaluation it asked for had no verdict."""


class MenuRewards:
    """The evaluator's result for each menu name, evaluated on first use and kept in ``path``. Only verdicts are
    kept: an evaluation without one (a busy host) gives that answer no reward in this step (``undecided``, cleared
    by ``next_step``) and is evaluated again in the next; a no-verdict an older run kept is dropped on reading."""

    def __init__(self, path: Path, task: Any, menu: dict[str, Path], evaluator: Callable[[], Evaluator],
                 on_stage: Callable[[str], None] = lambda line: None):
        self.path, self.task, self.menu, self.evaluator, self.on_stage = path, task, menu, evaluator, on_stage
        kept = json.loads(path.read_text()) if path.exists() else {}
        self.results: dict[str, dict[str, Any]] = {name: entry for name, entry in kept.items()
                                                   if entry.get("reward") is not None and entry.get("status") != "error"}
        self.undecided: dict[str, str] = {}  # answer -> why its evaluation in this step had no verdict
        self._evaluator: Evaluator | None = None

    def next_step(self) -> None:
        self.undecided.clear()

    def reward(self, answer: str) -> float | None:
        """The answer's reward: -1 for a name off the menu, None where its evaluation had no verdict."""
        if answer not in self.menu:
            return -1.0
        if answer in self.undecided:
            return None
        if answer not in self.results:
            self._evaluator = self._evaluator or self.evaluator()
            self.on_stage(f"evaluating the {answer!r} candidate with the real evaluator")
            result = self._evaluator.evaluate(self.task, load_candidate(self.menu[answer]))
            status = next((line.strip() for line in result.summary().splitlines() if line.strip().startswith("status")),
                          result.status)
            if result.no_verdict:
                self.undecided[answer] = no_reward_reason(result.to_dict())
                self.on_stage(f"  {answer}: no reward in this step ({self.undecided[answer]}); evaluated again next step")
                return None
            self.results[answer] = {"reward": result.reward, "status": result.status, "rule": result.rule,
                                    "summary": status}
            write_atomic(self.path, json.dumps(self.results, indent=1))
            self.on_stage(f"  {answer}: reward {result.reward:+.2f}, {status}")
        return float(self.results[answer]["reward"])

    def close(self) -> None:
        """Ends the evaluator's processes (its kept reference), if one was made."""
        if self._evaluator is not None:
            self._evaluator.close()
            self._evaluator = None


def run_demo(out: Path, device: str = "cpu", steps: int = 40, config: DemoConfig | None = None,
             evaluator_options: dict[str, Any] | None = None, quiet: bool = False) -> list[dict[str, Any]]:
    """Train for ``steps`` steps in total (resuming ``out`` if it holds a run); the metrics rows.
    ``evaluator_options`` go to the ``Evaluator`` (a ``cache_dir``, say); its policy is the config's reward."""
    config = config or DemoConfig(device=device)
    say = (lambda line: None) if quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    run = RunDir(out, {"kind": "demo"} | asdict(config))
    done = run.open()
    task, menu = prepare_menu(config.device, out / "menu")
    policy = Policy.preset("fair", reward=config.reward)
    rewards = MenuRewards(out / "menu.json", task, menu,
                          lambda: Evaluator(config.device, policy=policy, **(long_lived(config.device) | (evaluator_options or {}))), say)
    tokenizer = make_tokenizer(PROMPT.split() + list(menu) + FILLER.split())
    random.seed(config.seed)
    actor = make_actor(tokenizer, config.seed).to(config.device)
    critic = critic_from_actor(actor)
    trainer = PPOTrainer(actor, critic, config.ppo())
    models = {"actor": actor, "critic": critic}
    optimizers = {"actor": trainer.actor_optimizer, "critic": trainer.critic_optimizer}
    if done:
        run.restore(models, optimizers)
        say(f"resuming {out} after step {done}")
    prompt = tokenizer(PROMPT)["input_ids"]
    from cuda_agent.agent.tokens import TransformersBackend

    sampler = TransformersBackend(actor, tokenizer)
    try:
        _train(run, config, steps, done, sampler, prompt, tokenizer, rewards, trainer, menu, models, optimizers, say)
    finally:
        rewards.close()
    rows = run.metrics()
    if rows:
        try:
            plot_metrics(out)
        except ImportError:
            from cuda_agent.paths import install_hint
            say(f"no plots: matplotlib is not installed ({install_hint('train')})")
    return rows


def _train(run: Any, config: DemoConfig, steps: int, done: int, sampler: Any, prompt: list[int], tokenizer: Any,
           rewards: MenuRewards, trainer: Any, menu: dict[str, Path], models: dict[str, Any], optimizers: dict[str, Any],
           say: Callable[[str], None]) -> None:
    for step in range(done + 1, steps + 1):
        started = time.perf_counter()
        rewards.next_step()
        rollouts, answers, evaluate_s, clipped, undecided = [], [], 0.0, 0, 0
        for _ in range(config.batch):
            output = sampler.generate(prompt, config.max_new_tokens)
            answer = (tokenizer.decode(output.ids, skip_special_tokens=True).split() or [""])[0]
            clock = time.perf_counter()
            reward = rewards.reward(answer)
            evaluate_s += time.perf_counter() - clock
            clipped += output.finish_reason == "length"
            answers.append(answer)
            if reward is None:
                undecided += 1  # no verdict: no reward, so the sample is left out of the update
                continue
            rollouts.append(Rollout(tuple(prompt), tuple(output.ids), (1,) * len(output.ids), tuple(output.logprobs),
                                    reward))
        if not rollouts:
            raise NoVerdictStep(f"step {step}: no sampled answer got a reward (the host was too busy to decide: "
                                f"{'; '.join(rewards.undecided.values())}); nothing of the run is lost: run the same "
                                "command again once the host is quieter")
        rollout_s = time.perf_counter() - started - evaluate_s
        metrics = trainer.step(RolloutBatch.collate(rollouts, pad_id=tokenizer.pad_token_id))
        values = [r.reward for r in rollouts]
        line = {
            "reward_mean": sum(values) / len(values),
            "no_verdict": undecided,
            "reward_shares": {name: answers.count(name) / len(answers) for name in menu} | {
                "other": sum(a not in menu for a in answers) / len(answers)},
            "pass_rate": sum(v > 0 for v in values) / len(values),
            "answers": {name: answers.count(name) / len(answers) for name in sorted(set(answers))},
            "response_tokens": sum(len(r.response_ids) for r in rollouts) / len(rollouts),
            "clipped_share": clipped / len(rollouts),
            "rollout_seconds": rollout_s, "evaluate_seconds": evaluate_s,
        } | metrics
        run.commit(step, line, models, optimizers)
        say(f"step {step:3d}/{steps}: reward {line['reward_mean']:+.2f}  pass {line['pass_rate']:.0%}  "
            f"answers {', '.join(f'{k or chr(8709)} {v:.0%}' for k, v in line['answers'].items())}")
