"""The agent's tools: a sandboxed persistent shell, file reading and editing, search, a todo list.

One module per tool family, each tool registered by name with its schema next to it
(``registry``); ``Toolbox`` offers them all to the model over one workspace:

    registry   Tool (name, JSON schema, validation, call), @register, TOOLS, get_tool, tool_names
    bash       bash, bash_output, kill_job over agent.shell's Shell and BackgroundJob
    files      read, write, edit, multi_edit, and the confined I/O of every tool on files
    search     glob, grep
    todo       todo_write
    toolbox    Toolbox: the tools of one episode, call(name, arguments) -> ToolResult
"""

from cuda_agent.agent.tools.registry import (TOOLS, Tool, ToolError, ToolResult, get_tool, register,
                                             tool_names)
from cuda_agent.agent.tools.toolbox import Toolbox  # imports the families, which register their tools
from cuda_agent.agent.tools.bash import (MAX_RUNNING_JOBS, MAX_TIMEOUT_S, NO_NEW_OUTPUT, NO_OUTPUT, PASSED_ENV,
                                         default_env)
from cuda_agent.agent.tools.files import MAX_FILE_BYTES, READ_MAX_LINE_CHARS, READ_MAX_LINES
from cuda_agent.agent.tools.search import (GLOB_MAX_RESULTS, GREP_MAX_LINE_CHARS, GREP_MAX_MATCHES,
                                           MAX_CONTEXT_LINES, glob_regex)
from cuda_agent.agent.tools.text import clip
from cuda_agent.agent.tools.todo import TODO_STATUSES

__all__ = [
    "TOOLS", "Tool", "ToolError", "ToolResult", "Toolbox", "get_tool", "register", "tool_names",
    "MAX_RUNNING_JOBS", "MAX_TIMEOUT_S", "NO_NEW_OUTPUT", "NO_OUTPUT", "PASSED_ENV", "default_env",
    "MAX_FILE_BYTES", "READ_MAX_LINE_CHARS", "READ_MAX_LINES",
    "GLOB_MAX_RESULTS", "GREP_MAX_LINE_CHARS", "GREP_MAX_MATCHES", "MAX_CONTEXT_LINES", "glob_regex",
    "clip", "TODO_STATUSES",
]
