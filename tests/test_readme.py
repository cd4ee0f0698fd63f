"""The README, proven: every command in its ```bash blocks that is not marked as needing more than a CPU
machine (``[gpu]``, ``[cuda]``, ``[server]``, ``[yours]``, ``[install]``, ``[long]``) runs as written, in a
fresh directory laid out like the repository's root, and what the README says beside it is checked."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKS = ("[gpu]", "[cuda]", "[server]", "[yours]", "[install]", "[long]")


def readme_commands() -> list[str]:
    """The commands of the README's bash blocks, continuation lines joined, in order."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if command.strip() and not command.lstrip().startswith("#"):
                commands.append(command.strip())
    return commands


def runnable() -> list[str]:
    """The commands whose comment (after `` # ``) carries none of the marks."""
    return [c for c in readme_commands() if not any(mark in (re.split(r"\s#\s", c, 1) + [""])[1] for mark in MARKS)]


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def check_demo(out: str, err: str, cwd: Path) -> None:
    first, last = map(float, re.search(r"mean reward ([-+.\d]+) at step 1, ([-+.\d]+) at step 40", out).groups())
    menu = json.loads((cwd / "runs" / "demo" / "menu.json").read_text())
    fast, slow = menu["fast"]["reward"], menu["slow"]["reward"]
    assert menu["wrong"]["reward"] == menu["torch"]["reward"] == -1
    assert fast > 2 * slow > 0, menu  # slow does four times fast's work
    assert first < 0 and last >= fast - 0.5, (first, last, fast)  # from chance to near fast's reward
    for name in ("metrics.jsonl", "curves.png", "rewards.png"):
        assert (cwd / "runs" / "demo" / name).stat().st_size > 0, name


def check_synth(out: str, err: str, cwd: Path) -> None:
    assert "2 tasks accepted" in out, out
    assert len((cwd / "synth-cpu" / "tasks.jsonl").read_text().splitlines()) == 2


# What the README says beside each command, checked on its output (stdout, stderr, the directory).
CLAIMS = {
    "cuda-agent example": lambda out, err, cwd: "status: correct" in out,
    "--policy strict --json": lambda out, err, cwd: (json.loads(out)["status"], json.loads(out)["policy"]["name"])
    == ("correct", "strict"),
    "cuda-agent eval examples/cpu_swish/model.py examples/cpu_swish/solution  ": lambda out, err, cwd:
        "status: correct" in out,
    "cuda-agent compile examples/cpu_swish/solution": lambda out, err, cwd:
        _last_line(out).startswith("ok") and "eval` here reuses it" in out,
    "cuda-agent compile examples/triton_swish/solution": lambda out, err, cwd: _last_line(out).startswith("ok:"),
    "kernelbench.jsonl --level 1": lambda out, err, cwd: _last_line(err) == "100 tasks",
    "cuda-agent synth --n 2": check_synth,
    "cuda-agent tasks synth-cpu/": lambda out, err, cwd: _last_line(err) == "2 tasks",
    "cuda-agent catalog": lambda out, err, cwd: "usable" in out,
    "--dry-run": lambda out, err, cwd: "verl.trainer.main_ppo" in out,
    "cuda-agent train demo": check_demo,
}


def test_readme_marks_what_it_does_not_run():
    commands = readme_commands()
    assert len(runnable()) >= 8 and len(commands) > len(runnable())
    # Every command CI runs has its claim checked here (a new README command needs an entry).
    unchecked = [c for c in runnable() if not any(key in c for key in CLAIMS)]
    assert not unchecked, unchecked


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A fresh directory laid out as the README assumes: the repository root (its examples) with
    ../shared/data/kernelbench beside it where this checkout has one."""
    base = tmp_path_factory.mktemp("readme")
    root = base / "repo"
    root.mkdir()
    (root / "examples").symlink_to(ROOT / "examples")
    shared = ROOT.parent / "shared"
    if (shared / "data" / "kernelbench" / "kernelbench.jsonl").exists():
        (base / "shared").symlink_to(shared)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("command", runnable())
def test_readme_command_runs_as_written(command, workdir, cache_dir):
    if shutil.which("cuda-agent") is None:
        pytest.skip("the cuda-agent command is not installed (pip install -e .)")
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed: the README's quick start installs it")
    if "../shared/" in command and not (workdir.parent / "shared").exists():
        pytest.skip("no KernelBench data at ../shared/data/kernelbench")
    env = os.environ | {
        # The builds and baselines of the rest of the test run are reused (the README's first build is slow).
        "CUDA_AGENT_CACHE": str(cache_dir),
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    proc = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for key, check in CLAIMS.items():
        if key in command:
            assert check(proc.stdout, proc.stderr, workdir) is not False, f"{command}\n{proc.stdout[-3000:]}"
