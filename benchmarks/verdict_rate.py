"""How often an honest CPU evaluation gets a verdict on a busy host, and whether it is the quiet host's: an example's
solution evaluated with N busy processes beside it (one ``while True: pass`` each, for the whole evaluation, or
with ``--duty ON OFF`` busy ON seconds then idle OFF seconds, as other work comes and goes), with one attempt (no
retry: as before ``evaluate.retry``) and with the default ``RetryPolicy``. Each row records the host's load average
as it started (other users' work counts too).

    python3 benchmarks/verdict_rate.py --busy 0 1 2 4 --repeats 3 --out /tmp/verdict_rate.json
    python3 benchmarks/verdict_rate.py --device cuda --busy 0 8 14 --repeats 3   # a GPU host, most of its cores busy
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT  # noqa: E402

from cuda_agent import Evaluator, load_candidate, load_task  # noqa: E402
from cuda_agent.evaluate import TimingConfig  # noqa: E402
from cuda_agent.evaluate.retry import RetryPolicy  # noqa: E402

HOG = [sys.executable, "-c", "while True: pass"]


class Hogs:
    """``count`` busy processes; with ``duty`` (on_s, off_s) they run on_s seconds, then stand still off_s."""

    def __init__(self, count: int, duty: tuple[float, float] | None):
        self.procs = [subprocess.Popen(HOG) for _ in range(count)]
        self.duty, self.stop = duty, threading.Event()
        self.thread = threading.Thread(target=self._cycle, daemon=True) if duty and count else None
        if self.thread:
            self.thread.start()

    def _cycle(self) -> None:
        on_s, off_s = self.duty
        while not self.stop.wait(on_s):
            for proc in self.procs:
                proc.send_signal(19)  # SIGSTOP
            if self.stop.wait(off_s):
                break
            for proc in self.procs:
                proc.send_signal(18)  # SIGCONT

    def close(self) -> None:
        self.stop.set()
        for proc in self.procs:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--example", default=None, help="an example's folder name (cpu_swish on the CPU, cuda_gelu on a GPU)")
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["one", "retry"], choices=("one", "retry"))
    parser.add_argument("--duty", type=float, nargs=2, default=None, metavar=("ON_S", "OFF_S"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/verdict_rate.json"))
    parser.add_argument("--region-memory-share", type=float, default=None,
                        help="TimingConfig.region_memory_share (GPU): the card's share a region's calls may keep alive")
    parser.add_argument("--quiet-reward", type=float, default=1.0,
                        help="the quiet host's reward, where no evaluation here had a verdict without busy processes")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))  # the busy processes go with it (finally)
    args.example = args.example or ("cpu_swish" if args.device == "cpu" else "cuda_gelu")
    root = ROOT / "examples" / args.example
    task, candidate = load_task(root / "model.py"), load_candidate(root / "solution")
    rows = []
    policies = {"one": RetryPolicy.none(), "retry": RetryPolicy()}
    timing = TimingConfig() if args.region_memory_share is None else TimingConfig(
        region_memory_share=args.region_memory_share)
    with Evaluator(args.device, references=1, retry=RetryPolicy.none(), timing=timing) as evaluator:
        quiet = evaluator.evaluate(task, candidate)  # builds, reference and torch.compile warm; the quiet verdict
        print(json.dumps({"warm-up": quiet.status, "reward": quiet.reward,
                          "speedups": [quiet.speedup_eager, quiet.speedup_compile]}), flush=True)
        for busy in args.busy:
            for mode in args.modes:
                evaluator.retry = policies[mode]
                hogs = Hogs(busy, tuple(args.duty) if args.duty else None)
                try:
                    for repeat in range(args.repeats):
                        load = os.getloadavg()[0]
                        started = time.monotonic()
                        result = evaluator.evaluate(task, candidate)
                        row = {"busy": busy, "duty": args.duty, "mode": mode, "repeat": repeat, "load1": round(load, 2),
                               "status": result.status, "reward": result.reward, "attempts": result.attempts,
                               "kind": result.no_verdict_kind, "reason": result.reason,
                               "speedups": [result.speedup_eager, result.speedup_compile],
                               "waits": result.timing.get("cpu_waits"),
                               # The evaluator's clock's own terms (GPU): a no-verdict may be either's.
                               **{k: (result.timing.get("regions") or {}).get(k)
                                  for k in ("allowance", "uncertainty", "outside_ms")},
                               "seconds": round(time.monotonic() - started, 1)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                finally:
                    hogs.close()
    # The quiet host's reward: the warm-up's where it had a verdict, else the most common one with none busy.
    quiet_reward = quiet.reward if quiet.status != "error" else max(
        ((sum(r["reward"] == v for r in rows if r["busy"] == 0), v) for v in {r["reward"] for r in rows
                                                                                  if r["busy"] == 0 and r["reward"] is not None}),
        default=(0, args.quiet_reward))[1]
    args.out.write_text(json.dumps({"cpus": os.cpu_count(), "device": args.device, "example": args.example,
                                    "region_memory_share": timing.region_memory_share,
                                    "quiet_reward": quiet_reward,
                                    "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1))
    table(rows, args.busy, args.modes, quiet_reward)


def table(rows: list[dict], busy_levels: list[int], modes: list[str], quiet_reward: float | None) -> None:
    print("\n| busy processes | mode | verdicts | same reward as quiet | other reward | attempts (mean) | s (median) "
          "| load1 at start |\n|---|---|---|---|---|---|---|---|")
    for busy in busy_levels:
        for mode in modes:
            group = [r for r in rows if r["busy"] == busy and r["mode"] == mode]
            if not group:
                continue
            verdicts = [r for r in group if r["status"] != "error"]
            same = sum(r["reward"] == quiet_reward for r in verdicts)
            seconds = sorted(r["seconds"] for r in group)[len(group) // 2]
            loads = [r["load1"] for r in group]
            print(f"| {busy} | {mode} | {len(verdicts)}/{len(group)} | {same}/{len(group)} | {len(verdicts) - same} | "
                  f"{sum(r['attempts'] for r in group) / len(group):.1f} | {seconds} | {min(loads):.1f}-{max(loads):.1f} |")


if __name__ == "__main__":
    main()
