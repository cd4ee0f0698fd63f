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
from cuda_agent.agent.commands import CommandServer, Evaluation, better, candidate_files
from cuda_agent.agent.llm import BackendError, ChatBackend, Usage, assistant_message, tool_message
from cuda_agent.agent.tokens import token_trace
from cuda_agent.agent.tools import Toolbox
from cuda_agent.agent.workspace import SOCKET_ENV, create_workspace
from cuda_agent.candidates import CandidateError, load_workspace
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.tasks.task import Task

TRAJECTORY_FORMAT = 1
CHARS_PER_TOKEN = 4.0  # until the server's usage tells the real ratio

SYSTEM_PROMPT = """You are an expert CUDA performance engineer. You work alone in a sandboxed workspace \
through the tools you are given. Your goal: a ModelNew that is correct and faster than torch.compile, \
following SKILL.md exactly. Act, check the result of every action, and keep going until the goal is met; \
then reply with a short summary and no tool call."""


@dataclass
class AgentConfig:
    max_turns: int = 150  # the paper: 150 in training, 200 for evaluation
    context_tokens: int = 128_000
    wall_clock_s: float | None = None
    command_timeout_s: float = 300.0
    max_output_chars: int = 20_000
    # utils/profile.py ends with the hardware counters of a correct candidate (GPU only; 10-14 s more
    # per profile on the H200, docs/COUNTERS.md)
    counters: bool = True


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
    workdir = Path(workdir)
    workspace = create_workspace(workdir / "workspace", task, evaluator.policy, evaluator.device)
    started = time.time()
    clock = time.monotonic()
    record: dict[str, Any] = {
        "format": TRAJECTORY_FORMAT, "id": uuid.uuid4().hex[:12], "task": task.to_dict(), "model": model,
        "device": evaluator.device, "policy": evaluator.policy.to_dict(), "config": asdict(config),
        "started": started, "turns": [], "evaluations": [],
    }
    skill = (workspace.root / "SKILL.md").read_text()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"{skill}\n\n# The task: model.py\n\n```python\n{task.code}\n```\n\n"
                                    f"The workspace is your current directory: {workspace.root}"},
    ]
    usage = Usage()
    token_turns: list[dict[str, list]] = []  # token-level backends only
    chars_per_token = CHARS_PER_TOKEN
    end_reason = "max_turns"

    def evaluated(evaluation: Evaluation) -> None:
        record["evaluations"].append(_evaluation_record(evaluation))

    with CommandServer(workspace.root, task, evaluator, on_evaluation=evaluated, counters=config.counters) as server:
        # Only what the commands need: the toolbox's own minimal environment keeps API keys out of the shell.
        env = {SOCKET_ENV: str(server.socket_path)}
        with Toolbox(workspace.root, protected=workspace.protected, sandbox=sandbox, gpu=evaluator.device == "cuda",
                     env=env, readable=[server.directory], command_timeout_s=config.command_timeout_s,
                     max_output_chars=config.max_output_chars) as toolbox:
            tools = toolbox.schemas()
            for turn in range(config.max_turns):
                if config.wall_clock_s is not None and time.monotonic() - clock > config.wall_clock_s:
                    end_reason = "wall_clock"
                    break
                server.turn = turn
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
                    result = toolbox.call(call.name, call.arguments)
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
        best = server.best
    # After the shell and its background jobs are gone: nothing may run beside the final timing.
    final, files = _final_evaluation(task, evaluator, workspace.root)
    if files is not None:
        closing = Evaluation("final", len(record["turns"]), 0.0, final, files)
        if better(best, closing):
            best = closing
    record.update(messages=messages, final=final, end_reason=end_reason, usage=asdict(usage),
                  best=_evaluation_record(best, files=True) if best else None,
                  reward=final.get("reward"), best_reward=best.result.get("reward") if best else None,
                  seconds=round(time.monotonic() - clock, 3))
    if token_turns:
        # Token ids, logprobs and a mask (1: sampled by the model), what training needs.
        record["tokens"] = token_trace(token_turns)
    return Episode(record, final, best, end_reason)


def _final_evaluation(task: Task, evaluator: EvaluatorLike, root: Path) -> tuple[dict[str, Any], dict[str, str] | None]:
    """A fresh trusted evaluation of the workspace as the agent left it (and its files)."""
    try:
        candidate = load_workspace(root)
    except CandidateError as exc:
        result = EvalResult.unloadable(task.to_dict(), str(root), evaluator.device, evaluator.policy.to_dict(),
                                       evaluator.timing.to_dict(), str(exc))
        return result.to_dict(), None
    return evaluator.evaluate(task, candidate).to_dict(), candidate_files(candidate)


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
