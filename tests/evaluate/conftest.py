"""Fixtures of the evaluation core's tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def doubling_reference(tmp_path):
    """A reference process's side of the protocol, run here on the CPU, with a one-line task (x * 2) loaded."""
    from cuda_agent.evaluate.worker.loop import ReferenceSide

    (tmp_path / "task.py").write_text(
        "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x * 2\n"
        "def get_inputs():\n    return [torch.randn(8)]\ndef get_init_inputs():\n    return []\n")
    side = ReferenceSide()
    side.handle("load", {"task_file": str(tmp_path / "task.py"), "task_name": "t", "task_source": "task.py",
                         "device": "cpu", "tf32": "off", "init_seed": 1, "state_dict_path": str(tmp_path / "sd.pt")})
    return side
