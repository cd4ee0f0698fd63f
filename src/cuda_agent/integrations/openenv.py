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
    ReplyAction        single-turn: the model's one ``reply``, which writes the whole solution
    KernelReplyEnv     single-turn (the paper's stage 1): ``reset`` returns the single-turn prompt (``messages``, no
                       tools), one ``step(ReplyAction(reply=...))`` ends the episode with the reward TRL's
                       ``KernelReward`` and verl's ``compute_score`` give for that reply (``core.score_completion``)
    KernelReplyEnvClient  OpenEnv's typed client for it
    make_app / main    the server: ``python -m cuda_agent.integrations.openenv serve --tasks DIR --service URL``
                       (``--single-turn``: ``KernelReplyEnv``)

Every session has its own workspace, shell and command server (``SUPPORTS_CONCURRENT_SESSIONS``); the evaluations
go to the evaluation service when one is given, so many environment servers share one GPU pool.
"""

from __future__ import annotations

import argparse
import itertools
import uuid
from typing import Any, Optional, Sequence

try:
    from openenv.core.client_types import StepResult
    from openenv.core.env_client import EnvClient
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(f"the OpenEnv adapter needs openenv ({exc}): pip install 'cuda-agent[openenv]'") from exc

from cuda_agent.agent.session import AgentConfig
from cuda_agent.candidates.triton import LANGUAGES
from cuda_agent.integrations.core import EvaluatorOptions, ToolEpisode, score_completion, single_turn_messages
from cuda_agent.tasks import Task, TaskError, load_tasks

ENV_NAME = "cuda_agent"
FINISH = "finish"  # the action that ends an episode (a model's reply without a tool call, in our loop)


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
        return KernelObservation(content=content, error=error, task=self._state.task)

    def _finish(self, content: str, error: bool = False) -> KernelObservation:
        outcome = self.episode.finish()
        reward = self.episode.reward  # None: no verdict, no reward (the metadata's reason says why)
        self._state.done, self._state.reward, self._state.reason = True, reward, self.episode.reason
        summary = outcome.final.get("status", "")
        return KernelObservation(content=content or f"final evaluation: {self.episode.reason}", error=error,
                                 task=self._state.task, status=summary, done=True, reward=reward,
                                 metadata=_outcome_metadata(outcome.final, reward, self.episode.reason))

    def close(self) -> None:
        self._close()

    def _close(self) -> None:
        if self.episode is not None:
            self.episode.close()
            self.episode = None


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


class KernelReplyEnvClient(KernelEnvClient):
    """``with KernelReplyEnvClient(base_url=URL).sync() as env: env.reset(task=...); env.step(ReplyAction(reply=...))``
    against a ``serve --single-turn`` server."""


def make_app(tasks: Sequence[Task], options: EvaluatorOptions | None = None, *, max_sessions: int = 8,
             max_steps: int = 150, config: AgentConfig | None = None, workdir: str | None = None,
             single_turn: bool = False):
    """OpenEnv's FastAPI app (HTTP and WebSocket routes, ``/schema``, ``/health``) over ``KernelEnv`` (with
    ``single_turn``: ``KernelReplyEnv``): one environment per WebSocket session, at most ``max_sessions`` at once."""
    tasks = list(tasks)
    if single_turn:
        language = config.language if config is not None else "cuda"
        return create_fastapi_app(lambda: KernelReplyEnv(tasks, options, language), ReplyAction, KernelObservation,
                                  max_concurrent_envs=max_sessions, env_name=ENV_NAME, state_cls=KernelState)

    def factory() -> KernelEnv:
        return KernelEnv(tasks, options, config=config, max_steps=max_steps, workdir=workdir)

    return create_fastapi_app(factory, KernelAction, KernelObservation, max_concurrent_envs=max_sessions,
                              env_name=ENV_NAME, state_cls=KernelState)


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
    serve.add_argument("--single-turn", action="store_true",
                       help="single-turn episodes: reset gives the prompt, one ReplyAction(reply=...) is scored")
    serve.add_argument("--language", default="cuda", choices=LANGUAGES,
                       help="the kernels episodes ask for: cuda (C++/CUDA extensions) or triton")
    args = parser.parse_args(argv)
    import uvicorn

    options = EvaluatorOptions(args.service, args.device, args.policy, args.sandbox)
    app = make_app(load_tasks(args.tasks, args.levels or None), options, max_sessions=args.max_sessions,
                   max_steps=args.max_steps, single_turn=args.single_turn, config=AgentConfig(language=args.language))
    uvicorn.run(app, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
