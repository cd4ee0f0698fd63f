"""Ctrl-C (SIGINT) mid-run: the command stops at once, kills what it started, keeps what finished, says so
in one line and exits 130 without a traceback."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cuda_agent.sandbox.proctree import descendants

SRC = Path(__file__).resolve().parents[1] / "src"


def interrupt_midway(argv: list[str], cwd: Path, ready=lambda children, err: len(children) > 0,
                     limit_s: float = 240.0) -> tuple[int, str, float, list[int]]:
    """Run ``cuda-agent argv`` until ``ready(children, stderr so far)``, send SIGINT; its exit status,
    stderr, the seconds it took to exit after the signal and the processes it had started then."""
    # A temporary directory of its own: what the command leaves there is what an interruption left behind.
    (cwd / "tmp").mkdir(exist_ok=True)
    env = os.environ | {"PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "TMPDIR": str(cwd / "tmp")}
    err_path = cwd / "stderr.txt"
    with err_path.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "cuda_agent.cli", *argv], cwd=cwd, env=env,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        started = time.monotonic()
        while True:
            children = descendants(proc.pid)[1:]
            if ready(children, err_path.read_text()):
                break
            assert proc.poll() is None, f"ended before it was interrupted: {err_path.read_text()}"
            assert time.monotonic() - started < limit_s, err_path.read_text()
            time.sleep(0.2)
        children = descendants(proc.pid)[1:]
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        return code, err_path.read_text(), time.monotonic() - sent, children
    finally:
        if proc.poll() is None:
            proc.kill()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def assert_stopped(code: int, err: str, seconds: float, children: list[int], out: Path) -> None:
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = [line for line in err.splitlines() if "stopped by SIGINT" in line]
    assert len(lines) == 1 and str(out) in lines[0] and "run the same command again" in lines[0], err
    # 2 s on an idle machine; the bound is generous for a loaded 2-core CI host.
    assert seconds < 15, f"{seconds:.1f} s to stop"
    time.sleep(0.5)
    assert not [pid for pid in children if alive(pid)], "processes it started outlived it"
    left = sorted(p.name for p in (out.parent / "tmp").glob("cuda-agent-*")) if (out.parent / "tmp").is_dir() else []
    assert not [name for name in left if name.startswith(("cuda-agent-job-", "cuda-agent-ref-", "cuda-agent-synth-"))], left


@pytest.mark.slow
def test_ctrl_c_stops_eval_and_leaves_no_scratch(tmp_path, examples, cache_dir):
    out = tmp_path / "out"  # eval keeps nothing: the line says so; its parent holds the temporary directory
    out.mkdir()
    code, err, seconds, children = interrupt_midway(
        ["eval", str(examples / "cpu_swish" / "model.py"), str(examples / "cpu_swish" / "solution"), "--device", "cpu",
         "--cache-dir", str(cache_dir)], tmp_path, ready=lambda children, err: "reference" in err or "load" in err)
    assert code == 130 and "Traceback" not in err, err
    time.sleep(0.5)
    left = [p.name for p in (tmp_path / "tmp").glob("cuda-agent-*") if p.name.startswith(("cuda-agent-job-",
                                                                                          "cuda-agent-ref-"))]
    assert not left, left


@pytest.mark.slow
def test_ctrl_c_stops_bench(tmp_path, examples, cache_dir):
    code = (examples / "cpu_swish" / "model.py").read_text()
    table = tmp_path / "kb.jsonl"
    table.write_text("".join(json.dumps({"level": 1, "problem_id": i, "name": f"{i}_Swish", "code": code}) + "\n"
                             for i in (1, 2, 3)))
    for i in (1, 2, 3):
        shutil.copytree(examples / "cpu_swish" / "solution", tmp_path / "solutions" / f"level1_{i}")
    out = tmp_path / "run"
    result = interrupt_midway(["bench", str(table), "--solutions", str(tmp_path / "solutions"), "--out", str(out),
                               "--device", "cpu", "--cache-dir", str(cache_dir)], tmp_path)
    assert_stopped(*result, out)
    # Nothing the interruption killed is recorded as the solution's failure or the harness's error.
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()] \
        if (out / "results.jsonl").exists() else []
    assert all(row["status"] == "correct" for row in rows), [row["reason"] for row in rows]


@pytest.mark.slow
def test_ctrl_c_stops_synth(tmp_path):
    out = tmp_path / "synth"
    sandbox = "auto" if shutil.which("bwrap") else "none"
    result = interrupt_midway(["synth", "--n", "5", "--out", str(out), "--device", "cpu", "--no-decontaminate",
                               "--no-transformers", "--sandbox", sandbox], tmp_path)
    assert_stopped(*result, out)


@pytest.mark.slow
def test_ctrl_c_stops_train_demo(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "demo"
    result = interrupt_midway(["train", "demo", "--device", "cpu", "--out", str(out), "--steps", "3"], tmp_path,
                              ready=lambda children, err: children and "evaluating the" in err)
    assert_stopped(*result, out)
    # The candidates evaluated before the signal stay evaluated: none is recorded as failed by it.
    menu = json.loads((out / "menu.json").read_text()) if (out / "menu.json").exists() else {}
    assert all(entry["status"] != "error" for entry in menu.values()), menu
