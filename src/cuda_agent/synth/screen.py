"""The execution filters' worker (``python -m cuda_agent.synth.screen``), one per pool slot.

It runs synthesised programs, which an LLM may have written, so it runs in the
evaluation core's sandbox and speaks its request protocol (``evaluate.worker.loop.serve``).
Each request names a program file; the process keeps the last program loaded so
that checking, timing and compiling one program share the work. Checks run in
strict fp32 (TF32 off); timing under the policy's precision flags, as the
evaluator's baselines are.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from cuda_agent.evaluate.protocol.compare import compare_outputs, error_ratio, output_rms
from cuda_agent.evaluate.protocol.policy import TimingConfig
from cuda_agent.evaluate.protocol.messages import SCREEN_REQUESTS, ScreenCheckRequest, ScreenTimeRequest, parse_request
from cuda_agent.evaluate.worker.side import share_inductor_headers
from cuda_agent.evaluate.protocol.timing import measure
from cuda_agent.evaluate.worker.loop import init_inputs, make_inputs, pin_precision, seed_everything, serve, synchronize
from cuda_agent.tasks.task import Task, exec_task_module
from cuda_agent.tensors import tensors_in

# A quick timing: the runtime window spans two orders of magnitude, so a few hundred ms per program do.
SCREEN_TIMING = TimingConfig(warmup=2, warmup_ms=10.0, min_trials=20, max_trials=50, target_ms=200.0)


class ScreenSide:
    def __init__(self, device: str):
        self.device = device
        self.model: Any = None
        self.compiled: Any = None
        self.inputs: list[Any] = []

    def handle(self, op: str, msg: Any) -> dict[str, Any]:
        """Answer request ``op``: its dataclass (``protocol.SCREEN_REQUESTS``), or a dict it is parsed from."""
        msg = parse_request(op, msg, SCREEN_REQUESTS)
        if op == "check":
            return self.check(msg)
        if op == "time":
            return self.time(msg)
        if op == "compile":
            return self.compile()
        raise ValueError(f"unknown request {op!r}")

    def check(self, msg: ScreenCheckRequest) -> dict[str, Any]:
        """Filters ``runs``, ``deterministic`` and ``not_degenerate``; the first failure ends the list."""
        import torch

        from cuda_agent.evaluate.protocol.degenerate import leaf_means, trivial_failures

        self.model = self.compiled = None
        pin_precision("off")
        tol = {"atol": msg.atol, "rtol": msg.rtol, "scale": msg.scale}
        verdicts: list[dict[str, Any]] = []
        try:
            seed_a, seed_b, seed_c = msg.seeds
        except ValueError:
            raise ValueError(f"'check' request: field 'seeds' must hold 3 seeds, got {len(msg.seeds)}") from None
        try:
            task = Task(name=msg.name, code=Path(msg.path).read_text(), source=msg.name)
            module = exec_task_module(task)
            args = init_inputs(module, seed_a, task.source)
            seed_everything(seed_a)
            model = module.Model(*args)
            if not isinstance(model, torch.nn.Module):
                raise TypeError("Model(...) is not a torch.nn.Module")
            model = model.to(self.device).eval()
            inputs_a = make_inputs(module, seed_a, self.device, task.source)
            inputs_b = make_inputs(module, seed_b, self.device, task.source)
            with torch.no_grad():
                out_a = model(*inputs_a)
                seed_everything(seed_c)  # a random operator draws differently now
                out_again = model(*inputs_a)
                out_b = model(*inputs_b)
            synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - the program failing is the verdict
            return {"verdicts": [_fail("runs", f"eager: {type(exc).__name__}: {str(exc)[:300]}")]}
        leaves = list(tensors_in(out_a))
        if not leaves or not all(t.is_floating_point() for t in leaves):
            return {"verdicts": [_fail("runs", "forward returns no floating-point tensor")]}
        bad = [i for i, t in enumerate(leaves) if not bool(torch.isfinite(t).all())]
        if bad:
            return {"verdicts": [_fail("runs", f"output {bad[0]} has NaN or Inf values")]}
        verdicts.append(_pass("runs"))
        shapes = [list(t.shape) for t in leaves]

        if msg.stochastic_ops:
            return {"verdicts": verdicts + [_fail("deterministic", "stochastic operator: " + ", ".join(msg.stochastic_ops))]}
        ratio = error_ratio(compare_outputs(out_a, out_again, **tol))
        if ratio > 1:
            return {"verdicts": verdicts + [_fail("deterministic", f"two runs on the same inputs differ (error {ratio:.3g}x the tolerance)")]}
        verdicts.append(_pass("deterministic"))

        reason = None
        if all(bool((t == t.reshape(-1)[0]).all()) for t in leaves):
            reason = "constant output"
        elif error_ratio(compare_outputs(out_b, out_a, **tol)) <= 1:
            reason = "outputs do not change with the inputs"
        elif max(output_rms(t.double()) for t in leaves) < msg.atol:
            reason = f"outputs below the tolerance (RMS under atol={msg.atol:g})"
        else:
            trivial = trivial_failures(inputs_b, out_b, leaf_means(out_a), **tol)
            passing = [name for name, reason in trivial.items() if reason is None]
            if passing:
                reason = f"a trivial candidate passes: {', '.join(passing)}"
        if reason:
            return {"verdicts": verdicts + [_fail("not_degenerate", reason)], "output_shapes": shapes}
        verdicts.append(_pass("not_degenerate"))
        self.model, self.inputs, self.expected = model, inputs_a, out_a
        self.tol = tol
        return {"verdicts": verdicts, "output_shapes": shapes}

    def time(self, msg: ScreenTimeRequest) -> dict[str, Any]:
        """Median ms of the held program, eager or compiled, under the policy's precision flags."""
        import torch

        target = self.compiled if msg.compiled else self.model
        if target is None:
            raise RuntimeError("no program is held: send 'check' (and 'compile') first")
        pin_precision(msg.tf32)
        try:
            with torch.no_grad():
                stats = measure(lambda: target(*self.inputs), self.device, SCREEN_TIMING)
        finally:
            pin_precision("off")
        return {"median_ms": stats.median_ms, "cv": stats.cv}

    def compile(self) -> dict[str, Any]:
        """Filter ``compiles``: torch.compile runs the held program and matches eager."""
        import torch

        if self.model is None:
            raise RuntimeError("no program is held: send 'check' first")
        share_inductor_headers()
        started = time.perf_counter()
        try:
            compiled = torch.compile(self.model)
            with torch.no_grad():
                out = compiled(*self.inputs)
            synchronize(self.device)
        except Exception as exc:  # noqa: BLE001
            return {"verdict": _fail("compiles", f"torch.compile: {type(exc).__name__}: {str(exc)[:300]}")}
        seconds = time.perf_counter() - started
        ratio = error_ratio(compare_outputs(self.expected, out, **self.tol))
        if ratio > 1:
            return {"verdict": _fail("compiles", f"torch.compile output differs from eager ({ratio:.3g}x the tolerance)")}
        self.compiled = compiled
        return {"verdict": _pass("compiles"), "compile_seconds": seconds}


def _pass(name: str) -> dict[str, Any]:
    return {"filter": name, "ok": True, "reason": None}


def _fail(name: str, reason: str) -> dict[str, Any]:
    return {"filter": name, "ok": False, "reason": reason}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--memory-fraction", type=float, default=None,
                        help="this process's share of GPU memory (workers share one GPU)")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda":
        torch.cuda.init()
        if args.memory_fraction:
            # A fixed share per worker: a program that needs more fails the same way whatever the
            # other workers hold at the moment, instead of taking memory from their programs.
            torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    serve(ScreenSide(args.device), SCREEN_REQUESTS)


if __name__ == "__main__":
    main()
