"""Probe (issue 31, "the GPU quiet before a baseline"): can a process tell from outside that another
process's CUDA context has work running on the GPU? Without MPS, kernels of two contexts never run at once:
the GPU time-slices between them, so a tiny kernel launched here waits while another context's kernel runs.
This measures that wait (the launch-and-synchronise latency of a one-element kernel) with a second process
(A) idle, running a one-block spin kernel, the same while A is stopped (SIGSTOP: kernels go on), with work
queued behind a stream wait on memory nobody writes, and how long after A is killed the GPU is quiet again.
Also an event-timed 1 ms region here with and without A's kernel (what a baseline would lose)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

CHILD = r'''
import ctypes, sys, time, torch
mode = sys.argv[1]
torch.cuda.init()
buf = torch.zeros(16, dtype=torch.int32, device="cuda")
torch.cuda.synchronize()
rate = torch.cuda.get_device_properties(0).clock_rate * 1e3  # cycles per second
side = torch.cuda.Stream()
if mode == "spin":
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(rate * 60))
elif mode == "burst":
    # 0.3 ms kernels back to back on one stream, enqueued by a thread for as long as the queue takes them
    import threading
    def feed():
        with torch.cuda.stream(side):
            for _ in range(400000):
                torch.cuda._sleep(int(rate * 3e-4))
    threading.Thread(target=feed, daemon=True).start()
    time.sleep(0.1)
elif mode == "wait":
    cu = ctypes.CDLL("libcuda.so.1")
    fn = getattr(cu, "cuStreamWaitValue32_v2", None) or cu.cuStreamWaitValue32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    r = fn(ctypes.c_void_p(side.cuda_stream), ctypes.c_uint64(buf.data_ptr()), 1, 0)
    if r != 0:
        print(f"stream wait failed: CUresult {r}", flush=True)
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(rate * 60))
print("ready", flush=True)
time.sleep(120)
'''


def main() -> None:
    import torch

    buf = torch.zeros(1, device="cuda")
    rate = torch.cuda.get_device_properties(0).clock_rate * 1e3

    def probe(limit_s: float = 2.0) -> float:
        # Polled, not synchronised: a context that holds the GPU for good must not hang the probe.
        begin = time.perf_counter_ns()
        buf.add_(1)
        done = torch.cuda.Event()
        done.record()
        while not done.query():
            if time.perf_counter_ns() - begin > limit_s * 1e9:
                return float("inf")
        return (time.perf_counter_ns() - begin) / 1e3

    def probes(n: int = 40) -> dict:
        values = [probe() for _ in range(n)]
        values.sort()
        return {"min_us": round(values[0], 1), "median_us": round(statistics.median(values), 1),
                "p90_us": round(values[int(0.9 * n)], 1), "max_us": round(values[-1], 1)}

    def region_ms(n: int = 10) -> float:
        out = []
        for _ in range(n):
            if probe() == float("inf"):
                return float("inf")
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            torch.cuda._sleep(int(rate * 1e-3))
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        return round(statistics.median(out), 3)

    for _ in range(50):
        probe()
    rows = [{"case": "alone", **probes(), "region_1ms": region_ms()}]
    import select

    for mode in sys.argv[1:] or ("idle", "spin", "burst", "wait"):
        child = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, text=True)
        line = child.stdout.readline().strip() if select.select([child.stdout], [], [], 30)[0] else "no word in 30 s"
        print(f"{mode}: child says {line!r}", flush=True)
        time.sleep(0.2)
        row = {"case": f"A {mode}", "child": line, **probes(), "region_1ms": region_ms()}
        rows.append(row)
        print(json.dumps(row), flush=True)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.05)
        row = {"case": f"A {mode}, stopped", **probes(), "region_1ms": region_ms()}
        rows.append(row)
        print(json.dumps(row), flush=True)
        killed = time.perf_counter()
        os.kill(child.pid, signal.SIGKILL)
        quiet_after = None
        while time.perf_counter() - killed < 10:
            if probe() < 100:
                quiet_after = round((time.perf_counter() - killed) * 1e3, 1)
                break
        child.wait()
        row = {"case": f"A {mode}, killed", "quiet_after_ms": quiet_after, **probes(20)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
