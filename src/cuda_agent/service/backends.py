"""Where the service's slots live: in this process (``local_service``) or in Ray actors
(``ray_service``, ``pip install -e '.[ray]'``). Both return the same ``EvalService``.

One slot per GPU by default, each an ``Evaluator(prestart=True)`` that owns its GPU: on a cluster an
actor asks Ray for a whole GPU (``num_gpus=1``), so the pool's GPUs are never shared with training.
Locally, ``per_gpu`` slots may share a GPU through a ``DeviceLock`` (timing alone, the rest side by
side). On the CPU backend each slot takes a core, and several CPU slots share the CPU the same way. Every slot points at the same ``cache_dir``: builds and baselines
are content-addressed and written atomically, so a shared filesystem path is a cache shared across
nodes.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from cuda_agent.build.toolchain import default_build_workers
from cuda_agent.evaluate import Evaluator, Policy, TimingConfig, long_lived, resolve_device
from cuda_agent.evaluate.device_lock import DeviceLock
from cuda_agent.evaluate.retry import RetryPolicy
from cuda_agent.evaluate.pool import device_slots
from cuda_agent.evaluate.references import REFERENCE_MEMORY, ReferencePool, kept_references
from cuda_agent.service.messages import Job
from cuda_agent.service.pool import EvalService, LocalSlot, SlotLost, execute


# How long a slot waits for its task's reference to come back from another slot before it starts its own:
# longer than an evaluation's verify and timing (seconds to tens of seconds), shorter than a stuck one.
REFERENCE_WAIT_S = 60.0


def _info(device: str, backend: str, slots: int, options: dict[str, Any]) -> dict[str, Any]:
    """What ``GET /info`` tells a client: the policy and timing every slot evaluates under."""
    policy = options.get("policy") or Policy()
    timing = (options.get("timing") or TimingConfig()).resolved(device)
    return {"device": device, "backend": backend, "slots_total": slots, "policy": policy.to_dict(),
            "timing": timing.to_dict()}


def local_service(device: str = "auto", *, slots: int | None = None, gpus: list[int] | None = None,
                  per_gpu: int = 1, queue_size: int = 64, job_timeout_s: float = 3600.0, build_workers: int | None = None,
                  on_reply: Any = None, pause_neighbours: bool = True, apart: int = 1,
                  **options: Any) -> EvalService:
    """The service on this machine: ``per_gpu`` slots per GPU in ``gpus`` (default every visible one), or
    ``slots`` CPU slots (default 1); ``options`` go to each ``Evaluator``. Slots that share a device share a
    ``DeviceLock`` (unless ``options`` name a ``timing_lock``): each times alone on it, and loads, verifies
    and reads its outputs beside the others, so the device works while a slot is between timings.
    ``pause_neighbours``: a slot that times stops the other slots' evaluations where they only wait for their
    reference process (its start, torch.compile) instead of waiting for them (``DeviceLock``'s ``pause``; on by
    default: docs/SCALE.md).
    ``apart``: how many memory-hungry evaluations may run at once on a GPU (``DeviceLock``'s ``apart``)."""
    if per_gpu < 1:
        raise ValueError(f"per_gpu must be at least 1, not {per_gpu}")
    device = resolve_device(device)
    if device == "cuda":
        indices = [gpu for gpu in device_slots(device, gpus) for _ in range(per_gpu)]
    else:
        indices = [None] * max(1, slots or 1)
    # The queue retries an evaluation without a verdict (on another slot where there is one): its slots do not.
    options = long_lived(device) | options | {"retry": RetryPolicy.none()}
    # Every GPU gets a DeviceLock, one slot or several: the build workers take its shared side (below).
    shared = (device == "cuda" or len(set(indices)) < len(indices)) and "timing_lock" not in options
    locks = {index: DeviceLock(pause=pause_neighbours, apart=apart) for index in set(indices)} if shared else {}
    # Slots on one GPU share its reference processes: a task's reference (its torch.compile, its baselines'
    # warm-up) is started once for them, and a slot whose task's reference is busy waits for it.
    pools = {index: shared_references(device, indices.count(index), options) for index in set(indices)} if (
        shared and not isinstance(options.get("references"), ReferencePool)) else {}

    def make_slot(i: int) -> LocalSlot:
        lock = {"timing_lock": locks[indices[i]]} if shared else {}
        lock |= {"references": pools[indices[i]]} if pools else {}
        return LocalSlot(f"local-{i}" + (f"-gpu{indices[i]}" if indices[i] is not None else ""),
                         Evaluator(device, gpu_index=indices[i], **(options | lock)))

    # Compiles wait for every GPU's timing on this host, and its timing for them (evaluate.device_lock).
    builder = Evaluator(device, **({k: v for k, v in options.items() if k not in ("timing_lock", "references")}
                                   | {"prestart": False} | ({"build_lock": list(locks.values())} if locks else {})))
    workers = (default_build_workers() if device == "cuda" else 0) if build_workers is None else build_workers
    # The symbol audit's probe (and with it what every candidate's build shares: the glue's precompiled header,
    # binding.cpp) is built now, not by the first candidates, which would wait tens of seconds for it (a cached
    # one returns at once). On a thread, so the service answers at once; what keeps the audit apart from every
    # candidate is not this order but the probe's own namespace in the cache, and every evaluator (a build
    # worker's or a slot's) builds the probe before its first candidate anyway (``Evaluator.build``).
    threading.Thread(target=_prepare, args=(builder,), name="build-prepare", daemon=True).start()
    return EvalService(make_slot, len(indices), queue_size=queue_size, job_timeout_s=job_timeout_s,
                       builder=builder.build, build_workers=workers, on_reply=on_reply,
                       one_per_task=bool(pools) and len(set(indices)) < len(indices),
                       info=_info(device, "local", len(indices), options) | {"per_gpu": per_gpu if device == "cuda" else None})


def _prepare(builder: Evaluator) -> None:
    try:
        builder.toolchain_imports()
    except Exception:  # noqa: BLE001 - the first candidate's build meets the same trouble and reports it
        pass


def shared_references(device: str, slots: int, options: dict[str, Any]) -> ReferencePool:
    """One pool for ``slots`` evaluators on one device: as many idle references as they would keep apart
    (``Evaluator``'s default: 4 each where processes are started ahead, else none), within one memory bound."""
    each = kept_references(options.get("references"), options.get("prestart", False))
    return ReferencePool(each * slots, options.get("reference_memory", REFERENCE_MEMORY) if device == "cuda" else None,
                         wait_s=REFERENCE_WAIT_S)


class _EvaluatorActor:
    """A Ray actor that owns one evaluator (and, on a GPU node, one GPU)."""

    def __init__(self, device: str, options: dict[str, Any]):
        self.evaluator = Evaluator(device, **(long_lived(device) | options | {"retry": RetryPolicy.none()}))

    def run(self, job: dict[str, Any]) -> Any:
        return execute(self.evaluator, Job.from_dict(job))

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.evaluator.close()


class RaySlot:
    """One actor behind the slot interface: an actor or node that dies is ``SlotLost``; an exception
    the evaluator raised comes back as itself."""

    def __init__(self, name: str, actor: Any):
        self.name = name
        self.actor = actor

    def run(self, job: Job, built: Any = None) -> Any:
        import ray

        try:
            return ray.get(self.actor.run.remote(job.to_dict()))
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                ray.exceptions.ObjectLostError) as exc:
            raise SlotLost(f"{self.name}: {type(exc).__name__}") from None
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            raise RuntimeError(str(cause or exc).strip().splitlines()[-1][:500]) from None

    def close(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def ray_service(address: str = "local", device: str = "cuda", *, slots: int | None = None, queue_size: int = 256,
                job_timeout_s: float = 3600.0, on_reply: Any = None, **options: Any) -> EvalService:
    """The service on the Ray cluster at ``address`` ("local" starts one here): ``slots`` actors
    (default: one per GPU of the cluster on ``cuda``, one per CPU on ``cpu``)."""
    try:
        import ray
    except ImportError:
        from cuda_agent.paths import install_hint
        raise ValueError(f"--ray needs Ray: {install_hint('ray')} (or drop --ray for the local service).") from None
    if device not in ("cpu", "cuda"):
        raise ValueError(f"a Ray service needs --device cpu or cuda (the cluster's, not this machine's), got {device!r}")
    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, log_to_driver=False, include_dashboard=False)
    resources = ray.cluster_resources()
    if slots is None:
        slots = int(resources.get("GPU", 0)) if device == "cuda" else max(1, int(resources.get("CPU", 1)) - 1)
    if slots < 1:
        raise ValueError(f"the Ray cluster at {address!r} has no GPU for a cuda service; add GPU nodes or use --device cpu")
    actor_class = ray.remote(num_gpus=1, num_cpus=1)(_EvaluatorActor) if device == "cuda" \
        else ray.remote(num_cpus=1)(_EvaluatorActor)

    def make_slot(i: int) -> RaySlot:
        return RaySlot(f"ray-{i}", actor_class.remote(device, options))

    return EvalService(make_slot, slots, queue_size=queue_size, job_timeout_s=job_timeout_s, on_reply=on_reply,
                       info=_info(device, f"ray {address}", slots, options))
