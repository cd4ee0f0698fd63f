"""Many episodes at once, in either of the paper's modes, against evaluators that share one timing lock.

    single-turn  the chat prompt of ``single_turn.single_turn_messages``; one reply, parsed into a
                 candidate and evaluated (``score_reply``); one ``Rollout``.
    agentic      ``agent.loop.run_episode`` over ``TokenChat`` (the same workspace, tools and ReAct loop as
                 ``cuda-agent optimize``), up to the turn and context limits; one ``Rollout`` per segment of
                 its token trace, each carrying the final evaluation's reward.

``rollout.workers`` episodes run at once, each thread with an evaluator of its own (an evaluator keeps
per-evaluation processes; it is not shared between threads). The evaluators share one timing lock, so
timed regions never overlap, while generation, builds and checks do. Generation goes through one lock
too: the model is one, and ``generate`` on it from two threads would only contend. Single-turn replies,
independent of each other, are sampled together first (``generate_batch`` prompts per call, where the
backend has ``generate_batch``), then evaluated ``workers`` at a time.
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cuda_agent.evaluate.device_lock import DeviceLock
from cuda_agent.agent.tokens import TokenChat, TokenOutput
from cuda_agent.tasks import Task
from cuda_agent.train.rollout import Rollout, RolloutError, rollouts_from_trace
from cuda_agent.candidates.triton import check_language
from cuda_agent.train.single_turn import FAILURE_REWARD, score_reply, single_turn_messages


@dataclass
class EpisodeOutcome:
    """What the trainer and its metrics need of one episode; ``record`` is its trajectory (agentic: the
    agent's trajectory line, with token trace; single-turn: the reply and its evaluation)."""

    task: str
    reward: float | None  # None: its evaluation had no verdict; it has no rollouts, so nothing trains on it
    rollouts: list[Rollout]
    status: str
    turns: int = 1
    clipped: bool = False  # a reply ended at the token limit
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    evaluate_seconds: float = 0.0
    record: dict[str, Any] = field(default_factory=dict)


class _Generation:
    """One episode's view of the shared sampler: serialised, and its time and tokens counted."""

    def __init__(self, backend: Any, lock: threading.Lock):
        self.backend, self.lock = backend, lock
        self.seconds, self.tokens, self.clipped = 0.0, 0, False

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> TokenOutput:
        with self.lock:
            clock = time.perf_counter()
            out = self.backend.generate(prompt_ids, max_new_tokens)
            self.seconds += time.perf_counter() - clock
        self.tokens += len(out.ids)
        self.clipped |= out.finish_reason == "length"
        return out


class _TimedEvaluator:
    """An evaluator whose calls to ``evaluate`` and ``verify`` are timed for the step's metrics."""

    def __init__(self, evaluator: Any):
        self._evaluator, self.seconds = evaluator, 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._evaluator, name)

    def _timed(self, method: str, *args: Any, **kwargs: Any) -> Any:
        clock = time.perf_counter()
        try:
            return getattr(self._evaluator, method)(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - clock

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("evaluate", *args, **kwargs)

    def verify(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("verify", *args, **kwargs)


class EpisodeRunner:
    """Runs batches of episodes with ``backend`` (a ``TokenBackend``) and ``tokenizer``; ``make_evaluator``
    is called with the shared timing lock, once per worker thread, on first use."""

    def __init__(self, backend: Any, tokenizer: Any, *, single_turn: bool, workdir: Path,
                 make_evaluator: Callable[[threading.Lock], Any], workers: int = 4, max_new_tokens: int = 8192,
                 generate_batch: int = 16,
                 context_tokens: int = 32_768, max_turns: int = 150, wall_clock_s: float | None = None,
                 sandbox: str = "auto", model_name: str = "", language: str = "cuda"):
        check_language(language)
        self.backend, self.tokenizer, self.single_turn = backend, tokenizer, single_turn
        self.language = language  # the kernels the prompts ask for and the replies must be in
        self.workdir = Path(workdir)
        self.make_evaluator, self.workers = make_evaluator, workers
        self.max_new_tokens, self.context_tokens, self.generate_batch = max_new_tokens, context_tokens, generate_batch
        self.max_turns, self.wall_clock_s, self.sandbox, self.model_name = max_turns, wall_clock_s, sandbox, model_name
        self._generation_lock = threading.Lock()
        # Timing alone: on the CPU backend another rollout's compile beside a timing would make it refused.
        self._timing_lock = DeviceLock()
        self._evaluators: "queue.Queue[Any]" = queue.Queue()
        self._made: list[Any] = []

    @contextlib.contextmanager
    def _evaluator(self):
        try:
            evaluator = self._evaluators.get_nowait()
        except queue.Empty:
            evaluator = self.make_evaluator(self._timing_lock)
            self._made.append(evaluator)
        try:
            yield evaluator
        finally:
            self._evaluators.put(evaluator)

    def run(self, tasks: list[Task], on_episode: Callable[[int, EpisodeOutcome], None] | None = None,
            skip: set[int] = frozenset()) -> list[EpisodeOutcome | None]:
        """One episode per task, ``workers`` at a time; ``on_episode(index, outcome)`` as each ends (from its
        thread). Indices in ``skip`` are not run (their entry is None)."""
        results: list[EpisodeOutcome | None] = [None] * len(tasks)
        todo = [i for i in range(len(tasks)) if i not in skip]
        sampled: dict[int, tuple[list[int], TokenOutput | None, float]] = {}
        if self.single_turn and self.generate_batch > 1 and hasattr(self.backend, "generate_batch"):
            sampled = self._sample_replies(tasks, todo)

        def one(index: int) -> None:
            folder = self.workdir / f"episode-{index:05d}"
            shutil.rmtree(folder, ignore_errors=True)
            with self._evaluator() as evaluator:
                if self.single_turn:
                    outcome = self._single_turn(tasks[index], evaluator, folder, sampled.get(index))
                else:
                    outcome = self._agentic(tasks[index], evaluator, folder)
            shutil.rmtree(folder, ignore_errors=True)  # the trajectory keeps what matters
            results[index] = outcome
            if on_episode:
                on_episode(index, outcome)

        with ThreadPoolExecutor(max_workers=min(self.workers, max(len(todo), 1))) as pool:
            for future in [pool.submit(one, i) for i in todo]:
                future.result()  # the first failure is raised here
        return results

    def _prompt(self, task: Task) -> tuple[list[int], int]:
        """A single-turn episode's prompt ids and the tokens left for its reply in the context."""
        prompt = list(self.tokenizer.apply_chat_template(single_turn_messages(task, self.language),
                                                         add_generation_prompt=True,
                                                         tokenize=True, return_dict=False))
        return prompt, min(self.max_new_tokens, self.context_tokens - len(prompt))

    def _sample_replies(self, tasks: list[Task], todo: list[int]) -> dict[int, tuple[list[int], TokenOutput | None, float]]:
        """Every single-turn reply, ``generate_batch`` prompts per call (prompts of one room together);
        each episode is charged its share of its call's seconds."""
        prompts = {i: self._prompt(tasks[i]) for i in todo}
        sampled: dict[int, tuple[list[int], TokenOutput | None, float]] = \
            {i: (prompt, None, 0.0) for i, (prompt, room) in prompts.items() if room < 1}
        by_room: dict[int, list[int]] = {}
        for i, (_, room) in prompts.items():
            if room >= 1:
                by_room.setdefault(room, []).append(i)
        for room, indices in by_room.items():
            for start in range(0, len(indices), self.generate_batch):
                group = indices[start:start + self.generate_batch]
                with self._generation_lock:
                    clock = time.perf_counter()
                    outs = self.backend.generate_batch([prompts[i][0] for i in group], room)
                    share = (time.perf_counter() - clock) / len(group)
                for i, out in zip(group, outs):
                    sampled[i] = (prompts[i][0], out, share)
        return sampled

    def _single_turn(self, task: Task, evaluator: Any, folder: Path,
                     sampled: tuple[list[int], TokenOutput | None, float] | None = None) -> EpisodeOutcome:
        timed = _TimedEvaluator(evaluator)
        if sampled is None:
            prompt, room = self._prompt(task)
            generation = _Generation(self.backend, self._generation_lock)
            out = generation.generate(prompt, room) if room >= 1 else None
            seconds = generation.seconds
        else:
            prompt, out, seconds = sampled
        if out is None:
            return EpisodeOutcome(task.name, FAILURE_REWARD, [], "prompt-too-long",
                                  record={"task": task.name, "prompt_tokens": len(prompt)})
        text = self.tokenizer.decode(out.ids, skip_special_tokens=True)
        folder.mkdir(parents=True, exist_ok=True)
        outcome = score_reply(task, text, timed, folder, self.language)
        # Without a verdict the reply has no reward: dropped from the batch (counted as ``no_verdict``).
        rollouts = [Rollout(tuple(prompt), tuple(out.ids), (1,) * len(out.ids), tuple(out.logprobs), outcome.reward)] \
            if out.ids and not outcome.no_verdict else []
        status = outcome.evaluation["status"] if outcome.evaluation else "no-candidate"
        return EpisodeOutcome(task.name, outcome.reward, rollouts, status, 1, out.finish_reason == "length", len(out.ids),
                              seconds, timed.seconds,
                              {"task": task.name, "reply": text, "reward": outcome.reward, "reason": outcome.reason,
                               "evaluation": outcome.evaluation})

    def _agentic(self, task: Task, evaluator: Any, folder: Path) -> EpisodeOutcome:
        from cuda_agent.agent.loop import AgentConfig, run_episode

        generation = _Generation(self.backend, self._generation_lock)
        timed = _TimedEvaluator(evaluator)
        chat = TokenChat(generation, self.tokenizer, max_new_tokens=self.max_new_tokens)
        config = AgentConfig(max_turns=self.max_turns, context_tokens=self.context_tokens,
                             wall_clock_s=self.wall_clock_s, language=self.language)
        episode = run_episode(task, chat, timed, folder, config=config, model=self.model_name, sandbox=self.sandbox)
        if episode.final.get("status") == "error":
            reward, rollouts = None, []  # no verdict: no reward, so nothing of the episode trains (``no_verdict``)
        else:
            reward = FAILURE_REWARD if episode.reward is None else float(episode.reward)
            try:
                rollouts = rollouts_from_trace(episode.record.get("tokens", []), reward)
            except RolloutError:
                rollouts = []
        return EpisodeOutcome(task.name, reward, rollouts, str(episode.final.get("status")), len(episode.record["turns"]),
                              generation.clipped, generation.tokens, generation.seconds, timed.seconds,
                              episode.record)

    def close(self) -> None:
        for evaluator in self._made:
            evaluator.close()
        self._made.clear()
