"""Per-job cgroup v2 limits on a real cgroup hierarchy.

They run where an operator delegated a cgroup to the evaluator through
``$CUDA_AGENT_CGROUP`` (the GPU machine's session script does; docs/SANDBOX.md
says how) and skip elsewhere. The fake-directory test in test_bwrap.py covers
the settings written on machines without one.
"""

import os
import sys
from pathlib import Path

import pytest

from cuda_agent.sandbox import BwrapSandbox, Limits, SandboxUnavailable, run_command
from cuda_agent.sandbox.bwrap import CGROUP_ENV

PY = sys.executable


def test_named_cgroup_that_is_not_one_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv(CGROUP_ENV, str(tmp_path))
    try:
        sandbox = BwrapSandbox()
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    assert not sandbox.cgroups_available
    assert CGROUP_ENV in sandbox.cgroup_note and "not a cgroup v2 directory" in sandbox.cgroup_note


@pytest.fixture(scope="module")
def delegated():
    if not os.environ.get(CGROUP_ENV):
        pytest.skip(f"no delegated cgroup: set ${CGROUP_ENV} (see docs/SANDBOX.md)")
    sandbox = BwrapSandbox()
    assert sandbox.cgroups_available, sandbox.cgroup_note
    return sandbox


def test_memory_limit_kills_the_job_and_the_next_one_runs(delegated, tmp_path):
    hog = "b = bytearray(768 * 1024 * 1024)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('survived')"
    result = run_command([PY, "-c", hog], cwd=tmp_path, sandbox=delegated,
                         limits=Limits(timeout_s=60, memory_bytes=256 * 1024 * 1024))
    assert not result.ok and "survived" not in result.output
    fine = run_command([PY, "-c", "print('fine')"], cwd=tmp_path, sandbox=delegated, limits=Limits(timeout_s=60))
    assert fine.ok and "fine" in fine.output


def test_pid_limit_stops_a_fork_bomb(tmp_path):
    if not os.environ.get(CGROUP_ENV):
        pytest.skip(f"no delegated cgroup: set ${CGROUP_ENV} (see docs/SANDBOX.md)")
    sandbox = BwrapSandbox(max_pids=32)
    bomb = ("import os\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n            import time; time.sleep(5); os._exit(0)\n"
            "        n += 1\nexcept OSError as e:\n    print('refused after', n, e.errno)\n")
    result = run_command([PY, "-c", bomb], cwd=tmp_path, sandbox=sandbox, limits=Limits(timeout_s=60))
    assert "refused after" in result.output, result.output
    assert int(result.output.split("refused after")[1].split()[0]) < 32


def job_cgroups() -> set[str]:
    return {p.name for p in Path(os.environ[CGROUP_ENV]).iterdir() if p.is_dir() and p.name.startswith("cuda-agent-")}


def test_concurrent_jobs_get_their_own_cgroups_and_none_are_left_behind(delegated, tmp_path):
    """Spawns from several threads (the builder compiles in a pool): a spawn's cleanup
    must not remove another job's cgroup before its process is in it."""
    from concurrent.futures import ThreadPoolExecutor

    before = job_cgroups()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: run_command([PY, "-c", f"print({i})"], cwd=tmp_path, sandbox=delegated,
                                                      limits=Limits(timeout_s=60, memory_bytes=1 << 30)), range(24)))
    assert all(r.ok for r in results), [r.output for r in results if not r.ok]
    delegated.cleanup()
    assert job_cgroups() - before == set()


@pytest.mark.gpu
def test_cuda_starts_under_a_memory_limit(delegated, tmp_path):
    """The reason for cgroups over RLIMIT_AS: CUDA reserves far more address space than it uses."""
    code = "import torch\nx = torch.ones(1 << 20, device='cuda')\nprint('sum', int(x.sum().item()))"
    result = run_command([PY, "-c", code], cwd=tmp_path, sandbox=delegated, gpu=True,
                         limits=Limits(timeout_s=120, memory_bytes=4 * 1024**3))
    assert result.ok and "sum 1048576" in result.output, result.output
