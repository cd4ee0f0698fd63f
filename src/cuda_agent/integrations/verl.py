"""verl: our agent loop, single-turn reward, data and SFT dataset for verl's trainer. The code lives in
``cuda_agent.train.verl`` (the paths verl's YAML files name, ``cuda-agent train ... --engine verl`` and the
packaged configs use); this module gathers its entry points beside the other stacks' adapters. Importing it
imports verl (the agent loop registers itself with verl): ``pip install 'cuda-agent[verl]'``.

    CudaAgentLoop      verl's ``AgentLoopBase`` (``_target_: cuda_agent.train.verl.agent_loop.CudaAgentLoop``)
    compute_score      ``reward.custom_reward_function`` (``path: pkg://cuda_agent.train.verl.reward``)
    tasks_to_parquet   tasks as verl's RLHFDataset rows (``python -m cuda_agent.train.verl.data SOURCE OUT``)
    TrajectorySFTDataset  ``data.custom_cls`` for verl's SFT trainer (stage 2a, rejection fine-tuning)
"""

from __future__ import annotations

from cuda_agent.train.verl.agent_loop import CudaAgentLoop, ServerBackend
from cuda_agent.tasks.rows import task_from_row
from cuda_agent.train.verl.data import AGENT_NAME, SINGLE_TURN_AGENT, task_row, tasks_to_parquet
from cuda_agent.train.verl.reward import compute_score
from cuda_agent.train.verl.sft import TrajectorySFTDataset

__all__ = ["AGENT_NAME", "SINGLE_TURN_AGENT", "CudaAgentLoop", "ServerBackend", "TrajectorySFTDataset",
           "compute_score", "task_from_row", "task_row", "tasks_to_parquet"]
