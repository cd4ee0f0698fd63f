"""OpenEnv (openenv) with the real library: the environment served by OpenEnv's own FastAPI app under uvicorn,
driven by OpenEnv's WebSocket client, one scripted episode, the same reward as our loop; and the single-turn env
(``serve --single-turn``): one reply per episode, the same reward as ``score_reply`` for the same text."""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("openenv", reason="openenv is not installed: pip install 'cuda-agent[openenv]' to run the "
                                      "OpenEnv tests")
uvicorn = pytest.importorskip("uvicorn")

from cuda_agent.integrations.core import EvaluatorOptions  # noqa: E402
from cuda_agent.integrations.openenv import (FINISH, KernelAction, KernelEnvClient,  # noqa: E402
                                             KernelReplyEnvClient, ReplyAction, make_app)
from cuda_agent.train.single_turn import FAILURE_REWARD, score_reply, single_turn_messages  # noqa: E402

from integration_setup import CORRECT, SANDBOX  # noqa: E402
from tiny_lm import solution_reply  # noqa: E402


@pytest.fixture
def server(task, evaluator):
    """OpenEnv's app over the example task, evaluations by the shared CPU evaluator, on a free local port."""
    yield from serving(make_app([task], EvaluatorOptions(evaluator=evaluator, sandbox=SANDBOX), max_sessions=2,
                                max_steps=20))


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


@pytest.mark.slow
def test_episode_over_the_websocket_earns_what_our_loop_earns(server, task, solved_calls, loop_episode):
    with KernelEnvClient(base_url=server, message_timeout_s=300).sync() as env:
        opened = env.reset(task=task.name)
        assert not opened.done and opened.observation.task == task.name
        assert task.code in opened.observation.content
        assert [m["role"] for m in opened.observation.messages] == ["system", "user"]
        assert {"bash", "write", "read"} <= {t["function"]["name"] for t in opened.observation.tools}
        for name, arguments in solved_calls:
            result = env.step(KernelAction(tool=name, arguments=arguments))
            assert not result.done and not result.observation.error, result.observation.content
        assert "correct" in result.observation.content.lower()  # the last call: verify's report
        closed = env.step(KernelAction(tool=FINISH))
        assert closed.done and closed.observation.status == "correct"
        assert closed.reward == loop_episode.reward == CORRECT
        state = env.state()
        assert state.done and state.reward == CORRECT and state.step_count == len(solved_calls) + 1
        # The session goes on: a new episode in a fresh workspace (the stub ModelNew again), where a bad call is an
        # observation, not a broken session. (Its -1 at the end is shown through TRL's trainer; here it would
        # cost one more evaluation.)
        env.reset(task=task.name)
        fresh = env.step(KernelAction(tool="read", arguments={"path": "model_new.py"}))
        assert "scaled_swish" not in fresh.observation.content and not fresh.observation.error
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
