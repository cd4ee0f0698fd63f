"""A Triton episode on the CPU backend: the Triton workspace and skill, and a scripted policy (a test double)
that writes a Triton model_new.py, compiles (the static checks), verifies and profiles it through Triton's
interpreter; the final evaluation rewards it."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from cuda_agent.agent.llm import OpenAIChat
from cuda_agent.agent.loop import AgentConfig, run_episode
from cuda_agent.agent.session import TRITON_SYSTEM_PROMPT
from cuda_agent.agent.workspace import TRITON_PROTECTED, create_workspace, workspace_candidate
from cuda_agent.candidates import CandidateError
from cuda_agent.evaluate.evaluator import Evaluator
from cuda_agent.evaluate.protocol.policy import Policy
from cuda_agent.evaluate.retry import RetryPolicy
from cuda_agent.tasks import load_task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from openai_server import OpenAIServer  # noqa: E402
from scripted_policy import COMMANDS, scripted, write_solution  # noqa: E402

SANDBOX = "auto" if shutil.which("bwrap") else "none"


def test_the_triton_workspace_holds_model_new_alone_and_its_skill(tmp_path, examples):
    task = load_task(examples / "triton_swish" / "model.py")
    ws = create_workspace(tmp_path / "ws", task, Policy(), "cpu", language="triton")
    names = sorted(p.relative_to(ws.root).as_posix() for p in ws.root.rglob("*") if p.is_file())
    assert names == ["SKILL.md", "model.py", "model_new.py", "utils/compile.py", "utils/profile.py",
                     "utils/verify.py"]
    skill = (ws.root / "SKILL.md").read_text()
    assert "@triton.jit" in skill and "Triton's interpreter" in skill and "REGISTER_BINDING" not in skill
    assert ws.protected == TRITON_PROTECTED
    with pytest.raises(CandidateError, match="no `class ModelNew`|NotImplementedError|ModelNew") as caught:
        (ws.root / "model_new.py").write_text("import triton\n")
        workspace_candidate(ws.root, "triton")
    assert "\n" not in str(caught.value)
    with pytest.raises(CandidateError, match="unknown candidate language"):
        create_workspace(tmp_path / "other", task, Policy(), "cpu", language="cobol")


pytest.importorskip("triton")


@pytest.mark.slow
def test_a_scripted_triton_episode_writes_verifies_and_is_evaluated(tmp_path, examples, cache_dir):
    task = load_task(examples / "triton_swish" / "model.py")
    # One try at timing: the final evaluation's verdict or, on a busy host, none; the profile is left to the
    # final evaluation (the CUDA episode's test runs utils/profile.py).
    evaluator = Evaluator("cpu", cache_dir=cache_dir, sandbox=SANDBOX, time_compile=False,
                          retry=RetryPolicy(attempts=1))
    steps = [[("read", {"path": "SKILL.md"})], write_solution(examples / "triton_swish" / "solution"), *COMMANDS[:2],
             "ModelNew launches a fused scaled swish Triton kernel; verified."]
    with OpenAIServer(scripted(steps)) as server:
        episode = run_episode(task, OpenAIChat("scripted", base_url=server.url), evaluator, tmp_path / "ep",
                              config=AgentConfig(language="triton"), model="scripted", sandbox=SANDBOX)
    record = episode.record
    assert record["messages"][0]["content"] == TRITON_SYSTEM_PROMPT
    tool_results = {m["tool_call_id"]: m["content"] for m in record["messages"] if m["role"] == "tool"}
    calls = [c for t in record["turns"] for c in t["tool_calls"]]
    assert "compile: ok" in tool_results[calls[2]["id"]]
    assert "verify: correct" in tool_results[calls[3]["id"]], tool_results[calls[3]["id"]]
    assert [e["command"] for e in record["evaluations"]] == ["verify"]
    assert record["evaluations"][0]["status"] == "correct"
    # The final evaluation times the interpreter on a busy 2-core host: a verdict or, when the host was too busy
    # to time, none (never a failure). Either way the candidate is a Triton one.
    assert episode.final["status"] in ("correct", "error"), episode.final.get("reason")
    assert episode.final["candidate"]["language"] == "triton"
    if episode.final["status"] == "correct":
        assert episode.reward >= 1
    assert "model_new.py" in episode.best.files
