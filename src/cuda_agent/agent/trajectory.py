"""Trajectories: one JSON line per episode (``loop.run_episode``'s record), read back and shown.

A record holds every message (the full history, not the truncated requests),
per-turn timing, token usage and tool calls with their errors, every
evaluation the agent asked for, the final evaluation, the best solution with
its files, and the reward. ``render_text`` and ``render_html`` show one
readably (``cuda-agent show``).
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from cuda_agent.jsonl import read_jsonl

__all__ = ["read_trajectories", "render_text", "render_html"]


def read_trajectories(path: Path) -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / "trajectories.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no trajectory file; give trajectories.jsonl or an optimize output directory.")
    return read_jsonl(path)


def _summary(record: dict[str, Any]) -> list[str]:
    final = record.get("final") or {}
    usage = record.get("usage") or {}
    best = record.get("best") or {}
    return [
        f"task {record['task']['name']}  model {record.get('model') or '?'}  device {record.get('device')}  "
        f"policy {record.get('policy', {}).get('name')}",
        f"{len(record.get('turns', []))} turns, ended: {record.get('end_reason')}, {record.get('seconds')} s, "
        f"tokens {usage.get('prompt_tokens', 0)} prompt / {usage.get('completion_tokens', 0)} completion",
        f"final: {final.get('status')}" + (f" ({final.get('reason')})" if final.get("reason") else "")
        + f", reward {record.get('reward')}; best: reward {record.get('best_reward')}"
        + (f" ({best.get('command')} at turn {best.get('turn')})" if best else ""),
        "evaluations: " + (", ".join(f"t{e['turn']} {e['command']} {e['status']} r={e['reward']}"
                                      for e in record.get("evaluations", [])) or "none"),
    ]


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts
        return "\n".join(str(part.get("text", part)) for part in content)
    return content or ""


def render_text(record: dict[str, Any], width: int = 2000) -> str:
    """The episode for a terminal: a summary, then every message (long ones cut to ``width``)."""
    lines = _summary(record) + [""]
    for message in record.get("messages", []):
        role = message["role"]
        text = _content(message)
        if len(text) > width:
            text = text[:width] + f"\n[... {len(text) - width} more characters]"
        header = f"--- {role}" + (f" ({message['tool_call_id']})" if role == "tool" else "")
        lines += [header, text] if text else [header]
        for call in message.get("tool_calls") or []:
            fn = call.get("function", {})
            lines.append(f">>> {fn.get('name')}({fn.get('arguments')})  [{call.get('id')}]")
    return "\n".join(lines) + "\n"


def render_html(record: dict[str, Any]) -> str:
    """A self-contained HTML page (no scripts, no external files)."""
    rows = []
    for message in record.get("messages", []):
        role = message["role"]
        body = html.escape(_content(message))
        calls = "".join(
            f"<div class='call'>&#9654; <b>{html.escape(str(c.get('function', {}).get('name')))}</b>"
            f"<pre>{html.escape(_pretty(c.get('function', {}).get('arguments')))}</pre></div>"
            for c in message.get("tool_calls") or [])
        rows.append(f"<div class='msg {role}'><div class='role'>{role}</div><pre>{body}</pre>{calls}</div>")
    summary = "".join(f"<li>{html.escape(line)}</li>" for line in _summary(record))
    style = ("body{font-family:sans-serif;max-width:1100px;margin:auto}pre{white-space:pre-wrap;margin:4px 0}"
             ".msg{border-left:4px solid #ccc;padding:4px 10px;margin:8px 0}.role{font-weight:bold;color:#555}"
             ".system{border-color:#999}.user{border-color:#2a7}.assistant{border-color:#27c}.tool{border-color:#c72;"
             "background:#fafafa}.call{background:#eef4ff;padding:2px 6px}")
    title = html.escape(f"cuda-agent: {record['task']['name']}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{style}</style>"
            f"</head><body><h1>{title}</h1><ul>{summary}</ul>{''.join(rows)}</body></html>\n")


def _pretty(arguments: Any) -> str:
    try:
        return json.dumps(json.loads(arguments), indent=1)
    except (TypeError, ValueError):
        return str(arguments)
