"""Constants the adapter tests share with their conftest (a module of its own: test files cannot import a
conftest by name when several exist)."""

from __future__ import annotations

import shutil

from cuda_agent.evaluate.protocol.policy import Policy

# bubblewrap where the host has it (CI installs it); the agent's shell and the candidates run unsandboxed otherwise.
SANDBOX = "auto" if shutil.which("bwrap") else "none"
CORRECT, INCORRECT = 1.0, -1.0
NEVER_FASTER = Policy(beat_factor=1e-6)  # "faster" would need t < 1e-6 * t_baseline
