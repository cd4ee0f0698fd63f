"""OpenEnv (openenv) with the real library: the package (``envs/cuda_agent_env``) through ``openenv validate`` at
the static level; the MCP tool environment it serves under uvicorn, checked by ``openenv validate --url``, its
tools listed over ``/mcp`` and one scripted episode over OpenEnv's MCP tool client with per-turn feedback and the
same reward as our loop; ``KernelEnv``'s typed actions over the WebSocket; and the single-turn env (``serve
--single-turn``): one reply per episode, the same reward as ``score_reply`` for the same text."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("openenv", reason="openenv is not installed: pip install 'cuda-agent[openenv]' to run the "
                                      "OpenEnv tests")
uvicorn = pytest.importorskip("uvicorn")

from cuda_agent.integrations.core import EvaluatorOptions  # noqa: E402
from cuda_agent.integrations.openenv import (FINISH, KernelAction, KernelEnvClient,  # noqa: E402
                                             KernelReplyEnvClient, KernelToolEnvClient, ReplyAction, make_app)
from cuda_agent.integrations.tool_functions import tool_schemas  # noqa: E402
from openenv.core.env_server.mcp_types import CallToolAction  # noqa: E402
from cuda_agent.train.single_turn import FAILURE_REWARD, score_reply, single_turn_messages  # noqa: E402

from integration_setup import CORRECT, SANDBOX, console_script  # noqa: E402
from tiny_lm import solution_reply  # noqa: E402


@pytest.fixture
def server(task, evaluator):
    """OpenEnv's app over the example task, evaluations by the shared CPU evaluator, on a free local port."""
    yield from serving(make_app([task], EvaluatorOptions(evaluator=evaluator, sandbox=SANDBOX), max_sessions=2,
                                max_steps=20))


@pytest.fixture
def mcp_server(task, evaluator):
    """The environment the OpenEnv package serves (``KernelToolEnv``: MCP tools), over the example task."""
    yield from serving(make_app([task], EvaluatorOptions(evaluator=evaluator, sandbox=SANDBOX), max_sessions=2,
                                max_steps=20, mcp=True))


@pytest.fixture
def single_turn_server(task, evaluator):
    """The same, single-turn (``serve --single-turn``)."""
    yield from serving(make_app([task], EvaluatorOptions(evaluator=evaluator, sandbox=SANDBOX), max_sessions=2,
                                single_turn=True))


def serving(app):
    """Serve ``app`` with uvicorn on a free local port until the test ends; yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    running = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not running.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the OpenEnv server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    running.should_exit = True
    thread.join(timeout=30)


PACKAGE = Path(__file__).resolve().parents[2] / "envs" / "cuda_agent_env"


def openenv_cli(*args: str) -> subprocess.CompletedProcess:
    """OpenEnv's own command line (``openenv``), as a user runs it."""
    command = [*console_script("openenv", "openenv.cli.__main__:main"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=dict(os.environ, NO_COLOR="1"))


def test_the_package_passes_openenv_static_validation():
    done = openenv_cli("validate", str(PACKAGE), "--level", "static", "--skip-build", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["verdict"] == "pass" and report["manifest"]["name"] == "cuda_agent_env"
    # The manifest declares exactly the tools the environment offers.
    offered = [schema["function"]["name"] for schema in tool_schemas()] + [FINISH]
    assert sorted(report["manifest"]["capabilities"]["declared_tools"]) == sorted(offered)


def post_json(url: str, payload: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_mcp_episode_has_feedback_each_turn_and_earns_what_our_loop_earns(mcp_server, task, solved_calls,
                                                                          loop_episode):
    """The package's environment: ``openenv validate --url`` passes (its 6 runtime checks); ``/metadata`` describes
    the environment; ``/mcp`` lists our tools and ``finish``; then the scripted episode with OpenEnv's MCP tool
    client: each ``CallToolAction`` observed over the WebSocket, verify's feedback in its observation, ``finish``
    ending the episode with the loop's reward."""
    done = openenv_cli("validate", "--url", mcp_server, "--json", "--timeout", "60")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["passed"]
    with urllib.request.urlopen(f"{mcp_server}/metadata", timeout=60) as response:
        metadata = json.loads(response.read())
    assert "CUDA" in metadata["description"] and "feedback" in metadata["description"]
    listed = post_json(f"{mcp_server}/mcp", {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}})
    names = {tool["name"] for tool in listed["result"]["tools"]}
    assert {"bash", "read", "write", "edit", FINISH} <= names, listed
    with KernelToolEnvClient(base_url=mcp_server).sync() as env:
        opened = env.reset(task=task.name)
        assert not opened.done and task.code in opened.observation.content
        assert {t.name for t in env.list_tools()} == names
        for name, arguments in solved_calls:
            result = env.step(CallToolAction(tool_name=name, arguments=arguments))
            assert not result.done and result.observation.error is None, result.observation
        feedback = result.observation.feedback  # the last call: python utils/verify.py
        assert [(f["command"], f["status"]) for f in feedback] == [("verify", "correct")], feedback
        assert "correct" in json.dumps(result.observation.result).lower()  # verify's report, as the agent reads it
        closed = env.step(CallToolAction(tool_name=FINISH))
        assert closed.done and closed.observation.status == "correct"
        assert closed.reward == loop_episode.reward == CORRECT
        assert closed.observation.metadata["final"]["status"] == "correct"


def test_typed_actions_over_the_websocket_in_a_fresh_workspace(server, task):
    """``KernelEnv`` (one ``KernelAction`` per tool call): a fresh workspace (the stub ModelNew), a bad call is an
    observation, not a broken session."""
    with KernelEnvClient(base_url=server, message_timeout_s=300).sync() as env:
        opened = env.reset(task=task.name)
        assert [m["role"] for m in opened.observation.messages] == ["system", "user"]
        assert {"bash", "write", "read"} <= {t["function"]["name"] for t in opened.observation.tools}
        fresh = env.step(KernelAction(tool="read", arguments={"path": "model_new.py"}))
        assert "scaled_swish" not in fresh.observation.content and not fresh.observation.error
        assert fresh.observation.feedback == []  # no evaluation ran
        bad = env.step(KernelAction(tool="launch_missiles", arguments={}))
        assert bad.observation.error and "launch_missiles" in bad.observation.content and not bad.done
        assert env.state().step_count == 2 and not env.state().done


@pytest.mark.slow
def test_single_turn_reply_over_the_websocket_earns_what_score_reply_gives(single_turn_server, examples, task,
                                                                          evaluator, tmp_path):
    """reset gives the single-turn prompt (no tools); one ReplyAction with the example's solution as files ends the
    episode with score_reply's reward for that text; a reply without code earns the failure reward."""
    text = solution_reply(examples / "cpu_swish" / "solution")
    with KernelReplyEnvClient(base_url=single_turn_server, message_timeout_s=300).sync() as env:
        opened = env.reset(task=task.name)
        assert not opened.done and opened.observation.task == task.name
        assert opened.observation.messages == single_turn_messages(task) and not opened.observation.tools
        closed = env.step(ReplyAction(reply=text))
        assert closed.done and closed.observation.status == "correct"
        assert closed.reward == score_reply(task, text, evaluator, tmp_path).reward == CORRECT
        state = env.state()
        assert state.done and state.reward == CORRECT and state.step_count == 1
        # The session goes on: a new episode; prose writes no candidate (nothing is evaluated).
        env.reset(task=task.name)
        prose = env.step(ReplyAction(reply="I cannot write this kernel."))
        assert prose.done and prose.reward == FAILURE_REWARD and prose.observation.status == "no candidate"
        assert "model_new.py" in prose.observation.content  # why: the reply holds no model_new.py
