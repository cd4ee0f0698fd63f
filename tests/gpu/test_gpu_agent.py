"""An agent episode on the GPU: the scripted policy writes the row-softmax CUDA solution through the
tools, compiles, verifies and profiles it with the workspace commands, and ends with reward 3."""

import sys
from pathlib import Path

import pytest

from cuda_agent.agent.llm import OpenAIChat
from cuda_agent.agent.loop import run_episode
from cuda_agent.agent.trajectory import render_html, render_text
from cuda_agent.evaluate.evaluator import Evaluator
from cuda_agent.tasks import load_task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from openai_server import OpenAIServer  # noqa: E402
from scripted_policy import COMMANDS, scripted, write_solution  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("openai", reason="the agent's model backend is the [llm] extra")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cuda_row_softmax"


def test_episode_writes_a_cuda_solution_with_reward_3(tmp_path, cache_dir):
    task = load_task(EXAMPLE / "model.py")
    steps = [[("read", {"path": "model.py"}), ("bash", {"command": "nvidia-smi -L; nvcc --version | tail -1"})],
             write_solution(EXAMPLE / "solution"), *COMMANDS, "done: fused row softmax"]
    with OpenAIServer(scripted(steps)) as server:
        episode = run_episode(task, OpenAIChat("scripted", base_url=server.url), Evaluator("cuda", cache_dir=cache_dir),
                              tmp_path / "ep", model="scripted")
    record = episode.record
    print("\n" + render_text(record, width=600))
    observations = [m["content"] for m in record["messages"] if m["role"] == "tool"]
    assert "GPU 0" in observations[1]  # the sandboxed shell sees the GPU
    assert episode.end_reason == "done"
    assert [e["status"] for e in record["evaluations"]] == ["correct", "correct"]
    assert episode.final["status"] == "correct" and episode.final["device"] == "cuda"
    assert episode.reward == 3.0, episode.final.get("speedup_compile")
    assert any(name.endswith(".cu") for name in episode.best.files)
    (tmp_path / "trajectory.html").write_text(render_html(record))
