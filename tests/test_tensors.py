"""Reading GB-sized tensors a piece at a time (``cuda_agent.tensors``): the pieces cover a tensor once,
reductions and comparisons give what one pass over the whole gives, and no float64 copy is made."""

import math
import subprocess
import sys

import pytest

import cuda_agent.tensors as tensors
from cuda_agent.evaluate.protocol.compare import compare_outputs
from cuda_agent.tensors import pieces, read_all, wide_squares, wide_sum

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("transposed", [False, True])
def test_pieces_cover_a_tensor_once_in_row_major_order(monkeypatch, transposed):
    monkeypatch.setattr(tensors, "PIECE", 50)
    whole = torch.arange(37 * 11, dtype=torch.float32).reshape(37, 11)
    whole = whole.t() if transposed else whole
    seen = []
    for start, (piece,) in pieces(whole):
        assert torch.equal(piece.reshape(-1), whole.reshape(-1)[start:start + piece.numel()])
        seen.append((start, piece.numel()))
    assert [s for s, _ in seen] == [sum(n for _, n in seen[:i]) for i in range(len(seen))]
    assert sum(n for _, n in seen) == whole.numel() and len(seen) > 1


def test_pieces_of_two_tensors_are_aligned(monkeypatch):
    monkeypatch.setattr(tensors, "PIECE", 64)
    a, b = torch.randn(40, 9), torch.randn(40, 9)
    for start, (pa, pb) in pieces(a, b.t().contiguous().t()):  # one contiguous, one not
        n = pa.numel()
        assert torch.equal(pa.reshape(-1), a.reshape(-1)[start:start + n])
        assert torch.equal(pb.reshape(-1), b.reshape(-1)[start:start + n])


def test_read_all_gives_each_one_element_tensors_value_exactly():
    # Counts, flags, indices and float32 maxima alike, in their order: a float64 holds each exactly.
    values = [torch.tensor(2**40 + 1), torch.tensor(True), torch.tensor([7]), torch.tensor(0.1, dtype=torch.float32),
              torch.tensor(float("nan")), torch.tensor(-float("inf"))]
    read = read_all(values)
    assert read[:4] == [2**40 + 1, 1.0, 7.0, float(torch.tensor(0.1, dtype=torch.float32))]
    assert math.isnan(read[4]) and read[5] == -math.inf
    assert read_all([]) == []


def test_wide_reductions_match_one_pass_in_float64(monkeypatch):
    values = torch.randn(1000, dtype=torch.float32) * 1e3
    wide = values.double()
    monkeypatch.setattr(tensors, "PIECE", 33)
    assert wide_sum(values) == pytest.approx(float(wide.sum()), rel=1e-12)
    assert wide_squares(values) == pytest.approx(float((wide ** 2).sum()), rel=1e-12)
    values[3] = float("inf")
    assert math.isinf(wide_squares(values))
    assert wide_squares(values, finite_only=True) == pytest.approx(float((wide ** 2).sum() - wide[3] ** 2), rel=1e-12)
    assert wide_sum(torch.arange(10)) == 45.0 and wide_squares(torch.arange(4)) == pytest.approx(14.0)


@pytest.mark.parametrize("dtype,transposed,scale", [(torch.float32, False, False), (torch.float32, True, True),
                                                     (torch.bfloat16, False, True), (torch.float16, False, False)])
def test_a_comparison_by_pieces_reports_what_one_pass_reports(monkeypatch, dtype, transposed, scale):
    torch.manual_seed(0)
    expected = torch.randn(300, 70).to(dtype)
    actual = expected.clone()
    flat = actual.view(-1)
    flat[5] += 0.5
    flat[1000] += 0.25
    flat[-3] = float("nan")
    if transposed:
        expected, actual = expected.t(), actual.t()
    whole = compare_outputs(expected, actual, 1e-3, 1e-3, scale=scale)[0]
    monkeypatch.setattr(tensors, "PIECE", 97)
    pieced = compare_outputs(expected, actual, 1e-3, 1e-3, scale=scale)[0]
    assert whole.keys() == pieced.keys()
    for key in whole:
        if key == "scale":  # summed in another order: the last bits may differ
            assert pieced[key] == pytest.approx(whole[key], rel=1e-12)
        elif key == "reason" and scale:
            continue  # it prints the scale
        else:
            assert pieced[key] == whole[key], key
    assert pieced["mismatches"] == 3 and pieced["non_finite"] == 1 and not pieced["ok"]  # the NaN is one of the 3


def test_no_float64_copy_of_a_large_tensor_is_made():
    """ATen's own float64 reductions of a float32 tensor copy it whole first (2x its size): 512 MB in,
    1 GiB more at the peak. Read a piece at a time, the peak grows by about one piece's float64."""
    script = """
import torch
from cuda_agent.tensors import wide_squares, wide_sum
def peak():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) // 1024
x = torch.ones(128 * 1024 * 1024)
before = peak()
wide_sum(x); wide_squares(x, finite_only=True)
print(peak() - before)
"""
    grown = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert grown < 400, f"peak grew by {grown} MB"


def test_tensor_bytes_counts_every_tensor_in_nested_values_by_its_elements():
    value = {"a": torch.zeros(3, 4), "b": [torch.zeros(5, dtype=torch.float16), (torch.zeros(2, 8).t(), 7)]}
    assert tensors.tensor_bytes(value) == 3 * 4 * 4 + 5 * 2 + 2 * 8 * 4
    assert tensors.tensor_bytes([]) == tensors.tensor_bytes(1.5) == 0


def test_foreign_objects_in_an_output_are_named_by_their_types_alone():
    """Outputs the harness looks into after a timed region's end: exact tensors in plain containers (torch's own
    result tuples and named tuples too) pass; a tensor subclass, a container of the candidate's, or a class whose
    metaclass would compute its name are named without any of their methods running."""
    import collections

    from cuda_agent.tensors import foreign_object

    ran = []

    class Lazy(torch.Tensor):
        pass

    class Sneaky(tuple):
        def __iter__(self):
            ran.append("iter")
            return super().__iter__()

    class Meta(type):
        @property
        def __name__(cls):
            ran.append("name")
            return "Meta"

    class Odd(metaclass=Meta):
        pass

    pair = collections.namedtuple("Pair", "a b")
    t = torch.ones(3)
    assert foreign_object(t) is None and foreign_object([t, (t, {"k": t}), 2, None]) is None
    assert foreign_object(torch.max(torch.ones(2, 3), dim=1)) is None and foreign_object(pair(t, t)) is None
    assert foreign_object(t.as_subclass(Lazy)) == "Lazy"
    assert foreign_object([t, {"k": (t, t.as_subclass(Lazy))}]) == "Lazy"
    assert foreign_object(Sneaky((t,))) == "Sneaky"
    assert foreign_object(Odd()) == "Odd"
    assert foreign_object(torch.nn.Parameter(t)) == "Parameter"
    assert ran == []
