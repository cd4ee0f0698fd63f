"""The degenerate-task check: trivial candidates against a task, in the reference process."""

import pytest

from cuda_agent import Evaluator, load_task
from cuda_agent.evaluate import Policy
from cuda_agent.evaluate.protocol.degenerate import leaf_means, trivial_outputs

pytestmark = pytest.mark.slow

TASK = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return {body}


def get_inputs():
    return [torch.randn(32, 4096)]


def get_init_inputs():
    return []
'''


def task(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(TASK.format(body=body))
    return load_task(path)


def test_trivial_outputs_cover_zeros_constant_identity_and_input_mean():
    import torch

    x = torch.randn(4, 5)
    expected = (x * 2, torch.ones(4, 5))
    outs = dict(trivial_outputs([x], expected, leaf_means(expected)))
    assert torch.equal(outs["zeros"][0], torch.zeros(4, 5)) and torch.equal(outs["constant"][1], torch.ones(4, 5))
    assert torch.equal(outs["identity"][0], x) and outs["identity"][0].data_ptr() != x.data_ptr()
    assert float(outs["input-mean"][0][0, 0]) == pytest.approx(float(x.mean()), abs=1e-6)  # stored as float32
    assert "identity" not in dict(trivial_outputs([torch.randn(2)], expected, leaf_means(expected)))


def test_integer_outputs_get_a_rounded_constant():
    import torch

    # argmax-like tasks: an integer output leaf (once an UnboundLocalError on the H200 baselines).
    x = torch.randn(4, 5)
    expected = (x.argmax(dim=1), x.sum(dim=1))
    means = leaf_means(expected)
    outs = dict(trivial_outputs([x], expected, means))
    assert outs["constant"][0].dtype == torch.int64 and int(outs["constant"][0][0]) == round(means[0])
    # Never the expected output itself, which would make every argmax task look degenerate.
    assert outs["input-mean"][0].dtype == torch.int64 and not torch.equal(outs["input-mean"][0], expected[0])


@pytest.fixture(scope="module")
def fair(cache_dir):
    return Evaluator("cpu", cache_dir=cache_dir)


def test_identity_task_is_degenerate(fair, tmp_path):
    report = fair.check_degenerate(task(tmp_path, "nearly_identity", "x + 1e-6"))
    assert report.degenerate and "identity" in report.passing and "zeros" not in report.passing
    assert "DEGENERATE" in report.summary()


def test_long_softmax_is_degenerate_only_under_a_fixed_tolerance(fair, cache_dir, tmp_path):
    softmax = task(tmp_path, "long_softmax", "torch.softmax(x.reshape(4, -1), dim=1)")  # rows of 32768
    paper = Evaluator("cpu", cache_dir=cache_dir, policy=Policy.preset("paper")).check_degenerate(softmax)
    assert {"zeros", "constant"} <= set(paper.passing)
    assert not fair.check_degenerate(softmax).degenerate  # atol scaled to the outputs' RMS


def test_real_work_is_not_degenerate(fair, tmp_path):
    report = fair.check_degenerate(task(tmp_path, "gelu", "torch.nn.functional.gelu(x)"))
    assert not report.degenerate and set(report.details) == {"zeros", "constant", "identity", "input-mean"}
