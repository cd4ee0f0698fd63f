"""The workspace's command server (agent.commands): what the agent's shell gets back from utils/*.py."""

from __future__ import annotations

import json
import socket

from cuda_agent.agent.commands import CommandServer
from cuda_agent.agent.workspace import create_workspace
from cuda_agent.evaluate import Policy
from cuda_agent.tasks import load_task


class FailingEvaluator:
    """An evaluator whose service refuses (what RemoteEvaluator raises when the service is down)."""

    def verify(self, task, candidate):
        raise ConnectionRefusedError("the evaluation service at http://127.0.0.1:9 refused the connection")

    evaluate = verify


def ask(server: CommandServer, command: str) -> dict:
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(server.socket_path))
        conn.sendall(json.dumps({"command": command}).encode() + b"\n")
        return json.loads(conn.makefile().readline())


def test_an_evaluator_that_fails_is_answered_with_its_words_not_a_closed_socket(examples, tmp_path):
    task = load_task(examples / "cpu_swish" / "model.py")
    workspace = create_workspace(tmp_path / "ws", task, Policy(), "cpu")
    server = CommandServer(workspace.root, task, FailingEvaluator())
    try:
        reply = ask(server, "verify")
        assert reply["exit_code"] == 3
        assert "could not answer" in reply["text"] and "refused the connection" in reply["text"]
        assert ask(server, "launch")["exit_code"] == 2  # unknown commands still say so
    finally:
        server.close()
