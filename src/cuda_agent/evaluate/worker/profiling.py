"""What one call ran, under torch's profiler (runs inside worker processes): its ATen operator tree for the
torch-compute check (``guard.runtime``) and, on a GPU, its kernels by stream for the attribution
(``guard.attribution``). Not a timing: the profiled call is run outside the timed rounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from cuda_agent.evaluate.protocol.timing import _on_device, _synchronizer

FORWARD_SCOPE = "cuda_agent::forward"  # the profiler range around the profiled call
MAX_OP_NODES = 4096  # operators of one profiled call kept for the torch-compute check


@dataclass(frozen=True)
class CallProfile:
    """What one profiled call ran. ``ops``: the ATen operator tree under the call, as
    ``(name, children)`` nodes, outermost first (``guard.runtime.unlisted_aten`` reads it).
    ``kernels``: ``[name, launches, total ms, launches off the harness's stream]`` rows, longest
    first (GPU only; ``guard.attribution.parse_kernel_report`` reads them)."""

    ops: tuple[tuple[str, tuple[Any, ...]], ...]
    kernels: list[list[Any]]


def profile_call(fn: Callable[[], Any], device: str, on_start: Callable[[], None] = lambda: None,
                 limit: int = 256) -> tuple[Any, CallProfile]:
    """Run ``fn`` once under the profiler (operators; kernels too on the GPU); its result and what
    it ran. ``on_start`` runs once the profiler is active, before ``fn``. On the GPU a one-element
    fill on the current stream, launched and finished first, names the harness's stream: kernels
    on any other stream are counted as such."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    gpu = device == "cuda"
    marker = torch.zeros(1, device="cuda") if gpu else None
    synchronize = _synchronizer(device)
    synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        on_start()
        if marker is not None:
            marker.fill_(1.0)
            synchronize()
        with record_function(FORWARD_SCOPE):
            result = fn()
        synchronize()
    return result, CallProfile(_op_tree(prof), _kernel_table(prof, limit) if gpu else [])


def _op_tree(prof: Any) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """The operators recorded inside the ``FORWARD_SCOPE`` range, as nested ``(name, children)``."""
    budget = [MAX_OP_NODES]

    def node(event: Any) -> tuple[str, tuple[Any, ...]]:
        budget[0] -= 1
        children = tuple(node(c) for c in event.cpu_children if budget[0] > 0)
        return event.name, children

    scopes = [e for e in prof.events() if e.name == FORWARD_SCOPE and not _on_device(e)]
    return tuple(node(child) for scope in scopes for child in scope.cpu_children if budget[0] > 0)


def _kernel_table(prof: Any, limit: int) -> list[list[Any]]:
    """Kernels, copies and memsets by name, the harness's marker (the first to start) left out."""
    events = sorted((e for e in prof.events() if _on_device(e) and e.name != FORWARD_SCOPE
                     and not getattr(e, "is_user_annotation", False)), key=lambda e: e.time_range.start)
    if not events:
        return []
    harness_stream = events[0].device_resource_id
    table: dict[str, list[Any]] = {}
    for event in events[1:]:
        row = table.setdefault(event.name, [event.name, 0, 0.0, 0])
        row[1] += 1
        row[2] += float(event.device_time_total) / 1e3
        row[3] += int(event.device_resource_id != harness_stream)
    return sorted(table.values(), key=lambda row: -row[2])[:limit]
