"""Entry point of the two evaluation processes (``python -m cuda_agent.evaluate.worker.loop``): the request loop
(``serve``) over a side, ``reference_side.ReferenceSide`` or ``candidate_side.CandidateSide``.

``--role reference`` runs only the pristine task program: it writes the state
dict, times the baselines and holds the expected outputs, which never leave it.
``--role candidate`` imports the candidate's code and runs it on inputs it
regenerates from seeds it learns only at call time. Requests and replies are
JSON lines on private pipes; whatever the code under test prints goes to the
captured stdout/stderr instead.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
import traceback
from typing import Any

from cuda_agent.evaluate.protocol.bound import bind_cuda
from cuda_agent.evaluate.worker.candidate_side import CandidateSide, install_inline_shim, load_extension, load_model_new
from cuda_agent.evaluate.worker.reference_side import ReferenceSide
from cuda_agent.evaluate.worker.side import (
    _Side, fingerprint, init_inputs, make_inputs, pin_precision, seed_everything, synchronize,
)
from cuda_agent.evaluate.protocol.compare import compare_outputs
from cuda_agent.evaluate.protocol.messages import REQUESTS, parse_request
from cuda_agent.evaluate.protocol.policy import CPU_THREADS
from cuda_agent.evaluate.worker.profiling import profile_call
from cuda_agent.guard.runtime import RuleBroken
from cuda_agent.sandbox.nocode import LOCK_CODE_ENV, forbid_new_code
from cuda_agent.sandbox.nothreads import BAN_THREADS_ENV
from cuda_agent.tasks.task import TaskError

__all__ = ["CandidateSide", "ReferenceSide", "_Side", "classify", "fingerprint", "init_inputs", "install_inline_shim",
           "load_extension", "load_model_new", "main", "make_inputs", "pin_precision", "seed_everything", "serve",
           "synchronize", "warm_up_runtime"]


def warm_up_runtime(device: str, profiler: bool = False) -> None:
    """Start the threads torch, the CUDA runtime and (if asked) the profiler start on first use, so
    that any thread that appears later belongs to the candidate; run the harness's own operations
    (input draws, fingerprints, comparison) once, so their first use costs no check anything."""
    import torch

    for where in dict.fromkeys(("cpu", device)):
        sample = torch.randn(1 << 18, device=where)
        fingerprint([sample, torch.rand(64, device=where), torch.randint(0, 9, (64,), device=where)])
        compare_outputs(sample, sample * (1 + 1e-6), 1e-3, 1e-3, scale=True)
    if device == "cuda":
        # The timing path once, so that whatever the runtime resolves on first use of it is in place
        # before the runtime's pointers to the driver are read (``integrity.driver_slots``).
        # The calls bound here are the ones the timing loop makes, whatever is swapped later (``evaluate.protocol.bound``).
        cuda = bind_cuda()
        start, end = cuda.event(enable_timing=True), cuda.event(enable_timing=True)
        cuda.record(start)
        cuda.record(end)
        cuda.wait(end)
        cuda.elapsed(start, end)
        start.query()
        cuda.synchronize()
    if profiler:
        profile_call(lambda: torch.randn(1 << 10, device=device).sum(), device)
    # torch's intra-op pool at its full size (a parallel region asks for every thread of it), should the
    # draws above have been too small to split: the candidate's process starts no thread after load
    # (``sandbox.nothreads``), and the harness's checks run torch's parallel operators after that.
    torch.ones(1 << 20).sum()


def classify(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, MemoryError) or "OutOfMemoryError" in text or "out of memory" in text.lower() or "can't allocate memory" in text:
        return "out_of_memory"
    if isinstance(exc, TaskError):
        return "task"
    if isinstance(exc, RuleBroken):
        return "rule"
    return "exception"


def short_traceback(exc: BaseException, limit: int = 4000) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text if len(text) <= limit else "...\n" + text[-limit:]


def serve(side: Any, registry: dict[str, type] = REQUESTS) -> None:
    """Answer requests until ``exit`` or end of input: each message is parsed into its dataclass
    (``registry``, by op) before ``side.handle(op, request)``; one that does not parse is answered
    with an error naming the op and the field."""
    # Out of the environment before any code under test runs (the pipes can still
    # be found in /proc/self/fd: the reply nonce is what stops forged replies).
    requests = os.fdopen(int(os.environ.pop("CUDA_AGENT_REQUEST_FD")), "rb", buffering=0)
    replies = os.fdopen(int(os.environ.pop("CUDA_AGENT_RESPONSE_FD")), "wb", buffering=0)
    if "CUDA_AGENT_FD_SOCKET" in os.environ:
        side.fd_socket = socket.socket(fileno=int(os.environ.pop("CUDA_AGENT_FD_SOCKET")))
    buffer = b""
    while True:
        while b"\n" not in buffer:
            chunk = requests.read(1 << 16)
            if not chunk:
                return
            buffer += chunk
        line, _, buffer = buffer.partition(b"\n")
        msg = json.loads(line)
        op = msg.pop("op")
        nonce = msg.pop("nonce", None)
        if op == "exit":
            replies.write((json.dumps({"ok": True, "nonce": nonce}) + "\n").encode())
            return
        started = time.perf_counter()
        try:
            reply = {"ok": True} | side.handle(op, parse_request(op, msg, registry))
        except BaseException as exc:  # noqa: BLE001 - everything the code under test raises is reported
            reply = {
                "ok": False,
                "kind": classify(exc),
                "rule": getattr(exc, "rule", None),
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": short_traceback(exc),
            }
        reply["seconds"] = time.perf_counter() - started
        reply["nonce"] = nonce
        replies.write((json.dumps(reply) + "\n").encode())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--role", choices=("reference", "candidate"), required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    # Start-up work that involves no candidate code happens before the first
    # request, so it overlaps with the other process instead of adding to it.
    import torch

    if args.device == "cuda":
        torch.cuda.init()
    else:
        torch.set_num_threads(CPU_THREADS)
    # What every evaluation needs first (threads torch, CUDA and the profiler start on first use,
    # kernels loaded on first use), done before the first request: a started worker is ready sooner,
    # and the candidate's guard counts these threads as the harness's.
    warm_up_runtime(args.device, profiler=args.role == "candidate")
    side: Any = ReferenceSide() if args.role == "reference" else CandidateSide()
    if args.role == "candidate" and args.device == "cuda":
        from cuda_agent.evaluate.protocol.vmm import start_exporter

        side.exporter, side.gpu_export = start_exporter()  # before any candidate code, before the code lock
    if args.role == "candidate" and os.environ.pop(LOCK_CODE_ENV, None):
        side.code_lock = forbid_new_code() or "on"
    if args.role == "candidate" and os.environ.pop(BAN_THREADS_ENV, None):
        side.ban_threads = True  # installed as its code is about to load (CandidateSide.handle, "load")
    serve(side)


if __name__ == "__main__":
    main()
