"""GPU state that timing depends on and a candidate could change: the persisting-L2
limit of the process's CUDA context, and other work running on the GPU.

Persisting L2 lines survive the flush buffer written before every timed call,
so a candidate that marks its data persisting would be timed with a warm cache.
The harness demotes persisting lines to normal before each timed call, and
the limit itself is one of the global flags ``guard.runtime`` checks (it is not
0 by default on recent GPUs). Driver calls go through ``libcuda``
directly: torch exposes neither.

Baselines are timed while the GPU should be idle; ``gpu_busy`` says whether it
is not (another process's kernels, a left-over job), through NVML.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import time

_CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06


class DriverError(RuntimeError):
    pass


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise DriverError(f"cannot load the CUDA driver library libcuda.so.1: {exc}") from None


def _call(name: str, *args: object) -> None:
    status = getattr(_driver(), name)(*args)
    if status != 0:
        raise DriverError(f"{name} failed with CUresult {status}")


def persisting_l2_limit() -> int:
    """Bytes of L2 the current CUDA context may hold as persisting (0: none)."""
    value = ctypes.c_size_t(0)
    _call("cuCtxGetLimit", ctypes.byref(value), ctypes.c_int(_CU_LIMIT_PERSISTING_L2_CACHE_SIZE))
    return value.value


def reset_persisting_l2() -> None:
    """Demote every persisting L2 line to normal: the next flush evicts them too."""
    _call("cuCtxResetPersistingL2Cache")


def gpu_busy(index: int = 0, samples: int = 3, interval_s: float = 0.1, threshold: int = 5) -> str | None:
    """Why GPU ``index`` (NVML numbering) is not idle, or None when it is.

    Busy means kernels ran in NVML's last sample period (utilization above
    ``threshold`` percent) in any of ``samples`` readings. None also when no
    reading is possible (no NVML and no nvidia-smi): the caller records that.
    """
    read = _reader(index)
    if read is None:
        return None
    peak = 0
    for i in range(samples):
        if i:
            time.sleep(interval_s)
        peak = max(peak, read())
    return f"GPU {index} utilization was {peak}% (another process is running kernels)" if peak > threshold else None


def can_check_idle(index: int = 0) -> bool:
    return _reader(index) is not None


@functools.cache
def _reader(index: int):
    """A utilization reader for GPU ``index``: NVML once initialised, else nvidia-smi, else None."""
    return _nvml_reader(index) or _smi_reader(index)


def _nvml_reader(index: int):
    try:
        import pynvml  # nvidia-ml-py; optional
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError:
        return None
    return lambda: int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)


def _smi_reader(index: int):
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None

    def read() -> int:
        out = subprocess.run([smi, "-i", str(index), "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=False).stdout.strip()
        return int(out) if out.isdigit() else 0

    return read
