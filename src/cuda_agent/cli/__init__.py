"""The ``cuda-agent`` command line (thin: every command calls the library), one module per command family:

- ``evaluation``: ``eval``, ``example``, ``compile``
- ``serve``: ``serve``
- ``tasks``: ``tasks``, ``degenerate``, ``synth``, ``baselines``, ``catalog``
- ``bench``: ``bench``, ``report``, ``compare``
- ``agent``: ``optimize``, ``show``
- ``train``: ``train`` and its stages
- ``common``: exit statuses, progress lines and the options several families share
- ``main``: the top-level parser and ``main`` (interrupts, errors, exit status)

A new command goes into its family's ``register``; ``main.FAMILIES`` lists the families."""

from cuda_agent.cli.common import EXIT_CODES, EXIT_CORRECT, EXIT_FAILURE, EXIT_NO_VERDICT, EXIT_USAGE, exit_status
from cuda_agent.cli.main import INTERRUPTED, build_parser, main

__all__ = ["EXIT_CODES", "EXIT_CORRECT", "EXIT_FAILURE", "EXIT_NO_VERDICT", "EXIT_USAGE", "INTERRUPTED", "build_parser",
           "exit_status", "main"]
