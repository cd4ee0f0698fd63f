"""What each step of one check costs on a task with GB-sized outputs, outside the evaluator's processes: the
draw, the input fingerprint, the strict forward, the precision allowance, the output's copy into shared
page-locked memory and back, the comparison. Read beside ``eval_profile.py``'s per-request times to see
what the requests add (processes, sandbox, allocator settings) to the steps themselves.

    python experiments/verify_costs.py --kernelbench .data/kernelbench/kernelbench.jsonl level1_20 level1_5
"""

from __future__ import annotations

import sys
import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' shared helpers
from common import kernelbench_tasks  # noqa: E402

from cuda_agent.evaluate.protocol.compare import compare_outputs, precision_allowance
from cuda_agent.evaluate.worker.shared import SharedBuffer
from cuda_agent.evaluate.worker.side import fingerprint, init_inputs, make_inputs, pin_precision, seed_everything
from cuda_agent.evaluate.worker.transfer import packed_bytes, read_outputs, write_outputs
from cuda_agent.tasks.task import exec_task_module
from cuda_agent.tensors import tensor_bytes


DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def step(times: dict[str, list[float]], name: str, fn):
    sync()
    start = time.perf_counter()
    value = fn()
    sync()
    times.setdefault(name, []).append(time.perf_counter() - start)
    return value


def one_task(task, repeats: int) -> dict[str, float]:
    module = exec_task_module(task)
    seed_everything(0)
    with torch.device(DEVICE):
        model = module.Model(*init_inputs(module, 0, task.source)).to(DEVICE).eval()
    times: dict[str, list[float]] = {}
    shared = None
    with torch.no_grad():
        for repeat in range(repeats + 1):
            if repeat == 1:
                times.clear()  # the first round warms the allocator and the kernels
            inputs = step(times, "draw", lambda: make_inputs(module, repeat, DEVICE, task.source))
            step(times, "fingerprint", lambda: fingerprint(inputs))

            def strict():
                pin_precision("off")
                try:
                    return model(*inputs)
                finally:
                    pin_precision("on")

            expected = step(times, "forward strict", strict)
            own = step(times, "forward", lambda: model(*inputs))
            step(times, "allowance", lambda: precision_allowance(expected, own, 1e-2, 1e-2, False, 4.0))
            own = None  # noqa: F841 - its memory goes before the copies
            output_bytes = step(times, "tensor_bytes", lambda: tensor_bytes(expected))
            if shared is None:
                shared = step(times, "shared buffer (create + register)",
                              lambda: SharedBuffer.create(packed_bytes(expected), DEVICE))
            with tempfile.TemporaryDirectory() as folder:
                manifest = step(times, "output to shared memory", lambda: write_outputs(expected, Path(folder), shared))
                actual = step(times, "output from shared memory", lambda: read_outputs(manifest, Path(folder), DEVICE, shared))
            step(times, "compare", lambda: compare_outputs(expected, actual, 1e-2, 1e-2))
            actual = expected = inputs = None  # noqa: F841 - the next draw reuses their memory
    shared.close()
    return {name: round(min(values), 4) for name, values in times.items()} | {"output_gib": round(output_bytes / 2**30, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("solutions", nargs="+", help="benchmarks/solutions_kb folder names (level1_20)")
    parser.add_argument("--kernelbench", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    rows = {}
    for name, task in zip(args.solutions, kernelbench_tasks(args.kernelbench, args.solutions)):
        rows[name] = one_task(task, args.repeats)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        print(name, json.dumps(rows[name]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
