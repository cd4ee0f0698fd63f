"""Running untrusted work in child processes with limits.

Every process that compiles or runs candidate code is started through a
``Sandbox`` (``spawn``), usually via ``run_command`` or ``WorkerProcess``. All of
them get a process-group time limit and an output cap. Two sandboxes exist:

* ``BwrapSandbox`` ("bwrap", the default through ``make_sandbox("auto")``):
  bubblewrap with a read-only host root, writable ``cwd`` and ``writable``
  directories only, no network, own pid namespace, no capabilities, an
  unprivileged uid, a seccomp filter, GPU device nodes only for GPU jobs and,
  where cgroup v2 is delegated, per-job ``memory.max`` / ``pids.max``.
* ``LocalSandbox`` ("none"): process isolation only (process group, RLIMIT_AS for
  CPU jobs). Candidate code runs with this user's rights; ``make_sandbox("none")``
  warns.

See docs/SANDBOX.md.
"""

from cuda_agent.sandbox.bwrap import BwrapSandbox, SandboxUnavailable
from cuda_agent.sandbox.factory import SANDBOX_CHOICES, make_sandbox
from cuda_agent.sandbox.process import (
    Limits,
    LocalSandbox,
    ProcessResult,
    Sandbox,
    WorkerCrashed,
    WorkerForgedReply,
    WorkerProcess,
    WorkerTimeout,
    run_command,
)

__all__ = [
    "SANDBOX_CHOICES",
    "BwrapSandbox",
    "Limits",
    "LocalSandbox",
    "ProcessResult",
    "Sandbox",
    "SandboxUnavailable",
    "WorkerCrashed",
    "WorkerForgedReply",
    "WorkerProcess",
    "WorkerTimeout",
    "make_sandbox",
    "run_command",
]
