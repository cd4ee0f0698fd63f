"""Tasks: KernelBench-format PyTorch programs (``Model``, ``get_inputs``, ``get_init_inputs``)."""

from cuda_agent.tasks.task import Task, TaskError, check_task_source, exec_task_module
from cuda_agent.tasks.loaders import load_task, load_tasks

__all__ = ["Task", "TaskError", "check_task_source", "exec_task_module", "load_task", "load_tasks"]
