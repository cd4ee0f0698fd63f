"""Seconds from a changed candidate's source to its reward, as a trainer or an agent pays them (issue 34).

For each example, one long-lived evaluator (``prestart``, as the service runs it) with a fresh cache: one
cold evaluation (the reference starts, torch.compile runs, everything is built), then ``--edits`` evaluations of the same candidate with
one line of its kernel file changed each time (a comment carrying the edit's number: a new source, so the
build cache misses, while the kernel and its reward stay the same; what is measured is the rebuild and
the evaluation around it). Each evaluation is timed end to end, back to back, as a trainer submits them.

With ``--baseline-src`` (another tree's ``src``, e.g. main before the build cache) each example runs with
both trees, one after the other, each in its own process, in the same run:

    python3 benchmarks/edit_to_reward.py --device cuda --edits 5 --baseline-src .data/prev/src --out r.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def kernel_file(candidate) -> str:
    """The extension's kernel source (a .cu on the GPU, the kernels/ file on the CPU), not its glue."""
    sources = candidate.extensions[0].sources
    kernels = [p for p in sources if p.endswith(".cu")] or [p for p in sources if p.startswith("kernels/")
                                                            and not p.endswith("_binding.cpp")]
    if not kernels:
        raise SystemExit(f"edit_to_reward: no kernel file among {sorted(sources)}")
    return sorted(kernels)[0]


def edited(candidate, rel: str, number: int):
    ext = candidate.extensions[0]
    text = ext.sources[rel] + f"\n// edit {number}\n"
    return dataclasses.replace(candidate, extensions=(dataclasses.replace(ext, sources={**ext.sources, rel: text}),))


def worker(args: argparse.Namespace) -> None:
    """One tree (whatever ``cuda_agent`` this process imports), one example: JSON lines on stdout."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import examples

    from cuda_agent import Evaluator

    (name, task, candidate), = examples(args.device, [args.example])
    rel = kernel_file(candidate)
    # Long-lived, as the service, the agent and the trainers run it: references kept, processes started ahead.
    with tempfile.TemporaryDirectory(prefix="edit-to-reward-") as cache, \
            Evaluator(args.device, cache_dir=Path(cache), prestart=True) as evaluator:
        for number in range(args.edits + 1):
            if number:
                time.sleep(args.gap)
            this = candidate if number == 0 else edited(candidate, rel, number)
            start = time.perf_counter()
            result = evaluator.evaluate(task, this)
            seconds = time.perf_counter() - start
            build = result.build or {}
            print(json.dumps({"example": name, "case": "cold" if number == 0 else "kernel_edit", "edit": number,
                              "seconds": round(seconds, 3), "status": result.status, "reward": result.reward,
                              "reason": result.reason, "build_s": result.durations.get("build"),
                              "durations": result.durations, "kernel_file": rel,
                              "units_compiled": [u["unit"] for u in build.get("units", []) if not u.get("reused")],
                              "build_cpu_s": build.get("cpu_s")}),
                  flush=True)


def stages(durations: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in durations.items() if k != "total" and v >= 0.05)


def run_tree(args: argparse.Namespace, label: str, src: Path, example: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(src))
    command = [sys.executable, __file__, "--worker", "--device", args.device, "--example", example,
               "--edits", str(args.edits), "--gap", str(args.gap)]
    rows = []
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            row = json.loads(line) | {"tree": label}
            rows.append(row)
            print(f"[{label}] {row['example']} {row['case']} {row['edit']}: {row['status']} reward {row['reward']} "
                  f"in {row['seconds']:.1f} s (compiled {row['units_compiled']}; {stages(row['durations'])})", flush=True)
    if proc.returncode:
        print(f"[{label}] {example}: the worker exited {proc.returncode}", flush=True)
    return rows


def summary(rows: list[dict], trees: list[str]) -> str:
    lines = ["| example | tree | cold s | kernel edit s, median (min-max) | build s, median | rewards |",
             "|---|---|---|---|---|---|"]
    for example in dict.fromkeys(r["example"] for r in rows):
        for tree in trees:
            mine = [r for r in rows if r["example"] == example and r["tree"] == tree]
            cold = [r["seconds"] for r in mine if r["case"] == "cold"]
            edits = [r for r in mine if r["case"] == "kernel_edit"]
            if not edits:
                continue
            secs = [r["seconds"] for r in edits]
            builds = [r["build_s"] or 0.0 for r in edits]
            rewards = sorted({str(r["reward"]) for r in mine})
            lines.append(f"| {example} | {tree} | {cold[0] if cold else '-':.1f} | {statistics.median(secs):.1f} "
                         f"({min(secs):.1f}-{max(secs):.1f}) | {statistics.median(builds):.1f} | {', '.join(rewards)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--examples", nargs="*", default=None, help="example folder names (default: the device's first two)")
    parser.add_argument("--edits", type=int, default=5, help="kernel edits after the cold evaluation")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between evaluations (a trainer's next batch)")
    parser.add_argument("--baseline-src", type=Path, default=None, help="another tree's src, run beside this one")
    parser.add_argument("--out", type=Path, default=None, help="write the rows and the table here (JSON)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--example", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.baseline_src is not None and not (args.baseline_src / "cuda_agent").is_dir():
        parser.error(f"--baseline-src {args.baseline_src} has no cuda_agent package: pass a tree's src folder "
                     f"(git archive REV src | tar -x -C DIR, then DIR/src)")
    prefix = "cuda_" if args.device == "cuda" else "cpu_"
    names = args.examples or sorted(p.name for p in (ROOT / "examples").glob(prefix + "*"))[:2]
    trees = [("baseline", args.baseline_src.resolve())] if args.baseline_src else []
    trees.append(("this tree", ROOT / "src"))
    rows: list[dict] = []
    for name in names:
        for label, src in trees:
            rows += run_tree(args, label, src, name)
    table = summary(rows, [label for label, _ in trees])
    print(f"\n{args.device}, {args.edits} kernel edits per example, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    print(table)
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "table": table, "host": platform.node(),
                                        "python": platform.python_version(), "device": args.device}, indent=1))


if __name__ == "__main__":
    main()
