"""Screening on a Ray cluster (``pip install -e '.[ray]'``, ``cuda-agent synth --ray ADDRESS``).

One actor per worker slot, each owning a sandboxed screening process on its
node, behind the same three calls as a local ``Screener``. Composition, the
``unique`` filter and the output files stay in the driver, so a cluster run
writes and resumes exactly like a local one.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from cuda_agent.synth.pipeline import Screener, SynthConfig


class _ScreenerActor:
    def __init__(self, config: SynthConfig, slot: int):
        scratch = Path(tempfile.mkdtemp(prefix=f"cuda-agent-synth-{slot}-"))
        # One inductor cache per node, shared by the node's actors.
        cache = Path(tempfile.gettempdir()) / "cuda-agent-synth-inductor"
        self.screener = Screener(config, scratch / "slot", cache)

    def check(self, code: str, name: str, stochastic_ops: list[str]) -> list[dict[str, Any]]:
        return self.screener.check(code, name, stochastic_ops)

    def time(self, compiled: bool = False) -> float:
        return self.screener.time(compiled)

    def compile(self) -> dict[str, Any]:
        return self.screener.compile()

    def close(self) -> None:
        self.screener.close()


class RayScreener:
    """A local stand-in for one remote actor; errors come back as ``RuntimeError`` as locally."""

    def __init__(self, actor: Any):
        self.actor = actor

    def _get(self, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None) or exc
            raise RuntimeError(str(cause).strip().splitlines()[-1][:300]) from None

    def check(self, code: str, name: str, stochastic_ops: list[str]) -> list[dict[str, Any]]:
        return self._get(self.actor.check.remote(code, name, stochastic_ops))

    def time(self, compiled: bool = False) -> float:
        return self._get(self.actor.time.remote(compiled))

    def compile(self) -> dict[str, Any]:
        return self._get(self.actor.compile.remote())

    def close(self) -> None:
        import ray

        try:
            ray.get(self.actor.close.remote())
        except ray.exceptions.RayError:
            pass
        ray.kill(self.actor)


def ray_screeners(config: SynthConfig) -> list[RayScreener]:
    """``config.workers`` actors on the cluster at ``config.ray`` ("local" starts one on this machine)."""
    try:
        import ray
    except ImportError:
        from cuda_agent.paths import install_hint
        raise ValueError(f"--ray needs Ray: {install_hint('ray')} (or drop --ray for the local pool).") from None
    if not ray.is_initialized():
        ray.init(address=None if config.ray == "local" else config.ray, log_to_driver=False,
                 include_dashboard=False)
    # GPU actors share a GPU eight ways, as the local pool does; CPU actors take a core each.
    options = {"num_gpus": 0.125, "num_cpus": 1} if config.device == "cuda" else {"num_cpus": 1}
    actor_class = ray.remote(**options)(_ScreenerActor)
    return [RayScreener(actor_class.remote(config, slot)) for slot in range(config.workers)]
