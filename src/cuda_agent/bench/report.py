"""Reports of a benchmark run: the paper's metrics as markdown, CSV and JSON, plots, and the
comparison of two runs.

``write_report(run_dir)`` writes, beside the run's results:

- ``metrics.json``: per level and overall (``bench.metrics``), with the paper's Table 1 rows
- ``levels.csv`` and ``per_task.csv``: one row per level / per task (its best entry)
- ``report.md``: the tables, ours next to the paper's, failures with their reasons
- ``speedups.png``, ``fast_p.png``, ``vs_paper.png`` (with matplotlib, the ``[bench]`` extra)
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

from cuda_agent.bench.metrics import THRESHOLDS, TaskOutcome, best_of, fast_p, metrics
from cuda_agent.bench.run import read_results, read_run

__all__ = ["RATE_COLUMNS", "paper_table", "RunTable", "run_table", "write_report", "render_markdown", "plot_run",
           "different_code", "compare_runs"]

RATE_COLUMNS = (("pass_rate", "pass"), ("faster_eager@1", "> eager"), ("faster_compile@1", "> compile"),
                ("faster_compile@1.05", "> compile +5%"), ("geomean_eager", "x eager"), ("geomean_compile", "x compile"))


def paper_table() -> list[dict[str, Any]]:
    """Table 1 of the CUDA Agent paper (rates as fractions), shipped with the project."""
    text = resources.files("cuda_agent.bench").joinpath("paper_table1.json").read_text()
    return json.loads(text)["rows"]


@dataclasses.dataclass
class RunTable:
    """One outcome per task of a run (its best entry), and the row it came from."""

    spec: dict[str, Any]
    outcomes: dict[tuple[int, int], TaskOutcome]
    best_rows: dict[tuple[int, int], dict[str, Any]]
    samples: dict[tuple[int, int], int]


def run_table(run_dir: Path, levels: list[int] | None = None, language: str | None = None) -> RunTable:
    """``levels``: only the tasks of these KernelBench levels (default: every task of the run); ``language``: only
    the entries in that kernel language (a task without one counts as missing)."""
    spec = read_run(run_dir)
    degenerate = set(spec.get("degenerate", []))
    tasks = {(t["level"], t["problem_id"]): t["name"] for t in spec["tasks"]
             if t.get("level") is not None and t.get("problem_id") is not None
             and (levels is None or t["level"] in levels)}
    grouped: dict[tuple[int, int], list[tuple[TaskOutcome, dict[str, Any]]]] = {}
    for row in read_results(run_dir):
        if language is not None and _row_language(row, spec) != language:
            continue
        outcome = TaskOutcome.from_result(row, degenerate=row["task"]["name"] in degenerate)
        if outcome.key in tasks:
            grouped.setdefault(outcome.key, []).append((outcome, row))
    outcomes, best_rows = {}, {}
    for key, name in tasks.items():
        if key in grouped:
            best = best_of(o for o, _ in grouped[key])
            best_rows[key] = next(r for o, r in grouped[key] if o == best)
        else:
            best = TaskOutcome(key[0], key[1], "missing")
        outcomes[key] = dataclasses.replace(best, name=name, degenerate=name in degenerate)
    return RunTable(spec, outcomes, best_rows, {k: len(v) for k, v in grouped.items()})


def _fmt(value: Any, key: str) -> str:
    if value is None:
        return "-"
    if key.startswith("geomean"):
        return f"{value:.2f}x"
    return f"{100 * value:.1f}%"


def _level_label(level: str) -> str:
    return "overall" if level == "overall" else f"L{level}"


def write_report(run_dir: Path, exclude_degenerate: bool = False, plots: bool = True,
                 levels: list[int] | None = None) -> dict[str, Any]:
    """Write the run's reports (over ``levels`` only, when given); the metrics."""
    run_dir = Path(run_dir)
    table = run_table(run_dir, levels)
    report = metrics(table.outcomes, exclude_degenerate=exclude_degenerate)
    report["paper_table1"] = paper_table()
    report["languages"] = run_languages(table)
    entries = {_row_language(row, table.spec) for row in read_results(run_dir)}
    if len(entries) > 1:
        # Solutions in several languages: the paper's metrics over each language's entries alone, on every task.
        report["by_language"] = {language: metrics(run_table(run_dir, levels, language).outcomes,
                                                   exclude_degenerate=exclude_degenerate)["overall"]
                                 for language in sorted(entries)}
    (run_dir / "metrics.json").write_text(json.dumps(report, indent=1) + "\n")
    groups = {**report["levels"], "overall": report["overall"]}
    with (run_dir / "levels.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["level", "tasks", "correct", "degenerate", *(k for k, _ in RATE_COLUMNS),
                         "faster_eager@1.05", *(f"status_{s}" for s in groups["overall"]["status"])])
        for level, row in groups.items():
            writer.writerow([level, row["tasks"], row["correct"], row["degenerate"], *(row[k] for k, _ in RATE_COLUMNS),
                             row["faster_eager@1.05"], *row["status"].values()])
    with (run_dir / "per_task.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["name", "level", "problem_id", "status", "speedup_eager", "speedup_compile", "degenerate",
                         "samples", "best_entry", "reason"])
        for key, outcome in sorted(table.outcomes.items()):
            row = table.best_rows.get(key, {})
            writer.writerow([outcome.name, outcome.level, outcome.problem_id, outcome.status, outcome.speedup_eager,
                             outcome.speedup_compile, outcome.degenerate, table.samples.get(key, 0),
                             row.get("entry", ""), (row.get("reason") or "")[:300]])
    (run_dir / "report.md").write_text(render_markdown(table, report))
    # Without matplotlib (the [bench] extra), tables only.
    if plots and importlib.util.find_spec("matplotlib") is not None:
        plot_run(run_dir, table, report)
    return report


def _row_language(row: dict[str, Any], spec: dict[str, Any]) -> str:
    return (row.get("candidate") or {}).get("language") or spec.get("language") or "cuda"


def run_languages(table: RunTable) -> dict[str, int]:
    """How many tasks' best entries are in each kernel language (``cuda``, ``triton``)."""
    counts: dict[str, int] = {}
    for row in table.best_rows.values():
        language = _row_language(row, table.spec)
        counts[language] = counts.get(language, 0) + 1
    return dict(sorted(counts.items()))


def _languages_label(table: RunTable) -> str:
    languages = run_languages(table)
    return "/".join(languages) if languages else table.spec.get("language", "cuda")


def render_markdown(table: RunTable, report: dict[str, Any]) -> str:
    spec = table.spec
    policy = spec.get("policy") or next((r["policy"].get("name") for r in table.best_rows.values() if r.get("policy")), "?")
    groups = {**report["levels"], "overall": report["overall"]}
    lines = ["# Benchmark run", "",
             f"Solutions `{spec.get('solutions')}` ({_languages_label(table)}) on `{spec.get('device')}`, "
             f"policy `{policy}`; "
             f"{report['overall']['tasks']} tasks" + (" (degenerate tasks left out)" if report["exclude_degenerate"] else "")
             + ". Rates are shares of all tasks (a task without a solution counts as not passed); geometric means "
             "are over the correct ones. A task with several entries counts with its best.", "",
             "| split | tasks | " + " | ".join(label for _, label in RATE_COLUMNS) + " | degenerate |",
             "|---|---:|" + "---:|" * len(RATE_COLUMNS) + "---:|"]
    for level, row in groups.items():
        lines.append(f"| {_level_label(level)} | {row['tasks']} | "
                     + " | ".join(_fmt(row[k], k) for k, _ in RATE_COLUMNS) + f" | {row['degenerate']} |")
    if report.get("by_language"):
        lines += ["", "## By kernel language (each language's entries alone, over every task)", "",
                  "| language | " + " | ".join(label for _, label in RATE_COLUMNS) + " |",
                  "|---|" + "---:|" * len(RATE_COLUMNS)]
        for language, row in report["by_language"].items():
            lines.append(f"| {language} | " + " | ".join(_fmt(row[k], k) for k, _ in RATE_COLUMNS) + " |")
    lines += ["", "## Next to the paper's Table 1 (H100, their baselines)", "",
              "| split | model | pass | > eager | > compile | x eager | x compile |", "|---|---|---:|---:|---:|---:|---:|"]
    for level, row in groups.items():
        lines.append(f"| {_level_label(level)} | **this run** | {_fmt(row['pass_rate'], 'p')} | "
                     f"{_fmt(row['faster_eager@1'], 'p')} | {_fmt(row['faster_compile@1'], 'p')} | "
                     f"{_fmt(row['geomean_eager'], 'geomean')} | {_fmt(row['geomean_compile'], 'geomean')} |")
        for paper in (p for p in report["paper_table1"] if p["split"] == level):
            lines.append(f"| {_level_label(level)} | {paper['model']} | {_fmt(paper['pass_rate'], 'p')} | "
                         f"{_fmt(paper['faster_eager'], 'p')} | {_fmt(paper['faster_compile'], 'p')} | "
                         f"{_fmt(paper['geomean_eager'], 'geomean')} | {_fmt(paper['geomean_compile'], 'geomean')} |")
    status = report["overall"]["status"]
    lines += ["", "## Outcomes", "", "| " + " | ".join("no verdict" if s == "error" else s for s in status) + " |", "|" + "---:|" * len(status),
              "| " + " | ".join(str(v) for v in status.values()) + " |"]
    correct = sorted((o for o in table.outcomes.values() if o.correct), key=lambda o: -(o.speedup_compile or 0))
    if correct:
        lines += ["", "## Correct solutions", "", "| task | x eager | x compile | entry |", "|---|---:|---:|---|"]
        for o in correct:
            entry = table.best_rows[o.key].get("entry", "")
            lines.append(f"| {o.name}{' (degenerate)' if o.degenerate else ''} | {_fmt(o.speedup_eager, 'geomean')} | "
                         f"{_fmt(o.speedup_compile, 'geomean')} | {entry} |")
    wrong = [o for o in table.outcomes.values() if o.status in ("incorrect", "failed")]
    undecided = [o for o in table.outcomes.values() if o.status == "error"]
    if undecided:
        lines += ["", f"## Without a verdict ({len(undecided)}; not failures: the same command evaluates them again)",
                  "", "| task | attempts | stage | reason |", "|---|---:|---|---|"]
        for o in undecided:
            row = table.best_rows[o.key]
            reason = (row.get("reason") or "").replace("|", "\\|").replace("\n", " ")[:160]
            lines.append(f"| {o.name} | {row.get('attempts', 1)} | {row.get('stage') or '-'} | {reason} |")
    if wrong:
        lines += ["", "## Not correct", "", "| task | status | stage | reason |", "|---|---|---|---|"]
        for o in wrong:
            row = table.best_rows[o.key]
            reason = (row.get("reason") or "").replace("|", "\\|").replace("\n", " ")[:160]
            lines.append(f"| {o.name} | {o.status} | {row.get('stage') or '-'} | {reason} |")
    return "\n".join(lines) + "\n"


def plot_run(run_dir: Path, table: RunTable, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(report["levels"])
    # Speedup distribution per level, against both baselines.
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, baseline in zip(axes, ("eager", "compile")):
        data = [[getattr(o, f"speedup_{baseline}") for o in table.outcomes.values()
                 if o.correct and str(o.level) == level and getattr(o, f"speedup_{baseline}")] for level in levels]
        for i, values in enumerate(data):
            if values:
                ax.scatter([i + 1] * len(values), values, alpha=0.6, s=18)
        if any(data):
            ax.boxplot([d or [math.nan] for d in data], widths=0.5, showfliers=False)
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_yscale("log")
        ax.set_xticks(range(1, len(levels) + 1), [f"L{level}" for level in levels])
        ax.set_title(f"speedup vs {baseline} (correct solutions)")
    fig.tight_layout()
    fig.savefig(run_dir / "speedups.png", dpi=120)
    plt.close(fig)

    # fast_p: the share of all tasks correct and faster than p.
    correct_speedups = [s for o in table.outcomes.values() if o.correct for s in (o.speedup_eager, o.speedup_compile) if s]
    top = max([3.0, *correct_speedups])
    grid = tuple(top * i / 200 for i in range(201))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, baseline in zip(axes, ("eager", "compile")):
        for level in [*levels, "overall"]:
            group = [o for o in table.outcomes.values() if level == "overall" or str(o.level) == level]
            ax.plot(grid, fast_p(group, baseline, grid), label=_level_label(level), lw=2 if level == "overall" else 1)
        for t in THRESHOLDS:
            ax.axvline(t, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("speedup threshold p")
        ax.set_title(f"fast_p vs {baseline}")
        ax.legend()
    axes[0].set_ylabel("share of tasks correct and faster than p")
    fig.tight_layout()
    fig.savefig(run_dir / "fast_p.png", dpi=120)
    plt.close(fig)

    # Ours next to the paper's rows, per split.
    splits = ["overall", *levels]
    metrics_shown = (("pass_rate", "pass_rate", "pass"), ("faster_eager@1", "faster_eager", "> eager"),
                     ("faster_compile@1", "faster_compile", "> compile"))
    fig, axes = plt.subplots(1, len(splits), figsize=(4 * len(splits), 4), sharey=True, squeeze=False)
    groups = {**report["levels"], "overall": report["overall"]}
    for ax, split in zip(axes[0], splits):
        series = [("this run", [groups[split][ours] for ours, _, _ in metrics_shown])]
        series += [(p["model"], [p[theirs] for _, theirs, _ in metrics_shown])
                   for p in report["paper_table1"] if p["split"] == split]
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series):
            ax.bar([j + i * width for j in range(len(metrics_shown))], [v or 0 for v in values], width, label=label)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(metrics_shown))], [m[2] for m in metrics_shown])
        ax.set_title(_level_label(split))
        ax.set_ylim(0, 1.4)
        ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(run_dir / "vs_paper.png", dpi=120)
    plt.close(fig)


def different_code(a: RunTable, b: RunTable) -> list[str]:
    """Tasks both runs have under one level and number but with other code (digests): rows that
    ``compare_runs`` would set side by side as one task."""
    def digests(table: RunTable) -> dict[tuple[int, int], tuple[str, str | None]]:
        return {(t["level"], t["problem_id"]): (t["name"], t.get("digest")) for t in table.spec["tasks"]
                if t.get("level") is not None and t.get("problem_id") is not None}

    da, db = digests(a), digests(b)
    return [f"{da[k][0]} / {db[k][0]}" if da[k][0] != db[k][0] else da[k][0]
            for k in sorted(set(da) & set(db) & set(a.outcomes) & set(b.outcomes)) if da[k][1] != db[k][1]]


def compare_runs(a: Path, b: Path, exclude_degenerate: bool = False, levels: list[int] | None = None,
                 top: int = 15, force: bool = False) -> str:
    """Markdown: the metrics of run ``a`` and run ``b`` side by side, and the tasks that changed.
    Runs whose tasks of one level and number differ in code are refused (``force``: compared, with
    a warning naming those tasks), as they would be compared as one task."""
    ta, tb = run_table(a, levels), run_table(b, levels)
    differ = different_code(ta, tb)
    named = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
    if differ and not force:
        raise ValueError(f"{a} and {b} hold different code for {len(differ)} task(s) of the same level and number "
                         f"({named}): they are different task sets, and their rows would be compared as one task. "
                         "Compare runs over the same tasks, or give --force to compare anyway.")
    ma, mb = (metrics(t.outcomes, exclude_degenerate=exclude_degenerate) for t in (ta, tb))
    la, lb = _languages_label(ta), _languages_label(tb)
    lines = [f"# {Path(a).name} ({la}) vs {Path(b).name} ({lb})", ""]
    if la != lb:
        lines += [f"Kernel languages compared on the same tasks: A is {la}, B is {lb}.", ""]
    if differ:
        lines += [f"**Warning**: {len(differ)} task(s) have different code in the two runs ({named}); "
                  "their rows below compare different programs.", ""]
    lines += ["| split | metric | A | B | B - A |", "|---|---|---:|---:|---:|"]
    for level in sorted(set(ma["levels"]) | set(mb["levels"])) + ["overall"]:
        ga = ma["overall"] if level == "overall" else ma["levels"].get(level)
        gb = mb["overall"] if level == "overall" else mb["levels"].get(level)
        for key, label in RATE_COLUMNS:
            va, vb = (ga or {}).get(key), (gb or {}).get(key)
            delta = "-" if va is None or vb is None else (
                f"{vb - va:+.2f}x" if key.startswith("geomean") else f"{100 * (vb - va):+.1f} pt")
            lines.append(f"| {_level_label(level)} | {label} | {_fmt(va, key)} | {_fmt(vb, key)} | {delta} |")
    changed = []
    for key in sorted(set(ta.outcomes) | set(tb.outcomes)):
        oa, ob = ta.outcomes.get(key), tb.outcomes.get(key)
        sa = oa.status if oa else "absent"
        sb = ob.status if ob else "absent"
        ca = oa.speedup_compile if oa and oa.correct else None
        cb = ob.speedup_compile if ob and ob.correct else None
        if sa != sb or (ca and cb and abs(math.log(cb / ca)) > math.log(1.1)):
            change = math.inf if (ca is None) != (cb is None) else abs(math.log(cb / ca)) if ca and cb else 0.0
            changed.append((change, (oa or ob).name, sa, sb, ca, cb))
    if changed:
        changed.sort(key=lambda c: -c[0])
        lines += ["", f"## Tasks that changed ({len(changed)}; status, or speedup vs compile by more than 10%)", "",
                  "| task | A | B | A x compile | B x compile |", "|---|---|---|---:|---:|"]
        for _, name, sa, sb, ca, cb in changed[:top]:
            lines.append(f"| {name} | {sa} | {sb} | {_fmt(ca, 'geomean')} | {_fmt(cb, 'geomean')} |")
    return "\n".join(lines) + "\n"
