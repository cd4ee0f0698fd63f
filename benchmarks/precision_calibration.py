"""Calibrate the precision presets: which reduced-precision variants of a task pass which tolerance.

    python benchmarks/precision_calibration.py --device cuda --out results.json
    python benchmarks/precision_calibration.py --device cpu --tasks 'KB.jsonl#1/4' 'KB.jsonl#1/19'

For each task the truth is computed in strict fp32 (TF32 off). Then the task's
own Model runs again as a candidate that downgrades precision: TF32 (CUDA
only), autocast to fp16, autocast to bf16. For each preset this prints the
error ratio: the largest |actual - expected| / tolerance over all elements,
with the tolerance widened as the evaluator widens it (``Policy.precision_slack``
times the error of the Model under the preset's own flags). A ratio at or below
1 passes. The `fair` preset should pass TF32 and reject
bf16; the `paper` preset lets all of them through.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

from cuda_agent import load_task
from cuda_agent.evaluate import Policy
from cuda_agent.evaluate.protocol.compare import compare_outputs, error_ratio, precision_allowance
from cuda_agent.evaluate.worker.loop import init_inputs, make_inputs, pin_precision, seed_everything
from cuda_agent.tasks.task import exec_task_module

ROOT = Path(__file__).resolve().parents[1]
KERNELBENCH = Path(os.environ.get("KERNELBENCH_DATA", ROOT.parent / "shared" / "data" / "kernelbench"))
DEFAULT_TASKS = [f"1/{i}" for i in (1, 2, 3, 4, 6, 7, 8, 9, 10, 13, 16, 17, 18, 50, 55, 56, 57)]
PRESETS = ("fair", "strict", "paper")


def preset_ratio(expected, actual, own, policy: Policy) -> float:
    """The evaluator's error ratio for ``actual`` under ``policy`` (at most 1 passes), with the
    tolerance widened as the reference process widens it: by ``precision_slack`` times the error
    of ``own``, the Model under the baselines' flags, where that is larger."""
    tolerance = {"atol": policy.atol, "rtol": policy.rtol, "scale": policy.scale_tolerance}
    ratio = error_ratio(compare_outputs(expected, actual, **tolerance))
    if policy.strict_expected and policy.tf32 != "off" and policy.precision_slack:
        ratio /= precision_allowance(expected, own, **tolerance, slack=policy.precision_slack)
    return ratio


def run_variant(model, inputs, variant: str, device: str, tf32: str = "off"):
    """The Model as a candidate that downgrades precision: TF32 (``tf32`` variant), autocast to
    fp16/bf16, or as it is (``fp32``) under the precision flags ``tf32``."""
    import torch

    pin_precision("on" if variant == "tf32" else tf32)
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    with torch.no_grad():
        if variant in dtypes:
            with torch.autocast(device_type=device, dtype=dtypes[variant]):
                out = model(*inputs)
        else:
            out = model(*inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    pin_precision("off")
    return out.float()


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tasks", nargs="*", default=None,
                        help="task specs (default: KernelBench level 1 GEMM and convolution tasks)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    specs = args.tasks or [f"{KERNELBENCH / 'kernelbench.jsonl'}#{t}" for t in DEFAULT_TASKS]
    variants = ["tf32", "fp16", "bf16"] if args.device == "cuda" else ["fp16", "bf16"]
    rows = []
    for index, spec in enumerate(specs, 1):
        task = load_task(spec)
        print(f"[{index}/{len(specs)}] {task.name}", flush=True)
        module = exec_task_module(task)
        seed_everything(0)
        model = module.Model(*init_inputs(module, 0, task.source)).to(args.device).eval()
        inputs = make_inputs(module, 1, args.device, task.source)
        expected = run_variant(model, inputs, "fp32", args.device)
        policies = {name: Policy.preset(name) for name in PRESETS}
        own = {name: run_variant(model, inputs, "fp32", args.device, tf32=p.tf32) for name, p in policies.items()}
        for variant in variants:
            actual = run_variant(model, inputs, variant, args.device)
            row = {"task": task.name, "variant": variant}
            row |= {name: preset_ratio(expected, actual, own[name], p) for name, p in policies.items()}
            rows.append(row)
            print("   " + "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        del model, inputs, expected, own
        if args.device == "cuda":
            torch.cuda.empty_cache()

    print(f"\n{'variant':<8}" + "".join(f"{p + ' passes':>14}" for p in PRESETS))
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant]
        print(f"{variant:<8}" + "".join(f"{sum(r[p] <= 1 for r in mine):>10}/{len(mine):<3}" for p in PRESETS))
    report = {
        "benchmark": "precision_calibration",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "presets": {p: Policy.preset(p).to_dict() for p in PRESETS},
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
