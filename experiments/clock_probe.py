"""Where a timing round's time goes, seen from outside the candidate's process (the outside clock).

Part 1, in one process: the harness's time for a round with the calls left out (input draws, flushes,
holds, records), before and after the profiler has been started in that process (the candidate
process starts it at start-up), and a round of torch's own GELU, wall minus the time its regions
report (``--in-process``). Part 2: evaluations of the project's examples under variants of the
evaluator, with its clock figures (``EvalResult.timing["clock"]``).

    python experiments/clock_probe.py --in-process --out clock_probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "redteam"))


def in_process(example: str, trials: int, repeats: int) -> dict:
    import torch

    from cuda_agent.evaluate.protocol.policy import TimingConfig
    from cuda_agent.evaluate.protocol.messages import TimeRequest
    from cuda_agent.evaluate.worker.profiling import profile_call
    from cuda_agent.evaluate.worker.loop import _Side
    from cuda_agent.tasks import load_task
    from cuda_agent.tasks.task import exec_task_module

    task = load_task(ROOT / "examples" / example / "model.py")
    side = _Side()
    side.device = "cuda"
    side.task_module = exec_task_module(task)
    model = side.task_module.Model(*side.task_module.get_init_inputs()).cuda()
    timing = TimingConfig().resolved("cuda").to_dict()

    def rounds(fn, label):
        walls, claimed = [], []
        for r in range(repeats):
            msg = TimeRequest(seed=r, first=0, trials=trials, calls=1, timing=timing, probe=r)
            start = time.perf_counter()
            samples, _ = side.time_calls(fn, msg)
            walls.append((time.perf_counter() - start) * 1e3)
            claimed.append(sum(samples))
        row = {"label": label, "wall_ms": statistics.median(walls), "claimed_ms": statistics.median(claimed),
               "harness_ms": statistics.median(w - c for w, c in zip(walls, claimed))}
        print(json.dumps(row), flush=True)
        return row

    empty = lambda *inputs: [torch.empty_like(inputs[0])]  # noqa: E731
    out = [rounds(empty, "empty"), rounds(model, "eager")]
    profile_call(lambda: torch.randn(1 << 10, device="cuda").sum(), "cuda")
    out += [rounds(empty, "empty after profiler"), rounds(model, "eager after profiler")]
    return {"example": example, "trials": trials, "rows": out}


def evaluations(repeats: int, variants: list[str]) -> list[dict]:
    """Evaluations of the examples under variants of the evaluator: ``default``; ``no-pause`` (the
    candidate is not stopped between its rounds)."""
    from cuda_agent import Evaluator, load_candidate, load_task
    from cuda_agent.evaluate import rounds as timing_rounds

    rows = []
    pause = timing_rounds.pause
    for variant in variants:
        timing_rounds.pause = (lambda candidate: None) if variant == "no-pause" else pause
        with Evaluator("cuda", prestart=True) as evaluator:
            for example in ("cuda_gelu", "cuda_row_softmax"):
                task = load_task(ROOT / "examples" / example / "model.py")
                for _ in range(repeats):
                    result = evaluator.evaluate(task, load_candidate(ROOT / "examples" / example / "solution"))
                    clock = result.timing.get("clock") or {}
                    rows.append({"variant": variant, "example": example, "status": result.status, "rule": result.rule,
                                 "unexplained_ms": clock.get("unexplained_ms"), "limit_ms": clock.get("limit_ms"),
                                 "clock": clock, "plan": result.timing.get("plans", {}).get("candidate")})
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "clock"}), flush=True)
    timing_rounds.pause = pause
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=["default", "no-pause"])
    parser.add_argument("--in-process", action="store_true", help="part 1 too")
    parser.add_argument("--out", type=Path, default=Path("clock_probe.json"))
    args = parser.parse_args()
    report = {"in_process": [in_process(e, 7, 9) for e in ("cuda_gelu", "cuda_row_softmax")] if args.in_process else []}
    report["evaluations"] = evaluations(args.repeats, args.variants)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
