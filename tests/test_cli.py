import json
import shutil

import pytest

from cuda_agent import Evaluator, load_candidate
from cuda_agent.cli import main


def test_tasks_lists_and_rejects(tmp_path, capsys, examples):
    assert main(["tasks", str(examples / "cpu_swish" / "model.py")]) == 0
    captured = capsys.readouterr()
    assert "cpu_swish" in captured.out and captured.err == "1 task\n"
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n")
    assert main(["tasks", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "missing Model, get_inputs, get_init_inputs" in err


def test_eval_rejects_a_missing_candidate(capsys, examples, tmp_path):
    assert main(["eval", str(examples / "cpu_swish" / "model.py"), str(tmp_path / "nope")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_json(capsys, examples, cache_dir):
    code = main([
        "eval", str(examples / "cpu_swish" / "model.py"), str(examples / "cpu_swish" / "solution"),
        "--device", "cpu", "--json", "--cache-dir", str(cache_dir),
    ])
    record = json.loads(capsys.readouterr().out)
    assert code == 0 and record["status"] == "correct" and record["reward"] >= 1
    assert set(record["times"]) == {"candidate", "eager", "compile"}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_compile_only_cli_reports_file_and_line(tmp_path, capsys, cache_dir):
    root = tmp_path / "ws"
    (root / "kernels").mkdir(parents=True)
    (root / "model_new.py").write_text("class ModelNew:\n    pass\n")
    (root / "kernels" / "k.cu").write_text("__global__ void k(float* x) {\n  x[0] = 1.0f\n}\n")
    assert main(["compile", str(root), "--cache-dir", str(cache_dir)]) == 1
    out = capsys.readouterr().out
    assert "kernels/k.cu:3: error:" in out or "kernels/k.cu:2: error:" in out


def test_synth_refuses_without_llm_settings(tmp_path, capsys, monkeypatch):
    assert main(["synth", "--n", "1", "--out", str(tmp_path / "out"), "--no-decontaminate", "--composer", "llm"]) == 2
    assert "--model NAME and --base-url URL" in capsys.readouterr().err
    assert main(["synth", "--n", "0", "--out", str(tmp_path / "out"), "--no-decontaminate", "--device", "cpu"]) == 2
    assert "--n must be at least 1" in capsys.readouterr().err


def test_catalog_command_writes_and_summarises(tmp_path, capsys):
    assert main(["catalog", "--out", str(tmp_path / "catalog.json"), "--no-transformers", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "usable" in out and "nn.Conv2d" in out and "unusable: loss (needs targets)" in out
    assert (tmp_path / "catalog.json").stat().st_size > 10_000


@pytest.mark.parametrize("command", [
    ["eval", "{model}", "{solution}"],
    ["degenerate", "{model}"],
    ["baselines", "{model}", "--out", "{tmp}/b.jsonl"],
    ["bench", "{model}", "--solutions", "{tmp}", "--out", "{tmp}/run"],
    ["synth", "--n", "1", "--out", "{tmp}/synth", "--no-decontaminate"],
    ["optimize", "{model}", "--model", "m", "--base-url", "http://127.0.0.1:9/v1", "--out", "{tmp}/opt"],
])
def test_device_cuda_without_a_gpu_fails_at_once(command, tmp_path, capsys, examples, monkeypatch):
    import time

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fill = {"model": examples / "cpu_swish" / "model.py", "solution": examples / "cpu_swish" / "solution", "tmp": tmp_path}
    started = time.monotonic()
    assert main([part.format(**fill) for part in command] + ["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "--device cpu" in err, err
    assert time.monotonic() - started < 20  # no nvcc, no toolchain probe


def test_compile_backend_auto_picks_what_this_machine_and_candidate_need(capsys, examples, monkeypatch):
    import torch

    from cuda_agent.build import BuildResult
    from cuda_agent.cli import evaluation as cli

    used = []
    # The choice and what is said about it are tested here; the compilers in tests/build.
    monkeypatch.setattr(cli, "compile_only", lambda candidate, backend, **_: used.append(backend) or BuildResult(True, backend, "k"))
    # Where eval on this machine would build for the same backend, compile builds (and links) as it does.
    monkeypatch.setattr(cli, "build", lambda candidate, backend, **_: used.append(backend + "+link") or BuildResult(True, backend, "k"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu_solution, cuda_solution = examples / "cpu_swish" / "solution", examples / "cuda_gelu" / "solution"
    assert main(["compile", str(cpu_solution)]) == 0
    out = capsys.readouterr().out
    assert "ok [backend cpu: auto, no CUDA GPU" in out and "`eval` here reuses it" in out
    # CUDA sources need nvcc, not a GPU: auto compiles them for cuda anywhere, and so does --backend cuda.
    assert main(["compile", str(cuda_solution)]) == 0 and main(["compile", str(cpu_solution), "--backend", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "[backend cuda: auto, the candidate has .cu sources]" in out and "reuses" not in out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["compile", str(cpu_solution)]) == 0
    assert "[backend cuda: auto, a CUDA GPU is visible]" in capsys.readouterr().out
    assert used == ["cpu+link", "cuda", "cuda", "cuda+link"]


def test_task_commands_take_a_table_selector(tmp_path, capsys, examples):
    code = (examples / "cpu_swish" / "model.py").read_text()
    table = tmp_path / "kb.jsonl"
    table.write_text("".join(json.dumps({"level": 1, "problem_id": pid, "name": f"{pid}_Swish", "code": code}) + "\n"
                             for pid in (19, 20)))
    assert main(["tasks", f"{table}#1/19"]) == 0
    out = capsys.readouterr().out
    assert "level1/19_Swish" in out and "20_Swish" not in out
    assert main(["tasks", f"{table}#1/7"]) == 2
    assert "'1/7' matched 0 tasks" in capsys.readouterr().err


def test_binary_task_is_named_in_the_error(tmp_path, capsys):
    binary = tmp_path / "task.py"
    binary.write_bytes(b"\x00\x01\xfe binary")
    assert main(["tasks", str(binary)]) == 2
    err = capsys.readouterr().err
    assert f"{binary}: not UTF-8 text" in err and "UnicodeDecodeError" not in err


@pytest.mark.parametrize("task, candidate, reason", [
    ("{model}", "{tmp}/nope", "no such file or directory"),
    ("{tmp}/nope.py", "{solution}", "no such file or directory"),
    ("{tmp}/bad.py", "{solution}", "missing Model, get_inputs, get_init_inputs"),
])
def test_eval_json_prints_a_record_for_input_errors(task, candidate, reason, tmp_path, capsys, examples):
    (tmp_path / "bad.py").write_text("import torch\n")
    fill = {"model": examples / "cpu_swish" / "model.py", "solution": examples / "cpu_swish" / "solution", "tmp": tmp_path}
    task, candidate = task.format(**fill), candidate.format(**fill)
    assert main(["eval", task, candidate, "--device", "cpu", "--json"]) == 2
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert record["status"] == "error" and record["stage"] == "input" and reason in record["reason"]
    assert record["task"]["source"] == task and record["candidate"]["origin"] == candidate and record["reward"] is None
    assert reason in captured.err  # and the usual line on stderr


@pytest.mark.slow
def test_synth_on_the_cpu_without_kernelbench_runs_with_a_note(tmp_path, capsys, monkeypatch, cache_dir):
    # The README's first CPU example, with no KernelBench data anywhere.
    monkeypatch.setenv("KERNELBENCH_DATA", str(tmp_path / "nowhere"))
    monkeypatch.chdir(tmp_path)
    sandbox = "auto" if shutil.which("bwrap") else "none"
    code = main(["synth", "--n", "1", "--out", str(tmp_path / "out"), "--device", "cpu", "--quiet",
                 "--no-transformers", "--max-candidates", "30", "--sandbox", sandbox, "--cache-dir", str(cache_dir)])
    captured = capsys.readouterr()
    assert "NOT decontaminated against KernelBench" in captured.err and "--kernelbench" in captured.err
    assert code == 0 and "1 task accepted" in captured.out, captured.out + captured.err
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["identity"]["kernelbench"] is None


def test_optimize_fails_fast_when_the_model_server_is_down(tmp_path, capsys, examples):
    import socket
    import time

    pytest.importorskip("openai")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    code = main(["optimize", str(examples / "cpu_swish" / "model.py"), "--model", "m", "--device", "cpu",
                 "--base-url", f"http://127.0.0.1:{port}/v1", "--out", str(tmp_path / "out")])
    assert code == 2 and time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "cannot connect" in err and "is the server up" in err, err
    assert not (tmp_path / "out").exists()  # no episode started


@pytest.mark.slow
def test_optimize_exits_non_zero_when_every_episode_ends_on_a_backend_error(tmp_path, capsys, examples):
    pytest.importorskip("openai")
    from tests.openai_server import OpenAIServer

    with OpenAIServer(lambda request: (400, {"error": {"message": "model 'm' does not exist"}})) as server:
        code = main(["optimize", str(examples / "cpu_swish" / "model.py"), "--model", "m", "--device", "cpu",
                     "--base-url", server.url, "--out", str(tmp_path / "out"), "--quiet"])
    assert code == 1
    err = capsys.readouterr().err
    assert "every episode ended on a model backend error" in err and "model 'm' does not exist" in err, err


def test_timeout_bounds_the_stages_a_candidate_runs_in():
    from cuda_agent.cli import build_parser
    from cuda_agent.cli.common import _timeouts
    from cuda_agent.evaluate import Timeouts

    for command in (["eval", "t.py", "c/"], ["bench", "kb.jsonl", "--out", "r", "--solutions", "s"],
                    ["optimize", "t.py", "--model", "m"]):
        args = build_parser().parse_args(command + ["--timeout", "7"])
        assert _timeouts(args) == Timeouts(build_s=7, load_s=7, check_s=7, profile_s=7, baseline_s=Timeouts().baseline_s)
        assert _timeouts(build_parser().parse_args(command)) == Timeouts()
    assert _timeouts(build_parser().parse_args(["eval", "t.py", "c/", "--timeout", "900"])).check_s == Timeouts().check_s


@pytest.mark.slow
def test_eval_timeout_stops_a_hung_candidate(tmp_path, capsys, examples, cache_dir):
    import time

    root = tmp_path / "hang"
    shutil.copytree(examples / "cpu_swish" / "solution", root)
    forward = "    def forward(self, x: torch.Tensor) -> torch.Tensor:\n"
    code = (root / "model_new.py").read_text()
    assert forward in code
    (root / "model_new.py").write_text(code.replace(forward, forward + "        while True:\n            pass\n"))
    # --timeout bounds the builds too: built beforehand (the probe as well), so the check is what times out.
    warm = Evaluator("cpu", cache_dir=cache_dir)
    assert warm.build(load_candidate(root)).ok and warm.toolchain_imports()
    started = time.monotonic()
    code = main(["eval", str(examples / "cpu_swish" / "model.py"), str(root), "--device", "cpu", "--no-compile",
                 "--timeout", "15", "--cache-dir", str(cache_dir)])
    captured = capsys.readouterr()
    assert code == 1 and "no answer within 15 s" in captured.out, captured.out
    # The stages are shown as they go (the build, the reference, the checks), not only the verdict.
    assert " build " in captured.err and " reference " in captured.err and " verify " in captured.err, captured.err
    assert time.monotonic() - started < 240


def test_train_stages_on_verl_print_the_command_they_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "ppo", "--single-turn", "--engine", "verl", "--out", str(out), "--dry-run",
                 "--set", "trainer.nnodes=2"]) == 0
    command = capsys.readouterr().out.split()
    assert command[1:3] == ["-m", "verl.trainer.main_ppo"] and "ppo_single_turn" in command
    assert f"trainer.default_local_dir={out.resolve()}" in command and command[-1] == "trainer.nnodes=2"
    assert main(["train", "ppo", "--engine", "verl", "--out", str(out), "--dry-run"]) == 0
    assert "ppo_agentic" in capsys.readouterr().out
    assert main(["train", "rft", "--engine", "verl", "--out", str(out), "--dry-run"]) == 0
    assert "verl.trainer.sft_trainer" in capsys.readouterr().out
    assert main(["train", "value", "--engine", "verl", "--out", str(out), "--dry-run"]) == 2
    assert "has no verl stage" in capsys.readouterr().err
    assert main(["train", "rft", "--out", str(out)]) == 2  # our engine needs its config file
    assert "needs --config" in capsys.readouterr().err


def test_example_gives_eval_every_option_eval_reads(monkeypatch):
    """`cuda-agent example` (the README's quick start) builds eval's arguments itself: one eval gains
    must be there too (eval --remote once broke it)."""
    from cuda_agent.cli import build_parser, evaluation

    seen = {}
    monkeypatch.setattr(evaluation, "cmd_eval", lambda ns: seen.update(vars(ns)) or 0)
    assert main(["example", "--device", "cpu"]) == 0
    wanted = set(vars(build_parser().parse_args(["eval", "task.py", "candidate"]))) - {"func", "command"}
    assert wanted <= set(seen), wanted - set(seen)


def _parsers(parser, path=()):
    """Every (sub)command's parser with its command words."""
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                assert summaries.get(name), f"`{' '.join(path + (name,))}` has no summary line"
                yield from _parsers(sub, path + (name,))


def test_every_option_says_what_it_does_and_its_default():
    import argparse

    from cuda_agent.cli import build_parser

    missing, no_default = [], []
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = " ".join(path) + " " + (action.option_strings[0] if action.option_strings else action.dest)
            if not action.help:
                missing.append(name)
            # A value the user may leave out has a default, and the help says which.
            elif (action.option_strings and not action.required and action.nargs != 0
                  and "default" not in action.help.lower()):
                no_default.append(name)
    assert not missing, f"options without help: {missing}"
    assert not no_default, f"options whose help gives no default: {no_default}"


def test_task_references_are_spelled_one_way():
    from cuda_agent.cli import build_parser

    texts = [action.help or "" for _, parser in _parsers(build_parser()) for action in parser._actions]
    assert not [t for t in texts if "#ID" in t or "SOURCE#" in t], "TABLE#LEVEL/ID is the one spelling"
    assert any("TABLE#LEVEL/ID" in t for t in texts)


def test_example_lists_the_examples_and_offers_no_other(capsys):
    with pytest.raises(SystemExit):
        main(["example", "--help"])
    out = capsys.readouterr().out
    assert "cpu_swish" in out and "cuda_gelu" in out and "train" not in out.split("positional")[1].split("options")[0]
    with pytest.raises(SystemExit):
        main(["example", "train"])
    assert "invalid choice: 'train'" in capsys.readouterr().err


def test_compile_for_cuda_says_when_torch_is_a_cpu_build(capsys, examples, monkeypatch):
    import torch

    from cuda_agent.build import BuildResult
    from cuda_agent.cli import evaluation as cli

    missing = "torch/include/c10/cuda/CUDAMacros.h:9:10: error: c10/cuda/impl/cuda_cmake_macros.h: No such file"
    monkeypatch.setattr(cli, "compile_only", lambda *a, **k: BuildResult(False, "cuda", "k", error=missing))
    monkeypatch.setattr(torch.version, "cuda", None)
    assert main(["compile", str(examples / "cuda_gelu" / "solution"), "--backend", "cuda"]) == 1
    err = capsys.readouterr().err
    assert "is a CPU build without the CUDA headers" in err and "CUDA build of torch" in err and "--backend cpu" in err
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build: its errors are the candidate's own
    assert main(["compile", str(examples / "cuda_gelu" / "solution"), "--backend", "cuda"]) == 1
    assert "CPU build" not in capsys.readouterr().err


def test_synth_with_an_llm_composer_checks_the_endpoint_first(tmp_path, capsys):
    pytest.importorskip("openai")
    import time

    started = time.monotonic()
    code = main(["synth", "--n", "1", "--out", str(tmp_path / "out"), "--no-decontaminate", "--device", "cpu",
                 "--composer", "llm", "--model", "m", "--base-url", "http://127.0.0.1:9/v1"])
    err = capsys.readouterr().err
    assert code == 2 and "127.0.0.1:9" in err, err
    assert not (tmp_path / "out").exists()  # no candidate was screened
    assert time.monotonic() - started < 30  # one quick request, no retries per candidate


def test_train_stage_names_the_config_key_of_a_model_it_cannot_find(tmp_path, capsys, monkeypatch):
    pytest.importorskip("yaml")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    config = tmp_path / "stage1.yaml"
    config.write_text("stage: ppo\nmodel:\n  actor: someone/no-such-model\ntasks:\n  source: tasks.jsonl\n")
    (tmp_path / "tasks.jsonl").write_text("")
    out = tmp_path / "run"
    assert main(["train", "ppo", "--single-turn", "--config", str(config), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "model.actor someone/no-such-model" in err and "local model folder" in err and "hf download" in err
    assert not out.exists()  # no run was started (no config.json left behind)


def test_broken_pipe_ends_quietly(examples):
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    env = os.environ | {"PYTHONPATH": str(src)}
    # A reader that is gone before the first line is written (`| head -0`).
    read, write = os.pipe()
    os.close(read)
    proc = subprocess.run([sys.executable, "-m", "cuda_agent.cli", "tasks", str(examples / "cpu_swish" / "model.py")],
                          stdout=write, stderr=subprocess.PIPE, text=True, env=env)
    os.close(write)
    assert proc.returncode == 0 and "Broken pipe" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_compare_refuses_runs_whose_tasks_differ_in_code(tmp_path, capsys):
    def run(name, digest, status):
        folder = tmp_path / name
        folder.mkdir()
        task = {"name": "level1/1_Swish", "level": 1, "problem_id": 1}
        (folder / "run.json").write_text(json.dumps({"format": 1, "tasks": [task | {"digest": digest}]}))
        (folder / "results.jsonl").write_text(json.dumps({"task": task, "entry": "level1_1", "status": status}) + "\n")
        return str(folder)

    a, b, c = run("a", "d1", "correct"), run("b", "d2", "incorrect"), run("c", "d1", "incorrect")
    assert main(["compare", a, b]) == 2
    err = capsys.readouterr().err
    assert "different code for 1 task(s)" in err and "level1/1_Swish" in err and "--force" in err
    assert main(["compare", a, b, "--force"]) == 0
    assert "Warning" in capsys.readouterr().out
    assert main(["compare", a, c]) == 0  # the same code: compared, no warning
    assert "Warning" not in capsys.readouterr().out


@pytest.mark.slow
def test_out_of_memory_names_the_limit_and_the_flag(tmp_path, capsys, examples, cache_dir):
    task = tmp_path / "big.py"
    task.write_text("import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
                    "        return x * 2\n\n\ndef get_inputs():\n    return [torch.empty(2**31)]  # 8 GiB\n\n\n"
                    "def get_init_inputs():\n    return []\n")
    code = main(["eval", str(task), str(examples / "cpu_swish" / "solution"), "--device", "cpu", "--no-compile",
                 "--memory-limit", "2", "--cache-dir", str(cache_dir)])
    captured = capsys.readouterr()
    # Refused before the reference allocates anything: the task's size is taken on the meta device. No verdict on the
    # candidate (exit 3): the evaluation's own limit, not the kernel, stopped it.
    assert code == 3 and "needs at least 16.0 GiB" in captured.out, captured.out
    assert "more than the 2.0 GiB each evaluation process may use: raise it with --memory-limit GIB" in captured.out


def test_exit_statuses_tell_a_no_verdict_from_a_failure_and_help_says_so(capsys):
    from cuda_agent.cli import EXIT_NO_VERDICT, exit_status

    assert [exit_status(s) for s in ("correct", "incorrect", "failed", "error")] == [0, 1, 1, EXIT_NO_VERDICT]
    assert EXIT_NO_VERDICT not in (0, 1, 2, 130)
    for command in ("eval", "example", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "3 no verdict" in text or "3 some entries ended without a verdict" in text, command
        assert "--retries" in text


def test_eval_without_a_verdict_exits_3_with_what_to_do(capsys, examples, monkeypatch):
    """The evaluator's answer is scripted (the host busy while timing): exit 3, not a wrong kernel's 1, and one
    line saying what to do."""
    from cuda_agent.evaluate.result import EvalResult

    def undecided(self, task, candidate, build_result=None, *, timed=True):
        return EvalResult(task=task.to_dict(), candidate={}, device="cpu", policy={}, timing={}, status="error",
                          stage="profile", reward=None, attempts=3,
                          reason="the host was busy: evaluate again when the host is quieter")

    monkeypatch.setattr(Evaluator, "evaluate", undecided)
    code = main(["eval", str(examples / "cpu_swish" / "model.py"), str(examples / "cpu_swish" / "solution"),
                 "--device", "cpu", "--retries", "2"])
    captured = capsys.readouterr()
    assert code == 3
    assert "reward: none (no verdict)" in captured.out
    assert "no verdict after 3 attempts" in captured.err and "nothing is wrong with the kernel" in captured.err
    assert main(["eval", "x.py", "y", "--retries", "-1"]) == 2
