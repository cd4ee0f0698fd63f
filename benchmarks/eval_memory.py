"""Peak memory of the evaluation's processes, in copies of the task's output: how many tensors of a
task's size the reference and the candidate process hold at once, stage by stage.

    python benchmarks/eval_memory.py --device cpu --mib 512 --out results.json
    python benchmarks/eval_memory.py --device cuda --kernelbench .data/kernelbench/kernelbench.jsonl

KernelBench's largest level-1 tasks (ReLU, Sigmoid, Softmax: 6 GiB inputs and outputs) must fit both
processes on an 80 GB card. On the CPU the task is the cpu_swish example widened to ``--mib`` MiB of
float32 (glibc hands tensors this large back to the system when freed, so the resident anonymous
memory follows the live tensors); on a GPU it is KernelBench level 1 ReLU with the project's solution
(``tests/gpu/kernelbench_solutions/level1_19``), read from outside with ``nvidia-smi`` as the evaluation
runs. The evaluation's stages come from ``Evaluator(on_stage=...)``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from cuda_agent import Evaluator, Task, load_candidate
from cuda_agent.sandbox.proctree import descendants
from cuda_agent.tasks import load_tasks

ROOT = Path(__file__).resolve().parents[1]


def roles_of(root: int) -> dict[int, str]:
    """{pid: role} of ``root``'s descendants; the role is the worker's ``--role`` (or the program)."""
    found = {}
    for pid in descendants(root)[1:]:
        try:
            words = [w.decode(errors="replace") for w in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue  # ended since
        found[pid] = words[words.index("--role") + 1] if "--role" in words else Path(words[0]).name
    return found


def host_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


def gpu_mib() -> dict[int, float]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return {int(p): float(m) for p, m in (line.split(",") for line in out.splitlines() if line.strip())}


class Watch:
    """Polls the evaluation's processes; the peak per (role, stage)."""

    def __init__(self, device: str, every_s: float):
        self.device, self.every_s = device, every_s
        self.stage = "start"
        self.peaks: dict[tuple[str, str], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def on_stage(self, stage: str, detail: str) -> None:
        self.stage = stage

    def __enter__(self) -> "Watch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            roles = roles_of(os.getpid())
            try:
                sizes = gpu_mib() if self.device == "cuda" else {pid: host_mib(pid) for pid in roles}
            except (OSError, subprocess.CalledProcessError):
                continue
            totals: dict[str, float] = {}
            for pid, role in roles.items():
                totals[role] = totals.get(role, 0.0) + sizes.get(pid, 0.0)
            for role, mib in totals.items():
                key = (role, self.stage)
                self.peaks[key] = max(self.peaks.get(key, 0.0), mib)


def cpu_task(mib: int) -> tuple[Task, object]:
    code = (ROOT / "examples/cpu_swish/model.py").read_text()
    elements = mib * 1024 * 1024 // 4
    code = code.replace("dim = 16384", f"dim = {elements // 64}")
    return Task(name=f"cpu_swish_{mib}mib", code=code, source=f"examples/cpu_swish/model.py ({mib} MiB)"), load_candidate(ROOT / "examples/cpu_swish/solution")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--mib", type=int, default=512, help="CPU: the task's input (and output) size")
    parser.add_argument("--kernelbench", type=Path, default=ROOT / ".data/kernelbench/kernelbench.jsonl")
    parser.add_argument("--every", type=float, default=0.02, help="seconds between reads")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    if args.device == "cpu":
        task, candidate = cpu_task(args.mib)
        output_mib = float(args.mib)
    else:
        task = next(t for t in load_tasks(args.kernelbench, levels=[1]) if t.problem_id == 19)
        candidate = load_candidate(ROOT / "tests/gpu/kernelbench_solutions/level1_19")
        output_mib = 4096 * 393216 * 4 / 2**20
    watch = Watch(args.device, args.every)
    with watch, Evaluator(args.device, on_stage=watch.on_stage) as evaluator:
        began = time.perf_counter()
        result = evaluator.evaluate(task, candidate)
        seconds = time.perf_counter() - began
    print(f"{task.name}: {result.status} ({result.reason or 'ok'}), reward {result.reward}, {seconds:.1f} s")
    print(f"peak memory per process and stage, in MiB and in copies of the output ({output_mib:.0f} MiB)")
    print("| role | stage | MiB | copies |\n|---|---|---:|---:|")
    for (role, stage), mib in sorted(watch.peaks.items()):
        if role in ("reference", "candidate"):
            print(f"| {role} | {stage} | {mib:.0f} | {mib / output_mib:.2f} |")
    if args.out:
        args.out.write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
            "device": args.device, "task": task.name, "output_mib": output_mib, "status": result.status,
            "reason": result.reason, "reward": result.reward, "seconds": seconds,
            "environment": result.environment,
            "peaks": [{"role": r, "stage": s, "mib": m} for (r, s), m in sorted(watch.peaks.items())]}, indent=1))


if __name__ == "__main__":
    main()
