from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
KERNELBENCH = Path(os.environ.get("KERNELBENCH_DATA", ROOT.parent / "shared" / "data" / "kernelbench"))
# Markers that keep a test out of the fast tier: it needs a GPU, takes long, or starts evaluation processes.
NOT_FAST = ("gpu", "slow", "evaluates")
# The processes of an evaluation (the candidate's and the reference's) and of a synth screening.
EVALUATION_PROCESSES = ("cuda_agent.evaluate.worker.loop", "cuda_agent.synth.screen")


def pytest_collection_modifyitems(config, items):
    """The fast tier (``pytest -m fast``, CI's first step): every test that is not gpu, slow or evaluates."""
    for item in items:
        if not any(item.get_closest_marker(name) for name in NOT_FAST):
            item.add_marker(pytest.mark.fast)


@pytest.fixture(autouse=True)
def fast_tests_start_no_evaluation(request, monkeypatch):
    """A fast test that starts an evaluation (or screening) process fails, saying how to mark it: what the tier
    promises holds as tests are added, not by a list kept by hand."""
    if request.node.get_closest_marker("fast") is None:
        yield
        return
    from cuda_agent.sandbox.process import WorkerProcess

    started: list[str] = []
    start = WorkerProcess.__post_init__

    def refuse(self) -> None:
        if not any(str(part) in EVALUATION_PROCESSES for part in self.argv):
            return start(self)  # a worker of the sandbox's own tests
        started.append(" ".join(map(str, self.argv[1:6])))
        raise RuntimeError("the fast tier starts no evaluation process")

    monkeypatch.setattr(WorkerProcess, "__post_init__", refuse)
    yield
    if started:
        pytest.fail(f"this test starts evaluation processes ({started[0]}), which the fast tier (-m fast) does not: "
                    "mark it @pytest.mark.evaluates (or slow)", pytrace=False)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One build/baseline cache for the whole run: what one test built, the next reuses."""
    explicit = os.environ.get("CUDA_AGENT_TEST_CACHE")
    return Path(explicit) if explicit else tmp_path_factory.mktemp("cuda-agent-cache")


@pytest.fixture(scope="session", autouse=True)
def one_cache_for_the_run(cache_dir):
    """Every test, and every command a test starts, builds and times into the run's cache unless it names
    its own: nothing lands in the user's ~/.cache, and what one test compiled (the glue's 500 MB
    precompiled header takes 30 s on CI's 2 cores) the next reuses, as it would on a user's machine."""
    previous = os.environ.get("CUDA_AGENT_CACHE")
    os.environ["CUDA_AGENT_CACHE"] = str(cache_dir)
    yield
    if previous is None:
        os.environ.pop("CUDA_AGENT_CACHE", None)
    else:
        os.environ["CUDA_AGENT_CACHE"] = previous


@pytest.fixture(scope="session")
def examples() -> Path:
    return EXAMPLES


@pytest.fixture(scope="session")
def kernelbench_jsonl() -> Path:
    path = KERNELBENCH / "kernelbench.jsonl"
    if not path.exists():
        pytest.skip(f"KernelBench data not found at {path}")
    return path
