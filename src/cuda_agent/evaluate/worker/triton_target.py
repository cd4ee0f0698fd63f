"""The process of a Triton candidate's build stage (``evaluate.triton_build``), in the sandbox, on the GPU.

    python -m cuda_agent.evaluate.worker.triton_target SPEC.json

SPEC holds a ``LoadRequest`` (``request``) and an input ``seed``. The task loads, then the candidate; forward
runs twice on the task's inputs (the first call compiles and autotunes into ``TRITON_CACHE_DIR``, the second
shows that nothing more is compiled for them). Nothing this process computes is compared or timed, and
nothing it leaves but Triton's kernel files is used (``triton_build.KEPT_SUFFIXES``), and, where Triton compiles
a launcher per kernel signature, the signatures it made them for (``triton_runtime.LAUNCHERS_FILE``: data the
evaluator checks and builds Triton's launchers from itself). ``compiled`` beside SPEC says it finished.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    import torch

    from cuda_agent.evaluate.protocol.messages import LoadRequest
    from cuda_agent.evaluate.worker.triton_runtime import LAUNCHERS_FILE, point_at_libcuda, record_launchers
    from cuda_agent.evaluate.worker.loop import CandidateSide

    torch.cuda.init()
    point_at_libcuda()

    spec_path = Path((argv or sys.argv[1:])[0])
    spec = json.loads(spec_path.read_text())
    request = LoadRequest(**spec["request"])
    launchers = record_launchers()
    side = CandidateSide()
    side.load_task(request)
    side.load_unguarded(request)
    inputs = side.inputs(int(spec["seed"]))
    with torch.no_grad():
        for _ in range(2):
            side.model(*inputs)
            torch.cuda.synchronize()
    (spec_path.parent / LAUNCHERS_FILE).write_text(json.dumps(launchers))
    (spec_path.parent / "compiled").write_text("")
    print("compiled the Triton kernels on the task's inputs", flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:  # noqa: BLE001 - the candidate's error, as one line for the build stage's verdict
        print(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"[:600],
              file=sys.stderr, flush=True)
        sys.exit(1)
