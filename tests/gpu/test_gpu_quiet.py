"""The reference's quiet probe on a real GPU (``evaluate.protocol.quiet``): another process's context with work keeps it
waiting past ``QUIET_US`` (time-slicing), stopped or not; an idle one does not; the GPU is quiet soon after that
process ends; and an evaluation run beside another process's kernels is refused, not rewarded or failed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cuda_agent import Evaluator, load_candidate, load_task
from cuda_agent.evaluate.protocol.quiet import AFTER_END_S, QUIET_US, probe_us, quiet_within

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Another process: a CUDA context that is idle, or runs a one-block spin kernel for ten minutes (ended with the
# process: an evaluation beside it is slowed by time-slicing, and must not outlast it).
OTHER = r"""
import sys, time, torch
buf = torch.zeros(1, device="cuda")
torch.cuda.synchronize()
if sys.argv[1] == "spin":
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda._sleep(int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 600))
print("ready", flush=True)
time.sleep(120)
"""


def _other(mode: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", OTHER, mode], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    time.sleep(0.1)
    return child


def _end(child: subprocess.Popen) -> None:
    child.kill()
    child.wait()


def test_another_contexts_work_keeps_the_probe_waiting_and_ends_with_its_process():
    probe_us()  # this process's context up
    idle = _other("idle")
    try:
        assert probe_us() <= QUIET_US
    finally:
        _end(idle)
    busy = _other("spin")
    try:
        assert probe_us() > QUIET_US
        os.kill(busy.pid, signal.SIGSTOP)  # stopped, its kernel runs on
        assert probe_us() > QUIET_US
    finally:
        _end(busy)
    after = quiet_within(AFTER_END_S)
    assert after is not None and after < 1e3 * AFTER_END_S


def test_an_evaluation_beside_another_processs_kernel_is_refused_not_failed(examples, cache_dir):
    task = load_task(examples / "cuda_gelu" / "model.py")
    evaluator = Evaluator("cuda", cache_dir=cache_dir)
    evaluator.check_idle = False  # NVML would see the kernel and wait for it first
    busy = _other("spin")
    try:
        result = evaluator.evaluate(task, load_candidate(examples / "cuda_gelu" / "solution"))
    finally:
        _end(busy)
    assert result.status == "error", result.summary()
    assert "another process" in (result.reason or ""), result.summary()
    assert result.rule is None
