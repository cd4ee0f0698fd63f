"""Triton candidates on the GPU: the Triton solutions of KernelBench level 1-2 tasks (``triton_solutions/``), the
Triton red team (``tests/redteam/triton_cases/``), warm re-evaluation of a Triton candidate beside a CUDA one on the
same task, and one solution evaluated ten times (the same reward each time, the spread of its time).

    CUDA_AGENT_TRITON_REPORT=DIR python -m pytest -m gpu -s tests/gpu/test_gpu_triton.py   # [gpu]

With ``CUDA_AGENT_TRITON_REPORT``, every result is written to ``DIR/triton_gpu.json`` and a summary to
``DIR/triton_gpu.md`` as the tests go (a run cut short keeps what it measured); tests that would start after
``CUDA_AGENT_TRITON_BUDGET_S`` seconds (default 290) are skipped and listed. Needs Triton and KernelBench
(``../shared/data/kernelbench/`` or ``KERNELBENCH_DATA``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from cuda_agent import Evaluator, load_candidate, load_task
from cuda_agent.evaluate import Timeouts

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SOLUTIONS = HERE / "triton_solutions"
CUDA_SOLUTIONS = HERE / "kernelbench_solutions"
CASES = ROOT / "tests" / "redteam" / "triton_cases"
SWISH = ROOT / "examples" / "triton_swish"
FOLDERS = sorted(p.name for p in SOLUTIONS.iterdir() if (p / "model_new.py").is_file())
STABLE = "level2_40"  # a 16384 x 4096 x 4096 GEMM with its epilogue: milliseconds a call (the CV target is for
# 0.5 ms and longer), small inputs, and a CUDA solution of the same task for the warm comparison
REPEATS = 10
# The run's time budget: a test that would start after it is skipped (and says so in the report), so that one
# bounded run keeps everything measured before it. In order: the red team, ten evaluations of one solution, warm
# re-evaluation beside the CUDA solution of the same task, the solutions.
BUDGET_S = float(os.environ.get("CUDA_AGENT_TRITON_BUDGET_S", "290"))
STARTED = time.monotonic()
REPORT: dict[str, Any] = {"solutions": {}, "redteam": {}, "warm": {}, "stability": {}, "skipped": []}


@pytest.fixture(autouse=True)
def within_budget(request):
    if time.monotonic() - STARTED > BUDGET_S:
        REPORT["skipped"].append(request.node.name)
        write_report()
        pytest.skip(f"over the run's time budget ({BUDGET_S:.0f} s; CUDA_AGENT_TRITON_BUDGET_S raises it)")


def brief(result: Any, seconds: float) -> dict[str, Any]:
    times = result.times or {}
    return {"status": result.status, "reward": result.reward, "rule": result.rule,
            "reason": (result.reason or "")[:300],
            "candidate_ms": (times.get("candidate") or {}).get("median_ms"),
            "eager_ms": (times.get("eager") or {}).get("median_ms"),
            "compile_ms": (times.get("compile") or {}).get("median_ms"),
            "speedup_eager": result.speedup_eager, "speedup_compile": result.speedup_compile,
            "seconds": round(seconds, 2), "durations": result.durations,
            "notes": [n for n in result.notes if "Triton" in n]}


def write_report() -> None:
    where = os.environ.get("CUDA_AGENT_TRITON_REPORT")
    if not where:
        return
    out = Path(where)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0)
    import triton

    REPORT["environment"] = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__}
    (out / "triton_gpu.json").write_text(json.dumps(REPORT, indent=1, default=str))
    lines = [f"# Triton candidates on {gpu} (torch {torch.__version__}, Triton {triton.__version__})", "",
             "| task | status | reward | ms (candidate / eager / compile) | speedup vs eager / compile | s |",
             "|---|---|---|---|---|---|"]
    for name, r in REPORT["solutions"].items():
        lines.append(f"| {name} | {r['status']} {r['rule'] or ''} | {r['reward']} | {r['candidate_ms']} / {r['eager_ms']} / "
                     f"{r['compile_ms']} | {r['speedup_eager']} / {r['speedup_compile']} | {r['seconds']} |")
    lines += ["", "| red-team case | expected | status | rule | candidate ms | reason |", "|---|---|---|---|---|---|"]
    for name, r in REPORT["redteam"].items():
        lines.append(f"| {name} | {r['expected']} | {r['status']} | {r['rule']} | {r['candidate_ms']} | {r['reason'][:120]} |")
    for key, value in (("warm", REPORT["warm"]), ("stability", REPORT["stability"]), ("skipped", REPORT["skipped"])):
        lines += ["", f"## {key}", "", "```", json.dumps(value, indent=1, default=str)[:4000], "```"]
    (out / "triton_gpu.md").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def evaluator(cache_dir):
    # Long-lived, as in the agent and bench: each evaluation starts the next one's processes.
    with Evaluator("cuda", cache_dir=cache_dir, prestart=True, timeouts=Timeouts(build_s=240)) as evaluator:
        yield evaluator
    write_report()


def kernelbench_task(jsonl: Path, folder: str):
    level, problem = folder.removeprefix("level").split("_")
    return load_task(f"{jsonl}#{level}/{problem}")


def evaluate(evaluator: Evaluator, task: Any, candidate: Any) -> tuple[Any, float]:
    clock = time.monotonic()
    result = evaluator.evaluate(task, candidate)
    print("\n" + result.summary())
    return result, time.monotonic() - clock


# case file, static checks on, the status and rule it must end with (None: correct, judged by its time below)
RED_TEAM = [
    ("torch_in_forward.py", True, "failed", "torch-compute"),
    ("torch_in_forward.py", False, "failed", "torch-compute"),
    ("triton_internals.py", True, "failed", "triton-api"),
    ("new_specialisation_when_timed.py", True, "failed", "triton-compile"),
    ("autotune_when_timed.py", True, "failed", "triton-autotune"),
    ("side_stream.py", True, "failed", "stream"),
    ("side_stream.py", False, None, None),
    ("work_left_queued.py", True, None, None),
]
# A case judged by its time: rejected by some rule, or timed at no less than this share of the honest kernel's time
# (the queued kernel alone takes several times the honest one).
AT_LEAST = {"side_stream.py": 0.9, "work_left_queued.py": 1.5}


@pytest.fixture(scope="module")
def honest(evaluator):
    """The example's honest Triton solution on its task: the time a trick is judged against."""
    result, seconds = evaluate(evaluator, load_task(SWISH / "model.py"), load_candidate(SWISH / "solution"))
    REPORT["redteam"]["honest triton_swish"] = brief(result, seconds) | {"expected": "correct"}
    assert result.status == "correct", result.summary()
    return result


@pytest.mark.parametrize("name, static, status, rule", RED_TEAM,
                         ids=[f"{c[0][:-3]}{'' if c[1] else '-runtime'}" for c in RED_TEAM])
def test_triton_red_team_case(name, static, status, rule, evaluator, honest):
    if static:
        result, seconds = evaluate(evaluator, load_task(SWISH / "model.py"), load_candidate(CASES / name))
    else:  # the runtime layer alone; the task's reference process shared with the module's evaluator (never
        # closed here: closing it would close the shared pool; collected, it leaves the pool open)
        judge = Evaluator("cuda", policy=evaluator.policy.with_(static_checks=False), cache_dir=evaluator.cache_dir,
                          timeouts=evaluator.timeouts, sandbox=evaluator.sandbox, references=evaluator.references)
        result, seconds = evaluate(judge, load_task(SWISH / "model.py"), load_candidate(CASES / name))
    key = f"{name[:-3]}{'' if static else '-runtime'}"
    honest_ms = honest.times["candidate"]["median_ms"]
    REPORT["redteam"][key] = brief(result, seconds) | {"expected": f"{status} {rule or ''}".strip() if status
                                                       else "rejected, or timed at its true cost"}
    write_report()
    detail = result.summary() + (result.traceback or "") + result.output[-2000:]
    if status is None:  # rejected by a rule, or timed at its true cost
        assert result.rule is not None or (result.status == "correct" and result.times["candidate"]["median_ms"]
                                           >= AT_LEAST[name] * honest_ms), detail
        return
    assert (result.status, result.rule) == (status, rule), detail


def test_one_solution_ten_times_has_one_reward(kernelbench_jsonl, evaluator):
    task = kernelbench_task(kernelbench_jsonl, STABLE)
    candidate = load_candidate(SOLUTIONS / STABLE, language="triton")
    runs = [brief(*evaluate(evaluator, task, candidate)) for _ in range(REPEATS)]
    times = [r["candidate_ms"] for r in runs if r["candidate_ms"]]
    cv = {what: statistics.pstdev(values) / statistics.fmean(values) if len(values) > 1 else None
          for what in ("candidate_ms", "speedup_eager", "speedup_compile")
          for values in [[r[what] for r in runs if r[what]]]}
    REPORT["stability"] = {"task": STABLE, "rewards": [r["reward"] for r in runs], "candidate_ms": times,
                           "cv": cv, "statuses": [r["status"] for r in runs]}
    write_report()
    assert len({r["reward"] for r in runs}) == 1 and runs[0]["status"] == "correct", REPORT["stability"]
    # The target is the speedup's CV, for kernels of 0.5 ms and longer.
    assert statistics.median(times) < 0.5 or all(cv[what] is not None and cv[what] <= 0.01
                                                 for what in ("speedup_eager", "speedup_compile")), REPORT["stability"]


# Before each language's last (measured) evaluation: long enough for the candidate process the evaluation before it
# started to have finished starting. That process is started early in an evaluation and stands still while anything
# is timed, so one started beside a short evaluation is still starting when it ends: whichever language came right
# after the shorter one would otherwise wait for it (on the CPU backend, 1.7-1.9 s of a Triton evaluation that
# followed a C++ one, 0.02-0.04 s of the C++ one that followed Triton). An agent's re-evaluation comes after an edit.
SETTLE_S = 10.0


def test_warm_re_evaluation_of_a_triton_candidate_beside_a_cuda_one(kernelbench_jsonl, evaluator):
    """The same task, the two candidates evaluated in turn three times: the last of each (its build, Triton's kernels
    and the baselines cached, its process started ahead and given ``SETTLE_S`` to finish starting) is the warm one."""
    task = kernelbench_task(kernelbench_jsonl, STABLE)
    candidates = {"cuda": load_candidate(CUDA_SOLUTIONS / STABLE),
                  "triton": load_candidate(SOLUTIONS / STABLE, language="triton")}
    runs: dict[str, list[Any]] = {language: [] for language in candidates}
    for turn in range(3):
        for language, candidate in candidates.items():
            if turn == 2:
                time.sleep(SETTLE_S)
            runs[language].append(evaluate(evaluator, task, candidate))
    for language, pairs in runs.items():
        assert pairs[-1][0].status == "correct", pairs[-1][0].summary()
    REPORT["warm"] = {language: {"warm_s": round(pairs[-1][1], 2), "warm_durations": pairs[-1][0].durations,
                                 "seconds": [round(seconds, 2) for _, seconds in pairs],
                                 "wait_ready": [r.durations.get("wait_ready") for r, _ in pairs]}
                      for language, pairs in runs.items()} | {"settle_s": SETTLE_S}
    write_report()
    assert REPORT["warm"]["triton"]["warm_s"] <= 1.1 * REPORT["warm"]["cuda"]["warm_s"] + 1.0, REPORT["warm"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_triton_solution_is_correct_and_rewarded(folder, kernelbench_jsonl, evaluator):
    result, seconds = evaluate(evaluator, kernelbench_task(kernelbench_jsonl, folder),
                               load_candidate(SOLUTIONS / folder, language="triton"))
    REPORT["solutions"][folder] = brief(result, seconds)
    write_report()
    assert result.status == "correct", result.summary() + (result.traceback or "") + result.output[-3000:]
    assert result.reward >= 1.0 and result.candidate["language"] == "triton"
    assert any("build stage's cache" in n for n in result.notes), result.notes
