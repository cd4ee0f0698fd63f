"""Our agent trajectories as verl's SFT data: the paper's stage 2a (rejection fine-tuning) on verl's SFT trainer.

``TrajectorySFTDataset`` is a ``data.custom_cls`` for ``torchrun -m verl.trainer.sft_trainer``: it reads what
``cuda-agent train rft`` reads (``data.train_files``: trajectories.jsonl files or ``train collect`` output
folders), keeps the episodes the RFT filter keeps (``warmup.keep_episode``: reward above ``min_reward``, no
redundant loop, no tool call that breaks the schema), and yields one sample per token sequence of each kept
episode (``train.rollout``: a segment of its token trace), already tokenized::

    input_ids     the sequence as the policy saw and wrote it: the trace's ids, never re-encoded from text
    position_ids  0 .. n-1
    loss_mask     1 exactly on the tokens the policy sampled; 0 on the prompt, tool results and template tokens

That is verl's unpadded sample (``data.pad_mode: no_padding``, the only mode its FSDP engine trains): verl
shifts the mask by one itself, so a 1 marks the token to be predicted, as ``MultiTurnSFTDataset`` marks
assistant tokens. The filter's settings are ``data.rft_filter`` (``min_reward``, ``max_repeats``,
``drop_invalid_calls``), the paper's by default. ``configs/sft_rft.yaml`` sets all of this.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.utils.data import Dataset

from cuda_agent.train.config import DataConfig, StageConfig
from cuda_agent.train.rollout import Rollout
from cuda_agent.train.run import RunError
from cuda_agent.train.stages import filtered_rollouts

NO_PADDING = "no_padding"
TRUNCATIONS = ("error", "right")


class TrajectorySFTDataset(Dataset):
    """verl's custom SFT dataset over our trajectories; made by verl as
    ``cls(parquet_files=..., tokenizer=..., config=data_config, processor=..., max_samples=...)``."""

    def __init__(self, parquet_files: Any, tokenizer: Any = None, config: Any = None, processor: Any = None,
                 max_samples: int = -1):
        config = config if config is not None else {}
        pad_mode = str(_get(config, "pad_mode", NO_PADDING))
        if pad_mode != NO_PADDING:
            # verl's FSDP engine asserts no_padding when it prepares a micro-batch (workers/engine/fsdp).
            raise ValueError(f"data.pad_mode={pad_mode}: verl's SFT engine trains unpadded samples only; set "
                             f"data.pad_mode={NO_PADDING}")
        self.max_length = int(_get(config, "max_length", 0) or 0)
        self.truncation = str(_get(config, "truncation", "error"))
        if self.truncation not in TRUNCATIONS:
            # Cutting the start would train on contexts the policy never saw (no system prompt, no task).
            raise ValueError(f"data.truncation={self.truncation}: trajectories can be refused (error) or cut at "
                             f"the end (right); choose one of {', '.join(TRUNCATIONS)}")
        files = [parquet_files] if isinstance(parquet_files, (str, os.PathLike)) else list(parquet_files)
        rft = _get(config, "rft_filter", None) or {}
        defaults = DataConfig()
        data = DataConfig(trajectories=tuple(str(f) for f in files),
                          min_reward=float(_get(rft, "min_reward", defaults.min_reward)),
                          max_repeats=int(_get(rft, "max_repeats", defaults.max_repeats)),
                          drop_invalid_calls=bool(_get(rft, "drop_invalid_calls", defaults.drop_invalid_calls)))
        # The same loader, filter and report as `cuda-agent train rft`, so both engines train on the same episodes.
        try:
            episodes, self.reasons = filtered_rollouts(StageConfig(data=data), _say)
        except RunError as exc:  # its messages name our config's key; here the files are verl's
            raise RunError(str(exc).replace("data.trajectories", "data.train_files")) from None
        self.samples = self._fit([r for episode in episodes for r in episode])
        if max_samples is not None and int(max_samples) > 0:
            self.samples = self.samples[:int(max_samples)]

    def _fit(self, rollouts: list[Rollout]) -> list[tuple[list[int], list[int]]]:
        """Each rollout as (ids, loss mask), within ``max_length``."""
        samples = [(list(r.ids), [0] * len(r.prompt_ids) + [int(m) for m in r.response_mask]) for r in rollouts]
        if not self.max_length:
            return samples
        longest = max(len(ids) for ids, _ in samples)
        if longest <= self.max_length:
            return samples
        if self.truncation == "error":
            over = sum(len(ids) > self.max_length for ids, _ in samples)
            raise ValueError(f"{over} of {len(samples)} trajectory sequences are longer than data.max_length="
                             f"{self.max_length} (the longest: {longest} tokens): raise data.max_length to {longest}, "
                             "or set data.truncation=right to cut them")
        cut = [(ids[:self.max_length], mask[:self.max_length]) for ids, mask in samples]
        # A sequence cut before its first sampled token has nothing to learn, and a batch of only such would
        # divide verl's loss by zero tokens.
        kept = [(ids, mask) for ids, mask in cut if any(mask)]
        if not kept:
            raise ValueError(f"data.max_length={self.max_length} cuts every trajectory before its first sampled "
                             "token: raise data.max_length")
        return kept

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, mask = self.samples[index]
        return {"input_ids": torch.tensor(ids, dtype=torch.long),
                "position_ids": torch.arange(len(ids), dtype=torch.long),
                "loss_mask": torch.tensor(mask, dtype=torch.long)}


def _get(config: Any, key: str, default: Any) -> Any:
    """A key of verl's data config (an OmegaConf node) or of a plain mapping."""
    getter = getattr(config, "get", None)
    return getter(key, default) if getter is not None else default


def _say(line: str) -> None:
    print(f"TrajectorySFTDataset: {line}", file=sys.stderr, flush=True)
