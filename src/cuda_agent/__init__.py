"""cuda-agent: train and run LLM agents that write fast, verified CUDA kernels for PyTorch programs."""

from cuda_agent.candidates import Candidate, CandidateError, load_candidate
from cuda_agent.evaluate import EvalResult, Evaluator, Policy, TimingConfig, evaluate
from cuda_agent.tasks import Task, TaskError, load_task, load_tasks

__all__ = [
    "Candidate",
    "CandidateError",
    "EvalResult",
    "Evaluator",
    "Policy",
    "Task",
    "TaskError",
    "TimingConfig",
    "evaluate",
    "load_candidate",
    "load_task",
    "load_tasks",
]
__version__ = "0.1.0"
