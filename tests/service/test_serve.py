"""The service on the real evaluator: ``cuda-agent serve --device cpu`` answering concurrent
``cuda-agent eval --remote`` runs, and the Ray backend (``cuda-agent[ray]``) with two CPU actors,
one of them killed in the middle of a job."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from cuda_agent import load_candidate, load_task
from cuda_agent.bench.run import read_results
from cuda_agent.cli import main
from cuda_agent.service import Job
from tests.bench.test_run import kernelbench_like

pytestmark = pytest.mark.slow


@pytest.fixture
def server(cache_dir):
    """A ``cuda-agent serve --device cpu --port 0`` process and its URL (read from its first line)."""
    proc = subprocess.Popen([sys.executable, "-m", "cuda_agent.cli", "serve", "--device", "cpu", "--port", "0",
                             "--cache-dir", str(cache_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "serving 1 cpu slot(s)" in line, line + proc.stderr.read()
    url = line.split(" on ")[1].split()[0]
    yield url
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_serve_answers_three_concurrent_remote_evals(server, examples):
    task, solution = examples / "cpu_swish" / "model.py", examples / "cpu_swish" / "solution"

    def remote_eval(_):
        return subprocess.run([sys.executable, "-m", "cuda_agent.cli", "eval", str(task), str(solution), "--remote",
                               server, "--json"], capture_output=True, text=True, timeout=900)

    with ThreadPoolExecutor(3) as pool:
        runs = list(pool.map(remote_eval, range(3)))
    records = [json.loads(run.stdout) for run in runs]
    assert [run.returncode for run in runs] == [0, 0, 0], [run.stderr[-2000:] for run in runs]
    assert all(r["status"] == "correct" and r["reward"] >= 1 for r in records)
    assert all(r["task"]["name"] == "cpu_swish" for r in records)
    with urllib.request.urlopen(server + "/stats") as response:
        stats = json.loads(response.read())
    assert stats["counts"]["done"] == 3 and stats["queue"] == 0 and stats["in_flight"] == 0


def test_bench_runs_on_the_service(server, examples, tmp_path, capsys):
    source, sols = kernelbench_like(tmp_path, examples)
    args = ["bench", str(source), "--solutions", str(sols), "--out", str(tmp_path / "run"), "--remote", server, "--quiet"]
    assert main(args) == 0
    assert "| L1 | 3 | 66.7% |" in capsys.readouterr().out
    rows = read_results(tmp_path / "run")
    assert sorted((r["entry"], r["status"]) for r in rows) == [
        ("level1_1", "correct"), ("level1_2/sample_0", "correct"), ("level1_2/sample_1", "incorrect"),
        ("level1_3", "failed")]
    with urllib.request.urlopen(server + "/stats") as response:
        assert json.loads(response.read())["counts"]["done"] == 3  # the entry that does not load never left here


def test_remote_refuses_options_the_service_decides(server, examples):
    run = subprocess.run([sys.executable, "-m", "cuda_agent.cli", "eval", str(examples / "cpu_swish" / "model.py"),
                          str(examples / "cpu_swish" / "solution"), "--remote", server, "--policy", "paper"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "evaluates under policy 'fair'" in run.stderr and "--policy paper" in run.stderr


def test_ray_service_loses_and_duplicates_nothing_when_an_actor_dies(cache_dir, examples):
    ray = pytest.importorskip("ray", reason="the Ray backend needs cuda-agent[ray] (pip install 'cuda-agent[ray]')")
    from cuda_agent.service import ray_service

    task = load_task(examples / "cpu_swish" / "model.py")
    candidate = load_candidate(examples / "cpu_swish" / "solution")
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
    try:
        service = ray_service("local", "cpu", slots=2, cache_dir=cache_dir)
        try:
            # Verify-only evaluations: the scheduling is what is under test, and timed CPU evaluations on
            # two cores would take minutes. Six: the victim's job, the other slot's, and four still queued
            # when the actor dies, for the replacement and the survivor to share; more only repeat them.
            jobs = [Job("evaluate", task, candidate, timed=False) for _ in range(6)]
            futures = [service.submit(job) for job in jobs]
            deadline = time.monotonic() + 300
            while not service.stats()["slots"][0]["busy"] and time.monotonic() < deadline:
                time.sleep(0.1)
            victim = service._slots[0].slot
            time.sleep(1.0)  # into the job: its actor is loading or checking the candidate
            ray.kill(victim.actor, no_restart=True)
            replies = [future.result(900) for future in futures]
            stats = service.stats()
        finally:
            service.close()
    finally:
        ray.shutdown()
    assert [r.id for r in replies] == [j.id for j in jobs]
    failed = [(r.kind, r.error) for r in replies if not r.ok]
    assert not failed
    assert all(r.result["status"] == "correct" for r in replies), [r.result["reason"] for r in replies]
    assert stats["counts"]["done"] == len(jobs) and stats["counts"]["retried"] >= 1
    assert sum(r.attempts for r in replies) == len(jobs) + stats["counts"]["retried"]
    assert stats["slots"][0]["lost"] == 1
