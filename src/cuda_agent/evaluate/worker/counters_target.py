"""The process ``Evaluator.counters`` runs under Nsight Compute, in the sandbox.

    python -m cuda_agent.evaluate.worker.counters_target SPEC.json

SPEC holds a ``LoadRequest`` (``request``) and an input ``seed``. Before any candidate code loads, the
task's own Model runs once on the inputs to write FACTS (``facts.json`` beside SPEC): the bytes a call
must move (inputs read once, outputs written once), its FLOPs (torch's FLOP counter: matmuls,
convolutions, attention) and its dtype, for the speed of light. Then the candidate loads, runs twice to
warm up, and one call runs between ``cudaProfilerStart`` and ``cudaProfilerStop``: the only kernels ncu
profiles (``--profile-from-start off``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def facts(side: Any, inputs: list[Any]) -> dict[str, Any]:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model = side.task_module.Model(*side.init_args).to(side.device).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        output = model(*inputs)
    tensors = _tensors(inputs) + _tensors(output)
    floats = [t for t in [*_tensors(inputs), *model.parameters()] if t.is_floating_point()]
    result = {"bytes": sum(t.numel() * t.element_size() for t in tensors), "flops": float(counter.get_total_flops()),
              "dtype": str(floats[0].dtype).removeprefix("torch.") if floats else "",
              "output_bytes": sum(t.numel() * t.element_size() for t in _tensors(output)),
              # the policy's precision, pinned by load_task: eager's fp32 matmuls may run on TF32 tensor cores
              "tf32": bool(torch.backends.cuda.matmul.allow_tf32)}
    del model, output
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> None:
    import torch

    from cuda_agent.evaluate.protocol.messages import LoadRequest
    from cuda_agent.evaluate.worker.loop import CandidateSide

    spec_path = Path((argv or sys.argv[1:])[0])
    spec = json.loads(spec_path.read_text())
    request = LoadRequest(**spec["request"])
    side = CandidateSide()
    side.load_task(request)
    inputs = side.inputs(int(spec["seed"]))
    (spec_path.parent / "facts.json").write_text(json.dumps(facts(side, inputs)))
    side.load_unguarded(request)
    with torch.no_grad():
        for _ in range(2):
            side.model(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        side.model(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print("profiled one call", flush=True)


if __name__ == "__main__":
    main()
