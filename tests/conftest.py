from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
KERNELBENCH = Path(os.environ.get("KERNELBENCH_DATA", ROOT.parent / "shared" / "data" / "kernelbench"))


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
