"""GPU time attribution: which kernels a forward call ran, and which are the candidate's.

The candidate's own kernels are read from its built extension: nvcc emits a
host stub ``__device_stub__<mangled name>`` for every ``__global__`` function,
so the symbol table names each kernel the extension can launch (templates as
instantiated). The profiler names the kernels that ran, demangled the same way.

Two defences rest on this:

* decoy: the extension defines kernels, yet none of them ran in forward; the
  work came from somewhere else (a library call, torch reached some other way);
* coverage: the share of forward's GPU time spent in the candidate's own
  kernels, reported on every result; a policy may ask for a minimum (a "lazy"
  candidate that writes one trivial kernel and leaves the rest to cuBLAS);
* stream: own kernels launched on a stream other than the harness's, however
  the stream was named in the source (the per-thread default stream is an
  integer handle, which no name check sees).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cuda_agent.guard.symbols import SymbolAuditError, defined_symbols

_STUB = re.compile(r"__device_stub__(Z\w+)")
_TOOL_TIMEOUT_S = 120
MAX_KERNEL_NAMES = 256  # distinct kernel names a profiled call may report


class AttributionError(RuntimeError):
    """The extension's kernels could not be read (no nm / c++filt, not an object file)."""


@dataclass(frozen=True)
class KernelTime:
    name: str
    launches: int
    ms: float
    own: bool
    side_launches: int = 0  # launches on a stream other than the harness's


@dataclass(frozen=True)
class Attribution:
    """GPU kernels of one profiled forward call."""

    defined: int  # kernels the candidate's extension defines
    own_ms: float
    other_ms: float
    own_launches: int
    kernels: tuple[KernelTime, ...] = field(default=())
    own_side_launches: int = 0  # own kernels' launches on a stream other than the harness's

    @property
    def coverage(self) -> float | None:
        total = self.own_ms + self.other_ms
        return self.own_ms / total if total > 0 else None

    def to_dict(self) -> dict[str, Any]:
        top = sorted(self.kernels, key=lambda k: -k.ms)[:20]
        return {
            "defined": self.defined, "own_ms": self.own_ms, "other_ms": self.other_ms,
            "own_launches": self.own_launches, "own_side_launches": self.own_side_launches,
            "coverage": self.coverage, "kernels": [asdict(k) for k in top],
        }


def extension_kernels(paths: Sequence[Path]) -> frozenset[str]:
    """Demangled names of the ``__global__`` functions defined in built objects."""
    cxxfilt = shutil.which("c++filt")
    if cxxfilt is None:
        raise AttributionError("kernel attribution needs `c++filt` from GNU binutils "
                               "(Debian/Ubuntu: apt-get install binutils).")
    mangled: set[str] = set()
    try:
        for path in paths:
            # Demangled, the stub reads ``__device_stub__Z11gelu_kernelPKfPfi(float const*, ...)``: the
            # kernel's own mangled name less its leading underscore (extern "C" kernels get one too).
            for name in defined_symbols(Path(path)):
                mangled.update("_" + match.group(1) for match in _STUB.finditer(name))
    except SymbolAuditError as exc:
        raise AttributionError(str(exc)) from None
    if not mangled:
        return frozenset()
    ordered = sorted(mangled)
    demangled = _demangle(cxxfilt, "\n".join(ordered) + "\n").splitlines()
    if len(demangled) != len(ordered):
        raise AttributionError("c++filt returned a different number of names than it was given")
    return frozenset(demangled)


def _demangle(cxxfilt: str, names: str) -> str:
    try:
        proc = subprocess.run([cxxfilt], input=names, capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        raise AttributionError("c++filt timed out") from None
    if proc.returncode != 0:
        raise AttributionError(f"c++filt failed: {proc.stderr.strip()[:500]}")
    return proc.stdout


def base_name(kernel: str) -> str:
    """The qualified name without return type, template arguments or parameters:
    ``void ns::scale<float>(float const*, int)`` -> ``ns::scale``."""
    text = _anonymous(kernel.strip())
    text = text[5:] if text.startswith("void ") else text
    depth, out = 0, []
    for ch in text:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif ch == "(" and depth == 0:
            break
        elif depth == 0:
            out.append(ch)
    return re.sub(r"\s+", "", "".join(out))


def attribute(kernels: Iterable[tuple[str, int, float] | tuple[str, int, float, int]],
              own: frozenset[str]) -> Attribution:
    """Split profiled kernels (name, launches, total ms[, launches off the harness's stream]) into
    the candidate's and the rest.

    A kernel is the candidate's when its name is one the extension defines, or has
    the same qualified base name (demanglers differ in spacing of template arguments).
    Names in torch's namespaces cannot be the candidate's: the symbol audit refuses
    extensions that define anything there.
    """
    is_own = own_matcher(own)
    rows, own_ms, other_ms, own_launches, own_side = [], 0.0, 0.0, 0, 0
    for name, launches, ms, *side in kernels:
        mine = is_own(name)
        side_launches = int(side[0]) if side else 0
        rows.append(KernelTime(name, int(launches), float(ms), mine, side_launches))
        if mine:
            own_ms += ms
            own_launches += int(launches)
            own_side += side_launches
        else:
            other_ms += ms
    return Attribution(len(own), own_ms, other_ms, own_launches, tuple(rows), own_side)


def own_matcher(own: frozenset[str]) -> Callable[[str], bool]:
    """Whether a profiled kernel name is one of ``own`` (the extension's kernels): the same name, or
    the same qualified base name (demanglers differ in spacing of template arguments)."""
    exact = {_squash(n) for n in own}
    bases = {base_name(n) for n in own}
    return lambda name: _squash(name) in exact or base_name(name) in bases


def _anonymous(name: str) -> str:
    """One spelling of the anonymous namespace: c++filt and torch's profiler write "(anonymous namespace)",
    Nsight Compute "<unnamed>"."""
    return name.replace("(anonymous namespace)", "{anonymous}").replace("<unnamed>", "{anonymous}")


def _squash(name: str) -> str:
    return re.sub(r"\s+", "", _anonymous(name).removeprefix("void "))


def decoy_reason(attribution: Attribution) -> str | None:
    if attribution.defined == 0 or attribution.own_launches > 0:
        return None
    others = sorted((k for k in attribution.kernels if not k.own), key=lambda k: -k.ms)
    source = "; the GPU time came from " + ", ".join(f"`{k.name[:80]}`" for k in others[:3]) if others else ""
    return (f"none of the {attribution.defined} kernel(s) the extension defines ran during forward{source}. "
            "A solution must run its own kernels.")


def coverage_reason(attribution: Attribution, minimum: float) -> str | None:
    coverage = attribution.coverage
    if minimum <= 0 or coverage is None or coverage >= minimum:
        return None
    return (f"the candidate's own kernels carry {coverage:.1%} of forward's GPU time "
            f"({attribution.own_ms:.3f} of {attribution.own_ms + attribution.other_ms:.3f} ms); "
            f"the policy asks for at least {minimum:.0%}")


def stream_reason(attribution: Attribution) -> str | None:
    if attribution.own_side_launches == 0:
        return None
    names = sorted({k.name for k in attribution.kernels if k.own and k.side_launches})
    return (f"{attribution.own_side_launches} launch(es) of the candidate's own kernels ran on a stream other than "
            f"the one forward is called on ({', '.join(f'`{n[:80]}`' for n in names[:3])}); launch on the current "
            "stream (c10::cuda::getCurrentCUDAStream())")


def parse_kernel_report(raw: Any) -> list[tuple[str, int, float, int]]:
    """Validate the kernel list a candidate process sent: [[name, launches, ms, launches off the
    harness's stream], ...]."""
    if not isinstance(raw, list) or len(raw) > MAX_KERNEL_NAMES:
        raise ValueError("the kernel report is not a list of at most "
                         f"{MAX_KERNEL_NAMES} entries")
    rows = []
    for entry in raw:
        if (not isinstance(entry, list) or len(entry) != 4 or not isinstance(entry[0], str)
                or not isinstance(entry[1], int) or not isinstance(entry[2], (int, float))
                or not isinstance(entry[3], int) or isinstance(entry[1], bool) or isinstance(entry[3], bool)
                or entry[1] < 0 or entry[2] < 0 or not 0 <= entry[3] <= entry[1] or len(entry[0]) > 4096):
            raise ValueError("malformed kernel report entry")
        rows.append((entry[0], entry[1], float(entry[2]), entry[3]))
    return rows
