"""Red-team cases that need a GPU (run with `pytest -m gpu`): the CUDA example (exact GELU) attacked through
CUDA-specific routes, and the runtime guards on the CUDA path. The CPU suite (test_redteam.py) covers every pattern
it can.

Each case is a folder of ``gpu_cases/``, as the CPU cases are of ``cases/`` (``cases/README.md`` describes one): the
files that replace the CUDA example's solution (examples/cuda_gelu/solution) and a ``case.toml`` saying what it games
and what the evaluator must answer. The suites: ``rejected``, ``true-cost`` and ``deferral`` as on the CPU (every
deferral fraction here), and ``own-test``, the two cases a test below loads by name."""

from __future__ import annotations

import pytest
from casekit import GPU_CASES_DIR, deferred_share, gains_nothing, load_case, load_cases, make_candidate

from cuda_agent import Evaluator, load_candidate, load_task

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

L2_REFUSED = "the persisting L2 limit was refused"
# A deferral case that cannot set its deferral up on the device (the driver refuses what it needs) raises this and
# is skipped, saying so.
DEFERRAL_REFUSED = "deferral refused"


def cases(suite: str) -> list:
    """The suite's cases as parameters, each skipped where this Python is older than the case needs."""
    return [pytest.param(case, id=case.name, marks=pytest.mark.skipif(
        not case.runs_here, reason=f"needs Python {'.'.join(map(str, case.python or ()))}+"))
        for case in load_cases(GPU_CASES_DIR, suite)]


@pytest.fixture(scope="module")
def gelu(examples):
    return load_task(examples / "cuda_gelu" / "model.py"), examples / "cuda_gelu" / "solution"


@pytest.fixture(scope="module")
def honest_gelu(gelu, cache_dir):
    task, solution = gelu
    return Evaluator("cuda", cache_dir=cache_dir).evaluate(task, load_candidate(solution))


def judge_of(case, cache_dir) -> Evaluator:
    """An evaluator under the case's policy, its static checks off for a ``runtime`` case."""
    evaluator = Evaluator("cuda", cache_dir=cache_dir)
    evaluator.policy = evaluator.policy.with_(static_checks=not case.runtime, **case.policy)
    return evaluator


def evaluate_case(case, gelu, cache_dir, tmp_path):
    """``case`` on the gelu example, judged under its policy; the result and the detail a failed assertion shows."""
    task, solution = gelu
    evaluator = judge_of(case, cache_dir)
    result = evaluator.evaluate(task, make_candidate(case, solution, tmp_path / case.name))
    return result, f"{result.summary()}\n{result.traceback or ''}\n{result.output[-2000:]}"


@pytest.mark.parametrize("case", cases("rejected"))
def test_hacking_candidate_is_rejected_on_the_gpu(case, gelu, cache_dir, tmp_path):
    result, detail = evaluate_case(case, gelu, cache_dir, tmp_path)
    if L2_REFUSED in (result.reason or ""):
        pytest.skip(f"this device refuses the attack itself ({L2_REFUSED}; the H100s lent here do)")
    assert (result.status, result.rule) == (case.status, case.rule), detail
    assert case.reason is None or case.reason in (result.reason or ""), detail
    assert result.reward == -1.0


@pytest.mark.parametrize("case", cases("true-cost"))
def test_a_forged_report_or_a_region_ended_by_its_own_word_is_timed_at_its_true_cost(case, gelu, cache_dir, tmp_path,
                                                                                  honest_gelu):
    """Cases that forge what the candidate's process reports, or end its regions by its own word: its time is the
    evaluator's (evaluate.region_clock), so each is correct at its true cost or rejected, never above its honest
    twin."""
    assert case.expect["gains_nothing"]
    result, detail = evaluate_case(case, gelu, cache_dir, tmp_path)
    gains_nothing(result, honest_gelu, detail)


@pytest.mark.parametrize("case", cases("deferral"))
def test_work_finished_after_done_gains_nothing_on_the_gpu(case, gelu, honest_gelu, cache_dir, tmp_path):
    """The tail of each timed call launched after the region's DONE (a C-API thread, hooks on the timing thread,
    torch's GPU-trace callbacks, a graph), or where the harness's synchronise does not wait (a second stream, a second
    context released by a host callback or a stream write), is rejected with a named rule or timed at its true cost
    against the honest twin."""
    assert case.expect["gains_nothing"]
    result, detail = evaluate_case(case, gelu, cache_dir, tmp_path)
    if DEFERRAL_REFUSED in (result.reason or "") + (result.traceback or ""):
        pytest.skip(f"this device refuses the deferral itself: {detail}")
    gains_nothing(result, honest_gelu, detail, marker=case.expect["marker"], deferred=deferred_share(case))


def test_a_swapped_event_type_entry_changes_no_time(gelu, cache_dir, tmp_path):
    """gpu_cases/event-type-entry-swapped-runtime (it got reward 3 before the timing loop bound its calls): the
    candidate is timed as the honest solution is."""
    task, solution = gelu
    case = load_case(GPU_CASES_DIR / "event-type-entry-swapped-runtime")
    honest = judge_of(case, cache_dir).evaluate(task, load_candidate(solution))
    swapped, detail = evaluate_case(case, gelu, cache_dir, tmp_path)
    assert (honest.status, swapped.status) == ("correct", "correct"), f"{honest.summary()}\n{detail}"
    ratio = swapped.times["candidate"]["median_ms"] / honest.times["candidate"]["median_ms"]
    assert 0.9 < ratio < 1.1, f"{ratio:.3f}\n{honest.summary()}\n{detail}"
    assert swapped.reward <= honest.reward, f"{honest.summary()}\n{detail}"


def test_side_stream_work_is_timed(gelu, cache_dir, tmp_path):
    """gpu_cases/side-stream: work moved to another stream escapes current-stream events but not the device-wide
    synchronise."""
    task, solution = gelu
    side = load_case(GPU_CASES_DIR / "side-stream")
    assert side.runtime and side.policy == {"allow_streams": True}  # so that the profiled check lets it be timed
    honest = judge_of(side, cache_dir).evaluate(task, load_candidate(solution))
    sneaky, detail = evaluate_case(side, gelu, cache_dir, tmp_path)
    assert honest.status == "correct", honest.summary()
    if sneaky.status == "correct":  # if it passed the checks, its time must include the side-stream kernel
        assert sneaky.times["candidate"]["median_ms"] > 0.5 * honest.times["candidate"]["median_ms"], detail
    else:
        assert sneaky.rule in ("timed-output", "wrong-output"), detail


def test_legitimate_solution_is_attributed_to_its_own_kernels(gelu, cache_dir):
    task, solution = gelu
    result = Evaluator("cuda", cache_dir=cache_dir).evaluate(task, load_candidate(solution))
    assert result.status == "correct", result.summary()
    attribution = result.attribution
    assert attribution is not None and attribution["defined"] >= 2, result.summary()
    assert attribution["own_launches"] >= 1 and attribution["coverage"] > 0.9, attribution
    assert attribution["own_side_launches"] == 0, attribution
    assert any(k["own"] and "gelu" in k["name"] for k in attribution["kernels"]), attribution
