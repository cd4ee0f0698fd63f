"""Cached eager / torch.compile timings, keyed by everything that changes them."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

# 2: timed in rounds (evaluate.decide), fresh inputs for every call, launch-bound calls grouped.
BASELINE_FORMAT = 2
# Settings that change how often or alongside what baselines are timed, not what a time means.
_NOT_IN_KEY = ("baselines", "plans", "confidence", "budget_s", "rounds_max", "clock_slack", "clock_trial_us", "clock_noise", "clock_harness_share",
               "brackets", "allowance_target", "uncertainty_target", "resolution_target", "allowance_max", "uncertainty_max",
               "wait_max", "region_slack", "region_us", "outside_wins", "region_spread_max")


def _unchanged_hold(timing: dict[str, Any], device: str) -> tuple[str, ...]:
    """With fixed holds the baselines are timed as before these settings existed, so they stay out
    of the key and the tables measured then still serve; a host clock (CPU backend) holds nothing."""
    unchanged = timing.get("baseline_hold", "fixed") == "fixed" or device != "cuda"
    return ("baseline_hold", "hold_max_us") if unchanged else ()


def baseline_timing(timing: dict[str, Any], device: str) -> dict[str, Any]:
    """The timing settings that change what a baseline's time means (those in its key), with the
    method resolved for ``device`` and sequences as lists: two settings that time baselines alike
    give equal dicts."""
    method = timing.get("method", "auto")
    if method == "auto":
        timing = timing | {"method": "events" if device == "cuda" else "host"}
    kept = {k: v for k, v in timing.items() if k not in _NOT_IN_KEY and k not in _unchanged_hold(timing, device)}
    return json.loads(json.dumps(kept))


def baseline_key(task_digest: str, environment: dict[str, Any], policy: dict[str, Any], timing: dict[str, Any], device: str) -> str:
    # On a GPU the times are the GPU's and its software's: the same GPU model and stack behind another
    # host CPU (or another thread count) reuses them. On the CPU backend, the CPU is the device.
    fields = ("gpu", "driver", "torch", "torch_cuda") if device == "cuda" else ("cpu", "torch", "torch_threads")
    relevant_env = {k: environment.get(k) for k in fields}
    payload = {
        "format": BASELINE_FORMAT,
        "task": task_digest,
        "device": device,
        "env": relevant_env,
        "precision": {"tf32": policy.get("tf32")},
        "timing": baseline_timing(timing, device),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


class BaselineCache:
    """One JSON file per key; written atomically so concurrent evaluators never see half a file."""

    def __init__(self, root: Path):
        self.root = root

    def get(self, key: str) -> dict[str, Any] | None:
        path = self.root / f"{key}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def put(self, key: str, record: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        with os.fdopen(fd, "w") as handle:
            json.dump(record, handle, indent=1)
        os.replace(tmp, self.root / f"{key}.json")
