"""What a timing round keeps alive: the largest KernelBench tasks draw 6 GiB inputs and outputs per call,
and on an 80 GB card the H100 ran out of memory while the previous region's calls (and the one before
the round's last) were still held beside the next region's draw."""

from __future__ import annotations

import itertools
import weakref

import pytest

from cuda_agent.evaluate.protocol.policy import TimingConfig
from cuda_agent.evaluate.protocol.timing import time_round

torch = pytest.importorskip("torch")

TIMING = TimingConfig(method="host")


class Live:
    """Counts the tensors of a kind that are still alive, and the most alive at any draw."""

    def __init__(self) -> None:
        self.alive: set[int] = set()
        self.most = 0
        self._numbers = itertools.count()

    def track(self, value: object) -> object:
        number = next(self._numbers)
        self.most = max(self.most, len(self.alive))  # before this draw: what earlier draws left alive
        self.alive.add(number)
        weakref.finalize(value, self.alive.discard, number)
        return value


def test_a_round_frees_each_regions_calls_before_the_next_region_draws():
    inputs = Live()

    def prepare():
        x = inputs.track(torch.ones(4))
        return lambda: x * 2

    time_round(prepare, "cpu", TIMING, trials=4, calls=3)
    assert inputs.most == 2  # the calls drawn earlier in the same region, none of the region before


def test_a_side_keeps_only_the_rounds_last_call_past_its_region(doubling_reference):
    reference = doubling_reference
    inputs = Live()
    draw = reference.inputs
    reference.inputs = lambda seed: [inputs.track(x) for x in draw(seed)]
    reference.handle("time", {"side": "eager", "seed": 3, "first": 10, "trials": 5, "calls": 2,
                              "timing": TIMING.to_dict()})
    assert inputs.most == 1  # the call before it in its region
    index, kept, box = reference.final_call
    assert index == 19 and torch.equal(box["output"], kept[0] * 2)
    assert len(inputs.alive) == 1  # the final call's input, and nothing else
