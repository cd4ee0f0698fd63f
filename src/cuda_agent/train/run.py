"""A training run's directory: its config, metrics as they come, checkpoints to resume from, plots.

    RUN/config.json      what the run was started with; a restart with another config is refused
    RUN/metrics.jsonl    one line per finished step
    RUN/checkpoint/      actor/, critic/ (save_pretrained, with the tokenizer when the run has one: each is a
                         model directory the next stage loads by path), state.pt (optimisers, step, random states)
    RUN/*.png            ``plot_metrics``

A step's checkpoint is written before its metrics line, each by a rename, so a run killed at any moment
resumes at the step after the last one it recorded and never repeats or skips one. Steps committed
without a checkpoint (``checkpoint=False``, for models too large to save every step) hold their lines
until the next checkpoint writes them all: a kill loses and reruns them, and the metrics never run
ahead of the weights.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from cuda_agent.jsonl import append_jsonl, read_jsonl

__all__ = ["RunError", "RunDir", "write_atomic", "PLOTTED", "plot_metrics"]


class RunError(ValueError):
    """A run directory that cannot be resumed as asked."""


class RunDir:
    def __init__(self, path: Path, config: dict[str, Any], checkpoints: bool = True):
        self.path = Path(path)
        self.checkpoints = checkpoints  # False: a run that records metrics only (collect)
        self.tokenizer: Any = None  # saved with every model of a checkpoint, when set
        self.config = json.loads(json.dumps(config))  # as it reads back from disk
        self.metrics_path = self.path / "metrics.jsonl"
        self.checkpoint = self.path / "checkpoint"
        self._held: list[dict[str, Any]] = []  # lines of steps done since the last checkpoint

    def open(self) -> int:
        """Create the run, or check that it is the same run; the number of steps already done."""
        self.path.mkdir(parents=True, exist_ok=True)
        saved_path = self.path / "config.json"
        if saved_path.exists():
            saved = json.loads(saved_path.read_text())
            changed = sorted(k for k in saved.keys() | self.config.keys() if saved.get(k) != self.config.get(k))
            if changed:
                details = "; ".join(f"{k}: {saved.get(k)!r} -> {self.config.get(k)!r}" for k in changed)
                raise RunError(f"{self.path} was started with another config ({details}); resume it with the same "
                               "settings, or give a new --out")
        else:
            write_atomic(saved_path, json.dumps(self.config, indent=1, sort_keys=True) + "\n")
        done = len(self.metrics())
        if not self.checkpoints:
            return done
        state = self._state()
        saved = int(state["steps"]) if state else 0
        if state and saved > done:
            # Killed after the checkpoint and before its metrics lines: the lines are in the checkpoint.
            lines = state["metrics"] if isinstance(state["metrics"], list) else [state["metrics"]]
            missing = [line for line in lines if line.get("step", 0) > done]
            if [line.get("step") for line in missing] == list(range(done + 1, saved + 1)):
                for line in missing:
                    self.record(line)
                done = saved
        if saved != done:
            raise RunError(f"{self.path}: {done} step(s) are recorded but the checkpoint holds {saved}; the run "
                           "directory is damaged (start a new --out)")
        return done

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)

    def record(self, metrics: dict[str, Any]) -> None:
        append_jsonl(self.metrics_path, metrics)

    def _state(self) -> dict[str, Any] | None:
        if not self.checkpoint.exists() and (self.path / "checkpoint.old").exists():
            (self.path / "checkpoint.old").rename(self.checkpoint)  # killed between the two renames of save()
        path = self.checkpoint / "state.pt"
        return torch.load(path, weights_only=False) if path.exists() else None

    def commit(self, steps: int, metrics: dict[str, Any], models: dict[str, Any], optimizers: dict[str, Any],
               extra: dict[str, Any] | None = None, checkpoint: bool = True) -> None:
        """Step ``steps`` is done: its checkpoint, then its metrics line (``{"step": steps} | metrics``).
        Without ``checkpoint`` the line waits for the next step that has one."""
        self._held.append({"step": steps} | metrics)
        if not checkpoint:
            return
        self.save(steps, self._held, models, optimizers, extra)
        for line in self._held:
            self.record(line)
        self._held = []

    def save(self, steps: int, metrics: dict[str, Any] | list[dict[str, Any]], models: dict[str, Any],
             optimizers: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        """Everything needed to continue after ``steps`` finished steps (and the metrics lines not yet
        recorded), replacing the previous checkpoint."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per save_pretrained, every step
        staging = self.path / "checkpoint.new"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        for name, model in models.items():
            model.save_pretrained(staging / name)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(staging / name)  # each checkpoint a complete model directory
        torch.save({"steps": steps, "metrics": metrics, "optimizers": {k: o.state_dict() for k, o in optimizers.items()},
                    "random": _random_state(), "extra": extra or {}}, staging / "state.pt")
        old = self.path / "checkpoint.old"
        shutil.rmtree(old, ignore_errors=True)
        if self.checkpoint.exists():
            self.checkpoint.rename(old)
        staging.rename(self.checkpoint)
        shutil.rmtree(old, ignore_errors=True)

    def restore(self, models: dict[str, Any], optimizers: dict[str, Any]) -> dict[str, Any]:
        """Load the last checkpoint into ``models`` and ``optimizers``; its ``extra``."""
        state = self._state()
        if state is None:
            raise RunError(f"{self.path}: no checkpoint to resume from")
        for name, model in models.items():
            loaded = type(model).from_pretrained(self.checkpoint / name)
            model.load_state_dict(loaded.state_dict())
        for name, optimizer in optimizers.items():
            optimizer.load_state_dict(state["optimizers"][name])
        _set_random_state(state["random"])
        return state["extra"]

    def optimizer_states(self) -> dict[str, Any]:
        """The last checkpoint's optimiser states by name (to load into sharded optimisers)."""
        state = self._state()
        if state is None:
            raise RunError(f"{self.path}: no checkpoint to resume from")
        return state["optimizers"]


def write_atomic(path: Path, text: str) -> None:
    """``text`` at ``path`` by a rename: a kill leaves the old file or the new one, never half of one."""
    staging = path.with_suffix(path.suffix + ".tmp")
    staging.write_text(text)
    staging.replace(path)


def _random_state() -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.random.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_random_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.random.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


PLOTTED = (("reward_mean", "mean reward"), ("pass_rate", "pass rate (reward > 0)"), ("entropy", "actor entropy"),
           ("explained_variance", "critic explained variance"), ("approx_kl", "approximate KL"),
           ("clip_fraction", "clip fraction"), ("response_tokens", "response length (tokens)"),
           ("actor_grad_norm", "actor gradient norm"), ("logprob_mismatch", "sampler vs trainer logprob (mean |diff|)"),
           ("update_seconds", "update seconds"))


def plot_metrics(run: Path) -> list[Path]:
    """One PNG of the run's curves (the paper's: reward, pass rate, entropy, explained variance, KL, ...)
    and one of the reward distribution over -1/1/2/3 per step; the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(Path(run) / "metrics.jsonl")
    if not rows:
        raise RunError(f"{run}: no metrics.jsonl rows to plot")
    steps = [r["step"] for r in rows]
    shown = [(key, label) for key, label in PLOTTED if any(key in r for r in rows)]
    columns = 2
    fig, axes = plt.subplots((len(shown) + 1) // columns, columns, figsize=(10, 2.6 * ((len(shown) + 1) // columns)),
                             squeeze=False)
    for ax, (key, label) in zip(axes.flat, shown):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker=".")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.tight_layout()
    curves = Path(run) / "curves.png"
    fig.savefig(curves, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3))
    bottom = [0.0] * len(rows)
    # Milestone rewards (-1, 1, 2, 3) for the stages; the demo, whose rewards are speedups, shares by answer.
    keys = list(dict.fromkeys(key for r in rows for key in r.get("reward_shares", {}))) or ["-1", "1", "2", "3"]
    for key in keys:
        share = [r.get("reward_shares", {}).get(key, 0.0) for r in rows]
        ax.bar(steps, share, bottom=bottom, label=f"reward {key}" if key.lstrip("-").isdigit() else key)
        bottom = [b + s for b, s in zip(bottom, share)]
    ax.set_xlabel("step")
    ax.set_ylabel("share of episodes")
    ax.legend(fontsize=8, ncols=4, loc="upper center", bbox_to_anchor=(0.5, 1.25))
    fig.tight_layout()
    shares = Path(run) / "rewards.png"
    fig.savefig(shares, dpi=100)
    plt.close(fig)
    return [curves, shares]
