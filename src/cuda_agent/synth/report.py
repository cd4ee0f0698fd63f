"""What a synthesis run leaves for people and other tools: parquet, a dataset card, a report with plots.

``finish(out)`` reads ``candidates.jsonl`` and ``tasks.jsonl`` and writes
``tasks.parquet`` (when pyarrow is installed), ``README.md`` (the dataset card),
``report.md``, ``similarity.png`` and ``op_counts.png`` (when matplotlib is).
It can run again at any time, on a finished or an interrupted run.
"""

from __future__ import annotations

import json
import platform
import time
from collections import Counter
from pathlib import Path
from typing import Any

from cuda_agent.synth.compose import PAPER_OP_COUNTS
from cuda_agent.jsonl import read_jsonl
from cuda_agent.synth.pipeline import CANDIDATES_FILE, FILTERS, RUN_FILE, TASKS_FILE


def environment(device: str) -> dict[str, Any]:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
           "host": platform.node(), "cpu": platform.processor() or platform.machine()}
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def finish(out: Path) -> dict[str, Any]:
    """Write the exports, the card and the report; return the summary numbers."""
    out = Path(out)
    candidates = read_jsonl(out / CANDIDATES_FILE)
    tasks = read_jsonl(out / TASKS_FILE)
    run = json.loads((out / RUN_FILE).read_text()) if (out / RUN_FILE).exists() else {}
    summary = summarize(candidates, tasks)
    summary["parquet"] = _write_parquet(tasks, out / "tasks.parquet")
    summary["plots"] = _plots(candidates, tasks, summary["op_count_share"], out)
    (out / "report.md").write_text(render_report(summary, run))
    (out / "README.md").write_text(render_card(summary, run))
    return summary


def summarize(candidates: list[dict[str, Any]], tasks: list[dict[str, Any]]) -> dict[str, Any]:
    reached = Counter()
    passed = Counter()
    for row in candidates:
        for v in row["verdicts"]:
            reached[v["filter"]] += 1
            passed[v["filter"]] += bool(v["ok"])
    sources = Counter(t["data_source"] for t in tasks)
    shares = {}
    for key in PAPER_OP_COUNTS:
        label = key if key == "transformers" else f"torch#{key}"
        shares[key] = 100.0 * sources.get(label, 0) / len(tasks) if tasks else 0.0
    rejected = Counter(row["rejected_by"] for row in candidates if not row["accepted"])
    reasons: dict[str, Counter] = {}
    examples: dict[tuple[str, str], set[str]] = {}  # (filter, kind) -> the reasons of that kind, as written
    for row in candidates:
        if row["accepted"]:
            continue
        reason = next((v["reason"] for v in row["verdicts"] if not v["ok"]), "") or ""
        kind = _reason_kind(reason)
        reasons.setdefault(row["rejected_by"], Counter())[kind] += 1
        examples.setdefault((row["rejected_by"], kind), set()).add(_first_line(reason))
    seconds = sum(row.get("seconds", 0.0) for row in candidates)
    return {
        "candidates": len(candidates), "accepted": len(tasks),
        "acceptance": len(tasks) / len(candidates) if candidates else 0.0,
        "filters": [{"filter": f, "reached": reached[f], "passed": passed[f],
                     "rate": passed[f] / reached[f] if reached[f] else None} for f in FILTERS],
        "rejected": dict(rejected), "top_reasons": {k: [(_example(examples[(k, kind)]), count) for kind, count in v.most_common(3)]
                        for k, v in reasons.items()},
        "op_count_share": shares, "worker_seconds": seconds,
        "eager_ms": sorted(t["eager_ms"] for t in tasks if t.get("eager_ms") is not None),
        "similarity": [t["max_similarity"] for t in tasks if t.get("max_similarity") is not None],
        "distinct_ops": len({op for t in tasks for op in t["ops"]}),
    }


def _first_line(reason: str) -> str:
    return (reason.strip().splitlines() or [""])[0][:120]


def _reason_kind(reason: str) -> str:
    """A reason without its numbers, so that equal causes count together (shown by one example)."""
    import re

    return re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", _first_line(reason))


def _example(reasons: set[str]) -> str:
    """One reason of a kind as it was written (numbers and all), marked where others differ in them."""
    first = min(reasons)
    return first if len(reasons) == 1 else f"{first} (and {len(reasons) - 1} more like it)"


def render_report(summary: dict[str, Any], run: dict[str, Any]) -> str:
    identity, env = run.get("identity", {}), run.get("environment", {})
    lines = [
        "# Synthesis report", "",
        f"Composer `{identity.get('composer')}`, seed {identity.get('seed')}, device `{identity.get('device')}` "
        f"({env.get('gpu') or env.get('cpu', '?')}, torch {env.get('torch', '?')}), runtime window "
        f"{identity.get('window_ms')} ms, started {run.get('started', '?')}, report {time.strftime('%Y-%m-%d %H:%M')}.", "",
        f"**{summary['accepted']} task{'s' * (summary['accepted'] != 1)} accepted of {summary['candidates']} "
        f"candidate{'s' * (summary['candidates'] != 1)}** "
        f"({100 * summary['acceptance']:.1f}%), {summary['distinct_ops']} distinct operators.", "",
        "## Filters (in the order candidates meet them)", "",
        "| filter | reached | passed | pass rate |", "|---|---:|---:|---:|",
    ]
    for f in summary["filters"]:
        rate = "-" if f["rate"] is None else f"{100 * f['rate']:.1f}%"
        lines.append(f"| {f['filter']} | {f['reached']} | {f['passed']} | {rate} |")
    lines += ["", "Most common reasons per filter:", ""]
    for name, reasons in summary["top_reasons"].items():
        for reason, count in reasons:
            lines.append(f"- `{name}` ({count}): {reason}")
    lines += ["", "## Operator count (share of accepted tasks)", "",
              "| operators | this run | CUDA-Agent-Ops-6K |", "|---|---:|---:|"]
    for key, paper in PAPER_OP_COUNTS.items():
        lines.append(f"| {key} | {summary['op_count_share'][key]:.2f}% | {paper:.2f}% |")
    eager = summary["eager_ms"]
    if eager:
        lines += ["", f"Eager time of accepted tasks: median {eager[len(eager) // 2]:.3g} ms, "
                  f"min {eager[0]:.3g} ms, max {eager[-1]:.3g} ms."]
    if summary["similarity"]:
        sims = sorted(summary["similarity"])
        lines += [f"Largest similarity to KernelBench: median {sims[len(sims) // 2]:.3f}, max {sims[-1]:.3f} "
                  "(the filter's threshold is 0.9)."]
    for plot in summary.get("plots", []):
        lines += ["", f"![{plot}]({plot})"]
    return "\n".join(lines) + "\n"


def render_card(summary: dict[str, Any], run: dict[str, Any]) -> str:
    identity, env = run.get("identity", {}), run.get("environment", {})
    return "\n".join([
        "# Synthesised kernel tasks", "",
        f"{summary['accepted']} PyTorch tasks in KernelBench format (`class Model`, `get_inputs`, "
        "`get_init_inputs`), made by `cuda-agent synth` by composing torch operators and keeping those that pass "
        "execution filters (see report.md).", "",
        "## Files", "",
        "- `tasks.jsonl` / `tasks.parquet`: one task per row. Columns as CUDA-Agent-Ops-6K: `code`, `ops` "
        "(the operators, as the code spells them), `data_source` (`torch#K` for K composed operators, "
        "`transformers` for a standalone transformers layer); and metadata: `id`, `composer`, `seed`, `index`, "
        "`device`, `eager_ms` and `compile_ms` (median, on the device below), `compile_seconds`, `input_shapes`, "
        "`max_similarity` and `closest_kernelbench` (structural similarity of `Model` to KernelBench).",
        "- `candidates.jsonl`: every screened candidate with each filter's verdict and reason.",
        "- `report.md`, `*.png`: acceptance per filter, operator counts next to the paper's, similarity histogram.", "",
        "## Provenance", "",
        f"- composer: `{identity.get('composer')}`, seed {identity.get('seed')}",
        f"- device: {env.get('gpu') or env.get('cpu', '?')} (torch {env.get('torch', '?')}, "
        f"CUDA {env.get('cuda', '-')}), eager runtime window {identity.get('window_ms')} ms",
        f"- decontaminated against: {identity.get('kernelbench') or 'nothing (no KernelBench given)'}, "
        f"threshold {identity.get('threshold')}",
        "", "Load it as a task source: `cuda_agent.load_tasks('DIR/tasks.jsonl')` or "
        "`cuda-agent tasks DIR/tasks.jsonl`.", "",
    ])


def _write_parquet(tasks: list[dict[str, Any]], path: Path) -> str | None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return None
    if not tasks:
        return None
    rows = [t | {"input_shapes": json.dumps(t.get("input_shapes"))} for t in tasks]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path.name


def _plots(candidates: list[dict[str, Any]], tasks: list[dict[str, Any]], shares: dict[str, float],
           out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    sims = [row["similarity"] for row in candidates if row.get("similarity") is not None]
    if sims:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        accepted = [t["max_similarity"] for t in tasks if t.get("max_similarity") is not None]
        ax.hist(sims, bins=40, range=(0, 1), alpha=0.5, label="all candidates")
        ax.hist(accepted, bins=40, range=(0, 1), alpha=0.8, label="accepted")
        ax.axvline(0.9, color="red", linestyle="--", label="threshold 0.9")
        ax.set_xlabel("largest structural similarity to a KernelBench program")
        ax.set_ylabel("programs")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "similarity.png", dpi=120)
        plt.close(fig)
        written.append("similarity.png")
    if tasks:
        keys = list(PAPER_OP_COUNTS)
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = range(len(keys))
        ax.bar([x - 0.2 for x in xs], [shares[k] for k in keys], width=0.4, label="this run")
        ax.bar([x + 0.2 for x in xs], [PAPER_OP_COUNTS[k] for k in keys], width=0.4, label="CUDA-Agent-Ops-6K")
        ax.set_xticks(list(xs), keys)
        ax.set_xlabel("operators per task")
        ax.set_ylabel("% of tasks")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "op_counts.png", dpi=120)
        plt.close(fig)
        written.append("op_counts.png")
    return written
