"""Why are torch.compile's rounds sometimes 2-20% slow while eager's, interleaved with them, are not?
Times eager and torch.compile of an example's task in one process the way the harness's rounds do
(fresh inputs, L2 flush, a 200 us hold, the end event in stream order, a fence after the
synchronise), and keeps, per region, the time to the end event, the time to the fence, and whether
the harness would have taken the fence (it does when the fence is later than an empty region's
allowance). Half the rounds follow a pause, as evaluations do. A slow round whose time to the end
event is slow is the GPU's (the kernels); one slow only to the fence is the host's wake-up.

    python experiments/compile_slow_probe.py --example cuda_row_softmax --rounds 40 --out slow.json
"""

from __future__ import annotations

import sys
import argparse
import json
import statistics
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' shared helpers
from common import ROOT  # noqa: E402

from cuda_agent import load_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default="cuda_row_softmax")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--pause", type=float, default=1.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch

    from cuda_agent.evaluate.protocol.policy import TimingConfig
    from cuda_agent.evaluate.protocol.timing import _empty_fence_ms, _flush_buffer, _sm_clock_ghz
    from cuda_agent.guard.device_state import reset_persisting_l2
    from cuda_agent.evaluate.worker.loop import make_inputs
    from cuda_agent.tasks.task import exec_task_module

    task = exec_task_module(load_task(ROOT / "examples" / args.example / "model.py"))
    model = task.Model(*task.get_init_inputs()).cuda().eval()
    sides = {"eager": model, "compile": torch.compile(model)}
    config = TimingConfig(method="events").resolved("cuda")
    flush = _flush_buffer("cuda", config)
    hold = int(config.hold_us * _sm_clock_ghz() * 1e3)
    allowance = _empty_fence_ms(hold) * 2 + 0.005
    seed = [0]
    rows = []
    with torch.no_grad():
        for fn in sides.values():
            for _ in range(5):
                fn(*make_inputs(task, 1, "cuda", "probe"))
        for number in range(args.rounds):
            paused = number % 2 == 1
            if paused:
                time.sleep(args.pause)
            for side in (list(sides) if number % 4 < 2 else list(sides)[::-1]):
                fn = sides[side]
                events = []
                for _ in range(args.trials):
                    seed[0] += 1
                    inputs = make_inputs(task, seed[0], "cuda", "probe")
                    reset_persisting_l2()
                    flush.zero_()
                    torch.cuda.synchronize()
                    torch.cuda._sleep(hold)
                    start, end, fence = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                    host = time.perf_counter_ns()
                    start.record()
                    fn(*inputs)
                    end.record()
                    launched_us = (time.perf_counter_ns() - host) / 1e3
                    torch.cuda.synchronize()
                    fence.record()
                    events.append((start, end, fence, launched_us))
                torch.cuda.synchronize()
                to_end = [s.elapsed_time(e) for s, e, _, _ in events]
                to_fence = [s.elapsed_time(f) for s, _, f, _ in events]
                launch = [u for *_, u in events]
                taken = [f if f - e > allowance else e for e, f in zip(to_end, to_fence)]
                rows.append({"round": number, "paused": paused, "side": side,
                             "end_ms": statistics.median(to_end), "fence_ms": statistics.median(to_fence),
                             "taken_ms": statistics.median(taken), "fence_taken": sum(f - e > allowance for e, f in zip(to_end, to_fence)),
                             "launch_us": statistics.median(launch), "launch_us_max": max(launch)})
                print(json.dumps(rows[-1]), flush=True)
    args.out.write_text(json.dumps({"example": args.example, "allowance_ms": allowance, "rows": rows}, indent=1))
    for side in sides:
        for paused in (False, True):
            mine = [r for r in rows if r["side"] == side and r["paused"] == paused]
            ends = [r["end_ms"] for r in mine]
            print(f"{side} paused={paused}: end {min(ends):.4f}-{max(ends):.4f} ms, taken "
                  f"{min(r['taken_ms'] for r in mine):.4f}-{max(r['taken_ms'] for r in mine):.4f}, fence taken in "
                  f"{sum(r['fence_taken'] for r in mine)} of {len(mine) * args.trials}, launch us median "
                  f"{statistics.median(r['launch_us'] for r in mine):.0f}")


if __name__ == "__main__":
    main()
