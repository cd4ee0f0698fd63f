import math

import pytest
import torch

from cuda_agent.evaluate.protocol.compare import compare_outputs


def one(expected, actual, atol=1e-2, rtol=1e-2):
    (report,) = compare_outputs(expected, actual, atol, rtol)
    return report


def test_within_tolerance():
    e = torch.randn(8, 8)
    report = one(e, e + 1e-3)
    assert report["ok"] and report["max_abs_error"] == pytest.approx(1e-3, rel=1e-3)


def test_error_location_without_expected_values():
    e = torch.zeros(4, 5)
    a = e.clone()
    a[2, 3] = 0.5
    report = one(e, a)
    assert not report["ok"] and report["worst_index"] == [2, 3] and report["mismatches"] == 1
    assert report["max_abs_error"] == pytest.approx(0.5)
    assert "1 of 20 values outside" in report["reason"]
    assert not any(isinstance(v, torch.Tensor) for v in report.values())


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_fails(bad):
    e = torch.ones(3)
    a = e.clone()
    a[1] = bad
    report = one(e, a)
    assert not report["ok"] and "non-finite" in report["reason"]


def test_where_the_expected_value_is_not_finite_only_the_same_infinity_matches():
    """As torch.isclose without equal_nan (what KernelBench checks with): the same infinity matches,
    anything else fails, and a NaN expected is matched by nothing. A tolerance of rtol x inf let any
    finite value through where -inf was expected (log of zero), and an exact -inf counted as a
    non-finite output."""
    inf, nan = math.inf, math.nan
    e = torch.tensor([1.0, -inf, inf, 2.0])
    exact = one(e, e.clone())
    assert exact["ok"] and exact["error_ratio"] == 0.0 and exact["non_finite"] == 0
    for wrong in ([1.0, 5.0, inf, 2.0], [1.0, -inf, -inf, 2.0], [1.0, nan, inf, 2.0]):
        report = one(e, torch.tensor(wrong))
        assert not report["ok"] and report["mismatches"] == 1 and report["worst_index"] == [1 if wrong[1] != -inf else 2]
        assert report["error_ratio"] == inf
    assert not one(torch.tensor([1.0, nan]), torch.tensor([1.0, nan]))["ok"]
    assert not one(torch.tensor([1.0, nan]), torch.tensor([1.0, 3.0]))["ok"]


def test_shape_dtype_and_type_mismatch():
    e = torch.ones(3)
    assert "shape" in one(e, torch.ones(4))["reason"]
    assert "dtype" in one(e, torch.ones(3, dtype=torch.float64))["reason"]
    assert "expected torch.Tensor" in one(e, [1.0, 1.0, 1.0])["reason"]


def test_nested_structures():
    e = (torch.ones(2), {"a": torch.zeros(2)})
    reports = compare_outputs(e, (torch.ones(2), {"a": torch.zeros(2)}), 1e-2, 1e-2)
    assert [r["path"] for r in reports] == ["output[0]", "output[1]['a']"] and all(r["ok"] for r in reports)
    assert not compare_outputs(e, [torch.ones(2), {"a": torch.zeros(2)}], 1e-2, 1e-2)[0]["ok"]  # list != tuple
    assert "expected 2 elements" in compare_outputs(e, (torch.ones(2),), 1e-2, 1e-2)[0]["reason"]


def test_integer_outputs_must_match_exactly():
    e = torch.arange(5)
    assert one(e, e.clone())["ok"]
    assert not one(e, e + 1)["ok"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("atol,rtol", [(1e-2, 1e-2), (0.0, 1e-3), (1e-5, 0.0), (0.0, 0.0)])
def test_the_all_finite_path_gives_the_general_paths_figures(dtype, atol, rtol):
    # The fast path is taken for nearly every check; any figure it computed otherwise would change a verdict
    # or a report. Errors of every size, exact zeros on both sides, values equal where zero tolerance is
    # allowed, and a difference that overflows to infinity.
    from cuda_agent.evaluate.protocol.compare import _any_piece, _finite_piece
    from cuda_agent.tensors import read_all

    generator = torch.Generator().manual_seed(7)
    for case in range(24):
        e = torch.randn(129, 17, dtype=dtype, generator=generator)
        a = e + torch.randn(e.shape, dtype=dtype, generator=generator) * [0, 1e-4, 1e-2, 1][case % 4]
        if case % 3 == 0:
            e.view(-1)[::7] = 0
        if case % 5 == 0:
            a.view(-1)[::11] = e.view(-1)[::11]
        if case % 7 == 0:
            e.view(-1)[3] = torch.finfo(dtype).max
            a.view(-1)[3] = -torch.finfo(dtype).max
        assert read_all(_finite_piece(e, a, atol, rtol)) == read_all(_any_piece(e, a, atol, rtol))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_the_all_finite_path_leaves_any_non_finite_value_to_the_general_one(bad, monkeypatch):
    # Pieces are judged on their own (the all-finite path assumes what its name says): one bad value in
    # the third of four pieces, on either side, is found.
    monkeypatch.setattr("cuda_agent.tensors.PIECE", 9)
    e = torch.randn(6, 6)
    a = e.clone()
    a[3, 2] = bad
    report = one(e, a)
    assert not report["ok"] and report["non_finite"] == 1 and report["worst_index"] == [3, 2]
    report = one(a, e)
    assert not report["ok"] and (report["mismatches"] == 1 or report["non_finite"] == 1)
