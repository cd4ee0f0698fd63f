"""OpenEnv (``openenv`` on PyPI, 0.10): our agent workspace as an OpenEnv environment, served over OpenEnv's
HTTP/WebSocket protocol. Checked against openenv 0.10.0 (docs/INTEGRATIONS.md).

    KernelAction       a tool call: ``tool`` (one of the episode's tools, or ``finish``) and its ``arguments``
    KernelObservation  ``content`` (a tool's output; at reset, SKILL.md and the task), ``messages`` and ``tools`` at
                       reset (the opening chat and the tools' schemas, as our loop sends them to a model),
                       ``error``; ``done`` and ``reward`` once the episode ends (``reward`` None where the final
                       evaluation has no verdict: ``metadata["no_verdict"]`` and ``metadata["reason"]`` say why)
    KernelState        the episode id, step count, task, whether it is done and its reward
    KernelEnv          ``reset(task=NAME | seed=N)`` opens a fresh workspace for a task of the server's task set,
                       ``step(action)`` runs one tool call; ``finish`` (or the step limit) closes the tools and
                       evaluates the workspace: that reward is the one ``run_episode`` gives for the same calls
    KernelEnvClient    OpenEnv's typed client for it (WebSocket session per client)
    KernelToolEnv      the same episode by OpenEnv's tool-environment convention (an ``MCPEnvironment``): our
                       tools (and ``finish``) as MCP tools, listed and called with ``ListToolsAction`` /
                       ``CallToolAction`` over ``/ws`` or JSON-RPC ``tools/list`` / ``tools/call`` on ``/mcp``;
                       each ``KernelToolObservation`` carries the turn's ``feedback``; what the OpenEnv package
                       (``envs/cuda_agent_env``, ``make_package_app``) serves
    KernelToolEnvClient  OpenEnv's ``MCPToolClient`` for it, with ``reset(task=...)``
    ReplyAction        single-turn: the model's one ``reply``, which writes the whole solution
    KernelReplyEnv     single-turn (the paper's stage 1): ``reset`` returns the single-turn prompt (``messages``, no
                       tools), one ``step(ReplyAction(reply=...))`` ends the episode with the reward TRL's
                       ``KernelReward`` and verl's ``compute_score`` give for that reply (``core.score_completion``)
    KernelReplyEnvClient  OpenEnv's typed client for it
    make_app / main    the server: ``python -m cuda_agent.integrations.openenv serve --tasks DIR --service URL``
                       (``--single-turn``: ``KernelReplyEnv``)

Per-turn feedback: a tool call that ran ``utils/compile.py``, ``verify.py`` or ``profile.py`` in the workspace
carries what each evaluation said (``core.feedback``: compile errors, correctness, speedups over eager and
torch.compile, the profile's counters on a GPU, a rejected candidate's rule) in the observation's ``feedback``, beside
the text the agent reads; the reward stays the closing evaluation's.

Every session has its own workspace, shell and command server (``SUPPORTS_CONCURRENT_SESSIONS``); the evaluations
go to the evaluation service when one is given, so many environment servers share one GPU pool.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import itertools
import os
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

try:
    from openenv.core.client_types import StepResult
    from openenv.core.env_client import EnvClient
    from openenv.core.env_server.http_server import create_fastapi_app
    from fastmcp import FastMCP
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
    from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
    from openenv.core.mcp_client import MCPToolClient
    from pydantic import Field
except ImportError as exc:  # pragma: no cover - the message is the point
    from cuda_agent.paths import install_hint
    raise ImportError(f"the OpenEnv adapter needs openenv ({exc}): {install_hint('openenv')}") from exc

from cuda_agent.agent.session import AgentConfig
from cuda_agent.candidates.triton import LANGUAGES
from cuda_agent.integrations.core import EvaluatorOptions, ToolEpisode, score_completion, single_turn_messages
from cuda_agent.integrations.tool_functions import tool_function, tool_schemas
from cuda_agent.tasks import Task, TaskError, load_tasks
from cuda_agent.train.evaluators import options_from_settings

ENV_NAME = "cuda_agent"
FINISH = "finish"  # the action that ends an episode (a model's reply without a tool call, in our loop)


FEEDBACK_DOC = ("what the evaluations this call ran said (utils/compile.py, verify.py, profile.py): command, status, "
                "stage, speedups over eager and torch.compile, reward, rule, reason, the profile's counters")


class KernelAction(Action):
    tool: str = Field(description=f"the tool to call (its schema is in the reset observation's tools), or "
                                  f"'{FINISH}' to end the episode and have the workspace evaluated")
    arguments: dict[str, Any] = Field(default_factory=dict, description="the tool's arguments")


class ReplyAction(Action):
    reply: str = Field(description="the model's one reply: the solution's files, each a path line (### model_new.py) "
                                   "followed by a fenced code block, as the reset observation's prompt asks")


class KernelObservation(Observation):
    content: str = Field(default="", description="the tool's output; at reset, SKILL.md and the task")
    error: bool = Field(default=False, description="the call failed (its content says why and what to do)")
    task: str = Field(default="", description="the task's name")
    messages: list[dict[str, Any]] = Field(default_factory=list,
                                           description="at reset: the opening chat (system prompt, SKILL.md, task)")
    tools: list[dict[str, Any]] = Field(default_factory=list, description="at reset: the tools' schemas")
    status: Optional[str] = Field(default=None, description="at the end: the final evaluation's status")
    feedback: list[dict[str, Any]] = Field(default_factory=list, description=FEEDBACK_DOC)


class KernelState(State):
    task: str = ""
    done: bool = False
    reward: Optional[float] = None  # None once done: no verdict (``reason`` says why), never the failure reward
    reason: str = ""  # why the ended episode earned what it did


class _OverTasks:
    """What both environments keep: the server's tasks by name, the turn ``reset`` follows without a name or
    seed, where evaluations go, and the episode's state."""

    def _set_tasks(self, tasks: Sequence[Task], options: EvaluatorOptions | None) -> None:
        if not tasks:
            raise TaskError("the environment needs at least one task")
        self.tasks = {task.name: task for task in tasks}
        self.order = itertools.cycle(list(self.tasks))
        self.options = options or EvaluatorOptions()
        self._state = KernelState(episode_id=None, step_count=0)

    def _pick(self, task: Optional[str], seed: Optional[int]) -> str:
        """The task a ``reset`` names: ``task`` (a name), else the ``seed``-th, else the next in turn."""
        names = list(self.tasks)
        if task is not None:
            if task not in self.tasks:
                raise ValueError(f"unknown task {task!r}; this server has: {', '.join(names[:20])}")
            return task
        if seed is not None:
            return names[int(seed) % len(names)]
        return next(self.order)

    @property
    def state(self) -> KernelState:
        return self._state


class KernelEnv(_OverTasks, Environment[KernelAction, KernelObservation, KernelState]):
    """One episode at a time over ``tasks``; a new ``reset`` abandons the episode in progress."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each instance has its own workspace, shell and command server

    def __init__(self, tasks: Sequence[Task], options: EvaluatorOptions | None = None, *,
                 config: AgentConfig | None = None, max_steps: int = 150, workdir: str | None = None):
        super().__init__()
        self._set_tasks(tasks, options)
        self.config = config or AgentConfig()
        self.max_steps, self.workdir = max_steps, workdir
        self.episode: ToolEpisode | None = None

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, task: Optional[str] = None,
              **kwargs: Any) -> KernelObservation:
        """A fresh workspace for ``task`` (a name), else the ``seed``-th task, else the next task in turn."""
        name = self._pick(task, seed)
        self._close()
        self.episode = ToolEpisode(self.tasks[name], self.options, self.config, self.workdir)
        messages = self.episode.open()
        self._state = KernelState(episode_id=episode_id or uuid.uuid4().hex[:12], step_count=0, task=name)
        return KernelObservation(content=messages[-1]["content"], task=name, messages=messages,
                                 tools=self.episode.tools)

    def step(self, action: KernelAction, timeout_s: Optional[float] = None, **kwargs: Any) -> KernelObservation:
        if self.episode is None or self._state.done:
            raise RuntimeError("no episode in progress: call reset first")
        self._state.step_count += 1
        if action.tool == FINISH:
            return self._finish("")
        content = self.episode.call(action.tool, action.arguments)
        error = bool(self.episode.calls[-1]["error"])
        if self._state.step_count >= self.max_steps:
            return self._finish(content, error=error)
        return KernelObservation(content=content, error=error, task=self._state.task,
                                 feedback=self.episode.last_feedback)

    def _finish(self, content: str, error: bool = False) -> KernelObservation:
        outcome = self.episode.finish()
        reward = self.episode.reward  # None: no verdict, no reward (the metadata's reason says why)
        self._state.done, self._state.reward, self._state.reason = True, reward, self.episode.reason
        summary = outcome.final.get("status", "")
        return KernelObservation(content=content or f"final evaluation: {self.episode.reason}", error=error,
                                 task=self._state.task, status=summary, done=True, reward=reward,
                                 feedback=self.episode.last_feedback if content else [],
                                 metadata=_outcome_metadata(outcome.final, reward, self.episode.reason))

    def get_metadata(self) -> EnvironmentMetadata:
        return _metadata("KernelEnv: one tool call per KernelAction")

    def close(self) -> None:
        self._close()

    def _close(self) -> None:
        if self.episode is not None:
            self.episode.close()
            self.episode = None


class KernelToolObservation(CallToolObservation):
    """A tool call's observation (OpenEnv's ``CallToolObservation``: ``tool_name``, ``result``, ``error``) with the
    turn's ``feedback``; at the end (``finish``, or the step limit) ``done``, ``reward``, ``status`` and the
    metadata's ``final``, ``reason`` and ``no_verdict``."""

    task: str = Field(default="", description="the task's name")
    feedback: list[dict[str, Any]] = Field(default_factory=list, description=FEEDBACK_DOC)
    status: Optional[str] = Field(default=None, description="at the end: the final evaluation's status")


class KernelToolEnv(_OverTasks, MCPEnvironment):
    """``KernelEnv``'s episode by OpenEnv's tool-environment convention: ``reset(task=NAME | seed=N)`` opens a fresh
    workspace (the observation holds the opening messages and the tools' schemas); our tools and ``finish`` are MCP
    tools of a FastMCP server, called with ``CallToolAction``; ``finish`` (or the step limit) closes the tools and
    evaluates the workspace. A tool's text is the ``result``; a bad call is an error text, as our loop sends it."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, tasks: Sequence[Task], options: EvaluatorOptions | None = None, *,
                 config: AgentConfig | None = None, max_steps: int = 150, workdir: str | None = None,
                 readme: str | None = None):
        self.config = config or AgentConfig()
        server = FastMCP("cuda-agent")
        for schema in tool_schemas(self.config):
            server.tool(_threaded(tool_function(schema, self._call)))
        server.tool(_threaded(self.finish))
        super().__init__(server)
        self._set_tasks(tasks, options)
        self.max_steps, self.workdir, self.readme = max_steps, workdir, readme
        self.episode: ToolEpisode | None = None
        self._ended: KernelToolObservation | None = None

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, task: Optional[str] = None,
              **kwargs: Any) -> KernelObservation:
        """A fresh workspace for ``task`` (a name), else the ``seed``-th task, else the next task in turn."""
        name = self._pick(task, seed)
        self._close()
        self.episode = ToolEpisode(self.tasks[name], self.options, self.config, self.workdir)
        messages = self.episode.open()
        self._state = KernelState(episode_id=episode_id or uuid.uuid4().hex[:12], step_count=0, task=name)
        return KernelObservation(content=messages[-1]["content"], task=name, messages=messages,
                                 tools=self.episode.tools + [FINISH_SCHEMA])

    def finish(self) -> str:
        """End the episode: close the tools and evaluate the workspace as it is; the evaluation's reward is the
        episode's. Call it when model_new.py is the solution to submit.

        Returns:
            The final evaluation in brief.
        """
        self._open_episode()
        self._end()
        return f"final evaluation: {self.episode.reason}"

    def _end(self) -> None:
        """Close the tools and evaluate (once); the state holds the reward."""
        self.episode.finish()
        self._state.done, self._state.reward, self._state.reason = True, self.episode.reward, self.episode.reason

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        return self._open_episode().call(name, arguments)

    def _open_episode(self) -> ToolEpisode:
        if self.episode is None or self._state.done:
            raise RuntimeError("no episode in progress: call reset first")
        return self.episode

    def _step_impl(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        raise ValueError(f"this environment takes MCP actions (ListToolsAction, CallToolAction), not "
                         f"{type(action).__name__}: list the tools, then call one by name")

    def step(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        if not isinstance(action, CallToolAction):
            return super().step(action, timeout_s=timeout_s, **kwargs)
        before = len(self._open_episode().calls)
        return self._observe(action, super().step(action, timeout_s=self._timeout(timeout_s), **kwargs), before)

    async def step_async(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        if not isinstance(action, CallToolAction):
            return await super().step_async(action, timeout_s=timeout_s, **kwargs)
        before = len(self._open_episode().calls)
        observed = await super().step_async(action, timeout_s=self._timeout(timeout_s), **kwargs)
        return await asyncio.to_thread(self._observe, action, observed, before)

    def _timeout(self, timeout_s: Optional[float]) -> float:
        # OpenEnv's MCP default (30 s) is shorter than a build and a verification: the command's own limit, and
        # the closing evaluation's time for finish.
        return timeout_s or self.config.command_timeout_s + 600.0

    def _observe(self, action: CallToolAction, observed: Observation, before: int) -> KernelToolObservation:
        """The MCP observation with the turn's feedback (none where the call ran no tool of ours: ``finish``, or a
        call refused before it ran); the end of the episode where this call ended it."""
        self._state.step_count += 1
        fields = {"tool_name": action.tool_name, "task": self._state.task,
                  "result": getattr(observed, "result", None), "error": getattr(observed, "error", None)}
        feedback = self.episode.last_feedback if len(self.episode.calls) > before else []
        if not self._state.done and self._state.step_count < self.max_steps:
            return KernelToolObservation(**fields, feedback=feedback)
        if not self._state.done:
            self._end()
        final, reward = self.episode.outcome.final, self.episode.reward
        return KernelToolObservation(**fields, feedback=feedback, status=final.get("status"), done=True,
                                     reward=reward, metadata=_outcome_metadata(final, reward, self.episode.reason))

    def get_metadata(self) -> EnvironmentMetadata:
        return _metadata("KernelToolEnv: MCP tools (OpenEnv's tool-environment convention)", self.readme)

    def close(self) -> None:
        self._close()
        super().close()

    def _close(self) -> None:
        if self.episode is not None:
            self.episode.close()
            self.episode = None


FINISH_SCHEMA = {"type": "function", "function": {
    "name": FINISH, "description": "End the episode: close the tools and evaluate the workspace; its reward is the "
                                   "episode's.", "parameters": {"type": "object", "properties": {}}}}


def _threaded(function):
    """An async twin of a blocking tool: FastMCP awaits it on the server's event loop, so the call itself (a build,
    an evaluation, minutes) runs in a worker thread and other sessions go on."""

    @functools.wraps(function)
    async def threaded(*args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(function, *args, **kwargs)

    threaded.__signature__ = inspect.signature(function)  # type: ignore[attr-defined]
    return threaded


DESCRIPTION = ("Write fast, verified CUDA kernels for PyTorch programs (KernelBench format). Each episode opens a "
               "sandboxed workspace with the task's model.py, a model_new.py to rewrite, kernels/ and "
               "utils/compile.py|verify.py|profile.py, whose numbers come from a trusted evaluator; tools: bash "
               "(bash_output, kill_job), read, write, edit, multi_edit, glob, grep, todo_write, finish. Each tool "
               "call's observation carries feedback: what its evaluations said (compile errors, correctness, "
               "speedups over eager and torch.compile, the profile); the reward is the closing evaluation's milestone reward (-1 incorrect, 1 correct, 2 faster "
               "than eager, 3 faster than eager and torch.compile), None where the evaluator could not decide. "
               "Candidates are treated as adversaries: checked statically and at run time, rejected by named rule.")


def _metadata(kind: str, readme: str | None = None) -> EnvironmentMetadata:
    from cuda_agent import __version__

    text = Path(readme).read_text() if readme and Path(readme).is_file() else None
    return EnvironmentMetadata(name="cuda_agent_env", description=f"{DESCRIPTION} ({kind})", readme_content=text,
                               version=__version__, documentation_url="https://github.com/cuda-agent/cuda-agent/"
                                                                      "blob/main/docs/INTEGRATIONS.md")


class KernelReplyEnv(_OverTasks, Environment[ReplyAction, KernelObservation, KernelState]):
    """Single-turn episodes over ``tasks``: ``reset`` gives the prompt, one ``step(ReplyAction(reply=...))`` scores
    the reply and ends the episode. No workspace: the reply is parsed into a candidate and evaluated."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, tasks: Sequence[Task], options: EvaluatorOptions | None = None, language: str = "cuda"):
        super().__init__()
        self._set_tasks(tasks, options)
        self.language = language  # the kernels the prompt asks for and the reply must be in

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, task: Optional[str] = None,
              **kwargs: Any) -> KernelObservation:
        """The single-turn prompt of ``task`` (a name), else the ``seed``-th task, else the next task in turn."""
        name = self._pick(task, seed)
        messages = single_turn_messages(self.tasks[name], self.language)
        self._state = KernelState(episode_id=episode_id or uuid.uuid4().hex[:12], step_count=0, task=name)
        return KernelObservation(content=messages[-1]["content"], task=name, messages=messages)

    def step(self, action: ReplyAction, timeout_s: Optional[float] = None, **kwargs: Any) -> KernelObservation:
        if not self._state.task or self._state.done:
            raise RuntimeError("no episode in progress: call reset first")
        self._state.step_count += 1
        outcome = score_completion(self.tasks[self._state.task], action.reply, self.options, self.language)
        self._state.done, self._state.reward, self._state.reason = True, outcome.reward, outcome.reason
        return KernelObservation(content=f"evaluation: {outcome.reason}", task=self._state.task,
                                 status=outcome.status, done=True, reward=outcome.reward,
                                 metadata=_outcome_metadata(outcome.evaluation or {}, outcome.reward, outcome.reason))


def _outcome_metadata(final: dict[str, Any], reward: float | None, reason: str) -> dict[str, Any]:
    """An ended episode's metadata: the final evaluation in brief and why it earned what it did; ``no_verdict``
    where the reward is None because the evaluator could not decide (not the failure reward)."""
    return {"final": _brief(final), "reason": reason, "no_verdict": reward is None}


def _brief(final: dict[str, Any]) -> dict[str, Any]:
    keys = ("status", "reward", "speedup_eager", "speedup_compile", "reason", "rule", "attempts")
    return {k: final.get(k) for k in keys if k in final}


class KernelEnvClient(EnvClient[KernelAction, KernelObservation, KernelState]):
    """``with KernelEnvClient(base_url=URL).sync() as env: env.reset(task=...); env.step(KernelAction(...))``."""

    def _step_payload(self, action: KernelAction) -> dict[str, Any]:
        return action.model_dump()

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[KernelObservation]:
        fields = dict(payload.get("observation") or {})
        observation = KernelObservation(**fields, reward=payload.get("reward"), done=bool(payload.get("done")))
        return StepResult(observation=observation, reward=payload.get("reward"), done=bool(payload.get("done")),
                          metadata=payload.get("metadata"))

    def _parse_state(self, payload: dict[str, Any]) -> KernelState:
        return KernelState(**payload)


class KernelToolEnvClient(MCPToolClient):
    """OpenEnv's MCP tool client for ``KernelToolEnv`` (the package's server): ``reset(task=...)``, ``list_tools()``,
    ``call_tool(name, **arguments)`` or ``step(CallToolAction(...))`` for the observation with its feedback, then
    ``step(CallToolAction(tool_name="finish"))`` for the reward."""

    def __init__(self, base_url: str, **kwargs: Any):
        kwargs.setdefault("message_timeout_s", 900.0)  # a tool call may build and evaluate for minutes
        super().__init__(base_url=base_url, **kwargs)

    def _parse_result(self, payload: dict[str, Any]) -> StepResult:
        # MCPToolClient reads any observation with `tools` as a tool list and keeps only CallToolObservation's own
        # fields of a call: ours carry the opening messages, the feedback and the status besides.
        fields = dict(payload.get("observation") or {})
        done, reward = bool(payload.get("done")), payload.get("reward")
        if "tool_name" in fields:
            observation = KernelToolObservation(**{**fields, "done": done, "reward": reward})
        elif "messages" in fields:
            observation = KernelObservation(**{**fields, "done": done, "reward": reward})
        else:
            return super()._parse_result(payload)
        return StepResult(observation=observation, reward=reward, done=done, metadata=payload.get("metadata"))


class KernelReplyEnvClient(KernelEnvClient):
    """``with KernelReplyEnvClient(base_url=URL).sync() as env: env.reset(task=...); env.step(ReplyAction(reply=...))``
    against a ``serve --single-turn`` server."""


def make_app(tasks: Sequence[Task], options: EvaluatorOptions | None = None, *, max_sessions: int = 8,
             max_steps: int = 150, config: AgentConfig | None = None, workdir: str | None = None,
             single_turn: bool = False, mcp: bool = False):
    """OpenEnv's FastAPI app (HTTP and WebSocket routes, ``/schema``, ``/health``, ``/metadata``, ``/mcp``) over
    ``KernelEnv`` (with ``single_turn``: ``KernelReplyEnv``; with ``mcp``: ``KernelToolEnv``): one environment per
    WebSocket session, at most ``max_sessions`` at once."""
    tasks = list(tasks)
    if mcp:
        return create_fastapi_app(lambda: KernelToolEnv(tasks, options, config=config, max_steps=max_steps,
                                                        workdir=workdir),
                                  CallToolAction, KernelToolObservation, max_concurrent_envs=max_sessions,
                                  env_name=ENV_NAME, state_cls=KernelState)
    if single_turn:
        language = config.language if config is not None else "cuda"
        return create_fastapi_app(lambda: KernelReplyEnv(tasks, options, language), ReplyAction, KernelObservation,
                                  max_concurrent_envs=max_sessions, env_name=ENV_NAME, state_cls=KernelState)

    def factory() -> KernelEnv:
        return KernelEnv(tasks, options, config=config, max_steps=max_steps, workdir=workdir)

    return create_fastapi_app(factory, KernelAction, KernelObservation, max_concurrent_envs=max_sessions,
                              env_name=ENV_NAME, state_cls=KernelState)


TASKS_ENV = "CUDA_AGENT_TASKS"  # the package server's task source (``cuda-agent export --format openenv`` writes it)


def make_package_app(readme: str | None = None, environ: Any = None):
    """The OpenEnv package's server app (``envs/cuda_agent_env/server/app.py``): ``KernelToolEnv`` over the tasks of
    ``$CUDA_AGENT_TASKS`` (default: the bundled examples), evaluations as the environment says (``$CUDA_AGENT_SERVICE``,
    ``$CUDA_AGENT_REWARD_*``), at most ``$CUDA_AGENT_MAX_SESSIONS`` sessions (8) of ``$CUDA_AGENT_MAX_STEPS`` tool
    calls (150); ``readme`` is what ``/metadata`` shows."""
    from cuda_agent.paths import EXAMPLES

    environ = os.environ if environ is None else environ
    tasks = load_tasks(environ.get(TASKS_ENV) or EXAMPLES)
    options = options_from_settings(environ=environ)
    sessions, steps = int(environ.get("CUDA_AGENT_MAX_SESSIONS") or 8), int(environ.get("CUDA_AGENT_MAX_STEPS") or 150)

    def factory() -> KernelToolEnv:
        return KernelToolEnv(tasks, options, max_steps=steps, readme=readme)

    return create_fastapi_app(factory, CallToolAction, KernelToolObservation, max_concurrent_envs=sessions,
                              env_name="cuda_agent_env", state_cls=KernelState)


def main(argv: list[str] | None = None, prog: str = "python -m cuda_agent.integrations.openenv") -> int:
    """``serve``: the environment server (``cuda-agent env serve`` once the CLI registers it, with ``prog``
    "cuda-agent env")."""
    parser = argparse.ArgumentParser(prog=prog,
                                     description="Serve the kernel environment over OpenEnv's protocol.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="the OpenEnv server (HTTP and WebSocket)")
    serve.add_argument("--tasks", required=True, help="a task source: a task file, a folder of them, KernelBench, "
                                                      "JSONL/parquet, a hub dataset")
    serve.add_argument("--levels", type=int, nargs="*", help="only these KernelBench levels")
    serve.add_argument("--service", help="the evaluation service's URL (cuda-agent serve); default "
                                         "$CUDA_AGENT_SERVICE, else evaluators on this machine")
    serve.add_argument("--device", default="auto")
    serve.add_argument("--policy", default="fair")
    serve.add_argument("--sandbox", default="auto")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-sessions", type=int, default=8, help="environments (WebSocket sessions) at once")
    serve.add_argument("--max-steps", type=int, default=150, help="tool calls per episode (the paper: 150)")
    mode = serve.add_mutually_exclusive_group()
    mode.add_argument("--single-turn", action="store_true",
                      help="single-turn episodes: reset gives the prompt, one ReplyAction(reply=...) is scored")
    mode.add_argument("--mcp", action="store_true",
                      help="the tools as MCP tools (KernelToolEnv, OpenEnv's tool-environment convention), as the "
                           "OpenEnv package serves them")
    serve.add_argument("--language", default="cuda", choices=LANGUAGES,
                       help="the kernels episodes ask for: cuda (C++/CUDA extensions) or triton")
    args = parser.parse_args(argv)
    import uvicorn

    options = EvaluatorOptions(args.service, args.device, args.policy, args.sandbox)
    app = make_app(load_tasks(args.tasks, args.levels or None), options, max_sessions=args.max_sessions,
                   max_steps=args.max_steps, single_turn=args.single_turn, mcp=args.mcp,
                   config=AgentConfig(language=args.language))
    uvicorn.run(app, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
