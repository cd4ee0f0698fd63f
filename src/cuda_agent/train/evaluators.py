"""The evaluator behind the RL stacks' episodes and rewards (verl, TRL, OpenEnv, verifiers): the evaluation
service, or evaluators on this machine.

Trainers call an agent loop or a reward function many times at once (asyncio tasks or threads whose blocking
work runs in threads) and give it no place to keep state between calls, so the evaluators live here, per process:

* a service URL (the loop's or reward's ``service`` option, else ``CUDA_AGENT_SERVICE``): one
  ``RemoteEvaluator`` shared by every thread (each call is its own HTTP request). This is the setting for a
  cluster: the rollout servers and the trainer hold the GPUs of verl's workers, the service has its own.
* otherwise local ``Evaluator``s, one lent per call at a time (an evaluator keeps per-evaluation processes; it
  is not shared between threads), all sharing one timing lock so that timed regions never overlap.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any, Iterator

from cuda_agent.evaluate.device_lock import DeviceLock

SERVICE_ENV = "CUDA_AGENT_SERVICE"


def service_url(service: str | None = None) -> str | None:
    """The evaluation service to use: ``service`` if given, else ``$CUDA_AGENT_SERVICE``, else None (local)."""
    return service or os.environ.get(SERVICE_ENV) or None


class LocalEvaluators:
    """Local evaluators made on demand and lent one per caller at a time; they share one timing lock."""

    def __init__(self, device: str = "auto", policy: str = "fair", sandbox: str = "auto", time_compile: bool = True):
        self.device, self.policy, self.sandbox, self.time_compile = device, policy, sandbox, time_compile
        self.timing_lock = DeviceLock()  # timing alone, the rest side by side (evaluate.device_lock)
        self._idle: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._made: list[Any] = []
        self._guard = threading.Lock()

    def _make(self) -> Any:
        from cuda_agent.evaluate import Evaluator, long_lived, resolve_device
        from cuda_agent.evaluate.protocol.policy import Policy

        device = resolve_device(self.device)
        # As the training stages make theirs: candidates prestarted where a process start costs seconds.
        evaluator = Evaluator(device, policy=Policy.preset(self.policy), sandbox=self.sandbox,
                              timing_lock=self.timing_lock, time_compile=self.time_compile, **long_lived(device))
        with self._guard:
            self._made.append(evaluator)
        return evaluator

    @contextlib.contextmanager
    def lend(self) -> Iterator[Any]:
        try:
            evaluator = self._idle.get_nowait()
        except queue.Empty:
            evaluator = self._make()
        try:
            yield evaluator
        finally:
            self._idle.put(evaluator)

    def close(self) -> None:
        with self._guard:
            made, self._made = self._made, []
        for evaluator in made:
            evaluator.close()


_remote: dict[str, Any] = {}
_local: dict[tuple[str, str, str, bool], LocalEvaluators] = {}
_lock = threading.Lock()


def remote_evaluator(url: str) -> Any:
    """The process's ``RemoteEvaluator`` for ``url`` (made once: it asks the service for its settings)."""
    with _lock:
        if url not in _remote:
            from cuda_agent.service import RemoteEvaluator

            _remote[url] = RemoteEvaluator(url)
        return _remote[url]


def local_evaluators(device: str = "auto", policy: str = "fair", sandbox: str = "auto",
                     time_compile: bool = True) -> LocalEvaluators:
    with _lock:
        key = (device, policy, sandbox, time_compile)
        if key not in _local:
            _local[key] = LocalEvaluators(device, policy, sandbox, time_compile)
        return _local[key]


@contextlib.contextmanager
def lend_evaluator(service: str | None = None, *, device: str = "auto", policy: str = "fair", sandbox: str = "auto",
                   evaluator: Any = None, time_compile: bool = True) -> Iterator[Any]:
    """An evaluator for one episode or one reward: ``evaluator`` as given (an ``EvaluatorLike`` its owner
    made safe to share), else the service (``service_url``), else a local one lent for the ``with`` block."""
    if evaluator is not None:
        yield evaluator
        return
    url = service_url(service)
    if url:
        yield remote_evaluator(url)
        return
    with local_evaluators(device, policy, sandbox, time_compile).lend() as local:
        yield local


@dataclass(frozen=True)
class EvaluatorOptions:
    """Where evaluations go: ``evaluator`` (an ``EvaluatorLike`` safe to share), else ``service`` (a URL, or
    ``$CUDA_AGENT_SERVICE``), else local evaluators with ``device``, ``policy``, ``sandbox`` and ``time_compile``
    (whether the torch.compile baseline is timed: without it no candidate earns the reward for beating it)."""

    service: str | None = None
    device: str = "auto"
    policy: str = "fair"
    sandbox: str = "auto"
    evaluator: Any = None
    time_compile: bool = True

    def lend(self):
        return lend_evaluator(self.service, device=self.device, policy=self.policy, sandbox=self.sandbox,
                              evaluator=self.evaluator, time_compile=self.time_compile)


@atexit.register
def _close_local() -> None:
    # A Ray worker exits without closing what it holds: stop the prestarted candidate and reference processes.
    for pool in list(_local.values()):
        pool.close()


# The reward's settings as a dataset carries them (``cuda-agent export --service ... --policy ...`` writes them in a
# ``reward_settings`` column) and as the environment overrides them: a dataset says what the reward is, the place it
# runs may say where its evaluations go.
SETTINGS_ENV = {"service": SERVICE_ENV, "device": "CUDA_AGENT_REWARD_DEVICE", "policy": "CUDA_AGENT_REWARD_POLICY",
                "sandbox": "CUDA_AGENT_REWARD_SANDBOX", "time_compile": "CUDA_AGENT_REWARD_TIME_COMPILE"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def settings_of(options: EvaluatorOptions) -> dict[str, Any]:
    """``options`` as the ``reward_settings`` a dataset carries (``options_from_settings`` reads them back)."""
    return {name: getattr(options, name) for name in SETTINGS_ENV}


def options_from_settings(settings: Any = None, environ: Any = None) -> EvaluatorOptions:
    """The reward's ``EvaluatorOptions``: each setting from the environment (``SETTINGS_ENV``) where set, else from
    ``settings`` (a dataset's ``reward_settings``: a mapping or its JSON text), else the default."""
    import json

    from cuda_agent.evaluate.protocol.policy import PRESETS

    environ = os.environ if environ is None else environ
    if isinstance(settings, str):
        settings = json.loads(settings) if settings.strip() else {}
    settings = dict(settings or {})
    unknown = sorted(set(settings) - set(SETTINGS_ENV))
    if unknown:
        raise ValueError(f"unknown reward setting(s) {', '.join(unknown)}: use {', '.join(SETTINGS_ENV)}")
    values: dict[str, Any] = {}
    for name, variable in SETTINGS_ENV.items():
        value = environ.get(variable) or settings.get(name)
        if value is None or value == "":
            continue
        if name == "time_compile" and isinstance(value, str):
            if value.lower() not in _TRUE + _FALSE:
                raise ValueError(f"{variable}={value!r} is not a yes/no: set it to 1 or 0")
            value = value.lower() in _TRUE
        values[name] = value
    if values.get("policy", "fair") not in PRESETS:
        raise ValueError(f"unknown policy {values['policy']!r} in the reward's settings: use one of "
                         f"{', '.join(PRESETS)} ({SETTINGS_ENV['policy']} or `cuda-agent export --policy`)")
    if values.get("device", "auto") not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {values['device']!r} in the reward's settings: use auto, cpu or cuda")
    return EvaluatorOptions(**values)
