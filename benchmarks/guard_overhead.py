"""What the trust layer costs: seconds per evaluation with and without it, and its parts.

    python benchmarks/guard_overhead.py --device cpu --out results.json

For each example, with the build and baselines cached (the steady state of an
RL reward service):
- ``guarded``: the default evaluator (bwrap sandbox, static checks, symbol
  audit, runtime guards, checks of timed outputs);
- ``bare``: no sandbox and no static checks (runtime guards and timed-output
  checks are part of the protocol and stay on; their cost is measured apart);
and the parts: static checks, symbol audit, and one watched forward call
(dispatch mode and thread/output checks) against a plain call, in this process.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

from common import examples, timed

from cuda_agent import Evaluator
from cuda_agent.evaluate.worker.call_guard import CallGuard
from cuda_agent.guard import audit_symbols, check_candidate


def watched_call_overhead(module_path: str, task, device: str, calls: int = 50) -> dict[str, float]:
    """Milliseconds per call of the example's forward, plain and under CallGuard.watch."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("cuda_extension", module_path)
    extension = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extension)
    namespace: dict = {}
    exec(compile(task.code, task.name, "exec"), namespace)  # noqa: S102 - our own example task
    with torch.device(device):
        inputs = namespace["get_inputs"]()
    # The examples' single op takes the inputs, then the init arguments (cpu_swish's scale).
    extra = namespace["get_init_inputs"]()
    fn = getattr(extension, [n for n in dir(extension) if not n.startswith("_")][0])
    guard = CallGuard()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def plain() -> None:
        fn(*inputs, *extra)
        sync()

    def watched() -> None:
        out = guard.watch(lambda: fn(*inputs, *extra), sync)
        guard.check_output(out, inputs, torch.nn.Module())

    result = {}
    for name, call in (("plain", plain), ("watched", watched)):
        call()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        result[f"{name}_ms"] = (time.perf_counter() - start) * 1e3 / calls
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--examples", nargs="*", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    rows = []
    for name, task, candidate in examples(args.device, args.examples):
        cache = Path(tempfile.mkdtemp(prefix="cuda-agent-bench-"))
        try:
            guarded = Evaluator(args.device, cache_dir=cache)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                bare = Evaluator(args.device, cache_dir=cache, sandbox="none",
                                 policy=guarded.policy.with_(static_checks=False))
            first = guarded.evaluate(task, candidate)  # fills the build and baseline caches
            module = next(iter(first.build["modules"].values()))
            row = {"example": name, "first_eval_s": first.durations["total"]}
            # Interleaved, so drift in machine load hits both alike.
            g, b = [], []
            for _ in range(args.repeats):
                g.append(timed(guarded, task, candidate)[0])
                b.append(timed(bare, task, candidate)[0])
            row["guarded_s"] = statistics.median(g)
            row["bare_s"] = statistics.median(b)
            start = time.perf_counter()
            violations = check_candidate(candidate, guarded.policy.code_policy())
            row["static_checks_s"] = time.perf_counter() - start
            start = time.perf_counter()
            violations += audit_symbols([Path(module)], guarded.policy.code_policy(), guarded.toolchain_imports())
            row["symbol_audit_s"] = time.perf_counter() - start
            assert not violations, violations
            row |= watched_call_overhead(module, task, args.device)
            rows.append(row)
            print(json.dumps(row), flush=True)
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    import torch

    report = {
        "benchmark": "guard_overhead",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "cores": __import__("os").cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    print(f"{'example':<22}{'guarded s':>10}{'bare s':>9}{'static s':>10}{'audit s':>9}{'call ms':>9}{'watched ms':>11}")
    for r in rows:
        print(f"{r['example']:<22}{r['guarded_s']:>10.2f}{r['bare_s']:>9.2f}{r['static_checks_s']:>10.3f}"
              f"{r['symbol_audit_s']:>9.3f}{r['plain_ms']:>9.3f}{r['watched_ms']:>11.3f}")


if __name__ == "__main__":
    main()
