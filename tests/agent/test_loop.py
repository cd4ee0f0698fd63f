"""Whole episodes on the CPU backend: a scripted policy (a test double replaying tool calls) served by a
local OpenAI-protocol server, the real tools, sandbox and evaluation core."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from cuda_agent.agent.llm import OpenAIChat
from cuda_agent.agent.loop import AgentConfig, fit_to_budget, run_episode
from cuda_agent.agent.trajectory import read_trajectories, render_html, render_text
from cuda_agent.agent.workspace import PROTECTED, create_workspace
from cuda_agent.cli import main
from cuda_agent.evaluate.evaluator import Evaluator
from cuda_agent.evaluate.protocol.policy import Policy
from cuda_agent.tasks import load_task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from openai_server import OpenAIServer  # noqa: E402
from scripted_policy import COMMANDS, by_turn, call, scripted, write_solution  # noqa: E402

SANDBOX = "auto" if shutil.which("bwrap") else "none"


def solution_steps(examples: Path) -> list:
    sol = examples / "cpu_swish" / "solution"
    return [
        [("read", {"path": "SKILL.md"}), ("read", {"path": "model.py"})],
        # Hostile and malformed calls: each gets an error and the episode goes on.
        [("write", {"path": "model.py", "content": "class Model: pass"}),
         ("read", {"path": "../../../../etc/passwd"}),
         ("bash", "{not json"),
         ("launch_missiles", {}),
         ("edit", {"path": "model_new.py"})],
        [("bash", {"command": "echo hacked > utils/profile.py"})],
        write_solution(sol),
        *COMMANDS,
        "ModelNew calls the fused scaled swish kernel; verified and profiled.",
    ]


@pytest.mark.slow
def test_episode_writes_compiles_verifies_profiles_and_is_rewarded(tmp_path, examples, cache_dir):
    task = load_task(examples / "cpu_swish" / "model.py")
    evaluator = Evaluator("cpu", cache_dir=cache_dir, sandbox=SANDBOX, time_compile=False)
    with OpenAIServer(scripted(solution_steps(examples))) as server:
        backend = OpenAIChat("scripted", base_url=server.url)
        episode = run_episode(task, backend, evaluator, tmp_path / "ep", model="scripted", sandbox=SANDBOX)
    record = episode.record
    assert episode.end_reason == "done" and len(record["turns"]) == 8
    # The final trusted evaluation, and the best one seen on the way.
    assert episode.final["status"] == "correct" and episode.reward >= 1
    assert episode.best is not None and episode.best_reward >= 1 and "kernels/scaled_swish.cpp" in episode.best.files
    assert [e["command"] for e in record["evaluations"]] == ["verify", "profile"]
    assert all(e["status"] == "correct" for e in record["evaluations"])

    calls = [c for t in record["turns"] for c in t["tool_calls"]]
    errors = {c["name"]: c["error"] for c in calls[2:7]}
    assert errors == {"write": True, "read": True, "bash": True, "launch_missiles": True, "edit": True}
    observations = [m["content"] for m in record["messages"] if m["role"] == "tool"]
    assert "protected" in observations[2] and "JSON" in observations[4] and "launch_missiles" in observations[5]
    # The shell cannot touch the protected commands either; they still work afterwards.
    assert calls[7]["metadata"].get("exit_code") != 0
    assert "hacked" not in (tmp_path / "ep" / "workspace" / "utils" / "profile.py").read_text()
    tool_results = {m["tool_call_id"]: m["content"] for m in record["messages"] if m["role"] == "tool"}
    assert "compile: ok" in tool_results[calls[11]["id"]]
    assert "verify: correct" in tool_results[calls[12]["id"]]
    assert "speedup:" in tool_results[calls[13]["id"]] or "reward:" in tool_results[calls[13]["id"]]
    # The profile ends with the counters' report: on the CPU it says what there is (times only), and the
    # trajectory keeps it structured.
    assert "counters: not available: the CPU backend reports times only" in tool_results[calls[13]["id"]]
    counters = record["evaluations"][1]["result"]["counters"]
    assert counters["available"] is False and "candidate" in counters["times_ms"]
    assert (tmp_path / "ep" / "workspace" / "model.py").read_text() == task.code

    # The requests carried the tools and the skill; usage was counted; the record renders.
    first = server.requests[0]
    assert {t["function"]["name"] for t in first["tools"]} >= {"bash", "read", "write", "edit", "multi_edit", "glob",
                                                                "grep", "todo_write"}
    assert "SKILL" in first["messages"][1]["content"] or "ModelNew" in first["messages"][1]["content"]
    assert record["usage"]["prompt_tokens"] > 0
    text = render_text(record)
    assert "final: correct" in text and ">>> write(" in text
    page = render_html(record)
    assert page.startswith("<!doctype html>") and "<script" not in page


def test_context_budget_keeps_system_task_and_the_latest_turns():
    messages = [{"role": "system", "content": "s" * 400}, {"role": "user", "content": "t" * 400}]
    for i in range(10):
        messages.append({"role": "assistant", "content": None, "tool_calls": [call("bash", {"command": str(i)}, i)]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"turn {i} " + "x" * 380})
    kept, dropped = fit_to_budget(messages, budget_tokens=700, chars_per_token=4.0)
    assert kept[:2] == messages[:2] and dropped > 0
    assert "dropped" in kept[2]["content"]
    assert kept[-1] == messages[-1] and kept[-2] == messages[-2]  # whole turns: no tool result without its call
    assert all(kept[i]["role"] == "assistant" for i in range(3, len(kept), 2))
    everything, none = fit_to_budget(messages, budget_tokens=10**6, chars_per_token=4.0)
    assert everything == messages and none == 0


@pytest.mark.slow
def test_a_small_context_budget_truncates_the_requests(tmp_path, examples, cache_dir):
    task = load_task(examples / "cpu_swish" / "model.py")
    evaluator = Evaluator("cpu", cache_dir=cache_dir, sandbox=SANDBOX, time_compile=False)
    # The test server counts a token per word: observations of 1500 words each.
    steps = [[("bash", {"command": f"echo {'word ' * 1500} {i}"})] for i in range(6)] + ["stop"]
    budget = 4000  # tokens: the skill and the task fit, with about two of those turns
    with OpenAIServer(scripted(steps)) as server:
        episode = run_episode(task, OpenAIChat("scripted", base_url=server.url), evaluator, tmp_path / "ep",
                              config=AgentConfig(context_tokens=budget), sandbox=SANDBOX)
    dropped = [t["dropped_turns"] for t in episode.record["turns"]]
    assert dropped[0] == 0 and dropped[-1] > 0 and dropped == sorted(dropped)
    last = server.requests[-1]["messages"]
    assert last[0]["role"] == "system" and "model.py" in last[1]["content"] and "dropped" in last[2]["content"]
    # Within the budget as the server counts (the loop learns chars per token from its usage replies).
    assert sum(len(str(m.get("content") or "").split()) for m in last) <= budget * 1.25
    # The trajectory keeps the full history all the same.
    assert sum(m["role"] == "tool" for m in episode.record["messages"]) == 6
    assert episode.final["status"] == "failed"  # the stub ModelNew: no solution, reward -1
    assert episode.reward == -1.0 and episode.best is None


def test_workspace_layout_and_skill(tmp_path, examples):
    task = load_task(examples / "cpu_swish" / "model.py")
    ws = create_workspace(tmp_path / "ws", task, Policy(), "cpu")
    names = sorted(p.relative_to(ws.root).as_posix() for p in ws.root.rglob("*") if p.is_file())
    assert names == ["SKILL.md", "binding.cpp", "binding_registry.h", "model.py", "model_new.py",
                     "utils/compile.py", "utils/profile.py", "utils/verify.py"]
    skill = (ws.root / "SKILL.md").read_text()
    assert "kernels/*.cpp" in skill and "atol 0.001" in skill and "5% faster" in skill and "REGISTER_BINDING" in skill
    assert set(PROTECTED) <= {"SKILL.md", "model.py", "binding.cpp", "binding_registry.h", "utils"}
    with pytest.raises(FileExistsError):
        create_workspace(ws.root, task, Policy(), "cpu")


@pytest.mark.slow
def test_optimize_command_writes_solution_report_and_trajectory(tmp_path, examples, capsys):
    out = tmp_path / "out"
    with OpenAIServer(by_turn(solution_steps(examples))) as server:
        code = main(["optimize", str(examples / "cpu_swish" / "model.py"), "--model", "scripted",
                     "--base-url", server.url, "--out", str(out), "--device", "cpu", "--episodes", "2", "--quiet"])
    assert code == 0 and len(server.requests) == 2 * 8  # two episodes at once, eight turns each
    assert (out / "solution" / "model_new.py").is_file() and (out / "solution" / "kernels" / "scaled_swish.cpp").is_file()
    assert (out / "solution" / "binding.cpp").is_file()
    report = (out / "report.md").read_text()
    assert "Best solution: episode" in report and json.loads((out / "result.json").read_text())["status"] == "correct"
    episodes = read_trajectories(out)
    assert sorted(e["episode"] for e in episodes) == [0, 1] and all(e["reward"] >= 1 for e in episodes)
    assert "| 1 |" in report  # a row per episode
    assert main(["show", str(out), "--episode", "1", "--html", str(tmp_path / "t.html")]) == 0
    assert (tmp_path / "t.html").read_text().startswith("<!doctype html>")
    assert main(["show", str(out), "--episode", "3"]) == 2
    assert "2 episode" in capsys.readouterr().err
    # The solution it wrote evaluates as a candidate on its own.
    assert main(["eval", str(examples / "cpu_swish" / "model.py"), str(out / "solution"), "--device", "cpu", "--json"]) == 0


@pytest.mark.slow
def test_optimize_exits_non_zero_when_no_episode_is_correct(tmp_path, examples, capsys):
    out = tmp_path / "out"
    with OpenAIServer(by_turn(["I give up."])) as server:  # ends at once, the workspace as it was given
        code = main(["optimize", str(examples / "cpu_swish" / "model.py"), "--model", "scripted",
                     "--base-url", server.url, "--out", str(out), "--device", "cpu", "--quiet"])
    assert code == 1
    assert "no episode reached a correct solution" in capsys.readouterr().err
    assert "No episode reached a correct solution" in (out / "report.md").read_text()
