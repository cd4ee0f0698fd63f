"""The CLI as a person meets it: quiet progress with details behind -v, errors that name the flag and the fix,
and refusals before any work starts. No test here runs an evaluation: the evaluator's answers are scripted."""

from __future__ import annotations

import json
import shutil
import sys
import time

import pytest

from cuda_agent import Evaluator
from cuda_agent.cli import main
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.jsonl import append_jsonl

# 24 timing rounds, with the raw intervals the evaluator's own lines carry.
ROUNDS = [("profile", f"round {n}: 1.020x vs eager [0.000, 151797993.381]") for n in range(1, 25)]
STAGES = [("build", "toolchain probe: a minimal extension, built once per cache before any candidate, tells ..."),
          ("build", "1 extension(s), backend cpu"), ("reference", "kept from earlier"), ("load", "importing the candidate"),
          *[("verify", f"check {n}/5") for n in range(1, 6)], ("profile", "warming the candidate up"), *ROUNDS,
          ("done", "correct, reward 1.0")]


@pytest.fixture
def scripted(monkeypatch):
    """Evaluator.evaluate reports STAGES (plus ``extra``) through on_stage, then a verdict; ``calls`` counts it."""
    state = {"calls": 0, "extra": []}

    def evaluate(self, task, candidate, build_result=None, *, timed=True):
        state["calls"] += 1
        for stage, detail in STAGES + state["extra"]:
            self.on_stage(stage, detail)
        return EvalResult(task=task.to_dict(), candidate={}, device="cpu", policy={}, timing={}, status="correct",
                          stage="done", reward=1.0)

    monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    return state


def swish(examples):
    return [str(examples / "cpu_swish" / "model.py"), str(examples / "cpu_swish" / "solution")]


def test_eval_says_each_stage_once_and_the_rounds_only_with_verbose(scripted, capsys, examples):
    assert main(["eval", *swish(examples), "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert "round" not in captured.err and "151797993" not in captured.err, captured.err
    assert "toolchain probe" not in captured.err  # cached: nothing of it is said
    assert [line.split("] ", 1)[1].split()[0] for line in lines] == ["build", "reference", "load", "verify", "profile"], lines
    assert captured.out.count("reward") == 1  # one summary
    # -v: every line as the evaluator words it.
    assert main(["eval", *swish(examples), "--device", "cpu", "-v"]) == 0
    err = capsys.readouterr().err
    assert err.count("] profile   round ") == 24 and "toolchain probe: a minimal extension" in err


def test_a_toolchain_probe_that_really_builds_is_said(scripted, capsys, examples):
    scripted["extra"] = [("build", "toolchain probe built in 31 s (cached from now on)")]
    assert main(["eval", *swish(examples), "--device", "cpu"]) == 0
    assert "toolchain probe built in 31 s" in capsys.readouterr().err


def test_counters_on_the_cpu_are_refused_before_any_evaluation(scripted, capsys, examples):
    started = time.monotonic()
    assert main(["eval", *swish(examples), "--device", "cpu", "--counters"]) == 2
    err = capsys.readouterr().err
    assert "--counters" in err and "NVIDIA GPU" in err and "drop --counters" in err, err
    assert scripted["calls"] == 0 and time.monotonic() - started < 20
    # --json scripts get their record still.
    assert main(["eval", *swish(examples), "--device", "cpu", "--counters", "--json"]) == 2
    record = json.loads(capsys.readouterr().out)
    assert record["status"] == "error" and record["stage"] == "input" and "--counters" in record["reason"]


def test_an_unknown_flag_shows_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["bench", "kb.jsonl", "--out", "run", "--solutions", "s", "--bogus"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "usage: cuda-agent bench" in err and "unrecognized arguments: --bogus" in err
    with pytest.raises(SystemExit):
        main(["train", "ppo", "--out", "run", "--bogus", "1"])
    err = capsys.readouterr().err
    assert "usage: cuda-agent train ppo" in err and "unrecognized arguments: --bogus 1" in err


def test_an_os_error_on_a_path_names_the_flag_and_what_it_needs(tmp_path):
    from cuda_agent.cli import build_parser
    from cuda_agent.cli.main import command_parser, path_error

    parser = build_parser()
    args = parser.parse_args(["compare", "a", "b", "--out", str(tmp_path)])
    said = path_error(IsADirectoryError(21, "Is a directory", str(tmp_path)), args, command_parser(parser, args))
    assert said == f"--out {tmp_path} is a directory where a file is needed; give a file's path"
    args = parser.parse_args(["train", "demo", "--out", str(tmp_path / "f")])
    said = path_error(FileExistsError(17, "File exists", str(tmp_path / "f")), args, command_parser(parser, args))
    assert said.startswith(f"--out {tmp_path / 'f'}: ") and "is a file where a directory is needed" in said


def kernelbench_table(tmp_path, examples, ids=(19, 20)):
    code = (examples / "cpu_swish" / "model.py").read_text()
    table = tmp_path / "kb.jsonl"
    table.write_text("".join(json.dumps({"level": 1, "problem_id": pid, "name": f"{pid}_Swish", "code": code}) + "\n"
                             for pid in ids))
    return table


def test_bench_refuses_a_solutions_dir_that_matches_no_task(tmp_path, capsys, examples):
    table = kernelbench_table(tmp_path, examples)
    solutions = tmp_path / "solutions"
    shutil.copytree(examples / "cpu_swish" / "solution", solutions / "level2_7")  # a task the table does not hold
    out = tmp_path / "run"
    assert main(["bench", str(table), "--solutions", str(solutions), "--out", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"--solutions {solutions}: no entry names a task of {table} (2 tasks)" in err, err
    assert "level1_19/" in err and "(level2_7 names no task of it)" in err
    assert not (out / "report.md").exists()


def test_bench_names_the_flag_of_a_path_it_cannot_use(tmp_path, capsys, examples):
    from cuda_agent.cli.bench import _baselines_table

    table = kernelbench_table(tmp_path, examples)
    solutions = tmp_path / "solutions"
    shutil.copytree(examples / "cpu_swish" / "solution", solutions / "level1_19")
    command = ["bench", str(table), "--solutions", str(solutions), "--device", "cpu"]
    (tmp_path / "taken").write_text("")
    assert main(command + ["--out", str(tmp_path / "taken")]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'taken'} is a file" in err and "give a new directory" in err and "Errno" not in err
    empty = tmp_path / "tables"
    empty.mkdir()
    assert main(command + ["--out", str(tmp_path / "run"), "--baselines", str(empty)]) == 2
    err = capsys.readouterr().err
    assert f"--baselines {empty} is a directory that holds no .jsonl table" in err and "Errno" not in err, err
    assert main(command + ["--out", str(tmp_path / "run"), "--baselines", str(tmp_path / "none.jsonl")]) == 2
    assert "--baselines" in capsys.readouterr().err
    # A directory that holds one table is taken for it.
    (empty / "h100.jsonl").write_text("")
    assert _baselines_table(empty) == empty / "h100.jsonl"


def test_bench_shows_progress_from_the_start_and_cuts_reasons_at_a_word(tmp_path, capsys, examples, monkeypatch):
    from cuda_agent.bench import run
    from cuda_agent.cli import bench
    from cuda_agent.cli.common import clip

    reason = "the candidate's output differs from the reference at 1024 of 1048576 positions " * 3
    table = kernelbench_table(tmp_path, examples, ids=(19,))
    solutions = tmp_path / "solutions"
    shutil.copytree(examples / "cpu_swish" / "solution", solutions / "level1_19")

    def slow_bench(run_dir, tasks, found, device, *, evaluator_options, settings, progress, **_):
        run.start_run(run_dir, tasks, str(found.root), settings)
        evaluator_options["on_stage"]("build", "1 extension(s), backend cpu")
        time.sleep(1.0)  # a first evaluation takes a while: the heartbeat speaks meanwhile
        row = {"entry": "level1_19"} | EvalResult(task=tasks[0].to_dict(), candidate={}, device="cpu", policy={},
                                                  timing={}, status="incorrect", stage="verify", reason=reason).to_dict()
        append_jsonl(run.results_path(run_dir), row)
        progress(1, 1, row)
        return [row]

    monkeypatch.setattr(bench, "BEAT_S", 0.3)
    monkeypatch.setattr(run, "run_bench", slow_bench)
    assert main(["bench", str(table), "--solutions", str(solutions), "--out", str(tmp_path / "run"),
                 "--device", "cpu"]) == 0
    lines = capsys.readouterr().err.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("evaluating 1 entry on cpu"))
    beat = next(i for i, line in enumerate(lines) if "running: build: building the candidate's extension(s)" in line)
    done = next(i for i, line in enumerate(lines) if "level1/19_Swish level1_19: incorrect" in line)
    assert start < beat < done
    said = clip(reason, 100)
    assert f"({said})" in lines[done] and len(said) <= 100 and said.endswith(" ...")
    kept = said.removesuffix(" ...")
    assert reason.startswith(kept) and reason[len(kept)] == " "  # cut where a word ends
    assert clip("a " * 10, 100) == ("a " * 10).strip()


def test_compare_refuses_runs_over_different_tasks(tmp_path, capsys):
    def run(name, *ids):
        folder = tmp_path / name
        folder.mkdir()
        tasks = [{"name": f"level1/{i}_T", "level": 1, "problem_id": i, "digest": f"d{i}"} for i in ids]
        (folder / "run.json").write_text(json.dumps({"format": 1, "tasks": tasks}))
        (folder / "results.jsonl").write_text("".join(
            json.dumps({"task": t, "entry": f"level1_{t['problem_id']}", "status": "correct"}) + "\n" for t in tasks))
        return str(folder)

    a, b, c = run("a", 1, 2), run("b", 3), run("c", 2, 4)
    assert main(["compare", a, b]) == 2
    err = capsys.readouterr().err
    assert "share no task" in err and "nothing to compare" in err
    assert main(["compare", a, b, "--force"]) == 2  # nothing in common to compare, forced or not
    assert main(["compare", a, c]) == 2
    err = capsys.readouterr().err
    assert "different task sets" in err and "1 task only in the first (level1/1)" in err and "--force" in err, err
    assert main(["compare", a, c, "--force"]) == 0
    assert main(["compare", a, a]) == 0


def test_missing_extras_are_named_as_the_readme_installs(tmp_path, capsys, examples, monkeypatch):
    from cuda_agent import paths

    monkeypatch.setitem(sys.modules, "transformers", None)  # an environment without the [train] extra
    assert main(["train", "demo", "--out", str(tmp_path / "demo"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "`cuda-agent train demo` needs transformers, from the [train] extra" in err, err
    assert f"pip install -e '.[train]' (in {paths.CHECKOUT})" in err and not (tmp_path / "demo").exists()
    monkeypatch.setitem(sys.modules, "openai", None)
    assert main(["optimize", swish(examples)[0], "--model", "m", "--device", "cpu", "--out", str(tmp_path / "o")]) == 2
    assert "the model backends need the `openai` package: pip install -e '.[llm]'" in capsys.readouterr().err
    # Installed from the package index (no checkout around the package): the index's spelling.
    monkeypatch.setattr(paths, "CHECKOUT", tmp_path)
    assert paths.install_hint("llm") == "pip install 'cuda-agent[llm]'"


def test_on_a_terminal_progress_is_one_line_rewritten_in_place():
    import io

    from cuda_agent.cli.common import StageProgress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    progress = StageProgress(stream=screen)
    for stage, detail in STAGES:
        progress(stage, detail)
    progress.close()
    text = screen.getvalue()
    assert "\n" not in text and text.endswith("\r\x1b[K")  # nothing left on the line for the summary
    assert "timing the candidate (round 24)" in text and "151797993" not in text


def test_the_cli_is_one_small_module_per_command_family():
    from pathlib import Path

    import cuda_agent.cli as cli
    from cuda_agent.cli.main import FAMILIES

    folder = Path(cli.__file__).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in folder.glob("*.py")}
    assert max(sizes.values()) <= 600, sizes
    # Every command is registered by the family module that defines it.
    for family in FAMILIES:
        assert callable(family.register) and family.__name__.startswith("cuda_agent.cli.")
