"""The region brackets (evaluate.protocol.regions) and the reads from outside (evaluate.protocol.outside), between real
processes: a forked worker timing regions through the brackets, stopped and read from outside."""

from __future__ import annotations

import os
import signal
import struct
import time
from types import SimpleNamespace

import pytest
import torch

from cuda_agent.evaluate.protocol.channel import Stop
from cuda_agent.evaluate.protocol.outside import OutsideError, ProcessMemory as OutsideReader, describe
from cuda_agent.evaluate.protocol.policy import TimingConfig
from cuda_agent.evaluate.protocol.records import OUTPUT_VALUES, positions
from cuda_agent.evaluate.region_clock import FLOOR_MS, Overhead, judge, overhead, span_ms, times
from cuda_agent.evaluate.protocol.regions import (CONT, GO, HEADER, Bell, BellError, BellFailed, Ringer, decode_calls, encode_calls,
                                         thread_times)
from cuda_agent.evaluate.protocol.timing import time_round
from cuda_agent.evaluate.watchers import Regions


_CHILDREN: list[int] = []


@pytest.fixture(autouse=True)
def _no_child_outlives_its_test():
    yield
    while _CHILDREN:
        pid = _CHILDREN.pop()
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _fork(child) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            child()
        except BaseException:  # noqa: BLE001 - the child's failure is its exit status
            code = 1
        os._exit(code)
    _CHILDREN.append(pid)
    return pid


def _exit_status(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    _CHILDREN.remove(pid)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("poll_done", [False, True], ids=["slept-on", "polled"])
def test_a_round_through_the_brackets_is_bracketed_by_the_evaluators_clock(poll_done):
    """Either way the evaluator waits for DONE (``Bell.poll_done``: polled on a GPU read from outside), the brackets
    are the kernel's send stamps."""
    bell = Bell()
    bell.poll_done = poll_done
    samples_read, samples_write = os.pipe()
    config = TimingConfig(flush_l2=False)

    def worker() -> None:
        ringer = Ringer(bell.theirs)
        box = {}

        def prepare():
            return lambda: box.setdefault("x", sum(range(20000)))
        samples = time_round(prepare, "cpu", config, trials=6, calls=2, after_end=lambda: b"[]", bell=ringer)
        os.write(samples_write, repr(samples).encode())

    pid = _fork(worker)
    brackets = bell.serve(6, 30, alive=lambda: True)
    assert _exit_status(pid) == 0
    samples = eval(os.read(samples_read, 1 << 16))  # noqa: S307 - our own child's repr of floats
    assert [b.region for b in brackets] == list(range(6))
    for bracket, sample in zip(brackets, samples):
        # The outside bracket contains the inside measurement: GO was sent before the worker read its
        # clock, and DONE after it read it again.
        assert bracket.go_ns >= bracket.ready_ns and bracket.done_ns > bracket.go_ns
        assert bracket.outside_ms >= sample * 2
        assert decode_calls(bracket.payload) == []
    bell.close()


def test_a_polled_wait_for_done_still_notices_a_dead_worker():
    """Polled, the wait for DONE still looks at the worker once a second, and gives up at the deadline."""
    bell = Bell()
    bell.poll_done = True

    def worker() -> None:
        ringer = Ringer(bell.theirs)
        ringer.ready(0)
        ringer.wait(GO, 0)
        os._exit(0)  # dies in its region: no DONE

    pid = _fork(worker)
    begin = time.monotonic()
    with pytest.raises(BellError, match="died in timed region 0"):
        bell.serve(1, 30, alive=lambda: os.waitpid(pid, os.WNOHANG) == (0, 0))
    _CHILDREN.remove(pid)
    assert time.monotonic() - begin < 10
    assert not bell._polling  # the next wait (READY) sleeps on the socket again
    bell.close()


def test_the_evaluators_work_between_regions_is_held_time_not_the_regions():
    """What the evaluator does after a region (stop the worker, read it from outside) lands in the round's
    wall: the brackets say how long, so the round's clock can leave it out (rounds.time_candidate)."""
    bell = Bell()
    config = TimingConfig(flush_l2=False)

    def worker() -> None:
        time_round(lambda: (lambda: None), "cpu", config, trials=3, calls=1, after_end=lambda: b"[]",
                   bell=Ringer(bell.theirs))

    pid = _fork(worker)
    brackets = bell.serve(3, 30, alive=lambda: True, between=lambda bracket: time.sleep(0.05))
    assert _exit_status(pid) == 0
    for bracket in brackets:
        assert bracket.held_ns >= 50e6
        assert bracket.outside_ms < 50  # the worker waited for CONT after DONE: not in its region
    bell.close()


def test_a_failing_round_says_fail_and_a_datagram_out_of_turn_is_an_error():
    bell = Bell()

    def failing() -> None:
        ringer = Ringer(bell.theirs)
        ringer.ready(0)
        ringer.wait(GO, 0)
        ringer.fail(0xFFFFFFFF)

    bell.drain()
    pid = _fork(failing)
    with pytest.raises(BellFailed):
        bell.serve(3, 30, alive=lambda: True)
    _exit_status(pid)

    def out_of_turn() -> None:
        bell.theirs.send(HEADER.pack(CONT, 5, 0))

    pid = _fork(out_of_turn)
    _exit_status(pid)
    bell.drain()  # a datagram left over from a round that stopped is dropped; one sent during the round is not

    def forged_done() -> None:
        ringer = Ringer(bell.theirs)
        ringer.ready(0)
        ringer.wait(GO, 0)
        ringer.done(1)

    pid = _fork(forged_done)
    with pytest.raises(BellError, match="where"):
        bell.serve(1, 30, alive=lambda: True)
    _exit_status(pid)
    bell.close()


def test_no_datagram_in_time_is_an_error_naming_the_region():
    bell = Bell()
    with pytest.raises(BellError, match="region 0"):
        bell.serve(1, 0.2, alive=lambda: True)
    with pytest.raises(BellError, match="died"):
        bell.serve(1, 5, alive=lambda: False)
    bell.close()


def _bracket(outside_ms: float, *, let_go_ms: float = 0.0, waited_ms: float = 0.0, cpu_ms: float = 0.0,
             after_us: float = 0.0, blind_ms: float = 0.0):
    """A region GO at 1 ms, DONE ``outside_ms`` later; let go ``let_go_ms`` before GO; on a GPU probed ``blind_ms``
    after DONE for ``after_us``."""
    from cuda_agent.evaluate.protocol.regions import Bracket

    done = 1_000_000 + int(outside_ms * 1e6)
    return Bracket(0, 0, 0, 1_000_000, done, waited_ns=int(waited_ms * 1e6), let_go_ns=int(let_go_ms * 1e6),
                   thread_cpu_ns=int(cpu_ms * 1e6), after_done_us=after_us,
                   probed_ns=done + int(blind_ms * 1e6) if after_us or blind_ms else 0)


def test_a_regions_time_is_the_evaluators_whatever_the_process_reported():
    """The reward's time is the bracket less the brackets' own cost calibrated before the candidate's code loaded;
    the candidate's own report is a diagnostic (``agreement``): a forged report changes no time."""
    cost = overhead([_bracket(0.05 + 0.001 * i) for i in range(5)], [0.0] * 5, hold_us=0.0)
    assert isinstance(cost, Overhead) and cost.median_ms == pytest.approx(0.052)
    assert times([_bracket(2.052)] * 3, cost, 0.0) == pytest.approx([2.0] * 3)
    honest = judge([_bracket(2.052)] * 9, [2.0] * 9, cost, 0.0)
    forged = judge([_bracket(2.052)] * 9, [1.0] * 9, cost, 0.0)
    assert honest.outside_ms == forged.outside_ms == pytest.approx(2.0)
    assert honest.agreement == pytest.approx(1.0) and forged.agreement == pytest.approx(2.0)
    # A region whose hold is longer than the calibration's is that much less.
    assert times([_bracket(2.552)], cost, 500.0) == pytest.approx([2.0])
    # Never zero or negative: a region within the cost's noise of it is at the floor (and refused by its allowance).
    assert times([_bracket(0.01)], cost, 0.0) == [FLOOR_MS]


def test_a_region_runs_from_its_let_go_to_the_end_of_its_work_seen_from_outside():
    """Work done between the let-go and GO, or left on the GPU after DONE (a helper thread's launch, a hook on the
    harness's own thread, another stream or context), is inside the region by construction: the span starts at the
    let-go and ends where the probe after the stop ends; and it is never shorter than the timing thread's CPU time
    from the let-go to its stop (a hook that works on it after DONE)."""
    cost = overhead([_bracket(0.05, let_go_ms=0.08, after_us=20.0, blind_ms=0.05) for _ in range(9)], [0.0] * 9, 0.0)
    assert cost.median_ms == pytest.approx(0.05 + 0.08 + 0.05 + 0.02)
    assert cost.blind_ms == pytest.approx(0.05) and cost.allowance_ms == pytest.approx(0.05)
    honest = _bracket(2.05, let_go_ms=0.08, after_us=20.0, blind_ms=0.05)
    assert span_ms(honest) - cost.median_ms == pytest.approx(2.0)
    # The same calls with a fifth of their work finished after DONE: the probe waits for it.
    deferred = _bracket(1.65, let_go_ms=0.08, after_us=420.0, blind_ms=0.05)
    assert times([deferred], cost, 0.0)[0] == pytest.approx(2.0)
    # Work at the let-go (GO long after it) is counted too.
    early = _bracket(1.65, let_go_ms=0.48, after_us=20.0, blind_ms=0.05)
    assert times([early], cost, 0.0)[0] == pytest.approx(2.0)
    # The timing thread ran 3 ms from its let-go to its stop and waited 1 ms for a CPU: the region lasted at least
    # 4 ms on this host (the brackets' cost, measured without waits, at least its CPU time).
    after_done = _bracket(1.0, cpu_ms=3.0)
    after_done.thread_waited_ns = 1_000_000
    assert span_ms(after_done) == pytest.approx(4.0) and span_ms(after_done, less_waits=True) == pytest.approx(3.0)


def test_the_cost_is_calibrated_without_run_queue_waits_and_a_region_is_wall_time():
    """The no-op regions run beside the reference process's start: their waits for a CPU say nothing of the
    brackets, and are left out of the cost (never below the harness's CPU time there). A timed region is wall time,
    waits included, as the baselines' (timed by the reference's clock) are."""
    busy = [_bracket(2.0, waited_ms=1.99, cpu_ms=0.04) for _ in range(5)]
    assert overhead(busy, [0.0] * 5, hold_us=0.0).median_ms == pytest.approx(0.04)
    quiet = overhead([_bracket(0.05)] * 9, [0.0] * 9, 0.0)
    assert times([_bracket(3.05, waited_ms=1.0)], quiet, 0.0) == pytest.approx([3.0])


def test_on_the_cpu_backend_a_region_is_timed_less_its_threads_waits_and_never_below_its_cpu_time():
    """The CPU backend (``less_waits``): the candidate's one computing thread computes nothing while it waits for a
    CPU, so a busy host's waits are none of its time; work it does on that thread after DONE still counts in full,
    less only the no-op regions' own CPU time (not the whole calibrated cost, whose wake-ups are no CPU time)."""
    cost = overhead([_bracket(0.3, cpu_ms=0.1) for _ in range(9)], [0.0] * 9, 0.0)
    assert cost.median_ms == pytest.approx(0.3) and cost.cpu_ms == pytest.approx(0.1)
    busy = _bracket(3.3, waited_ms=1.0, cpu_ms=2.1)
    assert times([busy], cost, 0.0) == pytest.approx([3.0])  # the wall time, on a GPU's terms
    assert times([busy], cost, 0.0, less_waits=True) == pytest.approx([2.0])
    # A seventh of the work done on the timing thread after DONE: the span sees 6 ms, the thread's CPU time 7.
    tail = _bracket(6.3, cpu_ms=7.1)
    assert times([tail], cost, 0.0, less_waits=True) == pytest.approx([7.0])
    # Made to wait as long as it runs, it is no faster: its CPU time bounds it.
    waiting = _bracket(6.3, waited_ms=6.0, cpu_ms=7.1)
    assert times([waiting], cost, 0.0, less_waits=True) == pytest.approx([7.0])


def test_the_allowance_and_uncertainty_are_stated_and_the_allowance_refused_past_half_a_reward_line():
    """Every result states what the clock leaves unseen (the window before the GPU's probe) and how far its cost may
    be off, as shares of a region; over ``allowance_max`` the evaluation is refused as an error (no reward either
    way), never decided. The uncertainty is left to the decision (``verdict.clock_settles``)."""
    def judged(cost):
        return SimpleNamespace(cost=cost, judge=lambda hold_us: judge([_bracket(2.2, after_us=20, blind_ms=0.05)] * 9,
                                                                      [2.0] * 9, cost, hold_us))

    setup = SimpleNamespace(device="cuda", timing=TimingConfig())
    quiet = overhead([_bracket(0.05 + 0.001 * (i % 3), after_us=20, blind_ms=0.02) for i in range(9)], [0.0] * 9, 0.0)
    result = SimpleNamespace(timing={})
    assert Regions(judged(quiet), 0.0, setup, result).check("profile", "") == []
    stated = result.timing["regions"]
    assert stated["allowance"] == pytest.approx(0.02 / stated["outside_ms"], rel=1e-3)
    assert 0 < stated["uncertainty"] < 0.01 and "resolution" in stated
    blind = overhead([_bracket(0.05, after_us=20, blind_ms=0.2)] * 9, [0.0] * 9, 0.0)
    with pytest.raises(Stop) as stopped:
        Regions(judged(blind), 0.0, setup, SimpleNamespace(timing={})).check("profile", "")
    assert stopped.value.status == "error" and "allowance" in stopped.value.reason
    noisy = overhead([_bracket(0.05 + 0.1 * i) for i in range(9)], [0.0] * 9, 0.0)
    result = SimpleNamespace(timing={})
    assert Regions(judged(noisy), 0.0, setup, result).check("profile", "") == []
    assert result.timing["regions"]["uncertainty"] > TimingConfig().uncertainty_max


@pytest.mark.parametrize("share, eager, compiled, decided", [
    (0.02, 1.04, 0.9, True),    # within uncertainty_max: decided, even beside a line
    (0.08, 2.8, 0.7, True),     # far from every line: the reward is the same at both ends
    (0.08, 1.03, 0.7, False),   # 1.03 / 0.92 is over the eager line: it could earn 2 or 1
    (0.08, 2.8, 1.02, False),   # beside the compile line
    (1.5, 9.0, 9.0, False),     # no end to the range
])
def test_an_uncertain_clock_refuses_only_a_reward_it_could_change(share, eager, compiled, decided):
    from cuda_agent.evaluate.protocol.policy import Policy
    from cuda_agent.evaluate.verdict import clock_settles

    result = SimpleNamespace(timing={"regions": {"uncertainty": share}}, speedup_eager=eager,
                             speedup_compile=compiled, notes=[])
    setup = SimpleNamespace(timing=TimingConfig(), policy=Policy())
    if decided:
        clock_settles(setup, result)
        assert bool(result.notes) == (share > TimingConfig().uncertainty_max)
    else:
        with pytest.raises(Stop) as stopped:
            clock_settles(setup, result)
        assert stopped.value.status == "error" and "uncertainty" in stopped.value.reason
    continuous = SimpleNamespace(timing=TimingConfig(), policy=Policy(reward="speedup"))
    if share > TimingConfig().uncertainty_max:
        with pytest.raises(Stop):
            clock_settles(continuous, result)


def test_regions_are_sized_for_the_clock_for_every_side():
    """Regions last as long as the clock needs for its allowance, uncertainty and resolution targets (from the
    calibration), at least ``region_ms`` and at most ``region_max_ms``; the baselines' as long as the candidate's."""
    from cuda_agent.evaluate.rounds import sized

    config = TimingConfig()
    blind = overhead([_bracket(0.05, after_us=20, blind_ms=0.07)] * 9, [0.0] * 9, 0.0)
    assert sized(config, SimpleNamespace(cost=blind)).region_ms == pytest.approx(0.07 / config.allowance_target)
    quiet = overhead([_bracket(0.05)] * 9, [0.0] * 9, 0.0)
    assert sized(config, SimpleNamespace(cost=quiet)).region_ms == config.region_ms
    noisy = overhead([_bracket(0.05 + 0.5 * i) for i in range(9)], [0.0] * 9, 0.0)
    assert sized(config, SimpleNamespace(cost=noisy)).region_ms == config.region_max_ms
    assert sized(config, None) is config


def test_after_a_gpu_regions_done_the_process_is_stopped_then_the_gpu_probed():
    """The probe is worth something only for work still queued when it is launched, and only if nothing more can be
    queued while it waits: before GO the reference is asked for it (``before_go``); as soon as DONE is in the
    processes the last stop found are stopped and then it is rung (``at_done``): whatever a helper thread or a hook
    launched after DONE is queued before it; after the bracket is made its answer is taken,
    the tree walked for any other process and the stop awaited; then its calls are read; it is let go on once, after
    all of it. A region that goes no further has its probe called off and the answer taken."""
    from cuda_agent.evaluate.brackets import CandidateBrackets
    from cuda_agent.evaluate.protocol.outside import GpuMemory
    from cuda_agent.evaluate.protocol.regions import Bracket, Chunk

    events = []
    mib = 1 << 20
    base = 0x7F0000000000

    class Armed:
        def ring(self) -> int:
            events.append("ring")
            return 99

        def call_off(self) -> None:
            events.append("call off")

        def answer(self):
            events.append("answer")
            return 250.0, 123

    class Reference:  # the reference's side of GpuRemote, as it is asked
        def after_done(self, within_s):
            events.append(f"arm {within_s}")
            return Armed()

        def read(self, held, fds, sizes, reads, apart_s):
            events.append("read")
            return [bytes(size) for _, _, size in reads], []

    class Worker:
        class proc:
            poll = staticmethod(lambda: None)

        def stop_known(self) -> None:
            events.append("stop known")

        def pause(self, timeout_s: float = 2.0) -> bool:
            events.append("stop")
            return True

        def resume(self) -> None:
            events.append("resume")

    memory = GpuMemory(Reference())
    brackets = CandidateBrackets(Bell(chunked=True), "cuda", Worker(), reader=memory, outside=True)
    chunk = Chunk(base, 2 * mib, os.open("/dev/null", os.O_RDONLY))
    call = {"i": 0, "o": [[base, "float32", [64], [1]]], "in": [[base + mib, "float32", [64], [1]]]}
    bracket = Bracket(0, 0, 0, 1, 2, payload=encode_calls([call]), chunks=[chunk])
    at_done, before_go = brackets._probes(7, 5.0)
    before_go(0)
    at_done(0)
    assert events == ["arm 5.0", "stop known", "ring"]
    brackets._reader_for(0, 1, probe=7)(bracket)
    assert events[3:] == ["answer", "stop", "read", "resume"]
    assert (bracket.after_done_us, bracket.probed_ns, bracket.asked_ns) == (250.0, 123, 99)
    assert [record.index for _, record in brackets.records] == [0] and brackets.armed is None
    events.clear()
    before_go(1)  # the region fails before its DONE
    brackets._settle()
    assert events == ["arm 5.0", "call off", "answer"] and brackets.armed is None
    events.clear()
    with pytest.raises(Stop, match="no probe after its DONE"):  # a region bracketed without asking for one
        brackets._reader_for(0, 1, probe=7)(Bracket(0, 0, 0, 1, 2, payload=encode_calls([call])))
    assert events == ["resume"]
    assert brackets._probes(None, 5.0) == (None, None)  # no probe where the calls are not read (CPU calibration)
    brackets.close()


def test_the_doorbell_wakes_a_waiter_in_another_process_as_soon_as_its_region_is_rung():
    """The reference waits on the page the evaluator rings (``quiet.Doorbell``): a region rung wakes it, one called
    off or not rung in time does not count as rung, and an earlier region's ring does not wake a later one."""
    from cuda_agent.evaluate.protocol.quiet import Doorbell

    bell = Doorbell.create()
    waiter = Doorbell(os.dup(bell.fd))  # as the reference maps the descriptor it was handed
    assert not waiter.wait(1, within_s=0.01)
    bell.ring(1)
    assert waiter.wait(1, within_s=0.01) and not waiter.wait(2, within_s=0.01)
    bell.call_off(2)
    assert not waiter.wait(2, within_s=5.0)  # at once, not after 5 s
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the waiter in a process of its own: how long from the ring to its wake-up
        rung = waiter.wait(3, within_s=10.0)
        os.write(write_end, struct.pack("<?q", rung, time.time_ns()))
        os._exit(0)
    time.sleep(0.05)
    rung_ns = time.time_ns()
    bell.ring(3)
    rung, woke_ns = struct.unpack("<?q", os.read(read_end, 9))
    os.waitpid(pid, 0)
    assert rung and 0 <= woke_ns - rung_ns < 50_000_000
    for each in (waiter, bell):
        each.close()


def _stopped_child_with(tensor_factory):
    """A forked process holding tensors, stopped; its description of them."""
    read_end, write_end = os.pipe()

    def child() -> None:
        value = tensor_factory()
        os.write(write_end, encode_calls([describe(7, value, [value.flatten()[:3]])]))
        time.sleep(60)

    pid = _fork(child)
    calls = decode_calls(os.read(read_end, 1 << 16))
    os.kill(pid, signal.SIGSTOP)
    return pid, calls[0]


@pytest.mark.parametrize("make", [
    lambda: torch.arange(4096, dtype=torch.float32).reshape(64, 64) * 0.5,
    lambda: (torch.arange(4096, dtype=torch.float64).reshape(64, 64) - 7).t(),  # not contiguous
    lambda: torch.arange(300, dtype=torch.int64)[::3],
    lambda: torch.arange(512, dtype=torch.float32).to(torch.bfloat16),
])
def test_values_read_from_outside_are_the_tensors_at_the_secret_positions(make):
    expected = make()
    pid, call = _stopped_child_with(make)
    try:
        reader = OutsideReader(pid)
        record = reader.record(call, probe=12345)
        reader.close()
    finally:
        os.kill(pid, signal.SIGKILL)
    assert record.index == 7
    flat = expected.reshape(-1)
    wanted = [float(flat[p]) for p in positions(12345, "output", 0, flat.numel(), OUTPUT_VALUES)]
    assert record.outputs[0].values == wanted
    assert record.outputs[0].shape == list(expected.shape)
    assert len(record.inputs) == 1


def test_a_description_pointing_nowhere_cannot_be_read():
    pid, call = _stopped_child_with(lambda: torch.ones(16))
    try:
        reader = OutsideReader(pid)
        bad = dict(call, o=[[8, "float32", [16], [1]]])
        with pytest.raises(OutsideError, match="cannot be read"):
            reader.record(bad, probe=1)
        with pytest.raises(OutsideError, match="unreadable description"):
            reader.record(dict(call, o=[[call["o"][0][0], "float99", [16], [1]]]), probe=1)
        reader.close()
    finally:
        os.kill(pid, signal.SIGKILL)


def test_the_round_clock_judges_only_gross_excess_where_the_brackets_judged_every_region():
    """The round's empty twin runs in the reference process, whose harness time differs from the candidate's:
    an honest level2_76 (H100) came 8.0 ms over a 6-8 ms round limit while its brackets found every region
    explained. Once the brackets judged, the round decides only a gross excess; without them it decides as before."""
    from types import SimpleNamespace

    from cuda_agent.evaluate.protocol.policy import TimingConfig
    from cuda_agent.evaluate.watchers import Clock

    timing = TimingConfig()
    claimed, empty = [13.764] * 5, [9.318] * 5
    marginal, gross = [31.083] * 5, [80.0] * 5

    def rules(walls, judged):
        result = SimpleNamespace(timing={}, notes=[])
        regions = SimpleNamespace(judged=judged)
        return [b.rule for b in Clock(walls, claimed, empty, 4, timing, result, regions).check("profile", "")], result

    found, result = rules(marginal, judged=False)
    assert found == ["clock"] and result.timing["clock"]["decisive"]
    found, result = rules(marginal, judged=True)
    assert found == [] and not result.timing["clock"]["decisive"] and not result.timing["clock"]["ok"]
    assert "brackets" in result.notes[0]
    assert rules(gross, judged=True)[0] == ["clock"] and rules(gross, judged=False)[0] == ["clock"]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_calibrations_no_op_regions_are_stopped_and_read_between_as_the_rounds_are(device):
    """On a GPU what the brackets are found to cost must include what follows every timed region (the stop,
    the read from outside): calibrated without it, an honest 0.08 ms GPU call sat near its limit and failed
    as `clock`. On the CPU backend it only cost time and loosened the limits: the no-op regions run unread.
    (The worker here is a CPU process either way: only the evaluator's side differs by device.)"""
    from cuda_agent.evaluate.brackets import CALIBRATION_REGIONS, CandidateBrackets

    bell = Bell()
    config = TimingConfig(flush_l2=False)

    def worker() -> None:
        marker = torch.arange(64, dtype=torch.float32)
        count = iter(range(CALIBRATION_REGIONS))
        region: list[int] = []

        def prepare():
            region.append(next(count))
            return lambda: marker

        def after_end() -> bytes:
            described = [describe(index, marker, [marker]) for index in region]
            region.clear()
            return encode_calls(described)
        time_round(prepare, "cpu", config, trials=CALIBRATION_REGIONS, calls=1, after_end=after_end,
                   bell=Ringer(bell.theirs))

    pid = _fork(worker)

    class Worker:  # the sandbox's WorkerProcess, as far as the brackets use it
        stops = resumes = 0

        class proc:
            poll = staticmethod(lambda: None)

        def pause(self, timeout_s: float = 2.0) -> bool:
            os.kill(pid, signal.SIGSTOP)
            self.stops += 1
            return True

        def resume(self) -> None:
            os.kill(pid, signal.SIGCONT)
            self.resumes += 1

    stopped = Worker()
    brackets = CandidateBrackets(bell, device, stopped, outside=True, reader=OutsideReader(pid))
    calibration = brackets.serve_calibration(30)
    assert _exit_status(pid) == 0
    assert calibration is not None and len(calibration) == CALIBRATION_REGIONS
    if device == "cpu":
        assert stopped.stops == stopped.resumes == 0 and brackets.records == []
        brackets.close()
        return
    assert stopped.stops == stopped.resumes == CALIBRATION_REGIONS
    # One call a region read from outside while stopped: the marker's values at the secret positions.
    assert [record.index for _, record in brackets.records] == list(range(CALIBRATION_REGIONS))
    assert all(record.outputs[0].values and all(v == int(v) for v in record.outputs[0].values)
               for _, record in brackets.records)
    brackets.calibrate(calibration, [0.001] * CALIBRATION_REGIONS, 0.0)
    assert brackets.records == []  # the no-op regions' records are not the candidate's
    brackets.close()


def _drawer(values_of):
    """A stand-in for the reference's draw (``reference_process.input_drawer``): every tensor of call ``c`` filled
    with ``values_of(seed)``, packed into a memfd as the reference packs them."""
    import mmap

    from cuda_agent.evaluate.protocol.outside import ITEMSIZE, span_bytes
    from cuda_agent.evaluate.worker.shared import aligned

    asked = []

    def draw(seeds, leaves, send):
        asked.append(list(seeds))
        spans, blobs, total = [], [], 0
        for seed, call in zip(seeds, leaves):
            spans.append([])
            for dtype, shape, strides in call:
                nbytes = span_bytes(shape, strides, ITEMSIZE[dtype])
                blobs.append((total, torch.full((nbytes // 4,), values_of(seed), dtype=torch.float32)))
                spans[-1].append([total, nbytes])
                total += aligned(nbytes)
        fd = os.memfd_create("drawn")
        os.ftruncate(fd, max(total, 1))
        with mmap.mmap(fd, max(total, 1)) as memory:
            for offset, blob in blobs:
                memory[offset:offset + blob.numel() * 4] = blob.numpy().tobytes()
        return spans, max(total, 1), fd
    return draw, asked


def test_a_regions_inputs_are_written_from_outside_while_it_is_stopped_before_go():
    """The prep hole: a region's inputs drawn in the worker from seeds it was told let its code compute their
    outputs before READY. Now the values it is timed on are written from outside after READY, while it is stopped,
    from seeds it never sees; the calls see those values, not their own draw's."""
    from cuda_agent.evaluate.brackets import CandidateBrackets
    from cuda_agent.evaluate.protocol.outside import InputWriter
    from cuda_agent.evaluate.protocol.timing import trial_seed

    bell = Bell()
    seen_read, seen_write = os.pipe()
    config = TimingConfig(flush_l2=False)
    trials, calls = 3, 2

    def worker() -> None:
        count = iter(range(trials * calls))
        region: list[tuple[int, torch.Tensor]] = []
        seen: list[float] = []

        def prepare():
            index = next(count)
            x = torch.full((4096,), -1.0)  # its own draw: what the candidate could compute ahead
            region.append((index, x))
            return lambda: seen.append(float(x.sum()) / x.numel())

        ringer = Ringer(bell.theirs)

        def announce(number: int) -> None:
            ringer.ready(number, encode_calls([describe(index, None, [x]) for index, x in region]))

        def after_end() -> bytes:
            region.clear()
            return b""
        time_round(prepare, "cpu", config, trials=trials, calls=calls, after_end=after_end, bell=ringer,
                   announce=announce)
        os.write(seen_write, repr(seen).encode())

    pid = _fork(worker)
    os.close(seen_write)
    events = []

    class Worker:  # the sandbox's WorkerProcess, as far as the brackets use it
        class proc:
            poll = staticmethod(lambda: None)

        def pause(self, timeout_s: float = 2.0) -> bool:
            os.kill(pid, signal.SIGSTOP)
            events.append("stop")
            return True

        def resume(self) -> None:
            os.kill(pid, signal.SIGCONT)
            events.append("resume")

    draw, asked = _drawer(lambda seed: float(seed % 997))
    brackets = CandidateBrackets(bell, "cpu", Worker())
    brackets.writer = InputWriter(pid, draw, 0)
    brackets.round(0, trials, calls, 30)
    assert _exit_status(pid) == 0
    seen = eval(os.read(seen_read, 1 << 16).decode())  # noqa: S307 - the child's own repr of floats
    expected = [float(trial_seed(brackets.inputs_base, i) % 997) for i in range(trials * calls)]
    assert seen == expected
    assert asked == [[trial_seed(brackets.inputs_base, i) for i in range(r * calls, (r + 1) * calls)]
                     for r in range(trials)]
    assert events == ["stop", "resume"] * trials
    brackets.close()


def test_inputs_are_written_only_into_memory_the_process_could_write_itself():
    """A write through /proc/PID/mem goes through a read-only page as well: a description pointing at one (the
    harness's code, say) is refused, not written."""
    import mmap

    from cuda_agent.evaluate.protocol.outside import InputWriter

    draw, _ = _drawer(lambda seed: 7.0)
    writer = InputWriter(os.getpid(), draw, 1024)
    x = torch.zeros(256)
    written = writer.write([describe(0, None, [x])], [11])
    assert written == x.numel() * 4 and bool((x == 7.0).all())
    frozen = mmap.mmap(-1, 4096, prot=mmap.PROT_READ)
    with pytest.warns(UserWarning, match="not writable"):  # torch's word for the same thing
        address = torch.frombuffer(frozen, dtype=torch.uint8).data_ptr()
    with pytest.raises(OutsideError, match="not memory the process can write itself"):
        writer.write([{"i": 0, "o": [], "in": [[address, "float32", [256], [1]]]}], [11])
    assert bytes(frozen[:16]) == bytes(16)
    with pytest.raises(OutsideError, match="malformed|unreadable"):
        writer.write([{"i": 0, "o": [], "in": [[address, "float32", [256], [1, 2]]]}], [11])
    writer.close()


def _exported(starts_mib: list[int], sent: list) -> tuple:
    """A ``GpuMemory`` holding 2 MiB allocations at ``starts_mib`` MiB from a base address (their descriptors of
    /dev/null), whose reference records what it is asked in ``sent``; the memory, the base, the descriptors."""
    from cuda_agent.evaluate.protocol.outside import GpuMemory
    from cuda_agent.evaluate.protocol.regions import Chunk

    class Reference:  # the reference's side of GpuRemote, as it is asked
        def write(self, *args):
            sent.append(args)

        def keep(self, *args):
            sent.append(args)

    memory = GpuMemory(Reference())
    base = 0x7F0000000000
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in starts_mib]
    memory.take([Chunk(base + start * (1 << 20), 2 << 20, fd) for start, fd in zip(starts_mib, fds)])
    return memory, base, fds


def test_a_gpu_regions_inputs_are_written_by_the_reference_in_the_allocations_exported_at_ready():
    """On a GPU the reference writes the values (``vmm.Importer.write``): the writer hands it the allocations the
    described inputs lie in, as offsets from the lowest (a tensor may span several that follow one another), and
    each tensor's place among them; an input in memory not exported, or across a gap, is refused."""
    from cuda_agent.evaluate.protocol.outside import GpuInputWriter

    sent = []
    mib = 1 << 20
    # Three allocations back to back, one more after a gap of 2 MiB.
    memory, base, fds = _exported([0, 2, 4, 8], sent)
    writer = GpuInputWriter(memory)
    across = [base + mib, "float32", [mib // 2], [1]]  # 2 MiB from the middle of the first: into the second
    alone = [base + 8 * mib, "float16", [4, 8], [8, 1]]
    assert writer.write([{"i": 4, "o": [], "in": [across]}, {"i": 5, "o": [], "in": [alone]}], [41, 42]) == 2 * mib + 64
    (held, handed, sizes, offsets, seeds, leaves), = sent
    assert handed == [fds[0], fds[1], fds[3]] and sizes == [2 * mib] * 3 and offsets == [0, 2 * mib, 8 * mib]
    assert held.ids == [memory.ids[base], memory.ids[base + 2 * mib], memory.ids[base + 8 * mib]]
    assert held.new == [0, 1, 2] and held.drop == []
    assert seeds == [41, 42]
    assert leaves == [[["float32", [mib // 2], [1], mib]], [["float16", [4, 8], [8, 1], 8 * mib]]]
    over_the_gap = [base + 5 * mib, "float32", [mib // 2], [1]]
    with pytest.raises(OutsideError, match="not in the GPU memory"):
        writer.write([{"i": 6, "o": [], "in": [over_the_gap]}], [43])
    with pytest.raises(OutsideError, match="not in the GPU memory"):
        writer.write([{"i": 6, "o": [], "in": [[base - 64, "float32", [4], [1]]]}], [43])
    assert len(sent) == 1
    # The next region's: the reference holds those three already; only the one not handed over yet is sent.
    writer.write([{"i": 7, "o": [], "in": [across, [base + 4 * mib, "float32", [8], [1]]]}], [44])
    held, handed = sent[-1][:2]
    assert held.ids == [memory.ids[base + i * mib] for i in (0, 2, 4)] and held.new == [2] and handed == [fds[2]]
    memory.close()


def test_a_gpu_calls_output_is_kept_by_the_reference_from_the_allocations_it_lies_in():
    """The round's last output (the evaluation's last timed call, checked whole) is copied by the reference out of
    the exported allocations (``GpuMemory.keep``), never handed over by the candidate's code; an output over the
    limit is not kept (handed over as before), one in memory not exported is refused."""
    sent = []
    mib = 1 << 20
    memory, base, fds = _exported([0, 2], sent)
    call = {"i": 9, "o": [[base + mib, "float32", [mib // 2], [1]], [base + 3 * mib, "float16", [2, 4], [4, 1]]],
            "in": []}
    assert memory.keep(call, 4 * mib) == 2 * mib + 16
    (held, handed, sizes, offsets, leaves, index), = sent
    assert handed == fds and sizes == [2 * mib] * 2 and offsets == [0, 2 * mib] and index == 9
    assert leaves == [["float32", [mib // 2], [1], mib], ["float16", [2, 4], [4, 1], 3 * mib]]
    assert memory.keep(call, 2 * mib) is None and len(sent) == 1
    with pytest.raises(OutsideError, match="not in the GPU memory"):
        memory.keep({"i": 9, "o": [[base + 3 * mib, "float32", [mib], [1]]], "in": []}, 8 * mib)
    with pytest.raises(OutsideError, match="malformed|unreadable"):
        memory.keep({"i": 9, "o": [[base, "float32", [4], [1, 1]]], "in": []}, 8 * mib)
    assert len(sent) == 1
    memory.close()


def test_a_checked_output_is_copied_by_the_reference_while_the_process_is_stopped():
    """A check's output on a GPU (``RunRequest.outside``): the worker describes it and sends the allocations it lies
    in through the brackets (``CHECK_REGION``); the evaluator takes them, stops the process, has the reference copy
    the output out of them and lets it go on. Memory the worker could not export, an output outside what it sent,
    or no datagram at all fail the check by name, and the process is let go on either way."""
    from cuda_agent.evaluate.brackets import CandidateBrackets
    from cuda_agent.evaluate.protocol.channel import Stop
    from cuda_agent.evaluate.protocol.regions import CHECK_REGION

    sent, events = [], []
    mib = 1 << 20
    memory, base, fds = _exported([], sent)

    class Worker:  # the sandbox's WorkerProcess, as far as the brackets use it
        class proc:
            poll = staticmethod(lambda: None)

        def pause(self, timeout_s: float = 2.0) -> bool:
            events.append("stop")
            return True

        def resume(self) -> None:
            events.append("resume")

    bell = Bell(chunked=True)
    brackets = CandidateBrackets(bell, "cuda", Worker(), reader=memory, outside=True)
    assert brackets.copies_checks
    ringer = Ringer(bell.theirs)
    output = [base + mib, "float32", [mib // 4], [1]]
    ringer.chunks(CHECK_REGION, [(base, 2 * mib)], [os.open("/dev/null", os.O_RDONLY)], 0)
    brackets.keep_checked({"i": 0, "o": [output], "in": []}, 5.0)
    (held, handed, sizes, offsets, leaves, index), = sent
    assert len(handed) == 1 and sizes == [2 * mib] and offsets == [0] and leaves == [["float32", [mib // 4], [1], mib]]
    assert events == ["stop", "resume"]
    # The next check's output in the same allocation: nothing new to send, nothing handed again.
    ringer.chunks(CHECK_REGION, [], [], 0)
    brackets.keep_checked({"i": 0, "o": [output], "in": []}, 5.0)
    assert sent[-1][0].new == [] and sent[-1][1] == [] and events[-2:] == ["stop", "resume"]
    ringer.chunks(CHECK_REGION, [], [], 0)
    with pytest.raises(Stop) as outside:
        brackets.keep_checked({"i": 0, "o": [[base + 4 * mib, "float32", [4], [1]]], "in": []}, 5.0)
    assert outside.value.rule == "output-memory" and "not in the GPU memory" in outside.value.reason
    assert events[-2:] == ["stop", "resume"]
    ringer.chunks_failed(CHECK_REGION, "cuMemRetainAllocationHandle: CUresult 1")
    with pytest.raises(Stop) as unexported:
        brackets.keep_checked({"i": 0, "o": [output], "in": []}, 5.0)
    assert unexported.value.rule == "output-memory" and "CUresult 1" in unexported.value.reason
    with pytest.raises(Stop) as silent:
        brackets.keep_checked({"i": 0, "o": [output], "in": []}, 0.2)
    assert silent.value.rule == "forged-reply"
    assert len(sent) == 2
    brackets.close()


def test_the_worker_describes_a_checked_output_and_sends_its_allocations_through_the_brackets():
    """The worker's side of ``RunRequest.outside``: the output described (no bytes), the allocations its tensors span
    exported and sent numbered ``CHECK_REGION``, the output kept alive until the next request; an export that fails
    says why on the brackets, where the evaluator reads it as the output's memory."""
    from cuda_agent.evaluate.worker.candidate_side import CandidateSide
    from cuda_agent.evaluate.protocol.regions import BellUnreadable
    from cuda_agent.evaluate.protocol.vmm import VmmError

    class Exporter:
        def __init__(self, fail: bool = False):
            self.fail, self.spans = fail, []

        def export(self, spans):
            self.spans.append(spans)
            if self.fail:
                raise VmmError("cuMemExportToShareableHandle: CUresult 101")
            return [(spans[0][0] & ~0xFFFFF, 2 << 20)], [os.open("/dev/null", os.O_RDONLY)], 1

    bell = Bell(chunked=True)
    side = CandidateSide()
    side.ringer, side.exporter = Ringer(bell.theirs), Exporter()
    output = (torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.float16))
    described = side._export_checked(output)
    assert described["o"] == [[t.data_ptr(), str(t.dtype).removeprefix("torch."), list(t.shape), list(t.stride())]
                              for t in output] and described["in"] == []
    assert side.checked_output is output
    start = output[0].data_ptr()
    assert (start, start + 24) in side.exporter.spans[0]
    chunks = bell.checked_chunks(2.0, lambda: True)
    assert [(c.base, c.size) for c in chunks] == [(start & ~0xFFFFF, 2 << 20)]
    for chunk in chunks:
        os.close(chunk.fd)
    side.exporter = Exporter(fail=True)
    side._export_checked(output)
    with pytest.raises(BellUnreadable, match="CUresult 101"):
        bell.checked_chunks(2.0, lambda: True)
    bell.close()


@pytest.mark.parametrize("from_let_go", [True, False])
def test_work_after_the_let_go_counts_in_the_regions_cpu_time_on_the_cpu_backend(from_let_go):
    """Between the let-go (inputs written, the worker resumed) and GO the worker's code could compute on the written
    values outside the bracket. On the CPU backend the timing thread's CPU time is counted from the let-go, read
    while the worker is still stopped: 3 ms of CPU spent there on the written values show in the region's CPU time."""
    from cuda_agent.evaluate.brackets import CandidateBrackets
    from cuda_agent.evaluate.protocol.outside import InputWriter
    from cuda_agent.sandbox.proctree import process_state

    bell = Bell()
    config = TimingConfig(flush_l2=False)
    trials, calls = 3, 1

    def worker() -> None:
        count = iter(range(trials * calls))
        region: list[tuple[int, torch.Tensor]] = []

        def prepare():
            index = next(count)
            x = torch.full((4096,), -1.0)
            region.append((index, x))
            return lambda: float(x.sum())

        ringer = Ringer(bell.theirs)

        def announce(number: int) -> None:
            ringer.ready(number, encode_calls([describe(index, None, [x]) for index, x in region]))
            while float(region[-1][1][0]) == -1.0:  # until the evaluator has written the values
                pass
            spent = time.thread_time() + 0.003
            while time.thread_time() < spent:  # 3 ms of CPU on them, before GO
                pass

        def after_end() -> bytes:
            region.clear()
            return b""
        time_round(prepare, "cpu", config, trials=trials, calls=calls, after_end=after_end, bell=ringer,
                   announce=announce)

    pid = _fork(worker)

    class Worker:
        class proc:
            poll = staticmethod(lambda: None)

        def pause(self, timeout_s: float = 2.0) -> bool:
            os.kill(pid, signal.SIGSTOP)
            while process_state(pid) not in ("T", "t"):  # stopped: its CPU time read at the let-go is exact
                time.sleep(0.0005)
            return True

        def resume(self) -> None:
            os.kill(pid, signal.SIGCONT)

    draw, _ = _drawer(lambda seed: float(seed % 997))
    brackets = CandidateBrackets(bell, "cpu", Worker(), thread=thread_times(pid))
    bell.cpu_from_let_go = from_let_go
    brackets.writer = InputWriter(pid, draw, 0)
    found = brackets.round(0, trials, calls, 30)
    assert _exit_status(pid) == 0
    # The let-go's own CPU time is kept either way (a GPU judges it apart: ``region_clock.judge``). GO waits at most
    # ``SETTLE_S`` for the worker to sleep: on a loaded host the 3 ms spin outlasts that, and the rest of it lands in
    # the region, so the two together hold it all.
    times = [(b.let_go_cpu_ns, b.cpu_ns) for b in found]
    assert all(let_go >= 1e6 and let_go + cpu >= 2.9e6 for let_go, cpu in times), times
    if from_let_go:
        assert all(b.cpu_ns >= 2.9e6 for b in found), times
    else:
        assert all(b.cpu_ns < 2.9e6 for b in found), times
    brackets.close()
