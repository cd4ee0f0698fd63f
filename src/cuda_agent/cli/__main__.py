"""``python -m cuda_agent.cli`` (what torchrun launches): the ``cuda-agent`` command."""

import sys

from cuda_agent.cli.main import main

sys.exit(main())
