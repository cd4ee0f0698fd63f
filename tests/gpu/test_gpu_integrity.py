"""GPU tests of the native entry points watched from outside (``guard.integrity``) in a CUDA process:
the caching allocator's pointers and class are found, the harness's own use of CUDA (allocations,
frees, events, the cache emptied) changes none of them, and a swapped class is seen."""

import ctypes
import os

import pytest

from cuda_agent.evaluate.worker.loop import warm_up_runtime
from cuda_agent.guard.integrity import (
    IntegrityWatch, allocator_slots, driver_slots, harness_native_functions, native_slots, vdso_slots,
)

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_cuda_allocator_is_watched_and_the_harnesss_own_use_of_cuda_changes_nothing():
    torch.ones(1, device="cuda")
    slots = allocator_slots(cuda=True)
    print("\n" + "\n".join(f"{name}: 0x{address:x}" for name, address in slots.items()))
    assert any(name.startswith("the CUDA allocator (") for name in slots)
    pointer = slots["the CUDA allocator's class (its vtable pointer)"]
    assert sum(name.startswith("the CUDA allocator's virtual function") for name in slots) >= 10
    assert "the CPU allocator's class (its vtable pointer)" in slots
    warm_up_runtime("cuda")  # what the worker runs before it reports its slots
    driver = driver_slots()
    print(f"{len(driver)} pointers of the CUDA runtime to the driver, e.g. " + ", ".join(list(driver)[:3]))
    assert any(name.startswith("the CUDA runtime's pointer to cuEventElapsedTime") for name in driver), list(driver)
    watched = native_slots(harness_native_functions(cuda=True)) | slots | vdso_slots() | driver
    watch = IntegrityWatch.start(os.getpid(), watched, ("/nonexistent-job",))
    kept = [torch.empty(1 << k, device="cuda") for k in range(26)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1000)
    end.record()
    torch.cuda.synchronize()
    assert start.elapsed_time(end) > 0
    del kept
    torch.cuda.empty_cache()
    torch.ones(3).sum().item()
    # More of the runtime than the harness uses: streams, graphs, device queries.
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        static = torch.ones(8, device="cuda")
        with torch.cuda.graph(graph):
            static.mul_(2)
        graph.replay()
    torch.cuda.synchronize()
    torch.cuda.get_device_properties(0), torch.cuda.mem_get_info()
    assert watch.problems() == []
    # The object's class swapped for the time of one read (nothing allocates meanwhile).
    vtable = ctypes.c_void_p.from_address(pointer).value
    ctypes.c_void_p.from_address(pointer).value = vtable + 8
    try:
        problems = watch.problems()
    finally:
        ctypes.c_void_p.from_address(pointer).value = vtable
    assert problems == [f"the CUDA allocator's class (its vtable pointer) was replaced (0x{vtable:x} -> "
                        f"0x{vtable + 8:x})"]
    assert watch.problems() == []
