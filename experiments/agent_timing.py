"""Does an agent's idle sandboxed shell change the candidate's timing? Evaluates one example solution
several times, alternating with and without an open agent shell (``Toolbox``, gpu=True), and prints
the candidate's median each time (the baselines are measured once, by the first evaluation).

    python experiments/agent_timing.py --example cuda_row_softmax --rounds 3 --out timing.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from cuda_agent.agent.tools import Toolbox
from cuda_agent.candidates import load_candidate
from cuda_agent.evaluate.evaluator import Evaluator
from cuda_agent.tasks import load_task

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--example", default="cuda_row_softmax")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    task = load_task(EXAMPLES / args.example / "model.py")
    candidate = load_candidate(EXAMPLES / args.example / "solution")
    evaluator = Evaluator("cuda")
    rows = []
    for round_ in range(args.rounds):
        for shell in (False, True):
            with tempfile.TemporaryDirectory() as ws:
                toolbox = Toolbox(Path(ws), gpu=True) if shell else None
                if toolbox:
                    toolbox.call("bash", {"command": "echo ready"})  # the shell is up and idle
                clock = time.monotonic()
                result = evaluator.evaluate(task, candidate)
                if toolbox:
                    toolbox.close()
            row = {"round": round_, "shell": shell, "status": result.status, "reward": result.reward,
                   "candidate_ms": result.median_ms("candidate"), "eager_ms": result.median_ms("eager"),
                   "compile_ms": result.median_ms("compile"), "seconds": round(time.monotonic() - clock, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
