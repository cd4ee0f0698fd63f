"""Seconds per evaluation and reward stability, side by side with the CUDA Agent release's scripts.

    python experiments/vs_release.py --release .data/ca_release/agent_workdir --out results.json

The release (github.com/BytedTsinghua-SIA/CUDA-Agent, ``agent_workdir/``) evaluates a workspace with
three scripts run in it: ``utils/compile.sh`` (a forced rebuild), ``python -m utils.verification``
and ``python -m utils.profiling``. Each of its evaluations pays all three; we run them once per
workspace (a re-evaluation costs them the same again) and time each step.

Ours, per workspace, with one long-lived evaluator (``prestart``: the candidate process started
ahead, reference processes kept across evaluations): cold (empty cache), cached build with a fresh
evaluator (no kept reference), then ``--repeats`` warm re-evaluations of the unchanged candidate
``--gap`` seconds apart (what an RL trainer or an agent asks for). For each: seconds, reward,
speedups with their intervals and whether each decision was confident. The workspaces: the
release's own axpby, and our examples (``cuda_gelu``, ``cuda_row_softmax``) laid out as release
workspaces. Rows are appended to ``--out`` as they finish.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' shared helpers
from common import ROOT, cv  # noqa: E402

from cuda_agent import Evaluator, load_candidate, load_task


def workspaces(release: Path, names: list[str]) -> list[tuple[str, Path, Path]]:
    """(name, model.py, candidate directory): the release's axpby and our examples."""
    rows = [("axpby", release / "model.py", release)]
    for name in names:
        rows.append((name, ROOT / "examples" / name / "model.py", ROOT / "examples" / name / "solution"))
    return rows


def run_release(release: Path, model: Path, candidate: Path) -> dict[str, object]:
    """The release's three steps in a copy of its workspace holding this task and candidate."""
    work = Path(tempfile.mkdtemp(prefix="ca-release-"))
    shutil.copytree(release, work, dirs_exist_ok=True)
    if candidate != release:
        shutil.rmtree(work / "kernels")
        shutil.copytree(candidate / "kernels", work / "kernels")
        shutil.copy2(candidate / "model_new.py", work / "model_new.py")
    shutil.copy2(model, work / "model.py")
    row: dict[str, object] = {}
    for step, argv in (("compile", ["bash", "utils/compile.sh"]),
                       ("verify", [sys.executable, "-m", "utils.verification"]),
                       ("profile", [sys.executable, "-m", "utils.profiling"])):
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=900)
        row[f"{step}_s"] = round(time.perf_counter() - start, 2)
        row[f"{step}_ok"] = done.returncode == 0
        row[f"{step}_tail"] = (done.stdout + done.stderr)[-600:]
        if done.returncode != 0:
            break
    row["total_s"] = round(sum(v for k, v in row.items() if k.endswith("_s")), 2)
    shutil.rmtree(work, ignore_errors=True)
    return row


def ours(model: Path, candidate: Path, repeats: int, gap: float, cold_run: bool = True) -> dict[str, object]:
    task, cand = load_task(model), load_candidate(candidate)
    cache = Path(tempfile.mkdtemp(prefix="cuda-agent-vs-"))
    with Evaluator("cuda", cache_dir=cache, prestart=True) as evaluator:
        start = time.perf_counter()
        # Without the cold run the build still happens here (a check-only evaluation), not reported.
        cold = evaluator.evaluate(task, cand, timed=cold_run)
        cold_s = time.perf_counter() - start
    if not cold_run:
        cold, cold_s = None, None
    with Evaluator("cuda", cache_dir=cache, prestart=True) as evaluator:
        start = time.perf_counter()
        cached = evaluator.evaluate(task, cand)
        cached_s = time.perf_counter() - start
        warm = []
        for _ in range(repeats):
            time.sleep(gap)
            start = time.perf_counter()
            result = evaluator.evaluate(task, cand)
            warm.append((time.perf_counter() - start, result))
    shutil.rmtree(cache, ignore_errors=True)
    bad = [r for _, r in [(cold_s, cold), (cached_s, cached), *warm] if r is not None and r.status != "correct"]
    for r in bad:
        print(f"not correct: {r.status} ({r.rule}): {r.reason}", flush=True)
    speedups = {side: [r.decision["speedups"][side]["estimate"] for _, r in warm if r.decision
                       and side in r.decision["speedups"]] for side in ("eager", "compile")}
    return {
        "seconds_cold": round(cold_s, 2) if cold_s is not None else None,
        "seconds_cached_build_new_evaluator": round(cached_s, 2),
        "seconds_warm": [round(s, 2) for s, _ in warm],
        "seconds_warm_median": round(statistics.median(s for s, _ in warm), 2) if warm else None,
        "durations_warm": [r.durations for _, r in warm],
        "rewards": [r.reward for _, r in warm],
        "same_reward": len({r.reward for _, r in warm}) == 1,
        "confident": [r.decision["confident"] if r.decision else None for _, r in warm],
        "rounds": [r.decision["rounds"] if r.decision else None for _, r in warm],
        "speedup": {side: {"values": [round(v, 4) for v in values], "cv": round(cv(values), 4)}
                    for side, values in speedups.items() if values},
        "intervals": [r.decision["speedups"] if r.decision else None for _, r in warm[:3]],
        "candidate_ms": [r.times.get("candidate", {}).get("median_ms") for _, r in warm],
        "failures": [f"{r.status}: {r.reason}" for r in bad],
        "host": [r.timing.get("host") for _, r in warm],  # each side's longest enqueue, hold, late regions
        "notes": sorted({n for _, r in warm for n in r.notes}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--release", type=Path, required=True, help="the release's agent_workdir/ (a copy)")
    parser.add_argument("--examples", nargs="*", default=["cuda_gelu", "cuda_row_softmax"])
    parser.add_argument("--only", nargs="*", default=None, help="workspace names to run (default: all)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between warm evaluations")
    parser.add_argument("--no-release", action="store_true", help="skip the release's scripts")
    parser.add_argument("--release-for", nargs="*", default=None,
                        help="workspaces the release's scripts run for (default: all; a device call is 10 minutes)")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold evaluation (the build is not timed)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not (args.release / "utils" / "profiling.py").is_file():
        raise SystemExit(f"{args.release}: not the release's agent_workdir (no utils/profiling.py); copy it from "
                         "github.com/BytedTsinghua-SIA/CUDA-Agent")
    import torch

    header = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    print(json.dumps(header), flush=True)
    rows: list[dict[str, object]] = []
    for name, model, candidate in workspaces(args.release, args.examples):
        if args.only and name not in args.only:
            continue
        row: dict[str, object] = {"workspace": name, **header}
        if not args.no_release and (args.release_for is None or name in args.release_for):
            row["release"] = run_release(args.release, model, candidate)
            print(json.dumps({"workspace": name, "release": row["release"]}), flush=True)
        row["ours"] = ours(model, candidate, args.repeats, args.gap, cold_run=not args.no_cold)
        print(json.dumps({"workspace": name, "ours": row["ours"]}), flush=True)
        if args.out:
            with args.out.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
        rows.append(row)
    print(summary(rows), flush=True)


def summary(rows: list[dict[str, object]]) -> str:
    """A table of the rows: rewards, their confidence, the speedups' spread, seconds per evaluation."""
    lines = ["| workspace | rewards | same | confident | CV vs eager / compile | warm s (median) | cached s | cold s "
             "| release s |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ours, release = row["ours"], row.get("release") or {}
        cv_text = " / ".join(f"{ours['speedup'][side]['cv']:.2%}" if side in ours["speedup"] else "-"
                             for side in ("eager", "compile"))
        rewards = ",".join(f"{r:g}" for r in ours["rewards"])
        lines.append(f"| {row['workspace']} | {rewards} | {ours['same_reward']} | {sum(map(bool, ours['confident']))}"
                     f"/{len(ours['confident'])} | {cv_text} | {ours['seconds_warm_median']} | "
                     f"{ours['seconds_cached_build_new_evaluator']} | {ours['seconds_cold']} | {release.get('total_s', '-')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
