"""Speed of light: the least time a correct forward can take on a given GPU.

A forward must write its outputs, and writes reach DRAM at no more than the
memory bandwidth. At most one L2's worth can still sit in the cache when the
end event is recorded. So ``(output bytes - L2 bytes) / bandwidth`` is a floor
that holds for every correct kernel, whatever it computes. Inputs are left out
on purpose: a task may ignore part of its inputs, and a floor must never reject
a legitimate result. A time well below the floor means the measurement was
gamed.
"""

from __future__ import annotations

from dataclasses import dataclass

# Peak DRAM bandwidth (GB/s) and L2 size (MiB) of common data-centre GPUs, from
# the vendor's data sheets. Matched against the name nvidia-smi reports.
KNOWN_GPUS: dict[str, tuple[float, float]] = {
    "H200": (4800.0, 60.0),
    "H100 SXM": (3350.0, 50.0),
    "H100 NVL": (3900.0, 50.0),
    "H100 PCIe": (2000.0, 50.0),
    "H100": (3350.0, 50.0),
    "H20": (4000.0, 60.0),
    "H800": (3350.0, 50.0),
    "A100-SXM4-80GB": (2039.0, 40.0),
    "A100 80GB PCIe": (1935.0, 40.0),
    "A100": (1555.0, 40.0),
    "L40S": (864.0, 96.0),
    "B200": (8000.0, 126.0),
}
# Measured time may undershoot the floor by timer resolution and clock error.
FLOOR_MARGIN = 0.8


@dataclass(frozen=True)
class MemorySystem:
    bandwidth_gbs: float
    l2_mib: float


def memory_system(gpu_name: str | None) -> MemorySystem | None:
    """The entry of KNOWN_GPUS whose key appears in ``gpu_name`` (longest key first)."""
    if not gpu_name:
        return None
    for key in sorted(KNOWN_GPUS, key=len, reverse=True):
        if key.lower() in gpu_name.lower():
            bandwidth, l2 = KNOWN_GPUS[key]
            return MemorySystem(bandwidth, l2)
    return None


def speed_of_light_ms(output_bytes: int, memory: MemorySystem) -> float:
    """The least time, in ms, that writing ``output_bytes`` to DRAM can take."""
    must_reach_dram = max(0.0, output_bytes - memory.l2_mib * 2**20)
    return must_reach_dram / (memory.bandwidth_gbs * 1e9) * 1e3


def below_speed_of_light(time_ms: float, output_bytes: int, memory: MemorySystem | None) -> str | None:
    """A reason when ``time_ms`` is impossibly fast for these outputs, else None."""
    if memory is None:
        return None
    floor = speed_of_light_ms(output_bytes, memory)
    if floor > 0 and time_ms < FLOOR_MARGIN * floor:
        return (f"{time_ms:.4g} ms is below the speed of light: writing {output_bytes / 2**20:.0f} MiB of outputs "
                f"takes at least {floor:.4g} ms at {memory.bandwidth_gbs:g} GB/s (beyond {memory.l2_mib:g} MiB of L2)")
    return None
