"""verifiers (``verifiers`` 0.4, ``verifiers.v1``: prime-rl's environment library): the kernel episode as a
verifiers taskset plugin. Checked against verifiers 0.4.0 (docs/INTEGRATIONS.md says why this shape).

verifiers resolves a taskset id by importing it as a top-level module and taking the ``Taskset``, ``Harness``
and ``Env`` subclasses its ``__all__`` exports; the package ``cuda_agent_kernels`` exports these, so users name
``cuda-agent-kernels``::

    CUDA_AGENT_SERVICE=http://HOST:8470 vf-eval cuda-agent-kernels --env.taskset.tasks examples/ \\
        -m MODEL --client.base-url http://HOST:8000/v1 -r 2

    KernelTaskset  the tasks of ``tasks`` (a task file, a folder of them, KernelBench, JSONL/parquet, a hub
                   dataset), one ``KernelTask`` each; its data carries the task (``name``, ``code``, ...)
    KernelTask     the metrics (``kernel_metrics``: correct, fast_0/1/2, speedups over eager and torch.compile,
                   the reward's parts, no_verdict; ``core.rollout_metrics``) of every rollout, and
                   the reward: ``kernel_reward``, the closing evaluation's (what ``run_episode`` gives); where that
                   evaluation has no verdict (the evaluator could not decide) there is no reward: the state says
                   so (``no_verdict``, ``reason``), the program ends with exit code 3 and the reason on stderr
                   (verifiers records the rollout's program as failed), and ``kernel_reward`` is NaN, not a
                   number a trainer could learn from, never the failure reward
    KernelHarness  the program the model runs in, the taskset's default: our episode (a fresh workspace, our
                   tools, the closing trusted evaluation) with every model call sent to verifiers' interception
                   endpoint, so verifiers records the trace (and, for prime-rl, its tokens) and applies its
                   model, sampling and limits. verifiers 0.4 documents this in ``Harness.launch``: a harness may
                   run its loop in-process as long as every model call goes through ``endpoint`` + ``secret``.
                   With ``single_turn`` (``--env.agent.harness.single-turn``) it makes one model call instead,
                   the single-turn prompt without tools, and scores the reply as TRL's ``KernelReward`` and
                   verl's ``compute_score`` do (``integrations.core.score_completion``)
    KernelEnv      one agent seat, the subprocess runtime by default (the harness runs in the env worker;
                   a Prime sandbox per rollout would sit idle)

Evaluations go to the evaluation service (``$CUDA_AGENT_SERVICE``, or the harness config's ``service``), else
to local evaluators (``device``, ``policy``, ``sandbox``); ``KernelHarness.evaluator`` takes an ``EvaluatorLike``
for in-process callers (one that is safe to share between the worker's concurrent rollouts).
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Iterator

try:
    import verifiers.v1 as vf
except ImportError as exc:  # pragma: no cover - the message is the point
    from cuda_agent.paths import install_hint
    raise ImportError(f"the verifiers adapter needs verifiers 0.4 ({exc}): {install_hint('verifiers')} "
                      "(it cannot share an environment with openenv 0.10: verifiers pins mcp 2)") from exc

from cuda_agent.agent.llm import OpenAIChat
from cuda_agent.agent.loop import run_episode
from cuda_agent.agent.session import AgentConfig
from cuda_agent.evaluate.result import no_reward_reason
from cuda_agent.integrations.core import (FAILURE_REWARD, EvaluatorOptions, rollout_metrics, score_completion,
                                          single_turn_messages, task_columns, task_from_row)
from cuda_agent.tasks import TaskError, load_tasks

__all__ = ["KernelData", "KernelEnv", "KernelEnvConfig", "KernelHarness", "KernelHarnessConfig", "KernelState",
           "KernelTask", "KernelTaskset", "KernelTasksetConfig", "TASKSET_ID"]

TASKSET_ID = "cuda-agent-kernels"  # what users name: the package cuda_agent_kernels (taskset, harness and env)


class KernelData(vf.TaskData):
    """A task as verifiers' wire data: ``name`` (TaskData's) and the task's other columns."""

    code: str
    source: str = ""
    level: int | None = None
    problem_id: int | None = None


class KernelState(vf.State):
    """What the harness leaves on the trace for scoring: the closing evaluation (single-turn: the reply's)."""

    reward: float | None = None
    status: str | None = None
    end_reason: str | None = None
    no_verdict: bool = False  # the closing evaluation had no verdict: no reward (``reason`` says why)
    reason: str | None = None  # why the rollout earned what it did (a failure's or a no-verdict's reason among them)
    metrics: dict[str, float] = {}  # core.rollout_metrics of the closing evaluation


NO_VERDICT_EXIT = 3  # the program's exit code where the closing evaluation has no verdict (as ``cuda-agent eval``'s)


class KernelTask(vf.Task[KernelData, KernelState]):
    @property
    def key(self) -> str:
        # The task's name is durable across runs; the default (a content hash) is too, but unreadable.
        return self.data.name or self.hash

    @vf.metric
    async def kernel_metrics(self, trace: vf.Trace) -> dict[str, float]:
        """The rollout's metrics (``core.rollout_metrics``): every rollout has all of them, a rollout that never
        reached an evaluation its zeros."""
        return dict(trace.state.metrics) or rollout_metrics(None)

    @vf.reward
    async def kernel_reward(self, trace: vf.Trace) -> float:
        """The closing evaluation's reward; the failure reward when the episode never reached it; NaN (no
        score) when it had no verdict."""
        if trace.state.no_verdict:
            return math.nan
        reward = trace.state.reward
        return FAILURE_REWARD if reward is None else float(reward)


class KernelTasksetConfig(vf.TasksetConfig):
    tasks: str | None = None
    """A task source: a task file, a folder of them, a KernelBench tree, JSONL/parquet, a hub dataset."""
    levels: list[int] | None = None
    """Only these KernelBench levels."""


class KernelTaskset(vf.Taskset[KernelTask, KernelTasksetConfig]):
    def load(self) -> Iterator[KernelTask]:
        if not self.config.tasks:
            raise TaskError("the kernel taskset needs its tasks: --env.taskset.tasks PATH (a task file, a folder "
                            "of them, KernelBench, JSONL/parquet or a hub dataset)")
        for task in load_tasks(self.config.tasks, self.config.levels):
            # The prompt is the task; the harness opens the episode with our own first messages (SKILL.md, the
            # task and the workspace's path, known once the workspace exists), which the trace records.
            prompt = f"# The task: model.py\n\n```python\n{task.code}\n```"
            yield KernelTask(KernelData(id=task.name, prompt=prompt, **task_columns(task)), self.config.task)


class KernelHarnessConfig(vf.HarnessConfig):
    service: str | None = None
    """The evaluation service's URL (cuda-agent serve); default $CUDA_AGENT_SERVICE, else local evaluators."""
    single_turn: bool = False
    """One model call, no tools: the reply writes the whole solution (the paper's stage 1), parsed and evaluated
    as TRL's and verl's single-turn rewards do. Default: the agentic episode."""
    device: str = "auto"
    policy: str = "fair"
    sandbox: str = "auto"
    time_compile: bool = True
    """Time the torch.compile baseline (without it no candidate earns the reward for beating it)."""
    max_turns: int = 150
    """Model turns per episode (the paper: 150); verifiers' own --env.agent.max-turns also ends it."""
    command_timeout_s: float = 300.0
    max_output_chars: int = 20_000
    workdir: str | None = None
    """Where episodes' scratch folders go (default: the system's temporary folder)."""
    language: str = "cuda"
    """The kernels episodes ask for: cuda (C++/CUDA extensions) or triton."""


class KernelHarness(vf.Harness[KernelHarnessConfig]):
    """Our episode, in-process, its model calls through verifiers' interception (see the module's doc)."""

    NEEDS_CONTAINER = False  # the agent's shell runs in our own bubblewrap sandbox, not in verifiers' runtime
    evaluator: ClassVar[Any] = None  # an EvaluatorLike for in-process callers; else the config's

    async def launch(self, ctx: Any, trace: vf.Trace, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData, **_: Any) -> vf.ProgramResult:
        if mcp_urls:
            raise vf.HarnessError(f"the kernel harness offers our tools only; it cannot wire in the tool servers "
                                  f"{sorted(mcp_urls)} (pair it with the kernel taskset)")
        task = task_from_row(data.model_dump())
        if self.config.single_turn:
            return await self._single_turn(task, ctx.model, endpoint, secret, trace)
        # The episode blocks (tools, builds, evaluations): a thread keeps the worker's other rollouts going.
        episode = await asyncio.to_thread(self._episode, task, ctx.model, endpoint, secret)
        trace.state.reward = episode.reward
        trace.state.status = episode.final.get("status")
        trace.state.end_reason = episode.end_reason
        trace.state.metrics = rollout_metrics(episode.final)
        if trace.state.status == "error":
            return _no_verdict(trace, no_reward_reason(episode.final))
        trace.state.reason = _reason(episode.final)
        _record(trace)
        return vf.ProgramResult(exit_code=0, stdout=f"final evaluation: {trace.state.reason}", stderr="")

    def _options(self) -> EvaluatorOptions:
        config = self.config
        return EvaluatorOptions(config.service, config.device, config.policy, config.sandbox, self.evaluator,
                                config.time_compile)

    async def _single_turn(self, task, model: str, endpoint: str, secret: str, trace: vf.Trace) -> vf.ProgramResult:
        """One model call through the interception (the single-turn prompt, no tools), its reply scored."""
        backend = OpenAIChat(model, base_url=endpoint, api_key=secret)
        reply = await asyncio.to_thread(backend.complete, single_turn_messages(task, self.config.language), [])
        outcome = await asyncio.to_thread(score_completion, task, reply.content, self._options(), self.config.language)
        trace.state.reward = outcome.reward
        trace.state.status = outcome.status
        trace.state.end_reason = "single_turn"
        trace.state.metrics = rollout_metrics(outcome.evaluation)
        if outcome.no_verdict:
            return _no_verdict(trace, outcome.reason)
        trace.state.reason = outcome.reason
        _record(trace)
        return vf.ProgramResult(exit_code=0, stdout=f"single-turn reply: {outcome.reason}", stderr="")

    def _episode(self, task, model: str, endpoint: str, secret: str):
        config = self.config
        options = self._options()
        # The interception sets the model, sampling and limits itself; the loop only speaks to it.
        backend = OpenAIChat(model, base_url=endpoint, api_key=secret)
        agent = AgentConfig(max_turns=config.max_turns, command_timeout_s=config.command_timeout_s,
                            max_output_chars=config.max_output_chars, language=config.language)
        with options.lend() as evaluator, tempfile.TemporaryDirectory(prefix="cuda-agent-vf-",
                                                                       dir=config.workdir) as where:
            return run_episode(task, backend, evaluator, Path(where), config=agent, model=model,
                               sandbox=config.sandbox)


def _reason(final: dict[str, Any]) -> str:
    """Why an evaluated rollout earned what it did: its status, the rule a rejected candidate broke, and the
    evaluator's reason for anything but a correct candidate (a compile error, the first wrong output, ...)."""
    reason = str(final.get("status")) + (f" ({final['rule']})" if final.get("rule") else "")
    return reason if final.get("status") == "correct" or not final.get("reason") else f"{reason}: {final['reason']}"


def _record(trace: vf.Trace) -> None:
    """The outcome on the trace itself (``info["cuda_agent"]``: verifiers saves a trace's info with it, not its
    state): status, why, whether the evaluation had no verdict, how the episode ended."""
    state = trace.state
    trace.info["cuda_agent"] = {"status": state.status, "reason": state.reason, "no_verdict": state.no_verdict,
                                "end_reason": state.end_reason}


def _no_verdict(trace: vf.Trace, reason: str) -> vf.ProgramResult:
    """The rollout's end where its evaluation had no verdict: no reward, the reason on the state, the trace's info
    and stderr (verifiers records the exit code as the rollout's harness error, with the reason, and scores
    nothing: no reward, no metrics)."""
    trace.state.reward, trace.state.no_verdict, trace.state.reason = None, True, reason
    _record(trace)
    return vf.ProgramResult(exit_code=NO_VERDICT_EXIT, stdout="", stderr=reason)


class KernelEnvConfig(vf.EnvConfig):
    # Constructed, not validated: validating would resolve the harness id by importing this plugin mid-import.
    agent: vf.AgentConfig = vf.AgentConfig.model_construct(runtime=vf.SubprocessConfig(),
                                                           harness=KernelHarnessConfig(id=TASKSET_ID))
    """The one seat: the policy under evaluation or training (``--env.agent.*``). Its harness is ours, named, so
    that ``--env.agent.harness.single-turn`` (or any of its knobs) merges onto it; verifiers would read an unnamed
    harness block as ``bash``'s."""


class KernelEnv(vf.Env[KernelEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        await agents.agent.run(task)
