"""Where the reference's write of a region's inputs goes (issue 31's overhead): each step of ``write_gpu`` timed
alone on this GPU, for an example task. Prints one JSON line per step: median and spread over ``--repeats``.

    python3 experiments/probes/write_cost_probe.py --example cuda_gelu
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from cuda_agent.evaluate.protocol.quiet import probe_us
from cuda_agent.evaluate.worker.side import make_inputs
from cuda_agent.evaluate.protocol.timing import TimingConfig, flush_bytes


def timed(step, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        begin = time.perf_counter_ns()
        step()
        torch.cuda.synchronize()
        out.append((time.perf_counter_ns() - begin) / 1e6)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--example", default="cuda_gelu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    path = Path(__file__).resolve().parents[2] / "examples" / args.example / "model.py"
    spec = importlib.util.spec_from_file_location("task", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    source = path.read_text()
    drawn = make_inputs(module, 1, "cuda", source)
    target = [torch.empty_like(t) for t in drawn if isinstance(t, torch.Tensor)]
    flush = torch.empty(flush_bytes("cuda", TimingConfig()), dtype=torch.int8, device="cuda")
    seeds = iter(range(2, 10_000))

    def copy():
        for t, d in zip(target, drawn):
            t.copy_(d)
    steps = {
        "draw (make_inputs)": lambda: make_inputs(module, next(seeds), "cuda", source),
        "copy (device to device)": copy,
        "flush (zero_)": flush.zero_,
        "probe_us": probe_us,
    }
    for name, step in steps.items():
        ms = timed(step, args.repeats)
        print(json.dumps({"example": args.example, "step": name, "median_ms": round(statistics.median(ms), 3),
                          "min_ms": round(min(ms), 3), "max_ms": round(max(ms), 3),
                          "bytes": sum(t.numel() * t.element_size() for t in target)}), flush=True)


if __name__ == "__main__":
    main()
