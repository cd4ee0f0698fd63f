"""Our agentic episode as a verl agent loop: verl's trainer and rollout servers, our workspace, tools and loop.

``CudaAgentLoop`` (registered as ``cuda_agent``) runs one episode per dataset row (``data.tasks_to_parquet``):
``agent.loop.run_episode`` over ``TokenChat``, through ``train.episodes.EpisodeRunner`` exactly as
``cuda-agent train ppo`` runs it, with verl's rollout server as the token backend (``ServerBackend``), and
returns the episode's one token sequence as verl's ``AgentLoopOutput``:

    prompt_ids         the tokens before the first sampled one
    response_ids       from the first sampled token to the last: sampled replies and, between them, the tool
                       results and template tokens; trailing tool tokens are trimmed, so the reward verl puts
                       on the last response token lands on a token the policy chose (``train.rollout.Rollout``)
    response_mask      1 on sampled tokens, 0 elsewhere
    response_logprobs  the server's sampling logprobs (0.0 off the mask); None when it sent none
    reward_score       the episode's outcome: the final evaluation's reward (the failure reward without one)

One verl sample is one token sequence, so an episode ends (as verl's own tool loop does) where it would not
extend its sequence: when the response budget (``rollout.response_length``) is spent, or after a reply cut at
the token limit (its next prompt re-renders the history). The first prompt (system prompt, SKILL.md, the task)
must fit ``rollout.prompt_length``: a clear error says by how much it does not.

Our loop is synchronous (tools, evaluations, a Unix-socket command server): each episode runs in a thread
of its own, and its generation requests go back to verl's event loop (``asyncio.run_coroutine_threadsafe``).

In verl's config, ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` names a YAML list::

    - name: cuda_agent
      _target_: cuda_agent.train.verl.agent_loop.CudaAgentLoop
      service: http://HOST:PORT     # the evaluation service (cuda-agent serve); or set CUDA_AGENT_SERVICE
      max_turns: 150
      episodes: 32                  # episodes at once per agent-loop worker

Keys beyond ``name`` and ``_target_`` are ``CudaAgentLoop``'s options.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from uuid import uuid4

try:
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
    from omegaconf import OmegaConf  # verl's own configuration library
except ImportError as exc:  # pragma: no cover - the message is the point
    from cuda_agent.paths import install_hint
    raise ImportError(f"the verl agent loop needs verl ({exc}): {install_hint('verl')}") from exc

from cuda_agent.agent.llm import BackendError
from cuda_agent.agent.tokens import TokenOutput
from cuda_agent.train.episodes import EpisodeOutcome, EpisodeRunner
from cuda_agent.tasks.rows import row_language, task_from_row
from cuda_agent.train.evaluators import lend_evaluator
from cuda_agent.train.verl.data import AGENT_NAME
from cuda_agent.train.verl.reward import NO_VERDICT_SCORE

# The loop's own context budget guesses tokens from characters; the backend counts the real ones against
# verl's lengths, so the guess must never be what ends an episode (or drops turns, which starts a new sequence).
_NO_BUDGET = 1 << 40


class ServerBackend:
    """A ``TokenBackend`` over verl's server manager, called from an episode's thread: ids in, ids and logprobs
    out, never re-encoded. It keeps the episode to one token sequence that fits verl's lengths, ending the
    episode (``BackendError``, which the loop records as its end) where it could not."""

    def __init__(self, server_manager: Any, loop: asyncio.AbstractEventLoop, request_id: str,
                 sampling_params: dict[str, Any], *, eos_id: int | None, prompt_length: int, response_length: int,
                 priority: int = 0):
        self.server_manager, self.loop, self.request_id = server_manager, loop, request_id
        self.sampling_params, self.eos_id, self.priority = dict(sampling_params), eos_id, priority
        self.prompt_length, self.response_length = prompt_length, response_length
        self.first: list[int] | None = None  # the episode's first prompt: the sequence's prompt
        self.sequence: list[int] = []  # the last prompt and the ids sampled after it
        self.logprobs_missing = False
        self.num_preempted: int | None = None
        self.extra_fields: dict[str, Any] = {}

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> TokenOutput:
        if self.first is None:
            if len(prompt_ids) > self.prompt_length:
                raise ValueError(f"the agent's first prompt (system prompt, SKILL.md, the task) is {len(prompt_ids)} "
                                 f"tokens, more than actor_rollout_ref.rollout.prompt_length={self.prompt_length}: "
                                 f"set it to at least {len(prompt_ids)} (and data.max_prompt_length alike)")
            self.first = list(prompt_ids)
        elif prompt_ids[:len(self.sequence)] != self.sequence:
            raise BackendError("the next prompt does not extend the episode's token sequence (a reply was cut at the "
                               "token limit, or turns were dropped): one verl sample is one sequence, so it ends here")
        room = self.response_length - (len(prompt_ids) - len(self.first))
        if room < 1:
            raise BackendError(f"the response budget is spent (actor_rollout_ref.rollout.response_length="
                               f"{self.response_length} tokens after the first prompt)")
        params = dict(self.sampling_params, max_tokens=min(max_new_tokens, room))
        request = self.server_manager.generate(request_id=self.request_id, prompt_ids=list(prompt_ids),
                                               sampling_params=params, priority=self.priority)
        out = asyncio.run_coroutine_threadsafe(request, self.loop).result()
        ids = list(out.token_ids)
        if out.log_probs:
            logprobs = [float(x) for x in out.log_probs]
            if len(logprobs) != len(ids):
                raise RuntimeError(f"the rollout server sent {len(ids)} token ids and {len(logprobs)} logprobs")
        else:
            # verl recomputes them when the server sends none (rollout.calculate_log_probs off).
            self.logprobs_missing |= bool(ids)
            logprobs = [0.0] * len(ids)
        if out.num_preempted is not None:
            self.num_preempted = (self.num_preempted or 0) + out.num_preempted
        # As verl's tool loop keeps them: the first reply's fields (the policy version it came from), the newest
        # max_global_steps.
        if not self.extra_fields:
            self.extra_fields.update(out.extra_fields or {})
        elif (out.extra_fields or {}).get("max_global_steps"):
            self.extra_fields["max_global_steps"] = out.extra_fields["max_global_steps"]
        self.sequence = list(prompt_ids) + ids
        # TokenChat continues a prompt only after a reply that ended on the end-of-turn token.
        finish = "stop" if ids and ids[-1] == self.eos_id else "length"
        return TokenOutput(ids, logprobs, finish)


_threads: ThreadPoolExecutor | None = None
_threads_lock = threading.Lock()


def _episode_threads(size: int) -> ThreadPoolExecutor:
    """One pool per process: verl makes a loop object per sample, and its own helpers use the default executor,
    which long episodes must not fill."""
    global _threads
    with _threads_lock:
        if _threads is None:
            _threads = ThreadPoolExecutor(max_workers=size, thread_name_prefix="cuda-agent-episode")
        return _threads


@register(AGENT_NAME)
class CudaAgentLoop(AgentLoopBase):
    """Options (the YAML entry's keys): ``service`` (an evaluation service URL; else ``CUDA_AGENT_SERVICE``; else
    local evaluators with ``device``, ``policy``, ``sandbox``), ``evaluator`` (an ``EvaluatorLike`` object,
    shared by every episode: tests, embedding), ``max_turns``, ``max_new_tokens`` (per reply; default
    ``response_length``), ``wall_clock_s``, ``episodes`` (at once per process), ``workdir`` (episode
    workspaces; default the system's temporary directory). ``sandbox`` is also the agent's shell sandbox."""

    def __init__(self, *args: Any, service: str | None = None, device: str = "auto", policy: str = "fair",
                 sandbox: str = "auto", evaluator: Any = None, max_turns: int = 150, max_new_tokens: int | None = None,
                 wall_clock_s: float | None = None, episodes: int = 32, workdir: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)
        self.evaluator_options = {"service": service, "device": device, "policy": policy, "sandbox": sandbox,
                                  "evaluator": evaluator}
        self.sandbox, self.max_turns, self.wall_clock_s = sandbox, int(max_turns), wall_clock_s
        self.max_new_tokens = int(max_new_tokens or self.response_length)
        self.episodes, self.workdir = int(episodes), workdir
        self.model_name = str(OmegaConf.select(self.config, "actor_rollout_ref.model.path", default="") or "")

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any) -> AgentLoopOutput:
        task = task_from_row(kwargs.get("extra_info"))
        priority = int(priority)  # numpy from verl's non-tensor batch
        loop = asyncio.get_running_loop()
        # One id for the whole episode: the server manager keeps a request id's turns on one server (its prefix
        # cache); verl's own loops do the same.
        request_id = f"det-{priority}" if getattr(self.rollout_config, "full_determinism", False) else uuid4().hex
        backend = ServerBackend(self.server_manager, loop, request_id, sampling_params,
                                eos_id=self.tokenizer.eos_token_id, prompt_length=self.prompt_length,
                                response_length=self.response_length, priority=priority)
        language = row_language(kwargs.get("extra_info"))
        outcome = await loop.run_in_executor(_episode_threads(self.episodes), self._episode, task, backend, language)
        return self._output(outcome, backend)

    def _episode(self, task: Any, backend: ServerBackend, language: str = "cuda") -> EpisodeOutcome:
        if self.workdir:
            Path(self.workdir).mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="cuda-agent-verl-", dir=self.workdir))
        try:
            with lend_evaluator(**self.evaluator_options) as evaluator:
                # The runner's timing lock is not used: lent evaluators share their pool's.
                runner = EpisodeRunner(backend, self.tokenizer, single_turn=False, workdir=folder,
                                       make_evaluator=lambda _lock: evaluator, workers=1,
                                       max_new_tokens=self.max_new_tokens, context_tokens=_NO_BUDGET,
                                       max_turns=self.max_turns, wall_clock_s=self.wall_clock_s, sandbox=self.sandbox,
                                       model_name=self.model_name, language=language)
                (outcome,) = runner.run([task])
                # No runner.close(): the evaluator is the pool's (or the caller's), not the runner's.
            return outcome
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _output(self, outcome: EpisodeOutcome, backend: ServerBackend) -> AgentLoopOutput:
        if len(outcome.rollouts) > 1:  # the backend ends an episode whose prompt would start over
            raise RuntimeError(f"episode of {outcome.task}: {len(outcome.rollouts)} token sequences, verl takes one")
        if outcome.rollouts:
            (rollout,) = outcome.rollouts
            prompt, response = list(rollout.prompt_ids), list(rollout.response_ids)
            mask, logprobs = list(rollout.response_mask), list(rollout.logprobs)
        else:  # nothing sampled (an empty first reply): no token to train on, the prompt alone
            prompt, response, mask, logprobs = list(backend.first or []), [], [], []
        record = outcome.record
        tool_seconds = sum(call.get("seconds", 0.0) for turn in record.get("turns", []) for call in turn["tool_calls"])
        metrics = AgentLoopMetrics(generate_sequences=outcome.generate_seconds, tool_calls=tool_seconds,
                                   compute_score=outcome.evaluate_seconds,
                                   num_preempted=-1 if backend.num_preempted is None else backend.num_preempted)
        # verl's tool loop's keys (verl stacks extra fields across the batch), and why the episode ended.
        extra = dict(backend.extra_fields, turn_scores=[], tool_rewards=[], status=outcome.status,
                     end_reason=record.get("end_reason"), no_verdict=outcome.reward is None)
        if outcome.reward is None:
            # No verdict, no reward: verl needs a number, so the episode scores NO_VERDICT_SCORE with every response
            # token masked out, and none of its tokens takes part in the loss.
            mask = [0] * len(mask)
        return AgentLoopOutput(
            prompt_ids=prompt, response_ids=response, response_mask=mask,
            response_logprobs=None if backend.logprobs_missing else logprobs,
            reward_score=NO_VERDICT_SCORE if outcome.reward is None else outcome.reward,
            # verl counts chat turns: user, assistant and tool messages (the system prompt is none).
            num_turns=sum(m.get("role") != "system" for m in record.get("messages", [])),
            metrics=metrics, extra_fields=extra)
