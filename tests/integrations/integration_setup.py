"""Constants the adapter tests share with their conftest (a module of its own: test files cannot import a
conftest by name when several exist)."""

from __future__ import annotations

import shutil

from cuda_agent.evaluate.protocol.policy import Policy

# bubblewrap where the host has it (CI installs it); the agent's shell and the candidates run unsandboxed otherwise.
SANDBOX = "auto" if shutil.which("bwrap") else "none"
CORRECT, INCORRECT = 1.0, -1.0
NEVER_FASTER = Policy(beat_factor=1e-6)  # "faster" would need t < 1e-6 * t_baseline


def console_script(name: str, target: str) -> list[str]:
    """A library's command (``trl``, ``openenv``, ``vf-eval``) as a user runs it, for this Python: the script beside
    the interpreter, else what the script runs (``target``, "module:function"; pip may put scripts elsewhere than
    the interpreter, as a system Python's /usr/local/bin)."""
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / name
    if script.exists():
        return [str(script)]
    module, function = target.split(":")
    return [sys.executable, "-c", f"import sys; from {module} import {function}; sys.argv[0] = {name!r}; "
                                  f"sys.exit({function}())"]
