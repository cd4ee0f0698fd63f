import json
import shutil

import pytest

from cuda_agent import Evaluator, load_candidate
from cuda_agent.cli import main


def test_tasks_lists_and_rejects(tmp_path, capsys, examples):
    assert main(["tasks", str(examples / "cpu_swish" / "model.py")]) == 0
    assert "cpu_swish" in capsys.readouterr().out
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

    from cuda_agent import cli
    from cuda_agent.build import BuildResult

    used = []
    # The choice and what is said about it are tested here; the compilers in tests/build.
    monkeypatch.setattr(cli, "compile_only", lambda candidate, backend, **_: used.append(backend) or BuildResult(True, backend, "k"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu_solution, cuda_solution = examples / "cpu_swish" / "solution", examples / "cuda_gelu" / "solution"
    assert main(["compile", str(cpu_solution)]) == 0
    assert "ok [backend cpu: auto, no CUDA GPU" in capsys.readouterr().out
    # CUDA sources need nvcc, not a GPU: auto compiles them for cuda anywhere, and so does --backend cuda.
    assert main(["compile", str(cuda_solution)]) == 0 and main(["compile", str(cpu_solution), "--backend", "cuda"]) == 0
    assert "[backend cuda: auto, the candidate has .cu sources]" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["compile", str(cpu_solution)]) == 0
    assert "[backend cuda: auto, a CUDA GPU is visible]" in capsys.readouterr().out
    assert used == ["cpu", "cuda", "cuda", "cuda"]


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
def test_synth_on_the_cpu_without_kernelbench_runs_with_a_note(tmp_path, capsys, monkeypatch):
    # The README's first CPU example, with no KernelBench data anywhere.
    monkeypatch.setenv("KERNELBENCH_DATA", str(tmp_path / "nowhere"))
    monkeypatch.chdir(tmp_path)
    sandbox = "auto" if shutil.which("bwrap") else "none"
    code = main(["synth", "--n", "1", "--out", str(tmp_path / "out"), "--device", "cpu", "--quiet",
                 "--no-transformers", "--max-candidates", "30", "--sandbox", sandbox])
    captured = capsys.readouterr()
    assert "NOT decontaminated against KernelBench" in captured.err and "--kernelbench" in captured.err
    assert code == 0 and "1 tasks accepted" in captured.out, captured.out + captured.err
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
def test_optimize_exits_non_zero_when_every_episode_ends_on_a_backend_error(tmp_path, capsys, examples, cache_dir,
                                                                           monkeypatch):
    pytest.importorskip("openai")
    from tests.openai_server import OpenAIServer

    monkeypatch.setenv("CUDA_AGENT_CACHE", str(cache_dir))
    with OpenAIServer(lambda request: (400, {"error": {"message": "model 'm' does not exist"}})) as server:
        code = main(["optimize", str(examples / "cpu_swish" / "model.py"), "--model", "m", "--device", "cpu",
                     "--base-url", server.url, "--out", str(tmp_path / "out"), "--quiet"])
    assert code == 1
    err = capsys.readouterr().err
    assert "every episode ended on a model backend error" in err and "model 'm' does not exist" in err, err


def test_timeout_bounds_the_stages_a_candidate_runs_in():
    from cuda_agent.cli import _timeouts, build_parser
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
    import cuda_agent.cli as cli

    seen = {}
    monkeypatch.setattr(cli, "cmd_eval", lambda ns: seen.update(vars(ns)) or 0)
    assert main(["example", "--device", "cpu"]) == 0
    wanted = set(vars(cli.build_parser().parse_args(["eval", "task.py", "candidate"]))) - {"func", "command"}
    assert wanted <= set(seen), wanted - set(seen)
