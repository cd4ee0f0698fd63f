"""Why does a candidate's median move between evaluations? Times one example's candidate the way the
candidate process does (fresh inputs before every call, ``evaluate.protocol.timing.measure``) in several fresh
processes, in rounds that alternate that method, the same with the GPU held busy while the host
launches (so host launch latency and stalls are left out), and fixed inputs.

    python experiments/candidate_timing_probe.py --example cuda_gelu --processes 4 --out probe.json

Separates spread between processes from spread within one, and shows whether the spread comes from
the host side of the timed window.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' shared helpers
from common import ROOT, examples  # noqa: E402

from cuda_agent import Evaluator


def placements(task, model, setup, state, rounds: int) -> dict:
    """The candidate, eager and torch.compile timed as the rounds time them (fresh inputs, events, the
    end in stream order), with the allocator's pool laid out differently before each: a spacer of
    some MiB held while the timed calls draw their inputs and outputs. Keys: ``side@spacer``."""
    import torch

    from cuda_agent.evaluate.protocol.policy import TimingConfig
    from cuda_agent.evaluate.protocol.timing import measure

    config = TimingConfig(method="events", end_fence="stream", hold_us=50.0, target_ms=200)
    reference = task.Model(*task.get_init_inputs()).cuda().eval()
    sides = {"candidate": model, "eager": reference, "compile": torch.compile(reference)}
    out: dict[str, list[float]] = {}
    with torch.no_grad():
        for _ in range(rounds):
            for spacer_mib in (0, 2, 6, 34, 130, 514):
                torch.cuda.empty_cache()
                spacer = torch.empty(spacer_mib << 20, dtype=torch.uint8, device="cuda") if spacer_mib else None
                for side, fn in sides.items():
                    median = measure(lambda fn=fn: fn(*state["inputs"]), "cuda", config, setup).median_ms
                    out.setdefault(f"{side}@{spacer_mib}", []).append(median)
                del spacer
    return out


def child(task_file: str, modules: dict[str, str], model_new: str, rounds: int, placement: bool = False) -> dict:
    import torch

    from cuda_agent.evaluate.protocol.policy import TimingConfig
    from cuda_agent.evaluate.worker.profiling import profile_call
    from cuda_agent.evaluate.protocol.timing import measure, trial_seed
    from cuda_agent.evaluate.worker.loop import install_inline_shim, load_extension, load_model_new, make_inputs
    from cuda_agent.tasks.task import Task, exec_task_module

    task = exec_task_module(Task(name="probe", code=Path(task_file).read_text(), source=task_file))
    install_inline_shim({name: load_extension(name, path) for name, path in modules.items()})
    model = load_model_new(Path(model_new)).ModelNew(*task.get_init_inputs()).cuda().eval()
    config = TimingConfig(method="events")
    state = {"index": 0, "inputs": None}

    def setup() -> None:
        state["index"] += 1
        state["inputs"] = None
        state["inputs"] = make_inputs(task, trial_seed(7, state["index"]), "cuda", "probe")

    def fresh() -> float:
        with torch.no_grad():
            return measure(lambda: model(*state["inputs"]), "cuda", config, setup).median_ms

    fixed_inputs = make_inputs(task, 1, "cuda", "probe")

    def fixed() -> float:
        with torch.no_grad():
            return measure(lambda: model(*fixed_inputs), "cuda", config).median_ms

    def delayed() -> float:
        """The same trials, but the GPU is held busy (``torch.cuda._sleep``) while the host launches:
        host launch latency and stalls of the launching thread are left out of the window."""
        samples = []
        flush = torch.empty(config.flush_bytes, dtype=torch.int8, device="cuda")
        with torch.no_grad():
            for _ in range(200):
                setup()
                flush.zero_()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(200_000)  # about 100 us at 2 GHz
                start.record()
                model(*state["inputs"])
                torch.cuda.synchronize()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
        return statistics.median(samples)

    if placement:
        return placements(task, model, setup, state, rounds)
    out: dict[str, list[float]] = {"fresh": [], "delayed": [], "fixed": []}
    for round_ in range(rounds):
        out["fresh"].append(fresh())
        out["delayed"].append(delayed())
        out["fixed"].append(fixed())
        if round_ == 0:
            with torch.no_grad():
                profile_call(lambda: model(*fixed_inputs), "cuda")  # as the attribution check does, once
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--example", default="cuda_gelu")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--placement", action="store_true",
                        help="time candidate, eager and compile under different allocator layouts instead")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child(spec["task"], spec["modules"], spec["model_new"], args.rounds, args.placement)))
        return
    [(_, task, candidate)] = list(examples("cuda", [args.example]))
    built = Evaluator("cuda").build(candidate)
    assert built.ok, built.error
    spec = {"task": str(ROOT / "examples" / args.example / "model.py"), "modules": built.modules,
            "model_new": str(ROOT / "examples" / args.example / "solution" / "model_new.py")}
    rows = []
    for number in range(args.processes):
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec), "--rounds", str(args.rounds)]
                              + (["--placement"] if args.placement else []),
                              capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"process {number}: " + ", ".join(f"{k} {' '.join(f'{v:.4f}' for v in vs)}" for k, vs in row.items()),
              flush=True)
    for key in rows[0]:
        values = [v for r in rows for v in r[key]]
        per_process = [statistics.median(r[key]) for r in rows]
        print(f"{key:22s} all: {statistics.median(values):.4f} ms, CV {statistics.pstdev(values) / statistics.fmean(values):.2%}; "
              f"between processes CV {statistics.pstdev(per_process) / statistics.fmean(per_process):.2%}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
