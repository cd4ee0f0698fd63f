"""The agent's tools: a sandboxed persistent shell, file reading and editing, search, a todo list.

``Toolbox.call(name, arguments)`` never raises for a bad call: it returns a
``ToolResult`` with ``error=True`` and a message naming the problem and the fix,
and the episode goes on.

The file tools run in this (trusted) process, so they are where the workspace
is enforced: every path must resolve, symbolic links included, to a place
inside the workspace, and files are opened one directory at a time with
``O_NOFOLLOW`` so a link swapped in between the check and the open (by a
background job, say) makes the call fail instead of escaping. Protected paths
may be read but not changed, here and, through read-only binds of the bwrap
sandbox, in the shell.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import stat
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from cuda_agent.agent.shell import BackgroundJob, CommandResult, Shell
from cuda_agent.sandbox import Sandbox, make_sandbox

READ_MAX_LINES = 2000
READ_MAX_LINE_CHARS = 2000
MAX_FILE_BYTES = 64 * 1024 * 1024  # read, edit and grep refuse bigger files (use bash)
GLOB_MAX_RESULTS = 500
GREP_MAX_MATCHES = 250
GREP_MAX_LINE_CHARS = 500
MAX_CONTEXT_LINES = 20
MAX_RUNNING_JOBS = 16
MAX_TIMEOUT_S = 3600.0
TODO_STATUSES = ("pending", "in_progress", "completed")
NO_OUTPUT, NO_NEW_OUTPUT = "(no output)\n", "(no new output)\n"

# Host variables worth keeping in the sandbox. Everything else (API keys above all) stays out
# unless the caller passes it in ``env``.
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES",
              "LD_LIBRARY_PATH", "TORCH_CUDA_ARCH_LIST", "VIRTUAL_ENV", "CONDA_PREFIX")


@dataclass
class ToolResult:
    content: str  # what the model sees
    error: bool = False  # a bad call or a failed action; the episode goes on
    metadata: dict[str, Any] = field(default_factory=dict)


class ToolError(Exception):
    """A bad call or a failed action; the message is shown to the model as is."""


def default_env() -> dict[str, str]:
    env = {name: os.environ[name] for name in PASSED_ENV if name in os.environ}
    # The interpreter running the agent is the one with torch; `python` in the shell should find it.
    bin_dir = os.path.dirname(sys.executable)
    path = env.get("PATH", os.defpath)
    if bin_dir not in path.split(os.pathsep):
        path = bin_dir + os.pathsep + path
    env.update(PATH=path, HOME="/tmp", TMPDIR="/tmp", TERM="dumb", PAGER="cat", GIT_PAGER="cat",
               PYTHONUNBUFFERED="1")  # unbuffered: a background job's progress shows up in bash_output
    env.setdefault("LANG", "C.UTF-8")
    return env


def clip(head: str, limit: int, tail: str = "", missing: int = 0) -> tuple[str, bool]:
    """``head + tail`` cut to about ``limit`` characters: the start and the end are kept, with a note
    in the middle saying how much was cut. ``missing`` characters were already lost between them."""
    keep_front, keep_back = limit // 2, limit - limit // 2
    if not missing:
        text = head + tail
        if len(text) <= limit:
            return text, False
        front, back, total = text[:keep_front], text[len(text) - keep_back:], len(text)
    else:
        front, back = head[:keep_front], tail[max(len(tail) - keep_back, 0):]
        total = len(head) + len(tail) + missing
    cut = total - len(front) - len(back)
    note = (f"\n\n[... {cut} of {total} characters cut here (the limit is {limit}); send long output to a "
            "file and use read or grep on it ...]\n\n")
    return front + note + back, True


# ----------------------------------------------------------------------------- schemas

def _object(properties: dict[str, Any], required: Sequence[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


def _tool_specs(timeout_s: float, max_chars: int) -> dict[str, tuple[str, dict[str, Any]]]:
    path = {"type": "string", "description": "A path relative to the workspace (or absolute, inside it)."}
    edit_item = _object({
        "old_string": {"type": "string", "description": "The exact text to replace, whitespace included."},
        "new_string": {"type": "string", "description": "The text to put in its place."},
        "replace_all": {"type": "boolean", "description": "Replace every occurrence (default false: "
                                                          "old_string must occur exactly once)."},
    }, ["old_string", "new_string"])
    return {
        "bash": (
            "Run a bash command in a persistent shell inside a sandbox (no network). The shell starts in the "
            "workspace; the current directory and exported variables persist between calls. stdout and stderr "
            "come back together with the exit code; stdin is /dev/null, so nothing interactive works. Protected "
            f"files are read-only. Output longer than {max_chars} characters is cut in the middle. A command "
            f"running longer than timeout_s (default {timeout_s:g} s) is killed together with the shell, which "
            "restarts in the workspace; run long commands with background=true and poll them with bash_output.",
            _object({
                "command": {"type": "string", "description": "The command(s) to run, as in a bash script."},
                "timeout_s": {"type": "number", "description": f"Time limit in seconds (default {timeout_s:g}, "
                                                               f"at most {max(timeout_s, MAX_TIMEOUT_S):g})."},
                "background": {"type": "boolean", "description":
                               "Start the command as a background job and return its job id at once. It runs in "
                               "its own sandbox from the shell's current directory with its exported variables "
                               "(no shell functions, and its own /tmp)."},
            }, ["command"])),
        "bash_output": (
            "The output a background job printed since the last call for it, and whether it is still running "
            "(its exit code once it has finished).",
            _object({"job_id": {"type": "string", "description": "The id bash returned for the job."}}, ["job_id"])),
        "kill_job": (
            "Stop a background job (and everything it started).",
            _object({"job_id": {"type": "string", "description": "The id bash returned for the job."}}, ["job_id"])),
        "read": (
            f"Read a text file with numbered lines (like cat -n), at most {READ_MAX_LINES} lines per call; use "
            "offset and limit to read further. Lines longer than "
            f"{READ_MAX_LINE_CHARS} characters are cut.",
            _object({
                "path": path,
                "offset": {"type": "integer", "description": "The first line to show, counting from 1 (default 1)."},
                "limit": {"type": "integer", "description": f"How many lines to show (default {READ_MAX_LINES})."},
            }, ["path"])),
        "write": (
            "Write a file, replacing it if it exists; missing parent directories are created. Protected files "
            "cannot be written.",
            _object({"path": path, "content": {"type": "string", "description": "The whole new content."}},
                    ["path", "content"])),
        "edit": (
            "Replace text in a file: old_string must occur exactly once (add surrounding lines to make it "
            "unique), unless replace_all is true. Read the file first and copy the text exactly.",
            _object({"path": path, **edit_item["properties"]}, ["path", "old_string", "new_string"])),
        "multi_edit": (
            "Several edits of one file, applied in order, each to the result of the one before; if any of them "
            "fails, none is applied.",
            _object({"path": path, "edits": {"type": "array", "items": edit_item, "minItems": 1,
                                             "description": "The edits, as for the edit tool."}},
                    ["path", "edits"])),
        "glob": (
            "List files and directories whose path matches a glob pattern (* and ? within a name, ** across "
            "directories, [abc], {a,b}), relative to the workspace, sorted. Directories end with /.",
            _object({
                "pattern": {"type": "string", "description": "e.g. 'kernels/*.cu' or '**/*.py'."},
                "path": {"type": "string", "description": "The directory to search in (default: the workspace); "
                                                          "the pattern is matched relative to it."},
            }, ["pattern"])),
        "grep": (
            "Search file contents with a Python regular expression; prints file:line: text for each matching "
            f"line (at most {GREP_MAX_MATCHES}).",
            _object({
                "pattern": {"type": "string", "description": "A Python regular expression, matched per line."},
                "path": {"type": "string", "description": "A file or directory to search (default: the workspace)."},
                "glob": {"type": "string", "description": "Only files matching this glob, e.g. '*.cu' (a pattern "
                                                          "without / is matched against the file name)."},
                "ignore_case": {"type": "boolean", "description": "Match case-insensitively (default false)."},
                "context": {"type": "integer", "description": f"Lines of context around each match (0 to "
                                                             f"{MAX_CONTEXT_LINES}, default 0)."},
            }, ["pattern"])),
        "todo_write": (
            "Replace your todo list (plan and progress) with this one; returns it. Keep one item in_progress.",
            _object({"todos": {"type": "array", "description": "The whole list.", "items": _object({
                "content": {"type": "string", "description": "What to do."},
                "status": {"type": "string", "enum": list(TODO_STATUSES)},
            }, ["content", "status"])}}, ["todos"])),
    }


_JSON_TYPES = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "true or false",
               "array": "an array", "object": "an object"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _validate(value: Any, schema: dict[str, Any], where: str = "") -> Any:
    """``value`` checked against the small subset of JSON schema used above; integral floats become ints.
    ``where`` names the value in messages ('' for the arguments object itself)."""
    kind = schema.get("type")
    ok = {
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool)
                   or isinstance(value, float) and value.is_integer(),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
    }.get(kind, True)
    if not ok:
        raise ToolError(f"{where or 'the arguments'} must be {_JSON_TYPES[kind]}, not {_json_type(value)} "
                        f"({json.dumps(value)[:60]})")
    if kind == "integer":
        value = int(value)
    if "enum" in schema and value not in schema["enum"]:
        raise ToolError(f"{where} must be one of {', '.join(map(json.dumps, schema['enum']))}, not {json.dumps(value)}")
    if kind == "array":
        if len(value) < schema.get("minItems", 0):
            raise ToolError(f"{where} must have at least {schema['minItems']} item(s)")
        return [_validate(item, schema["items"], f"{where}[{i}]") for i, item in enumerate(value)]
    if kind == "object":
        props = schema.get("properties", {})
        inner = (where + ".") if where else ""
        for name in schema.get("required", ()):
            if name not in value:
                hint = props[name].get("description") or _JSON_TYPES.get(props[name].get("type"), "")
                raise ToolError(f"missing required argument {inner}{name!r}: {hint.rstrip('.')}. Required: "
                                f"{', '.join(schema['required'])}")
        for name in value:
            if name not in props:
                raise ToolError(f"unknown argument {inner}{name}; the arguments are: {', '.join(props)}")
        return {name: _validate(item, props[name], inner + name) for name, item in value.items()}
    return value


def _lines(text: str) -> list[str]:
    """Lines split at '\n' only, numbered as grep -n and sed count them."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


# ----------------------------------------------------------------------------- globs

def glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob as a regular expression over '/'-separated relative paths."""
    return re.compile(_glob_part(pattern) + r"\Z", re.DOTALL)


def _glob_part(pattern: str) -> str:
    out, i = [], 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif char == "*":
            out.append("[^/]*")
            i += 1
        elif char == "?":
            out.append("[^/]")
            i += 1
        elif char == "[" and pattern.find("]", i + 2) != -1:
            end = pattern.find("]", i + 2)  # from i + 2: a ']' right after '[' is part of the set
            body = pattern[i + 1:end].replace("\\", "\\\\").replace("[", "\\[")
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        elif char == "{":
            depth, end = 0, None
            for j in range(i, len(pattern)):
                depth += {"{": 1, "}": -1}.get(pattern[j], 0)
                if depth == 0:
                    end = j
                    break
            if end is None:
                out.append(re.escape(char))
                i += 1
                continue
            options, depth, start = [], 0, i + 1
            for j in range(i + 1, end):
                depth += {"{": 1, "}": -1}.get(pattern[j], 0)
                if pattern[j] == "," and depth == 0:
                    options.append(pattern[start:j])
                    start = j + 1
            options.append(pattern[start:end])
            out.append("(?:" + "|".join(_glob_part(option) for option in options) + ")")
            i = end + 1
        else:
            out.append(re.escape(char))
            i += 1
    return "".join(out)


# ----------------------------------------------------------------------------- the toolbox

class Toolbox:
    """The tools of one episode over one workspace. Not thread-safe beyond ``call`` itself being serialized."""

    def __init__(self, workspace: Path, *, protected: Iterable[str] = (), sandbox: Sandbox | str = "auto",
                 gpu: bool = False, env: dict[str, str] | None = None, readable: Sequence[Path] = (),
                 writable: Sequence[Path] = (), command_timeout_s: float = 300.0, max_output_chars: int = 20000):
        self.root = Path(os.path.realpath(workspace))
        if not self.root.is_dir():
            raise FileNotFoundError(f"workspace {workspace} is not a directory")
        self.protected = tuple(self._protected_entry(p) for p in protected)
        self.sandbox = make_sandbox(sandbox) if isinstance(sandbox, str) else sandbox
        self.gpu = gpu
        self.env = default_env() | dict(env or {})
        self.readable = tuple(Path(p) for p in readable)
        self.writable = tuple(Path(p) for p in writable)
        self.command_timeout_s = float(command_timeout_s)
        self.max_output_chars = int(max_output_chars)
        self._specs = _tool_specs(self.command_timeout_s, self.max_output_chars)
        self._todos: list[dict[str, str]] = []
        self._jobs: dict[str, BackgroundJob] = {}
        self._job_numbers = 0
        self._shell: Shell | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _protected_entry(self, entry: str) -> str:
        path = PurePosixPath(entry)
        if path.is_absolute():
            try:
                path = PurePosixPath(os.path.relpath(entry, self.root))
            except ValueError:
                pass
        if path.is_absolute() or ".." in path.parts or str(path) in ("", "."):
            raise ValueError(f"protected path {entry!r} must be a path inside the workspace {self.root}")
        return str(path)

    # ------------------------------------------------------------------ the interface

    def schemas(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": name, "description": description,
                                                  "parameters": copy.deepcopy(parameters)}}
                for name, (description, parameters) in self._specs.items()]

    @property
    def todos(self) -> list[dict[str, str]]:
        return copy.deepcopy(self._todos)

    def call(self, name: str, arguments: str | dict[str, Any]) -> ToolResult:
        with self._lock:
            try:
                if self._closed:
                    raise ToolError("the toolbox is closed: the episode is over")
                if name not in self._specs:
                    raise ToolError(f"unknown tool {name!r}; the tools are: {', '.join(self._specs)}")
                args = self._parse(name, arguments)
                return getattr(self, f"_tool_{name}")(**args)
            except ToolError as exc:
                return ToolResult(f"Error: {exc}", error=True)
            except Exception as exc:  # noqa: BLE001 - a tool failure must not end the episode
                return ToolResult(f"Error: {name} failed: {type(exc).__name__}: {exc}", error=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._shell is not None:
                self._shell.close()
                self._shell = None
            for job in self._jobs.values():
                job.kill()

    def __enter__(self) -> "Toolbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _parse(self, name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
        if isinstance(arguments, str):
            if not arguments.strip():
                arguments = {}  # some models send "" for a call without arguments
            else:
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError as exc:
                    raise ToolError(f"the arguments of {name} are not valid JSON ({exc}); send one JSON object "
                                    f"such as {{\"path\": \"model.py\"}}, with strings quoted and escaped") from None
        if not isinstance(arguments, dict):
            raise ToolError(f"the arguments of {name} must be a JSON object, not {_json_type(arguments)}")
        try:
            return _validate(arguments, self._specs[name][1])
        except ToolError as exc:
            raise ToolError(f"{name}: {exc}") from None

    # ------------------------------------------------------------------ paths

    def _resolve(self, path: str) -> str:
        """The workspace-relative POSIX path that ``path`` denotes ('' for the workspace itself)."""
        if not path.strip():
            raise ToolError("the path is empty; give a path relative to the workspace")
        if "\0" in path:
            raise ToolError(f"the path {path!r} contains a NUL character")
        candidate = path if os.path.isabs(path) else os.path.join(self.root, path)
        real = os.path.realpath(candidate)
        if not self._inside(real):
            via = " through a symbolic link" if self._inside(os.path.normpath(candidate)) else ""
            raise ToolError(f"{path} resolves{via} to {real}, outside the workspace {self.root}; "
                            "only paths inside the workspace can be used")
        rel = os.path.relpath(real, self.root)
        return "" if rel == "." else PurePosixPath(rel).as_posix()

    def _inside(self, path: str) -> bool:
        root = str(self.root)
        return path == root or path.startswith(root.rstrip("/") + "/")

    def _check_writable(self, path: str, rel: str) -> None:
        for entry in self.protected:
            if rel == entry or rel.startswith(entry + "/"):
                what = "it" if rel == entry else f"everything under {entry}/"
                raise ToolError(f"{path} is protected (read-only): {what} may be read but not changed "
                                f"(protected: {', '.join(self.protected)}); {path} is unchanged")
        if rel == "":
            raise ToolError(f"{path} is the workspace directory itself, not a file")

    def _open(self, rel: str, flags: int, *, make_parents: bool = False) -> int:
        """Open ``rel`` one component at a time, never following a symbolic link, so nothing swapped in
        after ``_resolve`` can lead outside the workspace."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        parts = rel.split("/") if rel else []
        part = ""
        try:
            for part in parts[:-1]:
                if make_parents:
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = inner
            if not parts:
                return os.dup(fd)
            part = parts[-1]
            # O_NONBLOCK: opening a FIFO the agent made must not hang this process.
            return os.open(part, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644, dir_fd=fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            try:
                link = stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode)
            except OSError:
                link = False
            if link:  # _resolve saw no link here: one was swapped in since
                raise ToolError(f"{rel}: a symbolic link appeared on the path while it was being used") from None
            raise ToolError(f"{rel}: {part} is a file, not a directory") from None
        finally:
            os.close(fd)

    def _read_bytes(self, path: str, rel: str) -> bytes:
        try:
            fd = self._open(rel, os.O_RDONLY)
        except FileNotFoundError:
            raise ToolError(f"{path} does not exist (in the workspace {self.root}); use glob to find files") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            what = "a directory; use glob to list it" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise ToolError(f"{path} is {what}")
        with os.fdopen(fd, "rb") as handle:
            if info.st_size > MAX_FILE_BYTES:
                raise ToolError(f"{path} has {info.st_size} bytes, more than this tool handles ({MAX_FILE_BYTES}); "
                                "use bash (head, sed -n, grep) on it")
            return handle.read(MAX_FILE_BYTES + 1)

    def _write_bytes(self, path: str, rel: str, data: bytes, *, create: bool) -> None:
        flags = os.O_WRONLY | os.O_TRUNC | (os.O_CREAT if create else 0)
        try:
            fd = self._open(rel, flags, make_parents=create)
        except IsADirectoryError:
            raise ToolError(f"{path} is a directory") from None
        with os.fdopen(fd, "wb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise ToolError(f"{path} is not a regular file")
            handle.write(data)

    # ------------------------------------------------------------------ shell tools

    def _tool_bash(self, command: str, timeout_s: float | None = None, background: bool = False) -> ToolResult:
        if not command.strip():
            raise ToolError("bash: the command is empty")
        if timeout_s is not None and timeout_s <= 0:
            raise ToolError(f"bash: timeout_s must be positive, not {timeout_s}")
        if background:
            return self._start_job(command)
        limit = min(timeout_s or self.command_timeout_s, max(self.command_timeout_s, MAX_TIMEOUT_S))
        shell = self._ensure_shell()
        result: CommandResult = shell.run(command, limit)
        text, truncated = clip(result.head, self.max_output_chars, result.tail, result.dropped)
        meta = {"exit_code": result.exit_code, "timed_out": result.timed_out, "truncated": truncated}
        if text and not text.endswith("\n"):
            text += "\n"
        if result.timed_out:
            restarted = self._restart_shell()
            return ToolResult(f"{text}[timed out after {limit:g} s: the command was killed, with the shell and "
                              f"everything started from it (jobs started with background=true keep running); "
                              f"{restarted}. Run long commands with background=true.]",
                              error=True, metadata=meta)
        if result.shell_exited:
            restarted = self._restart_shell()
            return ToolResult(f"{text}exit code {result.exit_code}\n[the command ended the shell (exit, exec or "
                              f"set -e); {restarted}]", error=result.exit_code != 0,
                              metadata=meta | {"shell_restarted": True})
        return ToolResult(f"{text or NO_OUTPUT}exit code {result.exit_code}",
                          error=result.exit_code != 0, metadata=meta)

    def _ensure_shell(self) -> Shell:
        if self._shell is None:
            self._shell = Shell(self.sandbox, self.root, self.env, gpu=self.gpu, writable=self.writable,
                                readable=self.readable, read_only=self._read_only())
        if not self._shell.alive:
            try:
                self._shell.start()
            except Exception as exc:  # noqa: BLE001 - reported to the model, as any failed action
                raise ToolError(f"bash: could not start the shell: {type(exc).__name__}: {exc}") from None
        return self._shell

    def _restart_shell(self) -> str:
        try:
            self._ensure_shell()
        except ToolError as exc:
            return f"no new shell could be started ({exc})"
        return "a fresh shell was started in the workspace (current directory and variables are reset)"

    def _read_only(self) -> list[Path]:
        # Only what exists can be bound; a missing protected path is still refused by the file tools.
        return [self.root / entry for entry in self.protected if os.path.lexists(self.root / entry)]

    def _start_job(self, command: str) -> ToolResult:
        running = [job for job in self._jobs.values() if job.running]
        if len(running) >= MAX_RUNNING_JOBS:
            raise ToolError(f"bash: {len(running)} background jobs are running already, the most allowed; "
                            f"wait for one or stop it with kill_job (running: {', '.join(j.job_id for j in running)})")
        snapshot = self._ensure_shell().snapshot()
        shell_cwd, exports = snapshot if snapshot else (None, None)
        self._job_numbers += 1
        job_id = str(self._job_numbers)
        try:
            job = BackgroundJob.start(job_id, command, self.sandbox, cwd=self.root, shell_cwd=shell_cwd,
                                      exports=exports, env=self.env, gpu=self.gpu, writable=self.writable,
                                      readable=self.readable, read_only=self._read_only())
        except Exception as exc:  # noqa: BLE001
            raise ToolError(f"bash: could not start the background job: {type(exc).__name__}: {exc}") from None
        self._jobs[job_id] = job
        return ToolResult(f"started background job {job_id} in {shell_cwd or self.root}; poll it with "
                          f"bash_output(job_id=\"{job_id}\"), stop it with kill_job(job_id=\"{job_id}\")",
                          metadata={"job_id": job_id, "background": True})

    def _job(self, job_id: str, tool: str) -> BackgroundJob:
        job = self._jobs.get(job_id.strip())
        if job is None:
            known = ", ".join(self._jobs) or "none yet (start one with bash and background=true)"
            raise ToolError(f"{tool}: there is no background job {job_id!r}; the job ids are: {known}")
        return job

    def _job_report(self, job: BackgroundJob) -> tuple[str, dict[str, Any]]:
        head, tail, dropped, code = job.poll()
        text, truncated = clip(head, self.max_output_chars, tail, dropped)
        if text and not text.endswith("\n"):
            text += "\n"
        if code is None:
            status = f"[job {job.job_id} is still running]"
        else:
            status = f"[job {job.job_id} has finished: {job.describe_exit()}]"
        meta = {"job_id": job.job_id, "running": code is None, "exit_code": code, "truncated": truncated}
        return f"{text or NO_NEW_OUTPUT}{status}", meta

    def _tool_bash_output(self, job_id: str) -> ToolResult:
        job = self._job(job_id, "bash_output")
        text, meta = self._job_report(job)
        return ToolResult(text, metadata=meta)

    def _tool_kill_job(self, job_id: str) -> ToolResult:
        job = self._job(job_id, "kill_job")
        if not job.running:
            text, meta = self._job_report(job)
            return ToolResult(f"job {job.job_id} had already finished\n{text}", metadata=meta)
        job.kill()
        text, meta = self._job_report(job)
        return ToolResult(f"killed job {job.job_id}\n{text}", metadata=meta)

    # ------------------------------------------------------------------ file tools

    def _tool_read(self, path: str, offset: int = 1, limit: int = READ_MAX_LINES) -> ToolResult:
        if offset < 1:
            raise ToolError(f"read: offset counts lines from 1, so it must be at least 1, not {offset}")
        if limit < 1:
            raise ToolError(f"read: limit must be at least 1, not {limit}")
        limit = min(limit, READ_MAX_LINES)
        rel = self._resolve(path)
        data = self._read_bytes(path, rel)
        if b"\0" in data[:8192]:
            raise ToolError(f"{path} looks binary ({len(data)} bytes); inspect it with bash (xxd, python)")
        lines = _lines(data.decode(errors="replace"))
        if not lines:
            return ToolResult(f"({path} is empty)", metadata={"lines": 0})
        if offset > len(lines):
            raise ToolError(f"read: {path} has {len(lines)} lines, so offset {offset} is past the end")
        out, size, last = [], 0, offset - 1
        for number in range(offset, min(offset + limit, len(lines) + 1)):
            line = lines[number - 1]
            if len(line) > READ_MAX_LINE_CHARS:
                line = line[:READ_MAX_LINE_CHARS] + f" [... line cut at {READ_MAX_LINE_CHARS} characters]"
            entry = f"{number:6}\t{line}"
            if out and size + len(entry) + 1 > self.max_output_chars:
                break
            out.append(entry)
            size += len(entry) + 1
            last = number
        text = "\n".join(out)
        if last < len(lines):
            text += (f"\n[lines {offset}-{last} of {len(lines)}; to read on, call read with offset={last + 1}]")
        return ToolResult(text, metadata={"lines": len(lines), "first": offset, "last": last,
                                          "truncated": last < len(lines)})

    def _tool_write(self, path: str, content: str) -> ToolResult:
        rel = self._resolve(path)
        self._check_writable(path, rel)
        data = content.encode("utf-8", errors="surrogateescape")
        existed = os.path.lexists(self.root / rel)
        self._write_bytes(path, rel, data, create=True)
        lines = content.count("\n") + (1 if content and not content.endswith("\n") else 0)
        verb = "overwrote" if existed else "created"
        return ToolResult(f"{verb} {rel} ({lines} lines, {len(data)} bytes)", metadata={"path": rel})

    def _load_text(self, path: str) -> tuple[str, str]:
        rel = self._resolve(path)
        self._check_writable(path, rel)
        # surrogateescape: bytes that are not UTF-8 are written back exactly as they were.
        return rel, self._read_bytes(path, rel).decode("utf-8", errors="surrogateescape")

    @staticmethod
    def _replace(text: str, path: str, old: str, new: str, replace_all: bool) -> tuple[str, int, int]:
        """(new text, occurrences replaced, index of the first one)."""
        if old == "":
            raise ToolError("old_string is empty; to create or replace a whole file use write")
        if old == new:
            raise ToolError("old_string and new_string are the same; nothing would change")
        count = text.count(old)
        if count == 0:
            raise ToolError(f"old_string was not found in {path}; read the file and copy the text exactly, "
                            "whitespace and indentation included")
        first = text.index(old)
        if count > 1 and not replace_all:
            starts, at = [], first
            while at != -1 and len(starts) < 10:
                starts.append(text.count("\n", 0, at) + 1)
                at = text.find(old, at + len(old))
            raise ToolError(f"old_string occurs {count} times in {path} (at lines {', '.join(map(str, starts))}); "
                            "include more surrounding lines to make it unique, or set replace_all=true")
        return text.replace(old, new), count, first

    def _tool_edit(self, path: str, old_string: str, new_string: str, replace_all: bool = False) -> ToolResult:
        rel, text = self._load_text(path)
        try:
            updated, count, first = self._replace(text, path, old_string, new_string, replace_all)
        except ToolError as exc:
            raise ToolError(f"edit: {exc}; {path} is unchanged") from None
        self._write_bytes(path, rel, updated.encode("utf-8", errors="surrogateescape"), create=False)
        start = updated.count("\n", 0, first) + 1
        end = start + new_string.count("\n")
        lines = _lines(updated)
        shown = range(max(start - 3, 1), min(end + 3, len(lines), start + 30) + 1)
        snippet = "\n".join(f"{n:6}\t{lines[n - 1][:READ_MAX_LINE_CHARS]}" for n in shown)
        plural = "s" if count > 1 else ""
        return ToolResult(f"replaced {count} occurrence{plural} in {rel}; lines {shown.start}-{shown.stop - 1} "
                          f"now read:\n{snippet}", metadata={"path": rel, "replacements": count})

    def _tool_multi_edit(self, path: str, edits: list[dict[str, Any]]) -> ToolResult:
        rel, text = self._load_text(path)
        total = 0
        for number, edit in enumerate(edits, 1):
            try:
                text, count, _ = self._replace(text, path, edit["old_string"], edit["new_string"],
                                               edit.get("replace_all", False))
            except ToolError as exc:
                raise ToolError(f"multi_edit: edit {number} of {len(edits)} failed: {exc} (old_string is matched "
                                f"against the text after the edits before it); no edit was applied, {path} is "
                                "unchanged") from None
            total += count
        self._write_bytes(path, rel, text.encode("utf-8", errors="surrogateescape"), create=False)
        return ToolResult(f"applied {len(edits)} edits to {rel} ({total} replacements)",
                          metadata={"path": rel, "replacements": total})

    # ------------------------------------------------------------------ search tools

    def _walk(self, rel: str):
        """(workspace-relative path, is_dir) under the directory ``rel``, sorted, without following links."""
        top = self.root / rel if rel else self.root
        for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
            dirnames.sort()
            base = os.path.relpath(dirpath, self.root)
            base = "" if base == "." else PurePosixPath(base).as_posix() + "/"
            for name in dirnames:
                yield base + name, not os.path.islink(os.path.join(dirpath, name))
            for name in sorted(filenames):
                yield base + name, False

    def _search_root(self, path: str | None) -> str:
        if path is None:
            return ""
        rel = self._resolve(path)
        if not os.path.exists(self.root / rel):
            raise ToolError(f"{path} does not exist (in the workspace {self.root})")
        return rel

    def _tool_glob(self, pattern: str, path: str | None = None) -> ToolResult:
        if not pattern.strip():
            raise ToolError("glob: the pattern is empty; try '**/*' for everything")
        rel = self._search_root(path)
        if not os.path.isdir(self.root / rel):
            raise ToolError(f"glob: {path} is not a directory")
        if os.path.isabs(pattern):
            pattern = os.path.relpath(pattern, self.root / rel)
        if ".." in PurePosixPath(pattern).parts:
            raise ToolError("glob: the pattern may not contain '..'; set path to search another directory "
                            "inside the workspace")
        while pattern.startswith("./"):
            pattern = pattern[2:]
        regex = glob_regex(pattern)
        prefix = rel + "/" if rel else ""
        matches = []
        for entry, is_dir in self._walk(rel):
            if regex.match(entry[len(prefix):]):
                matches.append(entry + "/" if is_dir else entry)
        matches.sort()
        if not matches:
            return ToolResult(f"no files match {pattern!r} in {rel or 'the workspace'}", metadata={"count": 0})
        text = "\n".join(matches[:GLOB_MAX_RESULTS])
        if len(matches) > GLOB_MAX_RESULTS:
            text += f"\n[{len(matches) - GLOB_MAX_RESULTS} more matches not shown; use a narrower pattern or path]"
        clipped, truncated = clip(text, self.max_output_chars)
        return ToolResult(clipped, metadata={"count": len(matches),
                                             "truncated": truncated or len(matches) > GLOB_MAX_RESULTS})

    def _tool_grep(self, pattern: str, path: str | None = None, glob: str | None = None,
                   ignore_case: bool = False, context: int = 0) -> ToolResult:
        try:
            regex = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
        except re.error as exc:
            raise ToolError(f"grep: {pattern!r} is not a valid Python regular expression: {exc}") from None
        if not 0 <= context <= MAX_CONTEXT_LINES:
            raise ToolError(f"grep: context must be between 0 and {MAX_CONTEXT_LINES}, not {context}")
        rel = self._search_root(path)
        name_filter = glob_regex(glob) if glob else None
        if os.path.isdir(self.root / rel):
            prefix = rel + "/" if rel else ""
            files = sorted(entry for entry, is_dir in self._walk(rel) if not is_dir)
        else:
            prefix, files = "", [rel]
        out: list[str] = []
        matched = files_with = 0
        for file in files:
            if name_filter and not name_filter.match(file[len(prefix):] if "/" in glob else file.rsplit("/", 1)[-1]):
                continue
            if os.path.islink(self.root / file) and not self._inside(os.path.realpath(self.root / file)):
                continue  # a link out of the workspace: its target is none of the agent's business
            try:
                data = self._read_bytes(file, self._resolve(file))
            except (ToolError, OSError):  # vanished, unreadable, too big, a FIFO: not searchable
                continue
            if b"\0" in data[:8192]:
                continue
            lines = _lines(data.decode(errors="replace"))
            hits = [n for n, line in enumerate(lines) if regex.search(line)]
            hit_set = set(hits)
            if not hits:
                continue
            files_with += 1
            shown_until = -1
            for n in hits:
                if matched >= GREP_MAX_MATCHES:
                    break
                matched += 1
                lo, hi = max(n - context, shown_until + 1), min(n + context, len(lines) - 1)
                if context and out and (shown_until < 0 or lo > shown_until + 1):
                    out.append("--")  # as grep does between groups that are not adjacent
                for k in range(lo, hi + 1):
                    line = lines[k]
                    if len(line) > GREP_MAX_LINE_CHARS:
                        line = line[:GREP_MAX_LINE_CHARS] + " [...]"
                    out.append(f"{file}:{k + 1}: {line}" if k in hit_set else f"{file}-{k + 1}- {line}")
                shown_until = max(shown_until, hi)
            if matched >= GREP_MAX_MATCHES:
                out.append(f"[stopped at {GREP_MAX_MATCHES} matching lines; narrow the pattern, path or glob]")
                break
        if not out:
            return ToolResult(f"no matches for {pattern!r} in {rel or 'the workspace'}", metadata={"matches": 0})
        text, truncated = clip("\n".join(out), self.max_output_chars)
        return ToolResult(text, metadata={"matches": matched, "files": files_with, "truncated": truncated})

    # ------------------------------------------------------------------ todos

    def _tool_todo_write(self, todos: list[dict[str, str]]) -> ToolResult:
        for number, item in enumerate(todos, 1):
            if not item["content"].strip():
                raise ToolError(f"todo_write: item {number} has an empty content")
        self._todos = [{"content": item["content"].strip(), "status": item["status"]} for item in todos]
        if not self._todos:
            return ToolResult("the todo list is now empty", metadata={"todos": 0})
        marks = {"pending": "[ ]", "in_progress": "[>]", "completed": "[x]"}
        lines = [f"{marks[item['status']]} {item['content']}" for item in self._todos]
        done = sum(item["status"] == "completed" for item in self._todos)
        return ToolResult(f"todo list ({done}/{len(lines)} completed):\n" + "\n".join(lines),
                          metadata={"todos": len(lines), "completed": done})
