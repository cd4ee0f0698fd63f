"""One node, several GPUs: ``torchrun --nproc_per_node N -m cuda_agent.cli train ...`` and FSDP2.

Every rank runs its share of the step's episodes (its own sampler, its own evaluators on its own GPU) and
updates on them; FSDP2 (``torch.distributed.fsdp.fully_shard``, one unit per decoder layer, then the root)
shards parameters, gradients and optimiser state, and averages gradients over the ranks. Rank 0 alone
writes the run directory.

Decisions (docs/TRAINING.md):
  * Mixed precision is FSDP's own: bf16 parameters in compute, fp32 gradient reduction, fp32 sharded master
    weights and optimiser state (``MixedPrecisionPolicy``). Without sharding, the same is autocast over
    fp32 weights (``models.compute_precision``).
  * The sampler is a full, unsharded copy of the actor on each rank, refreshed from the sharded weights
    after every update. Generation from the sharded model itself would all-gather every layer at every
    decoding step, and ranks whose replies differ in length would wait on each other forever.
  * Every forward and backward is collective, so every rank must run as many micro-batches: batches are
    padded with rows that hold no sampled token (they change no loss) to the largest rank's size.
  * The head is scored in chunks under FSDP too: the chunked head stands in for the output layer inside
    the model's own forward (``models._ScoringHead``), where the root unit's parameters are gathered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from cuda_agent.train.rollout import RolloutBatch

__all__ = ["Dist", "init_distributed", "leave_group", "shard", "full_state_dict", "full_optimizer_state",
           "load_optimizer_state", "SavedModel", "SavedOptimizer", "pad_rows"]


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    fsdp: bool = False  # shard even alone (``model.fsdp``): the FSDP2 path on one GPU

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world > 1 or self.fsdp

    def device(self) -> str:
        return f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"

    def share(self, items: list[Any]) -> list[Any]:
        """This rank's items of a list every rank holds: every ``world``-th from ``rank``."""
        return items[self.rank::self.world]

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.world == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        if self.world == 1:
            return [value]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, value)
        return out

    def mean(self, metrics: dict[str, float]) -> dict[str, float]:
        """Numeric metrics averaged over the ranks (``*_max`` keys: the largest)."""
        if self.world == 1:
            return metrics
        gathered = self.gather(metrics)
        out = {}
        for key, value in metrics.items():
            values = [m[key] for m in gathered]
            if not isinstance(value, (int, float)):
                out[key] = value
            elif key.endswith("_max"):
                out[key] = max(values)
            elif key in ("sampled_tokens",):
                out[key] = sum(values)
            else:
                out[key] = sum(values) / len(values)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


def init_distributed(fsdp: bool = False) -> Dist:
    """The process group of a ``torchrun`` launch (NCCL on GPUs, gloo on the CPU), or one process alone;
    with ``fsdp``, one process is a group of one and its models are sharded all the same."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not fsdp:
        return Dist()
    if world == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.distributed.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return Dist(rank, world, local, fsdp)


def leave_group() -> None:
    """The process group destroyed at the end of a run that succeeded. Left to the interpreter's exit, gloo's
    threads can outlive it and abort the rank ("terminate called without an active exception";
    pytorch/pytorch#190489). Not after a failure: a rank still in a collective
    would wait for this one there."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Every rank at the end first: a rank destroying its group while another still sends to it (rank 0 saving
        # the checkpoint) aborted the same way.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard(model: Any, precision: str) -> Any:
    """FSDP2 over ``model``: each block transformers keeps whole (``_no_split_modules``), then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" \
        else MixedPrecisionPolicy()
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no decoder blocks (_no_split_modules); FSDP needs them")
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def full_state_dict(model: Any, dist: Dist) -> dict[str, torch.Tensor]:
    """The whole model's weights on every rank (a collective: every rank calls it)."""
    if not dist.sharded:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(model: Any, optimizer: Any, dist: Dist) -> dict[str, Any]:
    if not dist.sharded:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: Any, optimizer: Any, state: dict[str, Any], dist: Dist) -> None:
    if not dist.sharded:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


class SavedModel:
    """What ``RunDir.save`` needs of a model (``save_pretrained``), with weights gathered beforehand."""

    def __init__(self, model: Any, state_dict: dict[str, torch.Tensor]):
        self.model, self.state = model, state_dict

    def save_pretrained(self, path: Any) -> None:
        import json
        from pathlib import Path

        self.model.save_pretrained(path, state_dict={k: v.detach().cpu() for k, v in self.state.items()})
        # fully_shard swapped in a subclass ("FSDPQwen2ForCausalLM"): name the class a loader knows.
        config = Path(path) / "config.json"
        values = json.loads(config.read_text())
        values["architectures"] = [next(c.__name__ for c in type(self.model).__mro__ if not c.__name__.startswith("FSDP"))]
        config.write_text(json.dumps(values, indent=2) + "\n")


class SavedOptimizer:
    def __init__(self, state: dict[str, Any]):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state


def pad_rows(batch: RolloutBatch, rows: int) -> RolloutBatch:
    """``batch`` with rows appended up to ``rows``, each one token with nothing sampled."""
    extra = rows - batch.ids.shape[0]
    if extra <= 0:
        return batch

    def grow(t: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.cat([t, torch.full((extra, t.shape[1]), fill, dtype=t.dtype, device=t.device)])

    attention = grow(batch.attention, 0)
    attention[-extra:, 0] = 1  # one real token: a forward over nothing at all is not defined
    return RolloutBatch(grow(batch.ids, 0), attention, grow(batch.mask, 0), grow(batch.old_logprobs, 0),
                        grow(batch.rewards, 0))
