"""A benchmark run end to end on the CPU backend: solutions matched to tasks, evaluated with the
real evaluation core, persisted and resumed, reported and compared."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from cuda_agent.bench.baselines import measure_baselines
from cuda_agent.bench.report import compare_runs, paper_table, write_report
from cuda_agent.bench.run import language_settings, read_results, run_bench, seed_baselines
from cuda_agent.bench.solutions import find_solutions, task_of
from cuda_agent.cli import main
from cuda_agent.evaluate.protocol.policy import Policy, TimingConfig
from cuda_agent.tasks import load_tasks

SANDBOX = "auto" if shutil.which("bwrap") else "none"


def test_paths_name_their_task():
    assert task_of(Path("level_1_problem_19_sample_0_kernel.py")) == (1, 19)
    assert task_of(Path("level2_40/step_3")) == (2, 40)
    assert task_of(Path("level3/7_GoogleNet.py")) == (3, 7)
    assert task_of(Path("runs/level1/19_ReLU")) == (1, 19)
    assert task_of(Path("wrong_level1_19")) is None  # only a part that starts with the level counts
    assert task_of(Path("level1")) is None


def test_paper_table_ships_with_the_package():
    rows = paper_table()
    ours = next(r for r in rows if r["split"] == "overall" and r["model"] == "CUDA Agent")
    assert ours["faster_compile"] == pytest.approx(0.968) and ours["geomean_compile"] == pytest.approx(2.11)
    assert {r["split"] for r in rows} == {"overall", "1", "2", "3"}


def kernelbench_like(tmp_path: Path, examples: Path) -> tuple[Path, Path]:
    """Three level-1 tasks (the CPU swish example, renamed) and a solution set for them: a correct
    workspace, a wrong one, one that does not load, and an entry that names no task."""
    tasks = tmp_path / "KernelBench" / "level1"
    tasks.mkdir(parents=True)
    code = (examples / "cpu_swish" / "model.py").read_text()
    for i, name in enumerate(("Swish", "SwishAgain", "SwishThird"), start=1):
        # A comment keeps the digests (and so the baselines' keys) apart.
        (tasks / f"{i}_{name}.py").write_text(f"# task {i}\n" + code)
    solution = examples / "cpu_swish" / "solution"
    sols = tmp_path / "solutions"
    shutil.copytree(solution, sols / "level1_1")
    shutil.copytree(solution, sols / "level1_2" / "sample_0")
    wrong = sols / "level1_2" / "sample_1"
    shutil.copytree(solution, wrong)
    model_new = wrong / "model_new.py"
    model_new.write_text(model_new.read_text().replace("scaled_swish(x, self.scale)", "scaled_swish(x, self.scale * 2.0)"))
    (sols / "level1_3").mkdir()
    (sols / "level1_3" / "model_new.py").write_text("import torch\n\nclass NotModelNew:\n    pass\n")
    shutil.copytree(solution, sols / "notes_level1_1")
    return tmp_path / "KernelBench", sols


@pytest.mark.slow
def test_run_resumes_reports_and_compares(tmp_path, examples, cache_dir):
    source, sols = kernelbench_like(tmp_path, examples)
    tasks = load_tasks(source)
    found = find_solutions(tasks, sols)
    assert {n: len(p) for n, p in found.by_task.items()} == {"level1/1_Swish": 1, "level1/2_SwishAgain": 2,
                                                              "level1/3_SwishThird": 1}
    assert [p.name for p in found.unmatched] == ["notes_level1_1"]

    # The baselines table measured here seeds the evaluation core's cache: the run times none.
    table = tmp_path / "baselines.jsonl"
    # The baselines are this test's own (it clears and seeds them); the builds are the run's, so the toolchain
    # probe (30-60 s on a fresh cache) and the example's extension are not built again for this test.
    (tmp_path / "cache").mkdir()
    for shared in ("builds", "objects"):
        (cache_dir / shared).mkdir(parents=True, exist_ok=True)
        (tmp_path / "cache" / shared).symlink_to(cache_dir / shared)
    options = {"sandbox": SANDBOX, "cache_dir": tmp_path / "cache", "time_compile": False}
    measure_baselines(tasks, table, device="cpu", evaluator_options=options)
    shutil.rmtree(tmp_path / "cache" / "baselines", ignore_errors=True)  # baselines too noisy here are not cached
    assert seed_baselines(table, tmp_path / "cache", Policy(), "cpu") == 3
    assert seed_baselines(table, tmp_path / "cache", Policy.preset("strict"), "cpu") == 0

    run = tmp_path / "run"
    options = options | {"timing": TimingConfig(baselines="cached")}  # as `cuda-agent bench --baselines` does
    part = find_solutions(tasks, sols)
    part.by_task = {"level1/1_Swish": part.by_task["level1/1_Swish"]}  # an interrupted run: one entry done
    first = run_bench(run, tasks, part, "cpu", evaluator_options=options, settings={"device": "cpu"})
    assert [r["status"] for r in first] == ["correct"] and first[0]["baseline_cached"]
    # The build cache is shared, so the run also checks that results are keyed by entry, not by build.
    seen = []
    rest = run_bench(run, tasks, found, "cpu", evaluator_options=options, settings={"device": "cpu"},
                     progress=lambda done, total, row: seen.append(total))
    assert sorted((r["task"]["name"], r["entry"], r["status"]) for r in rest) == [
        ("level1/2_SwishAgain", "level1_2/sample_0", "correct"),
        ("level1/2_SwishAgain", "level1_2/sample_1", "incorrect"),
        ("level1/3_SwishThird", "level1_3", "failed"),
    ]
    # Baselines are looked up only once a candidate is correct (an incorrect one is never timed).
    assert seen == [3, 3, 3] and all(r["baseline_cached"] for r in rest if r["status"] == "correct")
    assert not any(r["baseline_cached"] or r["times"] for r in rest if r["status"] != "correct")
    assert run_bench(run, tasks, found, "cpu", evaluator_options=options, settings={"device": "cpu"}) == []
    assert len(read_results(run)) == 4
    with pytest.raises(ValueError, match="other settings"):
        run_bench(run, tasks, found, "cpu", evaluator_options=options, settings={"device": "cuda"})

    report = write_report(run)
    level = report["levels"]["1"]
    assert (level["tasks"], level["correct"], level["status"]["failed"]) == (3, 2, 1)
    assert report["overall"]["pass_rate"] == pytest.approx(2 / 3)  # the wrong sample does not count against task 2
    for name in ("metrics.json", "levels.csv", "per_task.csv", "report.md", "speedups.png", "fast_p.png", "vs_paper.png"):
        assert (run / name).stat().st_size > 0, name
    per_task = {r["name"]: r for r in csv.DictReader((run / "per_task.csv").open())}
    assert per_task["level1/2_SwishAgain"]["best_entry"] == "level1_2/sample_0"
    assert per_task["level1/2_SwishAgain"]["samples"] == "2"
    assert "ModelNew" in per_task["level1/3_SwishThird"]["reason"]
    text = (run / "report.md").read_text()
    assert "| L1 | 3 | 66.7% |" in text and "CUDA Agent" in text and "level1/3_SwishThird | failed" in text

    # A second run without task 2's correct sample: compare names the change.
    other = tmp_path / "run2"
    shutil.copytree(run, other)
    rows = [r for r in read_results(other) if r["entry"] != "level1_2/sample_0"]
    (other / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = compare_runs(run, other)
    assert "| overall | pass | 66.7% | 33.3% | -33.3 pt |" in text
    assert "| level1/2_SwishAgain | correct | incorrect |" in text

    assert main(["compare", str(run), str(other), "--out", str(tmp_path / "cmp.md")]) == 0
    assert (tmp_path / "cmp.md").read_text() == text
    assert main(["report", str(tmp_path / "nowhere")]) == 2


@pytest.mark.slow
def test_bench_command_runs_and_continues(tmp_path, examples, cache_dir, capsys):
    source, sols = kernelbench_like(tmp_path, examples)
    args = ["bench", str(source), "--solutions", str(sols / "level1_1"), "--out", str(tmp_path / "run"),
            "--device", "cpu", "--cache-dir", str(cache_dir), "--quiet"]
    assert main(args) == 2  # one candidate is not a solution set: the error says what to give
    assert "not a solution set" in capsys.readouterr().err
    assert main(["bench", str(source), "--out", str(tmp_path / "run")]) == 2
    assert "--solutions DIR" in capsys.readouterr().err and not (tmp_path / "run").exists()
    args[args.index(str(sols / "level1_1"))] = str(sols)
    assert main(args + ["--level", "1"]) == 0
    out = capsys.readouterr().out
    assert "| L1 | 3 | 66.7% |" in out
    assert main(args + ["--level", "1"]) == 0 and len(read_results(tmp_path / "run")) == 4


@pytest.mark.slow
def test_live_agent_run_takes_the_best_of_each_trajectory_and_resumes(tmp_path, examples, cache_dir):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from openai_server import OpenAIServer
    from scripted_policy import by_turn, write_solution

    from cuda_agent.agent.llm import OpenAIChat
    from cuda_agent.bench.run import run_agent_bench

    source, _ = kernelbench_like(tmp_path, examples)
    tasks = load_tasks(source)[:2]
    policy = by_turn([write_solution(examples / "cpu_swish" / "solution"),
                      [("bash", {"command": "python utils/profile.py"})]])

    run = tmp_path / "live"
    options = {"sandbox": SANDBOX, "cache_dir": cache_dir, "time_compile": False}
    with OpenAIServer(policy) as server:
        rows = run_agent_bench(run, tasks, lambda: OpenAIChat("scripted", base_url=server.url), "cpu",
                               model="scripted", evaluator_options=options, sandbox=SANDBOX)
        assert sorted({r["entry"] for r in rows}) == ["agent/final", "agent/turn-1-profile"]
        assert all(r["status"] == "correct" for r in rows) and len(read_results(run)) == 4
        # An interrupted run: the second task's rows never landed. Only it runs again.
        kept = [r for r in read_results(run) if r["task"]["name"] == tasks[0].name]
        (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
        before = len(server.requests)
        again = run_agent_bench(run, tasks, lambda: OpenAIChat("scripted", base_url=server.url), "cpu",
                                model="scripted", evaluator_options=options, sandbox=SANDBOX)
        assert {r["task"]["name"] for r in again} == {tasks[1].name} and len(server.requests) - before == 3
    report = write_report(run, plots=False)
    assert report["overall"]["pass_rate"] == 1.0 and report["overall"]["tasks"] == 2
    assert len((run / "trajectories.jsonl").read_text().splitlines()) == 3  # the cut-off episode's trajectory too


def test_a_rerun_evaluates_error_rows_again(tmp_path, examples):
    from cuda_agent.evaluate.result import EvalResult

    tasks_dir = tmp_path / "KernelBench" / "level1"
    tasks_dir.mkdir(parents=True)
    shutil.copy(examples / "cpu_swish" / "model.py", tasks_dir / "1_Swish.py")
    shutil.copytree(examples / "cpu_swish" / "solution", tmp_path / "solutions" / "level1_1")
    tasks = load_tasks(tmp_path / "KernelBench")
    solutions = find_solutions(tasks, tmp_path / "solutions")

    class Flaky:
        """The harness's trouble first (a reference out of memory), then a verdict."""
        statuses = ["error", "correct"]

        def evaluate(self, task, candidate):
            status = self.statuses.pop(0)
            return EvalResult(task=task.to_dict(), candidate=candidate.to_dict(), device="cpu", policy={}, timing={},
                              status=status, reason="out of memory" if status == "error" else None)

    run, flaky = tmp_path / "run", Flaky()
    assert [r["status"] for r in run_bench(run, tasks, solutions, "cpu", evaluator=flaky)] == ["error"]
    assert [r["status"] for r in run_bench(run, tasks, solutions, "cpu", evaluator=flaky)] == ["correct"]
    assert [r["status"] for r in read_results(run)] == ["correct"]  # the error row is replaced, not kept beside
    assert run_bench(run, tasks, solutions, "cpu", evaluator=flaky) == []  # a verdict stands


def test_runs_in_each_language_are_reported_and_compared_on_the_same_tasks(tmp_path, examples):
    from cuda_agent.evaluate.result import EvalResult

    tasks_dir = tmp_path / "KernelBench" / "level1"
    tasks_dir.mkdir(parents=True)
    shutil.copy(examples / "cpu_swish" / "model.py", tasks_dir / "1_Swish.py")
    shutil.copytree(examples / "cpu_swish" / "solution", tmp_path / "cuda" / "level1_1")
    shutil.copytree(examples / "triton_swish" / "solution", tmp_path / "triton" / "level1_1")
    tasks = load_tasks(tmp_path / "KernelBench")

    class Judge:
        """A verdict without evaluating: the candidate's language decides its speedup."""

        def evaluate(self, task, candidate):
            speedup = 2.0 if candidate.language == "triton" else 1.5
            return EvalResult(task=task.to_dict(), candidate=candidate.to_dict(), device="cpu", policy={}, timing={},
                              status="correct", correct=True, reward=2.0, speedup_eager=speedup,
                              speedup_compile=speedup)

    for language in ("cuda", "triton"):
        run_bench(tmp_path / f"run-{language}", tasks, find_solutions(tasks, tmp_path / language), "cpu",
                  evaluator=Judge(), settings=language_settings(language), language=language)
    assert write_report(tmp_path / "run-triton", plots=False)["languages"] == {"triton": 1}
    assert "(triton)" in (tmp_path / "run-triton" / "report.md").read_text()
    text = compare_runs(tmp_path / "run-cuda", tmp_path / "run-triton")
    assert text.startswith("# run-cuda (cuda) vs run-triton (triton)") and "A is cuda, B is triton" in text
    # One solution set holding both, each entry read as its own language: the metrics of each beside the best's.
    shutil.copytree(tmp_path / "cuda" / "level1_1", tmp_path / "both" / "level1_1" / "cuda")
    shutil.copytree(tmp_path / "triton" / "level1_1", tmp_path / "both" / "level1_1" / "triton")
    run_bench(tmp_path / "run-both", tasks, find_solutions(tasks, tmp_path / "both"), "cpu", evaluator=Judge())
    both = write_report(tmp_path / "run-both", plots=False)
    assert both["languages"] == {"triton": 1} and set(both["by_language"]) == {"cuda", "triton"}
    assert both["by_language"]["cuda"]["geomean_compile"] == pytest.approx(1.5)
    assert "## By kernel language" in (tmp_path / "run-both" / "report.md").read_text()
    with pytest.raises(ValueError, match="other settings"):  # a Triton run is not continued as another language
        run_bench(tmp_path / "run-triton", tasks, find_solutions(tasks, tmp_path / "triton"), "cpu", evaluator=Judge(),
                  settings=language_settings(None))
