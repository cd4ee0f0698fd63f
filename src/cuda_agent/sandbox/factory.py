"""Choosing a sandbox by name (the ``--sandbox`` setting)."""

from __future__ import annotations

import logging
import warnings

from cuda_agent.sandbox.bwrap import BwrapSandbox
from cuda_agent.sandbox.process import LocalSandbox, Sandbox

SANDBOX_CHOICES = ("auto", "bwrap", "none")

logger = logging.getLogger(__name__)
_logged_unsandboxed = False


def make_sandbox(name: str) -> Sandbox:
    """"bwrap" and "auto": ``BwrapSandbox`` (``SandboxUnavailable`` if it cannot run here;
    "auto" never falls back silently). "none": ``LocalSandbox``, i.e. candidate code runs
    with this user's rights, network and file system; only for debugging trusted code."""
    global _logged_unsandboxed
    if name in ("auto", "bwrap"):
        return BwrapSandbox()
    if name == "none":
        message = (
            "running candidate code WITHOUT a sandbox: it can read and write this user's files, "
            "use the network and see other processes (use sandbox 'bwrap')"
        )
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        if not _logged_unsandboxed:
            _logged_unsandboxed = True
            logger.warning(message)
        return LocalSandbox()
    raise ValueError(f"unknown sandbox {name!r}; choose one of {', '.join(SANDBOX_CHOICES)}")
