"""``Toolbox``: the registered tools of one episode over one workspace.

``Toolbox.call(name, arguments)`` never raises for a bad call: it returns a
``ToolResult`` with ``error=True`` and a message naming the problem and the fix,
and the episode goes on.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# The families, imported in the order their tools are offered to the model.
from cuda_agent.agent.shell import BackgroundJob
from cuda_agent.agent.tools import bash, files, search, todo  # noqa: F401 - importing registers the tools
from cuda_agent.agent.tools.bash import BashSession, default_env
from cuda_agent.agent.tools.files import ConfinedFiles
from cuda_agent.agent.tools.registry import TOOLS, ToolError, ToolResult, get_tool
from cuda_agent.sandbox import Sandbox, make_sandbox


class Toolbox(ConfinedFiles):
    """The tools of one episode over one workspace. Not thread-safe beyond ``call`` itself being serialized."""

    def __init__(self, workspace: Path, *, protected: Iterable[str] = (), sandbox: Sandbox | str = "auto",
                 gpu: bool = False, env: dict[str, str] | None = None, readable: Sequence[Path] = (),
                 writable: Sequence[Path] = (), command_timeout_s: float = 300.0, max_output_chars: int = 20000):
        super().__init__(workspace, protected)
        self.sandbox = make_sandbox(sandbox) if isinstance(sandbox, str) else sandbox
        self.gpu = gpu
        self.env = default_env() | dict(env or {})
        self.readable = tuple(Path(p) for p in readable)
        self.writable = tuple(Path(p) for p in writable)
        self.command_timeout_s = float(command_timeout_s)
        self.max_output_chars = int(max_output_chars)
        self._todos: list[dict[str, str]] = []
        self._bash = BashSession(self.sandbox, self.root, self.env, gpu=self.gpu, readable=self.readable,
                                 writable=self.writable, read_only=self._read_only,
                                 max_output_chars=self.max_output_chars)
        self._lock = threading.Lock()
        self._closed = False

    def schemas(self) -> list[dict[str, Any]]:
        """The function schemas of every registered tool, in the order registered."""
        return [tool.schema(self) for tool in TOOLS.values()]

    @property
    def todos(self) -> list[dict[str, str]]:
        return copy.deepcopy(self._todos)

    @property
    def _jobs(self) -> dict[str, BackgroundJob]:
        return self._bash.jobs

    def call(self, name: str, arguments: str | dict[str, Any]) -> ToolResult:
        with self._lock:
            try:
                if self._closed:
                    raise ToolError("the toolbox is closed: the episode is over")
                try:
                    tool = get_tool(name)
                    parsed = tool.parse(self, arguments)
                except ToolError as exc:
                    # Marked apart from failed actions: training drops episodes with calls that break the schema.
                    return ToolResult(f"Error: {exc}", error=True, metadata={"invalid_call": True})
                return tool.call(self, **parsed)
            except ToolError as exc:
                return ToolResult(f"Error: {exc}", error=True)
            except Exception as exc:  # noqa: BLE001 - a tool failure must not end the episode
                return ToolResult(f"Error: {name} failed: {type(exc).__name__}: {exc}", error=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._bash.close()

    def __enter__(self) -> Toolbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
