"""The agent's workspace: the paper's layout, written from a task and the active policy.

```
SKILL.md            the rules of the active policy, the workflow, the tools and commands  (protected)
model.py            the task: Model, get_inputs, get_init_inputs                         (protected)
model_new.py        a stub: ModelNew calling ops of cuda_extension                     (the agent's)
binding.cpp         the module's entry point, REGISTER_BINDING's registry               (protected)
binding_registry.h  REGISTER_BINDING(name, register_fn)                                (protected)
kernels/            the agent's .cu (.cpp on the CPU backend) and *_binding.cpp files
utils/              compile.py, verify.py, profile.py: ask the trusted evaluator       (protected)
```

A Triton workspace (``language="triton"``) holds SKILL.md (the Triton skill), model.py, model_new.py (a
stub launching ``@triton.jit`` kernels) and utils/: no binding files and no kernels/.

The commands in ``utils/`` hold no logic: they send a request over a socket
to the process that owns the evaluator (``agent.commands``) and print its
answer, so no number the agent sees comes from code it can edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from cuda_agent.candidates import Candidate, fixed_file, load_candidate, load_workspace
from cuda_agent.candidates.triton import check_language
from cuda_agent.evaluate.protocol.policy import Policy
from cuda_agent.tasks.task import Task

PROTECTED = ("SKILL.md", "model.py", "binding.cpp", "binding_registry.h", "utils")
TRITON_PROTECTED = ("SKILL.md", "model.py", "utils")
COMMANDS = ("compile", "verify", "profile")
SOCKET_ENV = "CUDA_AGENT_COMMANDS"  # where utils/*.py find the evaluator's socket

MODEL_NEW_STUB = '''import torch
import torch.nn as nn

import cuda_extension  # built from kernels/ by `python utils/compile.py`


class ModelNew(nn.Module):
    """Same constructor arguments and parameters as Model in model.py; forward calls cuda_extension."""

    def __init__(self, *args):
        super().__init__()
        raise NotImplementedError("write ModelNew: see SKILL.md")

    def forward(self, *inputs):
        raise NotImplementedError
'''

TRITON_MODEL_NEW_STUB = '''import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def kernel(x_ptr, y_ptr, n_elements, BLOCK: tl.constexpr):
    """Replace with your kernels: each program handles BLOCK elements."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)


class ModelNew(nn.Module):
    """Same constructor arguments and parameters as Model in model.py; forward launches Triton kernels."""

    def __init__(self, *args):
        super().__init__()
        raise NotImplementedError("write ModelNew: see SKILL.md")

    def forward(self, *inputs):
        raise NotImplementedError
'''

COMMAND_SCRIPT = '''"""{doc}: asks the trusted evaluator (this file only forwards; do not edit)."""
import json
import os
import socket
import sys

path = os.environ.get("{env}")
if not path:
    sys.exit("{env} is not set: run this inside the agent's shell")
with socket.socket(socket.AF_UNIX) as conn:
    conn.connect(path)
    conn.sendall(json.dumps({{"command": "{command}", "args": sys.argv[1:]}}).encode() + b"\\n")
    reply = json.loads(conn.makefile().readline())
print(reply["text"])
sys.exit(reply["exit_code"])
'''

COMMAND_DOCS = {
    "compile": "Build kernels/ and binding.cpp into cuda_extension; print compiler errors",
    "verify": "Check ModelNew against Model on fresh random inputs; print errors where they differ",
    "profile": "Verify, then time ModelNew, eager Model and torch.compile(Model); print speedups and reward",
}


@dataclass(frozen=True)
class Workspace:
    root: Path
    task: Task
    device: str
    language: str = "cuda"

    @property
    def protected(self) -> tuple[str, ...]:
        return TRITON_PROTECTED if self.language == "triton" else PROTECTED


def workspace_candidate(root: Path, language: str = "cuda") -> Candidate:
    """The candidate a workspace holds now, read as its language's layout (CandidateError when it holds none)."""
    return load_candidate(root, language="triton") if language == "triton" else load_workspace(root)


def render_skill(policy: Policy, device: str, language: str = "cuda") -> str:
    template = resources.files("cuda_agent.agent").joinpath(
        "SKILL_TRITON.md" if language == "triton" else "SKILL.md").read_text()
    source = "kernels/*.cu (CUDA C++)" if device == "cuda" else "kernels/*.cpp (C++; this machine has no GPU)"
    libraries = ", ".join(policy.libraries) if device == "cuda" and policy.libraries else "none"
    allowed = ", ".join(policy.allowed_aten) if policy.allowed_aten else "none"
    tol = policy.tolerance()
    tolerance = (f"atol {tol['atol']:g} (relative to each output's RMS) and rtol {tol['rtol']:g}"
                 if tol["scale"] else f"atol {tol['atol']:g} and rtol {tol['rtol']:g}")
    backend = ("" if device == "cuda" else "This machine has no GPU: your kernels run in Triton's interpreter "
               "(correctness as on a GPU; its times say nothing of a GPU's).")
    return template.format(policy=policy.name, device=device, source=source, libraries=libraries, backend=backend,
                           allowed_aten=allowed, tolerance=tolerance, checks=policy.checks,
                           beat=round((1 / policy.beat_factor - 1) * 100))


def create_workspace(root: Path, task: Task, policy: Policy, device: str, language: str = "cuda") -> Workspace:
    """Write a fresh workspace for ``task`` at ``root`` (which must be empty or absent), for kernels in
    ``language`` (``cuda``: the paper's layout; ``triton``: model_new.py alone)."""
    check_language(language)
    root = Path(root)
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root}: not empty; an episode needs a fresh workspace directory.")
    root.mkdir(parents=True, exist_ok=True)
    (root / "utils").mkdir()
    (root / "SKILL.md").write_text(render_skill(policy, device, language))
    (root / "model.py").write_text(task.code)
    if language == "triton":
        (root / "model_new.py").write_text(TRITON_MODEL_NEW_STUB)
    else:
        (root / "kernels").mkdir()
        (root / "model_new.py").write_text(MODEL_NEW_STUB)
        for name in ("binding.cpp", "binding_registry.h"):
            (root / name).write_text(fixed_file(name))
    for command in COMMANDS:
        (root / "utils" / f"{command}.py").write_text(
            COMMAND_SCRIPT.format(doc=COMMAND_DOCS[command], env=SOCKET_ENV, command=command))
    return Workspace(root, task, device, language or "cuda")
