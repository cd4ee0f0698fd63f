"""The decontamination measure: structural AST similarity of Model classes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cuda_agent.synth import Decontaminator, similarity, structure_tokens

RELU = '''import torch
import torch.nn as nn


class Model(nn.Module):
    """Applies ReLU."""

    def __init__(self):
        super(Model, self).__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


batch_size = 16
dim = 16384


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
'''

CONV_BN_RELU = '''import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=1)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x):
        x = self.conv(x)
        x = self.bn(x)
        x = F.relu(x)
        return x * 2.0


def get_inputs():
    return [torch.randn(8, 3, 32, 32)]


def get_init_inputs():
    return [3, 16, 3]
'''

# The same program with other names, sizes, hyper-parameters, a docstring, and its modules imported
# under other aliases: a near-duplicate the rule must catch.
CONV_BN_RELU_DISGUISED = '''import torch
from torch import nn
from torch.nn import functional as G


class Model(nn.Module):
    """A convolution block."""

    def __init__(self, cin, cout, k):
        super().__init__()
        self.layer_a = nn.Conv2d(cin, cout, k, padding=2)
        self.layer_b = nn.BatchNorm2d(cout)

    def forward(self, inp):
        h = self.layer_a(inp)
        h = self.layer_b(h)
        h = G.relu(h)
        return h * 0.5


def get_inputs():
    return [torch.randn(64, 16, 128, 128)]


def get_init_inputs():
    return [16, 64, 5]
'''

CONV_BN_RELU_PLUS_TANH = CONV_BN_RELU.replace("        return x * 2.0", "        x = torch.tanh(x)\n        return x * 2.0")


def test_identical_programs_score_one():
    assert similarity(RELU, RELU) == 1.0


def test_renaming_resizing_and_aliases_do_not_hide_a_near_duplicate():
    assert structure_tokens(CONV_BN_RELU) == structure_tokens(CONV_BN_RELU_DISGUISED)
    assert similarity(CONV_BN_RELU, CONV_BN_RELU_DISGUISED) == 1.0


def test_different_operators_are_different_programs():
    assert "api:torch.nn.functional.relu" in structure_tokens(CONV_BN_RELU)
    other = CONV_BN_RELU.replace("F.relu(x)", "F.gelu(x)")
    assert similarity(CONV_BN_RELU, other) < 1.0
    assert similarity(RELU, CONV_BN_RELU) < 0.6


def test_another_single_operator_is_not_a_near_duplicate():
    """KernelBench's ReLU and Sigmoid share every token but the operator's."""
    sigmoid = RELU.replace("torch.relu(x)", "torch.sigmoid(x)")
    assert 0.8 < similarity(RELU, sigmoid) <= 0.9


def test_an_extra_operator_is_closer_than_another_program():
    extended = similarity(CONV_BN_RELU, CONV_BN_RELU_PLUS_TANH)
    assert similarity(RELU, CONV_BN_RELU) < extended < 1.0
    assert extended > 0.9  # one appended operator does not make a new task


def test_decontaminator_names_the_closest_reference():
    refs = Decontaminator([("level1/19_ReLU", RELU), ("conv_bn_relu", CONV_BN_RELU), ("broken", "def (")])
    assert len(refs) == 2  # the reference that does not parse is skipped
    match = refs.match(CONV_BN_RELU_DISGUISED)
    assert (match.closest, match.score) == ("conv_bn_relu", 1.0)
    assert refs.is_contaminated(CONV_BN_RELU_DISGUISED)
    fresh = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, 4 * dim)

    def forward(self, x):
        y = self.proj(self.norm(x))
        return torch.softmax(y, dim=-1).sum(dim=1, keepdim=True)
'''
    assert not refs.is_contaminated(fresh), refs.match(fresh)


def test_syntax_errors_are_raised():
    with pytest.raises(SyntaxError):
        structure_tokens("class Model(:\n")


KERNELBENCH = Path(os.environ.get("KERNELBENCH_DATA", Path(__file__).resolve().parents[2].parent / "shared" / "data"
                                  / "kernelbench")) / "kernelbench.jsonl"


@pytest.mark.skipif(not KERNELBENCH.is_file(), reason=f"KernelBench data not found at {KERNELBENCH}")
def test_every_kernelbench_program_is_its_own_closest_match():
    from cuda_agent import load_tasks

    tasks = load_tasks(KERNELBENCH)
    refs = Decontaminator((t.name, t.code) for t in tasks)
    assert len(refs) == len(tasks)
    for task in tasks[::10]:
        match = refs.match(task.code)
        assert match.score == 1.0, (task.name, match)
