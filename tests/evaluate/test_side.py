"""What both evaluation processes share (``evaluate.worker.side``): the memory of timed inputs whose values the evaluator
writes from outside, laid out as the task's own draw lays them out."""

from __future__ import annotations

import types

import pytest

from cuda_agent.evaluate.worker.side import input_memory, make_inputs

torch = pytest.importorskip("torch")

TASK = '''import random
import torch


def get_inputs():
    n = random.randint(3, 9)  # a shape of the seed's
    return [torch.randn(n, 5).t(), torch.randint(0, 7, (n,)), torch.randn(4, 1).expand(4, 6), n, 0.5]
'''
READS_A_VALUE = '''import torch


def get_inputs():
    n = int(torch.randint(2, 6, ()).item())  # a value read back: nothing to read on the meta device
    return [torch.randn(n, 3)]
'''


def _module(code: str) -> types.ModuleType:
    module = types.ModuleType("task")
    exec(compile(code, "task.py", "exec"), module.__dict__)  # noqa: S102 - the test's own task
    return module


def _layout(values):
    return [(str(v.dtype), list(v.shape), list(v.stride()), v.device.type) if isinstance(v, torch.Tensor) else v
            for v in values]


@pytest.mark.parametrize("code", [TASK, READS_A_VALUE], ids=["meta", "drawn-for-real"])
def test_input_memory_is_laid_out_as_the_tasks_draw(code):
    """Memory only, for values written from outside: each tensor's dtype, shape and strides as the real draw's under
    the same seed (the reference refuses inputs described otherwise), scalars the same; a draw that cannot run on the
    meta device is made for real."""
    module = _module(code)
    for seed in (1, 2, 3):
        drawn, memory = make_inputs(module, seed, "cpu", "task.py"), input_memory(module, seed, "cpu", "task.py")
        assert _layout(memory) == _layout(drawn)
        assert all(not t.is_meta for t in memory if isinstance(t, torch.Tensor))
