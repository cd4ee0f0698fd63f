"""The ReAct loop: a model, the workspace's tools, the trusted evaluator, one episode.

System prompt and task first, then model turns: each reply's tool calls run
and their results go back as observations, until the model answers without a
tool call (it is done) or a limit is hit (turns, wall clock). Requests are cut
to the context budget: the system prompt and the task stay, then as many of
the most recent turns as fit. The episode ends with a fresh trusted
evaluation of the final workspace; the best correct solution evaluated on the
way is kept too (the paper's evaluation takes the best of a trajectory).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from cuda_agent.evaluate.interface import EvaluatorLike
from cuda_agent.agent.commands import Evaluation
from cuda_agent.agent.llm import BackendError, ChatBackend, Usage, assistant_message, tool_message
# AgentConfig and SYSTEM_PROMPT live with the session now; importing them from here still works.
from cuda_agent.agent.session import SYSTEM_PROMPT, AgentConfig, EpisodeSession  # noqa: F401
from cuda_agent.agent.tokens import token_trace
from cuda_agent.tasks.task import Task

__all__ = ["TRAJECTORY_FORMAT", "CHARS_PER_TOKEN", "Episode", "fit_to_budget", "run_episode", "save_solution"]

TRAJECTORY_FORMAT = 1
CHARS_PER_TOKEN = 4.0  # until the server's usage tells the real ratio


@dataclass
class Episode:
    """What an episode produced; ``record`` is its trajectory line (JSON)."""

    record: dict[str, Any]
    final: dict[str, Any]
    best: Evaluation | None
    end_reason: str

    @property
    def reward(self) -> float | None:
        return self.final.get("reward")

    @property
    def best_reward(self) -> float | None:
        return self.best.result.get("reward") if self.best else None


def fit_to_budget(messages: list[dict[str, Any]], budget_tokens: int, chars_per_token: float) -> tuple[list[dict[str, Any]], int]:
    """The messages to send: the first two (system, task), a note if turns were dropped, then the
    most recent whole turns (an assistant message with its tool results) that fit; and how many
    turns were dropped."""
    def tokens(items: list[dict[str, Any]]) -> float:
        return sum(len(json.dumps(m)) for m in items) / chars_per_token

    head, rest = messages[:2], messages[2:]
    turns: list[list[dict[str, Any]]] = []
    for message in rest:
        if message["role"] == "assistant" or not turns:
            turns.append([message])
        else:
            turns[-1].append(message)
    kept: list[list[dict[str, Any]]] = []
    used = tokens(head) + 50  # room for the note
    for turn in reversed(turns):
        cost = tokens(turn)
        if used + cost > budget_tokens:
            break
        kept.insert(0, turn)
        used += cost
    dropped = len(turns) - len(kept)
    note = [{"role": "user", "content": f"[{dropped} earlier turns were dropped to fit the context budget; "
                                         "the workspace holds their work]"}] if dropped else []
    return head + note + [m for turn in kept for m in turn], dropped


def run_episode(task: Task, backend: ChatBackend, evaluator: EvaluatorLike, workdir: Path, *,
                config: AgentConfig | None = None, model: str = "", sandbox: Any = "auto",
                on_turn: Callable[[dict[str, Any]], None] | None = None) -> Episode:
    """One episode in a fresh workspace under ``workdir``."""
    config = config or AgentConfig()
    started = time.time()
    clock = time.monotonic()
    record: dict[str, Any] = {
        "format": TRAJECTORY_FORMAT, "id": uuid.uuid4().hex[:12], "task": task.to_dict(), "model": model,
        "device": evaluator.device, "policy": evaluator.policy.to_dict(), "config": asdict(config),
        "started": started, "turns": [], "evaluations": [],
    }
    usage = Usage()
    token_turns: list[dict[str, list]] = []  # token-level backends only
    chars_per_token = CHARS_PER_TOKEN
    end_reason = "max_turns"

    def evaluated(evaluation: Evaluation) -> None:
        record["evaluations"].append(_evaluation_record(evaluation))

    # The workspace, its tools and the closing evaluation are the session's (the RL-stack adapters drive the
    # same one); the loop is the model's side.
    with EpisodeSession(task, evaluator, Path(workdir), config=config, sandbox=sandbox,
                        on_evaluation=evaluated) as session:
        messages = session.messages
        tools = session.tools
        for turn in range(config.max_turns):
            if config.wall_clock_s is not None and time.monotonic() - clock > config.wall_clock_s:
                end_reason = "wall_clock"
                break
            session.turn = turn
            request, dropped = fit_to_budget(messages, config.context_tokens, chars_per_token)
            if len(request) <= 2 and len(messages) > 2:
                end_reason = "context"  # not even the latest turn fits
                break
            try:
                reply = backend.complete(request, tools)
            except BackendError as exc:
                end_reason = f"backend_error: {exc}"
                break
            usage.add(reply.usage)
            if reply.tokens is not None:
                token_turns.append(reply.tokens)
            if reply.usage.prompt_tokens:
                chars_per_token = sum(len(json.dumps(m)) for m in request) / reply.usage.prompt_tokens
            messages.append(assistant_message(reply))
            entry: dict[str, Any] = {"turn": turn, "model_seconds": round(reply.seconds, 3),
                                     "usage": asdict(reply.usage), "dropped_turns": dropped,
                                     "finish_reason": reply.finish_reason, "tool_calls": []}
            for call in reply.tool_calls:
                tick = time.monotonic()
                result = session.call(call.name, call.arguments)
                messages.append(tool_message(call.id, result.content))
                entry["tool_calls"].append({"id": call.id, "name": call.name, "arguments": call.arguments,
                                            "error": result.error, "metadata": result.metadata,
                                            "seconds": round(time.monotonic() - tick, 3)})
            record["turns"].append(entry)
            if on_turn:
                on_turn(entry)
            if not reply.tool_calls:
                end_reason = "done"
                break
        outcome = session.finish(turn=len(record["turns"]))
    final, best = outcome.final, outcome.best
    record.update(messages=messages, final=final, end_reason=end_reason, usage=asdict(usage),
                  best=_evaluation_record(best, files=True) if best else None,
                  reward=final.get("reward"), best_reward=best.result.get("reward") if best else None,
                  seconds=round(time.monotonic() - clock, 3))
    if token_turns:
        # Token ids, logprobs and a mask (1: sampled by the model), what training needs.
        record["tokens"] = token_trace(token_turns)
    return Episode(record, final, best, end_reason)


def _evaluation_record(evaluation: Evaluation, files: bool = False) -> dict[str, Any]:
    r = evaluation.result
    row = {"command": evaluation.command, "turn": evaluation.turn, "seconds": evaluation.seconds,
           "status": r.get("status"), "reward": r.get("reward"), "speedup_eager": r.get("speedup_eager"),
           "speedup_compile": r.get("speedup_compile"), "reason": r.get("reason"), "result": r}
    if files:
        row["files"] = evaluation.files
    return row


def save_solution(files: dict[str, str], out: Path) -> None:
    """A best solution as a ready-to-build directory (model_new.py, kernels/, the fixed files)."""
    from cuda_agent.candidates import fixed_file

    out = Path(out)
    for name, text in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for name in ("binding.cpp", "binding_registry.h"):
        (out / name).write_text(fixed_file(name))
