"""The shell tools: bash (the persistent sandboxed shell of ``agent.shell``, or a background job),
bash_output and kill_job, and ``BashSession``, the shell and jobs one episode keeps."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cuda_agent.agent.shell import BackgroundJob, CommandResult, Shell
from cuda_agent.agent.tools.registry import Tool, ToolError, ToolResult, object_schema, register
from cuda_agent.agent.tools.text import clip
from cuda_agent.paths import PASSED_ENV, passed_env  # noqa: F401 - PASSED_ENV re-exported by agent.tools
from cuda_agent.sandbox import Sandbox

if TYPE_CHECKING:
    from cuda_agent.agent.tools.toolbox import Toolbox

MAX_RUNNING_JOBS = 16
MAX_TIMEOUT_S = 3600.0
NO_OUTPUT, NO_NEW_OUTPUT = "(no output)\n", "(no new output)\n"

def default_env() -> dict[str, str]:
    # The host variables every sandboxed process may get (``paths.PASSED_ENV``); everything else (API keys
    # above all) stays out unless the caller passes it in ``env``.
    env = passed_env()
    # The interpreter running the agent is the one with torch; `python` in the shell should find it.
    bin_dir = os.path.dirname(sys.executable)
    path = env.get("PATH", os.defpath)
    if bin_dir not in path.split(os.pathsep):
        path = bin_dir + os.pathsep + path
    env.update(PATH=path, HOME="/tmp", TMPDIR="/tmp", TERM="dumb", PAGER="cat", GIT_PAGER="cat",
               PYTHONUNBUFFERED="1")  # unbuffered: a background job's progress shows up in bash_output
    env.setdefault("LANG", "C.UTF-8")
    return env


class BashSession:
    """The persistent shell (started on first use, restarted after a timeout or an exit) and the
    background jobs of one episode. ``read_only`` gives the paths to bind read-only at each start."""

    def __init__(self, sandbox: Sandbox, root: Path, env: dict[str, str], *, gpu: bool, readable: Sequence[Path],
                 writable: Sequence[Path], read_only: Callable[[], list[Path]], max_output_chars: int):
        self.sandbox, self.root, self.env, self.gpu = sandbox, root, env, gpu
        self.readable, self.writable, self.read_only = readable, writable, read_only
        self.max_output_chars = max_output_chars
        self.jobs: dict[str, BackgroundJob] = {}
        self._job_numbers = 0
        self._shell: Shell | None = None

    def ensure_shell(self) -> Shell:
        if self._shell is None:
            self._shell = Shell(self.sandbox, self.root, self.env, gpu=self.gpu, writable=self.writable,
                                readable=self.readable, read_only=self.read_only())
        if not self._shell.alive:
            try:
                self._shell.start()
            except Exception as exc:  # noqa: BLE001 - reported to the model, as any failed action
                raise ToolError(f"bash: could not start the shell: {type(exc).__name__}: {exc}") from None
        return self._shell

    def restart_shell(self) -> str:
        try:
            self.ensure_shell()
        except ToolError as exc:
            return f"no new shell could be started ({exc})"
        return "a fresh shell was started in the workspace (current directory and variables are reset)"

    def start_job(self, command: str) -> ToolResult:
        running = [job for job in self.jobs.values() if job.running]
        if len(running) >= MAX_RUNNING_JOBS:
            raise ToolError(f"bash: {len(running)} background jobs are running already, the most allowed; "
                            f"wait for one or stop it with kill_job (running: {', '.join(j.job_id for j in running)})")
        snapshot = self.ensure_shell().snapshot()
        shell_cwd, exports = snapshot if snapshot else (None, None)
        self._job_numbers += 1
        job_id = str(self._job_numbers)
        try:
            job = BackgroundJob.start(job_id, command, self.sandbox, cwd=self.root, shell_cwd=shell_cwd,
                                      exports=exports, env=self.env, gpu=self.gpu, writable=self.writable,
                                      readable=self.readable, read_only=self.read_only())
        except Exception as exc:  # noqa: BLE001
            raise ToolError(f"bash: could not start the background job: {type(exc).__name__}: {exc}") from None
        self.jobs[job_id] = job
        return ToolResult(f"started background job {job_id} in {shell_cwd or self.root}; poll it with "
                          f"bash_output(job_id=\"{job_id}\"), stop it with kill_job(job_id=\"{job_id}\")",
                          metadata={"job_id": job_id, "background": True})

    def job(self, job_id: str, tool: str) -> BackgroundJob:
        job = self.jobs.get(job_id.strip())
        if job is None:
            known = ", ".join(self.jobs) or "none yet (start one with bash and background=true)"
            raise ToolError(f"{tool}: there is no background job {job_id!r}; the job ids are: {known}")
        return job

    def job_report(self, job: BackgroundJob) -> tuple[str, dict[str, Any]]:
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

    def close(self) -> None:
        if self._shell is not None:
            self._shell.close()
            self._shell = None
        for job in self.jobs.values():
            job.kill()


# ----------------------------------------------------------------------------- the tools

JOB_ID = object_schema({"job_id": {"type": "string", "description": "The id bash returned for the job."}}, ["job_id"])


@register("bash")
class Bash(Tool):
    def describe(self, box: Toolbox) -> tuple[str, dict[str, Any]]:
        timeout_s, max_chars = box.command_timeout_s, box.max_output_chars
        return (
            "Run a bash command in a persistent shell inside a sandbox (no network). The shell starts in the "
            "workspace; the current directory and exported variables persist between calls. stdout and stderr "
            "come back together with the exit code; stdin is /dev/null, so nothing interactive works. Protected "
            f"files are read-only. Output longer than {max_chars} characters is cut in the middle. A command "
            f"running longer than timeout_s (default {timeout_s:g} s) is killed together with the shell, which "
            "restarts in the workspace; run long commands with background=true and poll them with bash_output.",
            object_schema({
                "command": {"type": "string", "description": "The command(s) to run, as in a bash script."},
                "timeout_s": {"type": "number", "description": f"Time limit in seconds (default {timeout_s:g}, "
                                                               f"at most {max(timeout_s, MAX_TIMEOUT_S):g})."},
                "background": {"type": "boolean", "description":
                               "Start the command as a background job and return its job id at once. It runs in "
                               "its own sandbox from the shell's current directory with its exported variables "
                               "(no shell functions, and its own /tmp)."},
            }, ["command"]))

    def call(self, box: Toolbox, command: str, timeout_s: float | None = None,
             background: bool = False) -> ToolResult:
        if not command.strip():
            raise ToolError("bash: the command is empty")
        if timeout_s is not None and timeout_s <= 0:
            raise ToolError(f"bash: timeout_s must be positive, not {timeout_s}")
        session = box._bash
        if background:
            return session.start_job(command)
        limit = min(timeout_s or box.command_timeout_s, max(box.command_timeout_s, MAX_TIMEOUT_S))
        result: CommandResult = session.ensure_shell().run(command, limit)
        text, truncated = clip(result.head, box.max_output_chars, result.tail, result.dropped)
        meta = {"exit_code": result.exit_code, "timed_out": result.timed_out, "truncated": truncated}
        if text and not text.endswith("\n"):
            text += "\n"
        if result.timed_out:
            restarted = session.restart_shell()
            return ToolResult(f"{text}[timed out after {limit:g} s: the command was killed, with the shell and "
                              f"everything started from it (jobs started with background=true keep running); "
                              f"{restarted}. Run long commands with background=true.]",
                              error=True, metadata=meta)
        if result.shell_exited:
            restarted = session.restart_shell()
            return ToolResult(f"{text}exit code {result.exit_code}\n[the command ended the shell (exit, exec or "
                              f"set -e); {restarted}]", error=result.exit_code != 0,
                              metadata=meta | {"shell_restarted": True})
        return ToolResult(f"{text or NO_OUTPUT}exit code {result.exit_code}",
                          error=result.exit_code != 0, metadata=meta)


@register("bash_output")
class BashOutput(Tool):
    description = ("The output a background job printed since the last call for it, and whether it is still "
                   "running (its exit code once it has finished).")
    parameters = JOB_ID

    def call(self, box: Toolbox, job_id: str) -> ToolResult:
        session = box._bash
        text, meta = session.job_report(session.job(job_id, "bash_output"))
        return ToolResult(text, metadata=meta)


@register("kill_job")
class KillJob(Tool):
    description = "Stop a background job (and everything it started)."
    parameters = JOB_ID

    def call(self, box: Toolbox, job_id: str) -> ToolResult:
        session = box._bash
        job = session.job(job_id, "kill_job")
        if not job.running:
            text, meta = session.job_report(job)
            return ToolResult(f"job {job.job_id} had already finished\n{text}", metadata=meta)
        job.kill()
        text, meta = session.job_report(job)
        return ToolResult(f"killed job {job.job_id}\n{text}", metadata=meta)
