"""Running untrusted work in child processes with limits.

Every process that compiles or runs candidate code is started through a
``Sandbox``. ``LocalSandbox`` gives process isolation with a process-group time
limit, an output cap and (CPU jobs) a memory limit; a namespace sandbox plugs
in behind the same ``spawn`` call.
"""

from cuda_agent.sandbox.process import (
    Limits,
    LocalSandbox,
    ProcessResult,
    Sandbox,
    WorkerCrashed,
    WorkerProcess,
    WorkerTimeout,
    run_command,
)

__all__ = [
    "Limits",
    "LocalSandbox",
    "ProcessResult",
    "Sandbox",
    "WorkerCrashed",
    "WorkerProcess",
    "WorkerTimeout",
    "run_command",
]
