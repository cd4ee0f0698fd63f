"""Does the candidate worker's own work start threads after its start-up? (issue 17: a thread started and
ended within the timing rounds is not seen by the outside count, which reads the threads at fixed points.)

In one process, as the candidate worker does: the runtime's warm-up (``worker.warm_up_runtime`` with the
profiler), then a seccomp filter that refuses every new thread (``clone3`` answers ENOSYS, so the C
library falls back to ``clone``, whose ``CLONE_THREAD`` flag is refused with EPERM), then the harness's
steps one by one: a profiled call, checked and timed calls, CUDA events, large CPU operations (torch's
pool), an output written and read. A step that needs a new thread fails; the report says which.

    python experiments/thread_probe.py --device cuda --out thread_probe.json
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

CLONE_THREAD = 0x00010000


def refuse_threads() -> None:
    import pyseccomp as seccomp

    program = seccomp.SyscallFilter(seccomp.ALLOW)
    program.set_attr(seccomp.Attr.CTL_TSYNC, 1)
    program.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    program.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, CLONE_THREAD))
    program.load()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import threading

    import torch

    from cuda_agent.evaluate.worker.profiling import profile_call
    from cuda_agent.evaluate.worker.loop import warm_up_runtime

    device = args.device
    if device == "cuda":
        torch.cuda.init()
    warm_up_runtime(device, profiler=True)
    threads_before = len(os.listdir("/proc/self/task"))
    refuse_threads()
    x = torch.randn(1 << 22, device=device)

    def forward() -> torch.Tensor:
        return torch.nn.functional.gelu(x)

    def timed() -> None:
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            forward()
            end.record()
            end.synchronize()
            start.elapsed_time(end)
        else:
            t = time.perf_counter_ns()
            forward()
            time.perf_counter_ns() - t

    def python_thread() -> None:  # the control: must fail once the filter is in force
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()

    steps = {
        "a checked call": lambda: forward().sum().item(),
        "a profiled call": lambda: profile_call(forward, device),
        "a second profiled call": lambda: profile_call(forward, device),
        "timed calls": lambda: [timed() for _ in range(20)],
        "large CPU operations (torch's pool)": lambda: (torch.randn(1 << 24) * 2).sum().item(),
        "a matrix product on the CPU": lambda: (torch.randn(1024, 1024) @ torch.randn(1024, 1024)).sum().item(),
        "an output to the host": lambda: forward().cpu().numpy().sum(),
        "a Python thread (control: refused)": python_thread,
    }
    report = {"device": device, "torch": torch.__version__, "threads_before": threads_before, "steps": {}}
    if device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    for name, step in steps.items():
        try:
            step()
            outcome = "ok"
        except Exception as exc:  # noqa: BLE001 - what failed is the finding
            outcome = f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]
            traceback.print_exc(limit=2)
        report["steps"][name] = outcome
        print(f"{name}: {outcome}", flush=True)
    report["threads_after"] = len(os.listdir("/proc/self/task"))
    print(f"threads: {report['threads_before']} before the filter, {report['threads_after']} at the end")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
