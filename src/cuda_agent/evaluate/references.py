"""Reference processes that outlive an evaluation: one per (task, precision, device), least recently
used evicted.

A reference process never runs candidate code: it runs the pristine task program, computes expected
outputs for seeds it learns at call time and times the baselines. So it can serve evaluation after
evaluation of one task, and the seconds it costs to start (torch imported, CUDA up, the task loaded,
its first forward, torch.compile) are paid once per task instead of once per evaluation. The
candidate side keeps a fresh process per evaluation.
"""

from __future__ import annotations

import collections
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cuda_agent.evaluate.protocol.channel import Channel
from cuda_agent.evaluate.protocol.messages import LoadReply
from cuda_agent.evaluate.protocol.quiet import Doorbell

# What idle references may hold of a GPU together by default: more, and candidates of other tasks run out on an
# 80 GB card. On a larger card, all of it but ``REFERENCE_HEADROOM``, so that the references of the tasks with
# GB-sized inputs fit beside the small ones: a reference started again costs 10-20 s. The headroom is what
# evaluations in flight need beside them: one memory-hungry evaluation at its worst (about 37 GiB for a 6 GiB
# output) and seven small ones. A tighter bound makes the GB-input tasks' references (8-12 GiB idle each) close
# each other, so each of their evaluations starts one again (docs/CONSTANTS.md).
REFERENCE_MEMORY = 16 * 1024**3
REFERENCE_HEADROOM = 64 * 1024**3


def kept_references(references: int | None, prestart: int | bool) -> int:
    """How many idle references an evaluator keeps: as asked, else 4 for a long-lived (prestarted) one and
    none for a one-shot one, which leaves nothing behind."""
    return references if references is not None else (4 if prestart else 0)


@dataclass
class LiveReference:
    key: str
    home: Path  # holds task.py; its reference/ directory is the process's own (state dict, caches)
    channel: Channel
    init_seed: int  # the weights' and init inputs' seed: fixed for the process's life
    loaded: LoadReply | None = None  # the load reply, once it came
    share_fd: int | None = None  # the output memory's descriptor, relayed to each candidate, never mapped here
    share_bytes: int = 0
    share_note: str | None = None  # why outputs go through files, where they do
    compiled: dict[str, Any] | None = None  # torch.compile's reply (compile_seconds or compile_error), once asked
    evaluations: int = 0
    reserved: int = 0  # GPU memory it holds while idle (bytes, after releasing what it can)
    doorbell: Doorbell | None = None  # rung at a candidate's GPU region's DONE (``quiet.after_done``), once made
    rung: int = 0  # the regions it was asked to probe after, over its life: each one's number on the doorbell

    @property
    def state_dict(self) -> Path:
        return self.home / "reference" / "state_dict.pt"

    def alive(self) -> bool:
        return self.channel.worker.proc.poll() is None

    def close(self) -> None:
        # Killed, not asked to exit: nothing is left to say, and an orderly exit of torch and CUDA
        # takes about a second.
        self.channel.worker.kill()
        self.channel.worker.close()
        if self.share_fd is not None:
            os.close(self.share_fd)
            self.share_fd = None
        if self.doorbell is not None:
            self.doorbell.close()
            self.doorbell = None
        shutil.rmtree(self.home, ignore_errors=True)


class ReferencePool:
    """Up to ``capacity`` idle reference processes holding at most ``bound`` bytes of GPU memory
    together (``memory``, more on a card larger than 80 GB). ``take`` hands one out for the exclusive use
    of an evaluation; ``give_back`` keeps it for the next one (or closes it, if it is not in a state to be
    trusted again). Over ``capacity`` the least recently used go first; over the bound, those that free it.

    Evaluators that share a GPU may share one pool (``local_service``): then a task's reference is
    started once for all of them. An evaluation that finds its task's reference out (in use by
    another, or being started by it) waits up to ``wait_s`` for it rather than starting a second
    one: slots that each start the same task's reference slow each other's starts down severalfold, and each
    compiles and times its own baselines."""

    def __init__(self, capacity: int, memory: int | None = None, wait_s: float = 0.0):
        self.capacity = capacity
        self.memory = memory
        self.card_bytes = 0  # the GPU's memory, as its references report it (``bound``)
        self.wait_s = wait_s
        self._idle: collections.OrderedDict[str, LiveReference] = collections.OrderedDict()
        self._out: collections.Counter[str] = collections.Counter()  # taken (or being started), not given back
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)
        self._closed = False

    def take(self, key: str) -> LiveReference | None:
        """An idle reference for ``key``, or None: the caller starts one. Either way the caller owes
        the pool a ``give_back`` (of the reference it used) or a ``forfeit`` (where it has none)."""
        deadline = time.monotonic() + (self.wait_s if self.capacity > 0 else 0.0)  # none would be kept
        with self._returned:
            while key not in self._idle and self._out[key] > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._returned.wait(left)
            reference = self._idle.pop(key, None)
            self._out[key] += 1
        if reference is not None and not reference.alive():
            reference.close()
            return None
        return reference

    def forfeit(self, key: str) -> None:
        """A ``take`` that ends with no reference to give back (its start failed)."""
        with self._returned:
            self._release(key)

    def give_back(self, reference: LiveReference, healthy: bool) -> bool:
        """Whether ``reference`` is kept: it is not where it is unhealthy, or alone over the memory bound."""
        if reference.loaded is not None:
            self.card_bytes = max(self.card_bytes, reference.loaded.device_bytes)
        bound = self.bound
        # One over the bound by itself is not kept, and does not push the others out first.
        if not healthy or self.capacity <= 0 or self._closed or (bound is not None and reference.reserved > bound):
            reference.close()
            self.forfeit(reference.key)
            return False
        evicted = []
        with self._returned:
            older = self._idle.pop(reference.key, None)
            if older is not None:
                evicted.append(older)
            self._idle[reference.key] = reference
            while len(self._idle) > self.capacity:
                evicted.append(self._idle.popitem(last=False)[1])
            while bound is not None and (excess := sum(r.reserved for r in self._idle.values()) - bound) > 0:
                evicted.append(self._idle.pop(self._to_free(excess, reference.key)))
            self._release(reference.key)
        for old in evicted:
            old.close()
        return reference not in evicted

    def _to_free(self, excess: int, newest: str) -> str:
        """Which idle reference goes to free ``excess`` bytes: the least recently used of those that free it
        alone, else the largest; the one just given back last. In least-recently-used order, a GB-input task's
        reference coming back would close every small task's (megabytes each) given back before it."""
        others = [key for key in self._idle if key != newest] or [newest]
        enough = [key for key in others if self._idle[key].reserved >= excess]
        return enough[0] if enough else max(others, key=lambda key: self._idle[key].reserved)

    @property
    def bound(self) -> int | None:
        """What idle references may hold together: ``memory``, or a larger card's memory less ``REFERENCE_HEADROOM``."""
        return None if self.memory is None else max(self.memory, self.card_bytes - REFERENCE_HEADROOM)

    def _release(self, key: str) -> None:
        self._out[key] -= 1
        if self._out[key] <= 0:
            del self._out[key]
        self._returned.notify_all()

    def idle_besides(self, key: str) -> int:
        """How many idle references of tasks other than ``key``'s the pool holds now."""
        with self._lock:
            return sum(other != key for other in self._idle)

    def drop_idle(self, keep: str | None = None) -> int:
        """Closes the idle references, all but ``keep``'s: the device memory they hold goes to an evaluation
        that must run with the device alone (``DeviceLock.alone``). How many were closed."""
        with self._lock:
            dropped = [key for key in self._idle if key != keep]
            closing = [self._idle.pop(key) for key in dropped]
        for reference in closing:
            reference.close()
        return len(closing)

    def __len__(self) -> int:
        return len(self._idle)

    def close(self) -> None:
        """Closes the idle references now, and any still out as it comes back (a pool shared by
        evaluators is closed by the first of them whose ``close()`` is called; one collected unclosed
        leaves a pool it was given open)."""
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle.values()), collections.OrderedDict()
        for reference in idle:
            reference.close()
