"""Reading a GPU candidate's timed outputs from outside its process (evaluate.protocol.vmm, evaluate.protocol.outside.GpuMemory):
the exported allocations' descriptors after each region (regions.Bell/Ringer), their relay, and the reads at the
secret positions. On the CPU the allocations are memfds, read by a stand-in for the reference's mapping; on a GPU
(``gpu`` marker) the real export and import, and a whole evaluation."""

from __future__ import annotations

import ctypes
import os
import socket
import threading

import pytest
import torch

from cuda_agent.evaluate.protocol.outside import GpuMemory, OutsideError, describe
from cuda_agent.evaluate.protocol.records import OUTPUT_VALUES, positions
from cuda_agent.evaluate.region_clock import judge, overhead
from cuda_agent.evaluate.protocol.regions import CONT, GO, Bell, BellError, BellUnreadable, Ringer, decode_calls, encode_calls
from cuda_agent.evaluate.protocol.vmm import spans
from cuda_agent.sandbox.process import receive_fds, send_fds


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("chunk")
    os.write(fd, data)
    return fd


def _worker(ringer: Ringer, regions: int, exports) -> threading.Thread:
    """A worker's timing loop: each region READY, GO, the region's allocations, DONE, CONT."""
    def run() -> None:
        for region in range(regions):
            ringer.ready(region)
            ringer.wait(GO, region)
            exports(ringer, region)
            ringer.done(region, b"[]")
            ringer.wait(CONT, region)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _bell() -> tuple[Bell, Ringer]:
    bell = Bell(chunked=True)
    ringer = Ringer(bell.theirs)
    return bell, ringer


def test_every_exported_allocation_reaches_the_evaluator_and_is_closed_after_the_region():
    bell, ringer = _bell()
    count = 450  # three datagrams' worth
    sent = {region: [(0x7000_0000 + i * (2 << 20), 2 << 20) for i in range(count)] for region in range(2)}
    seen: dict[int, list[tuple[int, int, bytes]]] = {}
    kept: list[int] = []

    def exports(ringer: Ringer, region: int) -> None:
        fds = [_memfd(f"{region}:{i}".encode()) for i in range(count)]
        ringer.chunks(region, sent[region], fds, looked_up=count + 7)

    def between(bracket) -> None:
        seen[bracket.region] = [(c.base, c.size, os.pread(c.fd, 16, 0)) for c in bracket.chunks]
        kept.extend(c.fd for c in bracket.chunks)

    worker = _worker(ringer, 2, exports)
    brackets = bell.serve(2, 30, lambda: True, between)
    worker.join(10)
    for region in range(2):
        assert [(b, s) for b, s, _ in seen[region]] == sent[region]
        assert [d.rstrip(b"\0") for _, _, d in seen[region]] == [f"{region}:{i}".encode() for i in range(count)]
        assert brackets[region].looked_up == count + 7 and brackets[region].new_chunks == count
    for fd in kept:  # the evaluator's copies no reader took are closed once the region is over
        with pytest.raises(OSError):
            os.fstat(fd)
    bell.close()


def test_a_region_whose_memory_cannot_be_exported_or_whose_table_lies_is_refused():
    bell, ringer = _bell()
    worker = _worker(ringer, 1, lambda r, region: r.chunks_failed(region, "address 0x10 is not memory of torch's"))
    with pytest.raises(BellUnreadable, match="is not memory of torch's"):
        bell.serve(1, 10, lambda: True)
    worker.join(5)
    bell.close()

    bell, ringer = _bell()
    fds = [_memfd(b"x"), _memfd(b"y")]
    worker = _worker(ringer, 1, lambda r, region: r.chunks(region, [(1 << 30, 2 << 20)], fds, 2))  # 2 fds, 1 entry
    with pytest.raises(BellError, match="does not match its descriptors"):
        bell.serve(1, 10, lambda: True)
    worker.join(5)
    bell.close()


def test_descriptors_travel_in_as_many_messages_as_they_need():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fds = [_memfd(str(i).encode()) for i in range(600)]
    sender = threading.Thread(target=send_fds, args=(ours, fds))
    sender.start()
    got = receive_fds(theirs, 600, 10)
    sender.join()
    assert [os.pread(fd, 8, 0).rstrip(b"\0") for fd in got] == [str(i).encode() for i in range(600)]
    for fd in fds + got:
        os.close(fd)
    ours.close()
    theirs.close()


class _Allocations:
    """The candidate's memory as exported allocations (memfds), and a stand-in for the reference: it holds what it
    was handed, by name, from request to request (``vmm.Importer.hold``), and reads it."""

    def __init__(self, tensor: torch.Tensor, pieces: int, base: int = 0x7F00_0000_0000):
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        self.base = base
        size = -(-len(data) // pieces)
        self.chunks = []
        for i in range(pieces):
            from cuda_agent.evaluate.protocol.regions import Chunk
            self.chunks.append(Chunk(base + i * size, size, _memfd(data[i * size:(i + 1) * size].ljust(size, b"\0"))))
        self.asked: list[int] = []  # descriptors sent with each request
        self.dropped: list[int] = []
        self.holding: dict[int, int] = {}  # name -> its descriptor here
        self.late = False
        self.refuse = False

    def read(self, held, fds, sizes, reads, apart_s):
        self.asked.append(len(fds))
        for name in held.drop:
            self.dropped.append(name)
            os.close(self.holding.pop(name))
        for position, fd in zip(held.new, fds):
            self.holding[held.ids[position]] = os.dup(fd)
        if self.refuse:
            raise OutsideError("import of an exported allocation: CUresult 1")
        mapped = [self.holding[name] for name in held.ids]  # a name never handed over: KeyError, the test fails
        first = [os.pread(mapped[c], n, o) for c, o, n in reads]
        return first, [0] if self.late else []


def test_values_of_gpu_memory_are_read_at_the_secret_positions_across_allocations():
    output = torch.arange(4096, dtype=torch.float32) * 0.25
    memory = _Allocations(output, pieces=4)
    call = describe(3, output, [])
    call["o"][0][0] = memory.base  # where the tensor lies in the candidate's address space
    reader = GpuMemory(memory)
    reader.take(list(reversed(memory.chunks)))  # the reader owns their descriptors from now on
    record = reader.records([call], probe=99)[0]
    wanted = [float(output[p]) for p in positions(99, "output", 0, output.numel(), OUTPUT_VALUES)]
    assert record.index == 3 and record.outputs[0].values == wanted
    touched = len({p * 4 // memory.chunks[0].size for p in positions(99, "output", 0, 4096, OUTPUT_VALUES)})
    assert memory.asked == [touched]

    memory.late = True  # the second read saw other bytes: work still writing after the region
    with pytest.raises(OutsideError, match="changed between two reads"):
        reader.records([call], probe=99)
    assert memory.asked[-1] == 0  # the reference holds them from the first read: no descriptor sent again
    memory.late = False
    elsewhere = dict(call, o=[[memory.base + 10 * memory.chunks[0].size, "float32", [16], [1]]])
    with pytest.raises(OutsideError, match="not in the GPU memory the candidate's process exported"):
        reader.records([elsewhere], probe=99)

    # An allocation exported again at the same address (another one took its place) replaces the one held, here
    # and in the reference, which is told to drop the old one as the new one is handed over.
    from cuda_agent.evaluate.protocol.regions import Chunk

    old_fd, old_name = reader.held[memory.base].fd, reader.ids[memory.base]
    zeros = _memfd(bytes(memory.chunks[0].size))
    reader.take([Chunk(memory.base, memory.chunks[0].size, zeros)])
    with pytest.raises(OSError):
        os.fstat(old_fd)
    again = reader.records([call], probe=99)[0].outputs[0].values
    assert memory.dropped == [old_name] and memory.asked[-1] == 1
    first_chunk = memory.chunks[0].size // 4
    assert [v for p, v in zip(positions(99, "output", 0, 4096, OUTPUT_VALUES), again) if p < first_chunk] == \
        [0.0] * sum(p < first_chunk for p in positions(99, "output", 0, 4096, OUTPUT_VALUES))

    # After a request that failed, the reference may hold some and not others: every descriptor is sent again.
    memory.refuse = True
    with pytest.raises(OutsideError, match="CUresult"):
        reader.records([call], probe=99)
    memory.refuse = False
    assert reader.records([call], probe=99)[0].outputs[0].values == again and memory.asked[-1] == touched
    reader.close()
    assert not reader.held


def test_spans_cover_every_described_tensor_and_a_region_exporting_more_is_allowed_for_it():
    x = torch.empty(64, 32)
    call = describe(0, x.t(), [x[:, :4]])
    assert spans([call], {"float32": 4}) == [(x.data_ptr(), x.data_ptr() + 64 * 32 * 4),
                                             (x.data_ptr(), x.data_ptr() + (63 * 32 + 3 + 1) * 4)]
    assert decode_calls(encode_calls([call])) == [call]

    from cuda_agent.evaluate.region_clock import EXPORT_MS_PER_CHUNK
    from cuda_agent.evaluate.protocol.regions import Bracket

    def bracket(outside_ms: float, spanned: int, new: int) -> Bracket:
        return Bracket(0, 0, 0, 1_000_000, 1_000_000 + int(outside_ms * 1e6), looked_up=spanned, new_chunks=new)

    cost = overhead([bracket(0.05, 2, 0)] * 5, [0.0] * 5, hold_us=0.0)
    new = 200
    # What exporting more allocations than the no-op regions did costs is taken off the region, no more.
    allowed = cost.export_ms(bracket(0, 2 + new, new))
    assert allowed >= new * EXPORT_MS_PER_CHUNK
    honest = judge([bracket(2.05 + allowed, 2 + new, new)] * 9, [2.0] * 9, cost, 0.0)
    assert honest.chunks == 2 + new and honest.outside_ms == pytest.approx(2.0)
    # Work done while exporting beyond that is the region's.
    hidden = judge([bracket(2.05 + allowed + 1.0, 2 + new, new)] * 9, [2.0] * 9, cost, 0.0)
    assert hidden.outside_ms == pytest.approx(3.0)


@pytest.mark.gpu
def test_an_allocation_exported_in_one_sandboxed_process_is_read_in_another(tmp_path):
    """The probe of docs/SECURITY.md as a test: torch's memory under expandable segments, exported by one
    sandboxed process, relayed here, imported and read by another (other namespaces)."""
    import subprocess
    import sys

    probe = __import__("pathlib").Path(__file__).resolve().parents[2] / "experiments" / "probes" / "vmm_share_probe.py"
    out = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert any('"torch-expandable"' in line and '"ok": true' in line for line in lines), out.stdout + out.stderr


@pytest.mark.gpu
def test_an_honest_gpu_candidate_is_read_from_outside_and_keeps_its_reward(examples, cache_dir):
    from cuda_agent.candidates import load_candidate
    from cuda_agent.evaluate import Evaluator
    from cuda_agent.tasks import load_task

    task = load_task(examples / "cuda_gelu" / "model.py")
    result = Evaluator("cuda", cache_dir=cache_dir).evaluate(task, load_candidate(examples / "cuda_gelu" / "solution"))
    assert result.status == "correct", result.summary()
    assert not any("recorded in the candidate's process" in note for note in result.notes), result.notes
    regions = result.timing["regions"]
    # Its allocations are looked up before each region: after DONE, nothing (the median region).
    assert regions["chunks"] == 0 and regions["allowance"] < 0.025, regions
    # The last timed call, checked whole, was the reference's own copy taken after its region, not handed over; so
    # were the checks before timing but the first (handed over whole: structure, plain values, devices).
    before = [c for c in result.checks if not c.get("timed")]
    assert [c.get("kept", False) for c in before] == [False] + [True] * (len(before) - 1), result.checks
    assert all(c["ok"] for c in result.checks), result.checks
    assert [c.get("kept") for c in result.checks if c.get("timed") and "kept" in c] == [True], result.checks


class _Driver:
    """The driver's VMM calls as the exporter makes them, over a table of pages (a test double of libcuda)."""

    def __init__(self, pages: dict[int, tuple[int, int]]):
        self.pages = pages  # base -> (size, handle)
        self.calls: list[str] = []
        self.exported: list[int] = []

    def _page(self, address: int) -> tuple[int, int, int] | None:
        return next(((b, s, h) for b, (s, h) in self.pages.items() if b <= address < b + s), None)

    def retain(self, handle_ref, address) -> int:
        self.calls.append("retain")
        page = self._page(address.value)
        if page is None:
            return 1
        handle_ref._obj.value = page[2]
        return 0

    def range(self, base_ref, size_ref, address) -> int:
        base, size, _ = self._page(address.value)
        base_ref._obj.value, size_ref._obj.value = base, size
        return 0

    def export(self, fd_ref, handle, kind, flags) -> int:
        self.exported.append(handle.value)
        fd_ref._obj.value = os.memfd_create("page")
        return 0


def _exporter(driver: _Driver):
    from cuda_agent.evaluate.protocol import vmm

    exporter = vmm.Exporter.__new__(vmm.Exporter)
    exporter.__dict__.update(_retain=driver.retain, _range=driver.range, _export=driver.export,
                             _release=lambda handle: 0, _close=os.close, _sorted=sorted, known={}, checked={},
                             checked_bases=[], pending=([], []), failed=None)
    import bisect
    exporter._bisect, exporter._insort = bisect.bisect_right, bisect.insort
    return exporter


def test_allocations_are_looked_up_before_the_region_and_exported_once_until_another_takes_their_place():
    mib = 1 << 20
    base = 0x7000_0000_0000
    driver = _Driver({base + i * mib: (mib, 100 + i) for i in range(3)})
    exporter = _exporter(driver)
    inputs, outputs = [(base, base + 2 * mib - 8)], [(base + 2 * mib, base + 3 * mib)]
    exporter.check(inputs)  # before the region: its inputs
    chunks, fds, looked_up = exporter.finish(inputs + outputs)
    assert [c[0] for c in chunks] == [base, base + mib, base + 2 * mib] and looked_up == 1  # the output's page
    for fd in fds:
        os.close(fd)
    # The next region: inputs and the last outputs looked up before it; nothing left for after DONE, nothing new.
    exporter.check(inputs + outputs)
    assert exporter.checked == {base: base + 3 * mib}  # one run: a span over it is skipped with one lookup
    assert exporter.finish(inputs + outputs) == ([], [], 0) and driver.exported == [100, 101, 102]
    # Another allocation at the output's address (the allocator released and mapped again): exported again.
    driver.pages[base + 2 * mib] = (mib, 999)
    exporter.check(inputs + outputs)
    chunks, fds, looked_up = exporter.finish(inputs + outputs)
    assert chunks == [(base + 2 * mib, mib)] and looked_up == 0 and driver.exported[-1] == 999
    for fd in fds:
        os.close(fd)
    # Memory that is not the allocator's: named after the region, its earlier exports closed, not sent.
    exporter.check([(0x10, 0x20)])
    with pytest.raises(Exception, match="not memory of torch's allocator"):
        exporter.finish([(0x10, 0x20)])


class _Mapper:
    """The driver's VMM calls as the reference's importer makes them (a test double of libcuda): every mapping
    lives at its own reserved address, 1 GiB apart."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.next_address = 1 << 40
        self.handles = 0

    def table(self) -> dict:
        def imported(handle_ref, fd, kind):
            self.handles += 1
            handle_ref._obj.value = 1000 + self.handles
            self.calls.append(("import", fd.value))
            return 0

        def reserve(address_ref, size, align, fixed, flags):
            address_ref._obj.value = self.next_address
            self.next_address += 1 << 30
            return 0

        def record(name):
            def call(*args):
                self.calls.append((name, *[getattr(a, "value", a) for a in args]))
                return 0
            return call
        return {"cuMemImportFromShareableHandle": imported, "cuMemAddressReserve": reserve,
                "cuMemMap": record("map"), "cuMemSetAccess": lambda *args: 0, "cuMemcpyDtoD_v2": record("copy"),
                "cuMemcpyDtoH_v2": record("read"), "cuMemUnmap": record("unmap"), "cuMemAddressFree": lambda *a: 0,
                "cuMemRelease": record("release"), "cuCtxSynchronize": lambda: 0}

    def of(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


def test_the_reference_keeps_what_it_was_handed_mapped_and_writes_across_allocations_that_follow_one_another():
    from cuda_agent.evaluate.protocol import vmm

    driver = _Mapper()
    importer = vmm.Importer.__new__(vmm.Importer)
    importer.f, importer.held = driver.table(), {}
    importer.access = vmm._Access(vmm._Location(vmm.LOCATION_DEVICE, 0), vmm.PROT_READWRITE)
    mib = 1 << 20
    mapped = importer.hold([1, 2, 3], [2 * mib] * 3, [0, 1, 2], [10, 11, 12], [])
    assert [c[1] for c in driver.of("import")] == [10, 11, 12] and len(driver.of("map")) == 3
    # The next request: held already, nothing imported or mapped again.
    assert importer.hold([2, 1], [2 * mib] * 2, [], [], []) == [mapped[1], mapped[0]]
    assert len(driver.of("import")) == 3 and not driver.of("unmap")

    # A tensor from the middle of allocation 1 into allocation 2 (they follow one another in the candidate's
    # address space): two copies, each to where that allocation is mapped here.
    importer.write(mapped[:2], [0, 2 * mib], [(0x5000, mib, 2 * mib)])
    assert driver.of("copy") == [("copy", mapped[0][0] + mib, 0x5000, mib), ("copy", mapped[1][0], 0x5000 + mib, mib)]
    # A kept output copied the other way (``copy_out``): from where the allocations are mapped here to 0x7000.
    importer.copy_out(mapped[:2], [0, 2 * mib], [(0x7000, mib, 2 * mib)])
    assert driver.of("copy")[2:] == [("copy", 0x7000, mapped[0][0] + mib, mib), ("copy", 0x7000 + mib, mapped[1][0], mib)]
    with pytest.raises(vmm.VmmError, match="a read of .* outside the allocations handed over"):
        importer.copy_out(mapped[:2], [0, 2 * mib], [(0x7000, 3 * mib, 2 * mib)])
    del driver.calls[-2:]
    # Across a gap, or past the last: refused before anything is copied.
    for offsets, at in (([0, 4 * mib], mib), ([0, 2 * mib], 3 * mib)):
        with pytest.raises(vmm.VmmError, match="outside the allocations handed over"):
            importer.write(mapped[:2], offsets, [(0x5000, 0, 64), (0x6000, at, 2 * mib)])
    with pytest.raises(vmm.VmmError, match="overlap"):
        importer.write(mapped[:2], [0, mib], [(0x5000, 0, 64)])
    assert len(driver.of("copy")) == 2

    # Another allocation took one's place: dropped as asked; a name never handed over is refused; one handed over
    # again is mapped again (the evaluator is not sure it is held after a failure).
    importer.hold([1], [2 * mib], [], [], [3])
    assert [c[1] for c in driver.of("unmap")] == [mapped[2][0]] and set(importer.held) == {1, 2}
    with pytest.raises(vmm.VmmError, match="allocation 9 of .* is not held here"):
        importer.hold([1, 9], [2 * mib] * 2, [], [], [])
    again = importer.hold([1], [2 * mib], [0], [13], [])
    assert again[0] != mapped[0] and len(driver.of("unmap")) == 2 and driver.of("import")[-1][1] == 13
    with pytest.raises(vmm.VmmError, match="descriptors"):
        importer.hold([1], [2 * mib], [0], [], [])
    assert importer.forget() == 2 and not importer.held and len(driver.of("release")) == 4


def test_the_reference_gathers_a_regions_reads_on_the_device_and_copies_them_out_at_once(monkeypatch):
    """``Importer.read``'s gather (test double of libcuda over host memory: a device address is a host one): each
    read lands in its own bytes, in the order asked, with one copy to the host per pass; a value written between
    the two passes is named; the staging buffer grows when a region reads more than it holds."""
    from cuda_agent.evaluate.protocol import vmm

    memory = [ctypes.create_string_buffer(bytes(range(256)) * 16) for _ in range(2)]
    kept: list = []
    calls: list[str] = []

    def alloc(address_ref, nbytes):
        kept.append(ctypes.create_string_buffer(nbytes))
        address_ref._obj.value = ctypes.addressof(kept[-1])
        calls.append("alloc")
        return 0

    def gather(dst, src, nbytes, stream):
        ctypes.memmove(dst.value, src.value, nbytes)
        calls.append("gather")
        return 0

    def out(host, src, nbytes):
        ctypes.memmove(host, src.value, nbytes)
        calls.append("out")
        return 0

    importer = vmm.Importer.__new__(vmm.Importer)
    importer.f = {"cuMemAlloc_v2": alloc, "cuMemFree_v2": lambda a: calls.append("free") or 0,
                  "cuMemcpyDtoDAsync_v2": gather, "cuMemcpyDtoH_v2": out}
    importer.held, importer.staging = {}, (0, 0)
    mapped = [(ctypes.addressof(m), len(m)) for m in memory]
    memory[1][100] = 7

    def write_between(seconds):
        memory[0][3] = 0xEE  # lands in the second read of chunk 0 only

    monkeypatch.setattr(vmm.time, "sleep", write_between)
    data, changed = importer.read(mapped, [(1, 99, 3), (0, 2, 2), (0, 4000, 16)], 0.001)
    assert data == [bytes([99, 7, 101]), bytes([2, 3]), bytes(range(160, 176))]
    assert changed == [1]
    assert calls == ["alloc"] + ["gather"] * 3 + ["out"] + ["gather"] * 3 + ["out"]
    calls.clear()
    data, changed = importer.read(mapped, [(0, 0, 4096), (1, 0, 4096)], 0.001)
    assert data == [bytes(memory[0])[:4096], bytes(memory[1])[:4096]] and not changed
    assert calls[:3] == ["free", "alloc", "gather"] and importer.staging[1] == 8192
    with pytest.raises(vmm.VmmError, match="outside allocation 1"):
        importer.read(mapped, [(1, 4090, 8)], 0.001)
