"""The clocks and CUDA entry points the timing loop calls, bound before candidate code loads and called as bound
(nothing in-process is looked up after load).

A name looked up at call time is whatever is in its dictionary then: ``time.perf_counter_ns`` in ``time``'s, and
for every ``torch.cuda.Event`` method, the C event type's (``Event.record`` and ``Event.elapsed_time`` reach it
through ``super()`` on each call), dictionaries the candidate's native code can write through the CPython C API
and restore before anything checks them. The timing loop calls what this module took at import (the clocks) and
at ``bind_cuda`` (the worker's start, on a GPU), so what is swapped later changes nothing it calls. This module's
own names are in the harness snapshot (``call_guard.trusted_functions``): swapping one of them is ``monkeypatch``
at the next check, and what it could forge in between is what the outside clock bounds."""

from __future__ import annotations

import time
from typing import Any

perf_counter_ns = time.perf_counter_ns
perf_counter = time.perf_counter


class CudaCalls:
    """torch's CUDA calls of the timing loop, each taken once: the event type's methods from the C type's own
    dictionary, device synchronisation and the hold's sleep from ``torch._C``. Its slots are what the harness
    snapshot holds to identity (``CUDA_CALLS``): a call added here is held with the rest."""

    __slots__ = ("event", "_record", "elapsed", "wait", "synchronize", "sleep", "_current_stream")

    def __init__(self) -> None:
        import torch

        methods = torch._C._CudaEventBase.__dict__
        self.event = torch.cuda.Event
        self._record = methods["record"]
        self.elapsed = methods["elapsed_time"]  # (start, end) -> ms
        self.wait = methods["synchronize"]  # (event): until it has completed
        self.synchronize = torch._C._cuda_synchronize
        self.sleep = torch._C._cuda_sleep
        self._current_stream = torch.cuda.current_stream

    def record(self, event: Any) -> None:
        """``event.record()``: on the current stream."""
        self._record(event, self._current_stream())


CUDA: CudaCalls | None = None
CUDA_CALLS = CudaCalls.__slots__


def bind_cuda() -> CudaCalls:
    """Take the CUDA calls (once; a worker calls this as it starts, before any candidate code loads)."""
    global CUDA
    if CUDA is None:
        CUDA = CudaCalls()
    return CUDA
