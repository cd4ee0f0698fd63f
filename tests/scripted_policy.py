"""A scripted policy for agent tests (a test double): replays fixed tool calls through the local
OpenAI-protocol server, as a model would send them."""

from __future__ import annotations

import json
from pathlib import Path


def call(name: str, arguments: dict | str, n: int) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": text}}


def scripted(steps: list):
    """A reply function for ``OpenAIServer`` that replays ``steps``: per turn, a list of
    ``(tool, arguments)`` calls, or a final text."""
    turns = iter(steps)
    counter = iter(range(10_000))

    def reply(request: dict) -> dict | str:
        step = next(turns, "done")
        if isinstance(step, str):
            return step
        return {"content": None, "tool_calls": [call(name, args, next(counter)) for name, args in step]}

    return reply


def write_solution(solution: Path) -> list:
    """One turn writing every file of a solution directory (model_new.py, kernels/*) to the workspace."""
    files = sorted(p for p in solution.rglob("*") if p.is_file())
    return [("write", {"path": p.relative_to(solution).as_posix(), "content": p.read_text()}) for p in files]


COMMANDS = [
    [("bash", {"command": "python utils/compile.py"})],
    [("bash", {"command": "python utils/verify.py"})],
    [("bash", {"command": "python utils/profile.py"})],
]


def by_turn(steps: list):
    """Like ``scripted``, but stateless: the turn is the number of assistant messages in the request,
    so episodes running at once against one server each follow ``steps``."""

    def reply(request: dict) -> dict | str:
        turn = sum(m["role"] == "assistant" for m in request["messages"])
        step = steps[turn] if turn < len(steps) else "done"
        if isinstance(step, str):
            return step
        return {"content": None, "tool_calls": [call(name, args, 100 * turn + i) for i, (name, args) in enumerate(step)]}

    return reply
