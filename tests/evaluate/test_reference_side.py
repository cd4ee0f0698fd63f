"""The reference process's side of the protocol, run in this process: the precision
allowance (the tolerance widens to the baselines' own error under their flags)."""

from __future__ import annotations

import os

import pytest

from cuda_agent.evaluate.worker.transfer import write_outputs
from cuda_agent.evaluate.worker.loop import ReferenceSide, pin_precision

torch = pytest.importorskip("torch")

# Under "TF32 on" this Model's arithmetic errs by about 3x the fair tolerance, standing in for
# a TF32 convolution on a GPU (the flag can be set on any machine; only CUDA kernels read it).
FLAG_SENSITIVE_TASK = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        y = 2 * x
        if torch.backends.cuda.matmul.allow_tf32:
            y = y + 3e-3 * y.pow(2).mean().sqrt() * torch.sin(1000 * x)
        return y


def get_inputs():
    return [torch.randn(256, 256)]


def get_init_inputs():
    return []
'''
TOLERANCE = {"atol": 1e-3, "rtol": 1e-3, "scale": True}


@pytest.fixture
def reference(tmp_path):
    (tmp_path / "task.py").write_text(FLAG_SENSITIVE_TASK)
    side = ReferenceSide()
    side.handle("load", {"task_file": str(tmp_path / "task.py"), "task_name": "flags", "task_source": "task.py",
                         "device": "cpu", "tf32": "on", "init_seed": 1, "state_dict_path": str(tmp_path / "sd.pt")})
    yield side
    pin_precision("off")


def candidate_output(reference, seed, error, tmp_path):
    """The strict answer plus an error of ``error`` times the fair tolerance, written as a candidate would."""
    (x,) = reference.inputs(seed)
    truth = 2 * x
    out = truth + error * 1e-3 * truth.pow(2).mean().sqrt() * torch.cos(999 * x).sign()
    directory = tmp_path / f"out-{seed}-{error}"
    return {"dir": str(directory), "manifest": write_outputs(out, directory), **TOLERANCE}


@pytest.mark.parametrize("slack, error, passes", [(2.0, 4.0, True), (0.0, 4.0, False), (2.0, 12.0, False)])
def test_tolerance_widens_to_the_baselines_own_error(reference, tmp_path, slack, error, passes):
    reply = reference.handle("expect", {"seed": 7, "strict": True, "slack": slack, **TOLERANCE})
    if slack:
        assert 4.0 < reply["allowance"] < 8.0  # 2 x about 3
    else:
        assert reply["allowance"] == 1.0
    (report,) = reference.handle("compare", candidate_output(reference, 7, error, tmp_path))["reports"]
    assert report["ok"] is passes, report


def test_the_expected_call_says_its_inputs_and_outputs_bytes(reference):
    """What a timed call keeps alive, from the reference's own draw and output: it caps a region's calls."""
    reply = reference.handle("expect", {"seed": 5, "strict": False, "slack": 1.0, **TOLERANCE})
    inputs = reference.inputs(5)
    assert reply["input_bytes"] == sum(t.numel() * t.element_size() for t in inputs) > 0
    assert reply["output_bytes"] == reference.expected.numel() * reference.expected.element_size() > 0


def test_no_allowance_when_the_truth_uses_the_baselines_flags(reference):
    assert reference.handle("expect", {"seed": 3, "strict": False, "slack": 2.0, **TOLERANCE})["allowance"] == 1.0


def test_a_sampled_output_is_kept_for_the_next_and_compared_with_it_whole(reference, tmp_path):
    """The run-again check (unwatched-compute): a candidate output read at a record's positions, and two
    runs compared in every element, so that a candidate whose results vary is told apart."""
    same = candidate_output(reference, 7, 0.0, tmp_path)
    other = candidate_output(reference, 7, 1.0, tmp_path)

    def sample(output, keep=False):
        return reference.handle("sample", {"dir": output["dir"], "manifest": output["manifest"], "probe": 3,
                                           "keep": keep})

    first = sample(same, keep=True)
    assert "same_as_kept" not in first and len(first["outputs"][0]["values"]) == 16
    second = sample(same)
    assert second["same_as_kept"] is True and second["outputs"] == first["outputs"] and reference.kept is None
    sample(same, keep=True)
    assert sample(other)["same_as_kept"] is False and "same_as_kept" not in sample(other)


HUGE_TASK = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(1 << 17, 1 << 17)]  # 64 GiB


def get_init_inputs():
    return []
"""


def test_a_task_bigger_than_the_memory_limit_is_refused_before_anything_is_allocated(tmp_path):
    from cuda_agent.tasks import TaskError

    (tmp_path / "task.py").write_text(HUGE_TASK)
    request = {"task_file": str(tmp_path / "task.py"), "task_name": "huge", "task_source": "huge.py", "device": "cpu",
               "tf32": "off", "init_seed": 1, "state_dict_path": str(tmp_path / "sd.pt"), "memory_limit": 4 * 1024**3}
    with pytest.raises(TaskError, match=r"huge.py: needs at least 128.0 GiB .* 4.0 GiB .*--memory-limit"):
        ReferenceSide().handle("load", request)
    # A task that fits is loaded as before under the same limit.
    (tmp_path / "task.py").write_text(FLAG_SENSITIVE_TASK)
    assert ReferenceSide().handle("load", request | {"tf32": "on"})["parameters"] == 0
    pin_precision("off")


def test_inputs_are_drawn_for_the_evaluator_in_the_layout_the_candidate_described(reference):
    """The values a candidate's timed call is given come from the reference's draw of the evaluator's seed
    (outside.InputWriter): packed into a memfd handed over on the descriptor channel, each tensor's span as the
    candidate described its own; a description that is not what the task draws is said in the reply."""
    import mmap
    import socket

    from cuda_agent.sandbox.process import receive_fd

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    reference.fd_socket = theirs
    layout = [["float32", [256, 256], [256, 1]]]
    reply = reference.handle("draw", {"seeds": [5, 6], "leaves": [layout, layout], "send": True})
    assert reply["grown"] and not reply.get("error")
    fd = receive_fd(ours, 5)
    with mmap.mmap(fd, reply["bytes"], mmap.MAP_SHARED, mmap.PROT_READ) as memory:
        for seed, [[offset, nbytes]] in zip([5, 6], reply["spans"]):
            assert nbytes == 256 * 256 * 4
            drawn = torch.frombuffer(bytearray(memory[offset:offset + nbytes]), dtype=torch.float32).view(256, 256)
            assert torch.equal(drawn, reference.inputs(seed)[0])
    os.close(fd)
    again = reference.handle("draw", {"seeds": [7], "leaves": [layout]})
    assert not again["grown"]  # the memory the evaluator maps already holds it
    for wrong in ([["float32", [256, 128], [128, 1]]], [["float64", [256, 256], [256, 1]]], [], layout * 2):
        refused = reference.handle("draw", {"seeds": [5], "leaves": [wrong]})
        assert refused["error"] and refused["spans"] == []
    ours.close()
    theirs.close()


def test_the_reference_says_whether_its_task_draws_differ_in_values_alone(tmp_path):
    shaped = FLAG_SENSITIVE_TASK.replace("torch.randn(256, 256)", "torch.randn(int(torch.randint(1, 10**6, ())), 4)")
    answers = []
    for name, code in (("fixed", FLAG_SENSITIVE_TASK), ("shaped", shaped)):
        (tmp_path / f"{name}.py").write_text(code)
        side = ReferenceSide()
        reply = side.handle("load", {"task_file": str(tmp_path / f"{name}.py"), "task_name": name,
                                     "task_source": f"{name}.py", "device": "cpu", "tf32": "off", "init_seed": 1,
                                     "state_dict_path": str(tmp_path / f"{name}.pt")})
        answers.append(reply.get("fixed_inputs"))
    assert answers == [True, False]


def test_the_candidates_gpu_memory_held_for_an_evaluation_is_released_when_it_ends_not_before(reference):
    """``release`` comes twice in an evaluation on a GPU: before timing (holding little memory) and at its end;
    only the last one lets go of the candidate's allocations the reference keeps mapped (``vmm.Importer``)."""
    class Held:
        forgotten = 0

        def forget(self):
            self.forgotten += 1
            return 3
    reference.importer = Held()
    reference.handle("release", {})
    assert reference.importer.forgotten == 0
    reference.handle("release", {"ended": True})
    assert reference.importer.forgotten == 1


def test_gpu_requests_take_the_descriptors_handed_over_and_close_them_once_answered(reference):
    """``read_gpu`` and ``keep_gpu`` receive the descriptors of allocations the reference does not hold yet, map
    through its importer (a test double of ``vmm.Importer`` here), close them once answered, and answer what the
    importer refuses as an error (the candidate's doing), not by raising."""
    import socket

    from cuda_agent.evaluate.protocol.vmm import VmmError
    from cuda_agent.sandbox.process import send_fd

    class Importer:
        def __init__(self):
            self.held, self.copied, self.refuse = [], [], False

        def hold(self, ids, sizes, new, fds, drop):
            self.held.append((ids, list(fds)))
            return [(0x1000 * (i + 1), size) for i, size in enumerate(sizes)]

        def read(self, mapped, reads, apart_s):
            if self.refuse:
                raise VmmError("a read of 4 bytes at 0 lies outside the allocations handed over")
            return [b"\x00\x00\x80\x3f"] * len(reads), []

        def copy_out(self, mapped, offsets, copies):
            self.copied.append((mapped, offsets, [(at, nbytes) for _, at, nbytes in copies]))

        def forget(self):
            return len(self.held)

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    reference.fd_socket = theirs
    reference.importer = importer = Importer()
    held = {"ids": [7], "new": [0], "drop": []}
    send_fd(ours, os.open("/dev/null", os.O_RDONLY))
    reply = reference.handle("read_gpu", {"held": held, "sizes": [2 << 20], "reads": [[0, 16, 4]], "apart_s": 0.0})
    assert reply["data"] == ["0000803f"] and reply["changed"] == [] and not reply.get("error")
    (ids, (fd,)), = importer.held
    with pytest.raises(OSError):
        os.fstat(fd)  # closed once answered
    importer.refuse = True
    refused = reference.handle("read_gpu", {"held": {"ids": [7], "new": [], "drop": []}, "sizes": [2 << 20],
                                            "reads": [[0, 0, 4]], "apart_s": 0.0})
    assert refused["error"].startswith("a read of 4 bytes") and refused["data"] == []
    send_fd(ours, os.open("/dev/null", os.O_RDONLY))
    kept = reference.handle("keep_gpu", {"held": held, "sizes": [2 << 20], "offsets": [0], "call": 24,
                                         "leaves": [["float32", [2, 3], [3, 1], 64]]})
    assert kept == {} and importer.copied == [([(0x1000, 2 << 20)], [0], [(64, 24)])]
    assert [tuple(t.shape) for t in reference.kept_output] == [(2, 3)]
    with pytest.raises(OSError):
        os.fstat(importer.held[-1][1][0])
    reference.handle("release", {"ended": True})
    assert reference.kept_output is None
    ours.close()
    theirs.close()
