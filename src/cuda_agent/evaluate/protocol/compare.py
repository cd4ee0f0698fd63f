"""Compare a candidate's outputs with the expected ones (runs in the reference process).

Only summaries leave this module: error magnitudes and where, never the
expected values themselves.
"""

from __future__ import annotations

import math
from typing import Any

from cuda_agent.tensors import pieces, read_all, wide_squares


def compare_outputs(expected: Any, actual: Any, atol: float, rtol: float, path: str = "output",
                    scale: bool = False) -> list[dict[str, Any]]:
    """One report per leaf; a leaf's ``ok`` is False with a ``reason`` when it fails.

    With ``scale``, a floating-point leaf's ``atol`` is multiplied by the RMS
    of its expected values: a fixed atol lets zeros pass for outputs much
    smaller than it, which is a known way to game a tolerance.
    """
    import torch

    if isinstance(expected, torch.Tensor):
        return [_compare_tensor(expected, actual, atol, rtol, path, scale)]
    if type(actual) is not type(expected):
        return [_fail(path, f"expected {type(expected).__name__}, got {type(actual).__name__}")]
    if isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            return [_fail(path, f"expected {len(expected)} elements, got {len(actual)}")]
        reports: list[dict[str, Any]] = []
        for i, (e, a) in enumerate(zip(expected, actual)):
            reports += compare_outputs(e, a, atol, rtol, f"{path}[{i}]", scale)
        return reports
    if isinstance(expected, dict):
        if set(actual) != set(expected):
            return [_fail(path, f"expected keys {sorted(map(str, expected))}, got {sorted(map(str, actual))}")]
        reports = []
        for key in expected:
            reports += compare_outputs(expected[key], actual[key], atol, rtol, f"{path}[{key!r}]", scale)
        return reports
    if isinstance(expected, float):
        ok = abs(actual - expected) <= atol + rtol * abs(expected)
        return [{"path": path, "ok": ok, "reason": None if ok else "scalar value out of tolerance"}]
    ok = actual == expected
    return [{"path": path, "ok": ok, "reason": None if ok else "value differs"}]


def error_ratio(reports: list[dict[str, Any]]) -> float:
    """The largest error over its tolerance across the leaves of a comparison: at most 1
    passes; inf where a leaf failed on structure, exact values or non-finite numbers."""
    worst = 0.0
    for report in reports:
        ratio = report.get("error_ratio")
        if ratio is None:
            ratio = 0.0 if report["ok"] else math.inf
        elif report.get("non_finite"):
            ratio = math.inf
        worst = max(worst, ratio)
    return worst


def precision_allowance(expected: Any, own: Any, atol: float, rtol: float, scale: bool, slack: float) -> float:
    """The factor the tolerance widens by: ``slack`` times the error ratio of ``own`` (the task's
    Model under the baselines' precision flags) against the strict ``expected``, at least 1."""
    ratio = error_ratio(compare_outputs(expected, own, atol, rtol, scale=scale))
    return max(1.0, slack * ratio) if math.isfinite(ratio) else 1.0


def _fail(path: str, reason: str) -> dict[str, Any]:
    return {"path": path, "ok": False, "reason": reason}


def _compare_tensor(expected, actual, atol: float, rtol: float, path: str, scale: bool = False) -> dict[str, Any]:
    import torch

    if type(actual) is not torch.Tensor:
        return _fail(path, f"expected torch.Tensor, got {type(actual).__name__}")
    report: dict[str, Any] = {"path": path, "shape": list(expected.shape), "dtype": str(expected.dtype).removeprefix("torch.")}
    if actual.shape != expected.shape:
        return report | _fail(path, f"shape {list(actual.shape)} != expected {list(expected.shape)}")
    if actual.dtype != expected.dtype:
        return report | _fail(path, f"dtype {actual.dtype} != expected {expected.dtype}")
    actual = actual.to(expected.device)
    numel = expected.numel()
    report["numel"] = numel
    if numel == 0:
        return report | {"ok": True, "reason": None}
    if not expected.is_floating_point() and not expected.is_complex():
        mismatches = int((actual != expected).sum())
        ok = mismatches == 0
        return report | {"ok": ok, "mismatches": mismatches, "reason": None if ok else f"{mismatches} of {numel} values differ"}
    low = expected.dtype in (torch.float16, torch.bfloat16)
    atol_text = f"atol={atol:g}"
    if scale:
        rms = output_rms(expected)  # float16 and bfloat16 widen exactly
        if rms > 0:
            atol_text = f"atol={atol:g} x output RMS {rms:.3g}"
            atol = atol * rms
        report["scale"] = rms
    # A piece at a time (tensors.PIECE): each step below makes a temporary of its input's size. The figures stay
    # on the device until all pieces are done and are read at once (``read_all``): a hundred pieces of a 6 GiB
    # output each waited for the device seven times, each wait a turn of the GPU's time slice beside the
    # candidate's process.
    views = list(pieces(expected, actual))
    finite = read_all([torch.isfinite(e).all() & torch.isfinite(a).all() for _, (e, a) in views])
    figures = []
    for (_, (e, a)), all_finite in zip(views, finite):
        e = e.float() if low else e
        a = a.to(e.dtype)
        figures += (_finite_piece if all_finite else _any_piece)(e, a, atol, rtol)
        del a
    values = read_all(figures)
    non_finite = mismatches = flat_index = 0
    ratio = max_abs = max_rel = -1.0
    for (start, _), first in zip(views, range(0, len(values), len(PIECE_FIGURES))):
        piece_ratio, piece_mismatches, piece_non_finite, at, largest, piece_rel = values[first:first + len(PIECE_FIGURES)]
        ratio = _larger(ratio, piece_ratio)
        mismatches += int(piece_mismatches)
        non_finite += int(piece_non_finite)
        if largest > max_abs:  # the first of equal maxima, as one argmax over the whole would choose
            max_abs, flat_index = largest, start + int(at)
        max_rel = _larger(max_rel, piece_rel)
    worst = [int(i) for i in torch.unravel_index(torch.tensor(flat_index), expected.shape)] if expected.dim() else []
    ok = mismatches == 0 and non_finite == 0
    reason = None
    if non_finite:
        reason = f"{non_finite} non-finite values (NaN/Inf)"
    elif mismatches:
        reason = f"{mismatches} of {numel} values outside {atol_text}, rtol={rtol:g}"
    return report | {
        "ok": ok,
        "reason": reason,
        "max_abs_error": max_abs,
        "max_rel_error": max_rel,
        "error_ratio": ratio,  # the largest error over its tolerance: at most 1 passes
        "worst_index": worst,
        "mismatches": mismatches,
        "non_finite": non_finite,
    }


# A piece's figures, one-element tensors on its device (``read_all``): the largest error over its tolerance, values
# outside it, non-finite values where finite ones were expected, the flat index of the largest absolute error,
# that error, the largest relative error.
PIECE_FIGURES = ("ratio", "mismatches", "non_finite", "at", "largest", "relative")


def _finite_piece(e, a, atol: float, rtol: float) -> list[Any]:
    """``_any_piece``'s figures where every value on both sides is finite (nearly every check), in a third of
    its passes over memory (about a millisecond a pass over a 1 GiB output on a GPU)."""
    import torch

    tiny = torch.finfo(e.dtype).tiny
    diff = (a - e).abs()  # finite minus finite: finite or infinite (overflow), never NaN
    tolerance = e.abs().mul_(rtol).add_(atol)
    mismatches = (diff > tolerance).sum()
    ratio = (diff / tolerance.clamp_min_(tiny)).max()
    at, largest = _largest(diff)
    del tolerance
    relative = diff.div_(e.abs().clamp_min_(tiny)).max()
    return [ratio, mismatches, torch.zeros((), device=e.device), at, largest, relative]


def _largest(diff) -> tuple[Any, Any]:
    """The flat index of the largest value of ``diff`` (a new tensor: contiguous) and that value, on its device."""
    flat = diff.reshape(-1)
    at = flat.argmax()
    return at, flat.gather(0, at.reshape(1))


def _any_piece(e, a, atol: float, rtol: float) -> list[Any]:
    import torch

    expected_finite = torch.isfinite(e)
    # NaN or infinity where a finite value was expected fails as non-finite.
    non_finite = (expected_finite & ~torch.isfinite(a)).sum()
    # Where the expected value is infinite, only the same infinity matches, and where it is NaN
    # nothing does (torch.isclose without equal_nan, as KernelBench checks): a tolerance of
    # rtol x inf would let any finite value through there.
    matched = ~expected_finite & (a == e)
    diff = torch.where(expected_finite, (a - e).abs(), torch.where(matched, 0.0, math.inf).to(e.dtype))
    diff = torch.where(torch.isnan(diff), math.inf, diff)  # NaN or infinity in the output, NaN in the sum
    tiny = torch.finfo(e.dtype).tiny
    tolerance = atol + rtol * e.abs()
    over = torch.where(expected_finite, diff / tolerance.clamp_min(tiny), diff)
    ratio = over.max()
    mismatches = torch.where(expected_finite, diff > tolerance, ~matched).sum()
    del tolerance, over
    at, largest = _largest(diff)
    relative = torch.where(expected_finite, diff / e.abs().clamp_min(tiny), diff).max()
    return [ratio, mismatches, non_finite, at, largest, relative]


def _larger(current: float, new: float) -> float:
    """The larger of two pieces' maxima, NaN winning as it does in one ``max`` over the whole."""
    return new if math.isnan(new) or (not math.isnan(current) and new > current) else current


def output_rms(values) -> float:
    """Root mean square of the finite values (non-finite ones count as zero), in float64 a piece at
    a time (``tensors.PIECE``): no float64 copy of a GB-sized output."""
    return math.sqrt(wide_squares(values, finite_only=True) / values.numel())
