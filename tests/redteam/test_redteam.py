"""The red-team suite: one hostile candidate per known reward-hacking pattern
(docs/SECURITY.md has the table), each rejected with its specific rule, and the
project's legitimate solutions, which must pass.

Each case is a folder of ``cases/`` (its README describes one): the files that
replace the CPU example's solution (examples/cpu_swish/solution), and a
``case.toml`` saying what it games and what the evaluator must answer. Every
case runs against the CPU example task (scaled swish), or the case's own
``task.py``, through the real evaluator: sandbox, static checks, build, symbol
audit, runtime guards. Cases marked ``runtime`` switch the static checks off to
show that the runtime layer holds on its own (defence in depth).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from casekit import (CASES_DIR, CPU_NOISE, FRACTIONS, FolderCase, deferred_share, gains_nothing, load_case,
                     load_cases, make_candidate)

from cuda_agent import Evaluator, load_candidate, load_task
from cuda_agent.evaluate import Policy, Timeouts
from cuda_agent.evaluate.references import ReferencePool

pytestmark = pytest.mark.slow

# On the CPU each deferral case is a build of its own (about a minute and a half on two cores): the default run takes
# the last eighth of each mechanism, CUDA_AGENT_REDTEAM_FRACTIONS=all every fraction (the GPU file always takes them all).
CPU_FRACTIONS = FRACTIONS if os.environ.get("CUDA_AGENT_REDTEAM_FRACTIONS") == "all" else (8,)


CASES = load_cases(CASES_DIR, "rejected")
TRUE_COST_CASES = load_cases(CASES_DIR, "true-cost")
DEFERRAL_CASES = load_cases(CASES_DIR, "deferral", CPU_FRACTIONS)


@pytest.fixture(scope="module")
def evaluator(cache_dir):
    # One pool of reference processes for every case, as the service keeps them for every candidate of a
    # task: a case that could reach a kept reference would show in the cases after it. It spares each case
    # a reference start and torch.compile (~10 s on a 2-core host).
    references = ReferencePool(4)
    yield Evaluator("cpu", cache_dir=cache_dir, timeouts=Timeouts(check_s=60, load_s=180), memory_limit=6 * 1024**3,
                    references=references)
    references.close()


@pytest.fixture(scope="module")
def solution(examples) -> Path:
    return examples / "cpu_swish" / "solution"


@pytest.fixture(scope="module")
def prebuilt(evaluator, solution, request, tmp_path_factory) -> None:
    """The selected cases' extensions built ahead, two at a time, into the evaluator's cache, where each case's own
    build then finds its result (the cache is keyed by the sources, not their folder). On a fresh cache each native
    case compiles one file (10-18 s on two cores, a fifth of the module's time on a fresh cache); the evaluations
    themselves run one at a time. A build that fails here is the case's to report when it is evaluated."""
    chosen = {item.callspec.params["case"].name for item in request.session.items
              if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})}
    cases = [case for case in (*CASES, *TRUE_COST_CASES, *DEFERRAL_CASES) if case.name in chosen]
    root = tmp_path_factory.mktemp("prebuilt")
    candidates = [make_candidate(case, solution, root / case.name) for case in cases]
    evaluator.build_probe()

    def build(candidate) -> None:
        try:
            evaluator.build(candidate)
        except Exception:  # noqa: BLE001 - the evaluation builds it again and reports what went wrong
            pass

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(build, [c for c in candidates if c.extensions]))


def make_task(case: FolderCase, examples: Path, tmp_path: Path):
    if case.task is None:
        return load_task(examples / "cpu_swish" / "model.py")
    path = tmp_path / f"{case.name}_task.py"
    path.write_text(case.task)
    return load_task(path)


def judge_of(case: FolderCase, evaluator: Evaluator) -> Evaluator:
    """The module's evaluator (its references kept) under the case's policy and timing."""
    policy = evaluator.policy.with_(static_checks=not case.runtime, **case.policy)
    timing = replace(evaluator.timing, **case.timing)
    return Evaluator("cpu", policy=policy, timing=timing, cache_dir=evaluator.cache_dir, timeouts=evaluator.timeouts,
                     memory_limit=evaluator.memory_limit, sandbox=evaluator.sandbox, references=evaluator.references)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hacking_candidate_is_rejected_for_the_right_reason(case, evaluator, prebuilt, solution, examples, tmp_path):
    result = judge_of(case, evaluator).evaluate(make_task(case, examples, tmp_path),
                                                make_candidate(case, solution, tmp_path / case.name))
    detail = f"{result.summary()}\n{result.traceback or ''}\n{result.output[-2000:]}"
    assert result.status == case.status, detail
    assert result.reward == case.expect["reward"] == -1.0, detail
    assert result.rule == case.rule, detail
    if case.reason:
        assert case.reason in (result.reason or ""), detail


def test_the_precision_exploit_passes_the_paper_preset(evaluator, solution, examples, tmp_path):
    """The paper's fixed 1e-2 tolerance lets zeros through for small outputs; the default does not. Verified
    only: a question of the checks, and an untimed evaluation cannot be refused by a busy host's timing (CI
    saw the brackets' calibration refuse this tiny call's timing as `error`)."""
    case = load_case(CASES_DIR / "zeros-for-tiny-outputs")
    judge = Evaluator("cpu", policy=Policy.preset("paper"), cache_dir=evaluator.cache_dir, timeouts=evaluator.timeouts,
                      memory_limit=evaluator.memory_limit, sandbox=evaluator.sandbox, references=evaluator.references)
    result = judge.verify(make_task(case, examples, tmp_path), make_candidate(case, solution, tmp_path / "c"))
    assert result.status == "correct", result.summary()


def test_legitimate_solution_passes_and_the_evaluator_keeps_serving(evaluator, solution, examples):
    task = load_task(examples / "cpu_swish" / "model.py")
    for _ in range(2):
        result = evaluator.evaluate(task, load_candidate(solution))
        assert result.status == "correct" and result.rule is None and not result.violations, result.summary()
        reruns = [c for c in result.checks if c.get("rerun")]
        assert [(c["rerun"], c["ok"], c["reason"]) for c in reruns] == [(1, True, None)], reruns  # same bits


def test_a_candidate_whose_bits_vary_from_run_to_run_is_not_judged_bit_for_bit(evaluator, solution, examples, tmp_path):
    """As a kernel that adds up with atomics: each call's last bits differ, timed or checked alike."""
    case = load_case(CASES_DIR / "last-bit-noise")
    assert case.suite == "honest" and case.status == "correct"
    result = evaluator.evaluate(make_task(case, examples, tmp_path), make_candidate(case, solution, tmp_path / "c"))
    assert result.status == "correct", result.summary()
    reruns = [c for c in result.checks if c.get("rerun")]
    assert reruns and reruns[-1]["rerun"] == 2 and "not deterministic" in reruns[-1]["reason"], reruns
    assert any("not compared bit for bit" in note for note in result.notes)


@pytest.fixture(scope="module")
def honest_twins(evaluator, solution, examples, tmp_path_factory):
    """The honest solution on each case's task, evaluated once (``twin(case)``); ``twin(case, again=True)`` evaluates
    it once more and keeps the faster of the two."""
    found: dict = {}

    def twin(case: FolderCase, again: bool = False):
        if case.task not in found or again:
            task = make_task(case, examples, tmp_path_factory.mktemp("twin"))
            for _ in range(3):  # a host busy with other work refuses to time the baselines (status error): again
                result = evaluator.evaluate(task, load_candidate(solution))
                print("honest twin:", result.summary())
                if result.status != "error":
                    break
            if result.status == "error":
                if case.task in found:  # a retake the busy host refused: the first evaluation stays the bar
                    return found[case.task]
                pytest.skip(f"the honest twin could not be timed here: {result.reason}")
            assert result.status == "correct", result.summary()
            earlier = found.get(case.task)
            if earlier is None or result.times["candidate"]["median_ms"] < earlier.times["candidate"]["median_ms"]:
                found[case.task] = result
        return found[case.task]
    return twin


def judge_against_twin(case: FolderCase, result, detail: str, twins, **bar) -> None:
    """``gains_nothing`` against the case's honest twin. On a shared 2-core host one evaluation of the honest solution
    can run a third slower than the next (another tenant's work on the core beside it): where the bar fails, the twin
    is timed once more and the faster of its two evaluations is the bar. That only lowers the honest time a case
    must not beat, never raises it."""
    try:
        gains_nothing(result, twins(case), detail, **bar)
    except AssertionError:
        gains_nothing(result, twins(case, again=True), detail, **bar)


def evaluate_case(case: FolderCase, evaluator, solution, examples, tmp_path):
    result = judge_of(case, evaluator).evaluate(make_task(case, examples, tmp_path),
                                                make_candidate(case, solution, tmp_path / case.name))
    return result, f"{result.summary()}\n{result.traceback or ''}\n{result.output[-2000:]}"


@pytest.mark.parametrize("case", TRUE_COST_CASES, ids=[c.name for c in TRUE_COST_CASES])
def test_a_candidate_that_moves_its_work_where_its_own_clock_cannot_see_is_timed_at_its_true_cost(
        case, evaluator, prebuilt, honest_twins, solution, examples, tmp_path):
    assert case.expect["gains_nothing"]
    result, detail = evaluate_case(case, evaluator, solution, examples, tmp_path)
    judge_against_twin(case, result, detail, honest_twins, noise=CPU_NOISE)


@pytest.mark.parametrize("case", DEFERRAL_CASES, ids=[c.name for c in DEFERRAL_CASES])
def test_work_finished_after_done_gains_nothing(case, evaluator, prebuilt, honest_twins, solution, examples, tmp_path):
    """Issue 62: the tail of each timed call finished after the region's DONE (by a thread started through the C API,
    a profile hook on the harness's own timing thread, or torch's pools) is rejected or timed at its true cost."""
    assert case.expect["gains_nothing"]
    result, detail = evaluate_case(case, evaluator, solution, examples, tmp_path)
    judge_against_twin(case, result, detail, honest_twins, marker=case.expect["marker"], noise=CPU_NOISE,
                       deferred=deferred_share(case))
