"""The command lines that run the paper's stages on verl, from the override files in ``configs/``.

    ppo-single-turn  stage 1   python -m verl.trainer.main_ppo, configs/ppo_single_turn.yaml
    rft              stage 2a  torchrun -m verl.trainer.sft_trainer, configs/sft_rft.yaml (our trajectories,
                               ``sft.TrajectorySFTDataset``)
    ppo-agentic      stage 3   python -m verl.trainer.main_ppo, configs/ppo_agentic.yaml (our agent loop,
                               configs/agent_loops.yaml)

Stage 2b, value pretraining, has no verl command: verl has no offline value pretraining, so it is
``cuda-agent train value`` on every engine; its RUN/checkpoint/critic is stage 3's ``critic.model.path``.
Each stage's checkpoints go to OUT (``trainer.default_local_dir``); the next stage's model is
OUT/global_step_N/actor/huggingface after PPO, OUT/global_step_N/huggingface after RFT.

Multi-node launch
-----------------
PPO (stages 1 and 3) runs on a Ray cluster; the command starts on the head node and places its workers on
every node's GPUs:

1. The evaluation service first, on GPU nodes of its own (the rollout servers and the trainer hold every GPU
   of verl's nodes): ``cuda-agent serve --ray auto --device cuda`` on the service's Ray cluster (docs/SCALE.md),
   listening at http://SERVICE:PORT.
2. On every node of the training cluster, with the service's URL in the environment, since Ray workers
   inherit the environment of the ``ray start`` that launched their node (the reward function and the agent
   loop read it there)::

       export CUDA_AGENT_SERVICE=http://SERVICE:PORT
       ray start --head --port 6379                       # the head node
       ray start --address HEAD:6379                      # each worker node

3. On the head node, the command ``verl_command`` returns, with the cluster's shape as overrides::

       trainer.nnodes=NODES trainer.n_gpus_per_node=GPUS

   ``ray.init`` in verl's trainer joins the running cluster. On one node no ``ray start`` is needed: verl
   starts Ray itself, and its workers inherit the trainer's environment (export CUDA_AGENT_SERVICE there).
   The configs' other ``${oc.env:...}`` values (CUDA_AGENT_ACTOR, CUDA_AGENT_CRITIC, CUDA_AGENT_TRAIN_FILES,
   CUDA_AGENT_VAL_FILES) are resolved in a Ray worker too: give them as overrides (``actor_rollout_ref.model.path=
   ...``), or export them with CUDA_AGENT_SERVICE.

RFT (stage 2a) is torchrun, no Ray: run the same command on every node, torchrun's rendezvous options
before the module (``torchrun_args``: ``--nnodes NODES --node_rank I --master_addr HEAD --master_port
29500``); it needs no evaluation service.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["CONFIGS", "STAGES", "AGENT_LOOPS", "AGENT_LOOP_KEY", "OUT_KEY", "default_config", "verl_command"]

CONFIGS = Path(__file__).resolve().parent / "configs"
# stage -> (its packaged config, the verl module that runs it)
STAGES = {
    "ppo-single-turn": ("ppo_single_turn.yaml", "verl.trainer.main_ppo"),
    "rft": ("sft_rft.yaml", "verl.trainer.sft_trainer"),
    "ppo-agentic": ("ppo_agentic.yaml", "verl.trainer.main_ppo"),
}
AGENT_LOOPS = "agent_loops.yaml"
AGENT_LOOP_KEY = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
OUT_KEY = "trainer.default_local_dir"


def default_config(stage: str) -> Path:
    """The packaged override file of ``stage``."""
    return CONFIGS / STAGES[_check_stage(stage)][0]


def verl_command(stage: str, config_path: str | Path | None, out_dir: str | Path, overrides: Sequence[str] = (), *,
                 nproc_per_node: int | str = "gpu", torchrun_args: Sequence[str] = ()) -> list[str]:
    """The argv that runs ``stage`` on verl with the override file ``config_path`` (None: the packaged one),
    checkpoints in ``out_dir``, and hydra ``overrides`` (``key=value``, last wins) after ours.

    PPO stages: ``python -m verl.trainer.main_ppo --config-path DIR --config-name NAME
    trainer.default_local_dir=OUT ...``; ppo-agentic also gets ``agent_loop_config_path`` as the absolute
    path of the agent_loops.yaml beside the config, where the config leaves it to the environment (``${oc.env:
    ...}``) or unset and ``overrides`` do not set it. rft: ``python -m torch.distributed.run --nproc_per_node N [torchrun_args] -m
    verl.trainer.sft_trainer ...``. Hydra takes a key's last value, so ``overrides`` may replace ours. Paths are
    made absolute; nothing is run, and verl is not imported. Raises ValueError for an unknown stage or a config file that is not there."""
    name, module = STAGES[_check_stage(stage)]
    config = Path(config_path).expanduser().resolve() if config_path is not None else CONFIGS / name
    if not config.is_file():
        raise ValueError(f"{config}: no such verl config file (the packaged ones are in {CONFIGS})")
    overrides = [str(o) for o in overrides]
    ours = [f"{OUT_KEY}={Path(out_dir).expanduser().resolve()}"]
    if stage == "ppo-agentic" and not _sets(overrides, AGENT_LOOP_KEY) and _unset(config, AGENT_LOOP_KEY):
        loops = config.parent / AGENT_LOOPS
        if not loops.is_file():
            raise ValueError(f"{config} does not set {AGENT_LOOP_KEY} and there is no {AGENT_LOOPS} beside it: "
                             f"copy {CONFIGS / AGENT_LOOPS} there, or pass {AGENT_LOOP_KEY}=/absolute/path.yaml")
        ours.append(f"{AGENT_LOOP_KEY}={loops}")
    hydra = ["--config-path", str(config.parent), "--config-name", config.stem]
    if module == "verl.trainer.sft_trainer":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc_per_node),
                    *torchrun_args, "-m", module]
    else:
        launcher = [sys.executable, "-m", module]
    return launcher + hydra + ours + overrides


def _check_stage(stage: str) -> str:
    if stage not in STAGES:
        raise ValueError(f"unknown verl stage {stage!r}; the stages are {', '.join(STAGES)} (value pretraining "
                         "has no verl stage: run `cuda-agent train value`)")
    return stage


def _sets(overrides: Sequence[str], key: str) -> bool:
    return any(o.split("=", 1)[0].lstrip("+~") == key for o in overrides)


def _unset(config: Path, dotted: str) -> bool:
    """Whether the YAML file leaves ``dotted`` to the environment or to verl's default (null)."""
    import yaml

    node: Any = yaml.safe_load(config.read_text()) or {}
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return True
        node = node[part]
    return node is None or node == "???" or (isinstance(node, str) and node.startswith("${oc.env:"))
