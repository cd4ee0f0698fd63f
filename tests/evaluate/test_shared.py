"""Outputs handed over in shared memory: the reference creates and seals it, the candidate writes."""

import errno
import os
import socket

import pytest
import torch

from cuda_agent.evaluate.worker.shared import ALIGN, SharedBuffer, SharedError, packed_size
from cuda_agent.evaluate.worker.transfer import TransferError, read_outputs, write_outputs
from cuda_agent.sandbox.process import receive_fd, send_fd


def handed_over(created: SharedBuffer) -> SharedBuffer:
    """The candidate's mapping of ``created``, reached the way the processes reach it: a socket."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        send_fd(ours, created.fd)
        return SharedBuffer.attach(receive_fd(theirs, 5), created.nbytes, "cpu")


def test_outputs_written_by_one_mapping_are_read_from_the_other(tmp_path):
    output = (torch.randn(3, 5), {"b": torch.arange(7, dtype=torch.int64)}, 2.5)
    reference = SharedBuffer.create(packed_size([60, 56]), "cpu")
    candidate = handed_over(reference)
    manifest = write_outputs(output, tmp_path / "out", candidate)
    assert [leaf["offset"] for leaf in (manifest["items"][0], manifest["items"][1]["items"][0])] == [0, ALIGN]
    assert not (tmp_path / "out").exists()  # nothing went through files
    back = read_outputs(manifest, tmp_path / "out", "cpu", reference)
    assert torch.equal(back[0], output[0]) and torch.equal(back[1]["b"], output[1]["b"]) and back[2] == 2.5
    candidate.host.fill_(0)  # the candidate writing afterwards cannot change what was read
    assert torch.equal(back[0], output[0])


def test_an_output_larger_than_the_shared_memory_goes_through_files(tmp_path):
    reference = SharedBuffer.create(packed_size([16]), "cpu")
    candidate = handed_over(reference)
    manifest = write_outputs(torch.ones(1000), tmp_path / "out", candidate)
    assert "file" in manifest and "offset" not in manifest
    assert torch.equal(read_outputs(manifest, tmp_path / "out", "cpu", reference), torch.ones(1000))


def test_the_candidate_cannot_shrink_the_memory_under_the_reference():
    candidate = handed_over(SharedBuffer.create(1 << 20, "cpu"))
    with pytest.raises(PermissionError):
        os.ftruncate(candidate.fd, 0)


@pytest.mark.parametrize("offset,nbytes", [(-ALIGN, 8), (ALIGN, 1 << 20), (3, 8), (1 << 20, 1)])
def test_manifest_ranges_outside_the_shared_memory_are_refused(tmp_path, offset, nbytes):
    reference = SharedBuffer.create(1 << 20, "cpu")
    manifest = {"kind": "tensor", "offset": offset, "dtype": "uint8", "shape": [nbytes], "device": "cpu"}
    with pytest.raises(TransferError, match="outside the shared buffer"):
        read_outputs(manifest, tmp_path, "cpu", reference)


def test_a_manifest_naming_shared_memory_when_none_was_shared_is_refused(tmp_path):
    manifest = {"kind": "tensor", "offset": 0, "dtype": "float32", "shape": [2], "device": "cpu"}
    with pytest.raises(TransferError, match="none was shared"):
        read_outputs(manifest, tmp_path, "cpu", None)


def test_attach_refuses_memory_that_could_shrink():
    unsealed = os.memfd_create("plain")
    os.ftruncate(unsealed, 4096)
    with pytest.raises(SharedError, match="not sealed"):
        SharedBuffer.attach(unsealed, 4096, "cpu")
    read_end, write_end = os.pipe()
    os.close(write_end)
    with pytest.raises(SharedError, match="not a sealed memfd"):
        SharedBuffer.attach(read_end, 4096, "cpu")
    with pytest.raises(OSError) as closed:
        os.fstat(read_end)  # attach closed what it refused
    assert closed.value.errno == errno.EBADF


def test_receive_fd_times_out_naming_the_wait():
    ours, theirs = socket.socketpair()
    with ours, theirs, pytest.raises(TimeoutError):
        receive_fd(theirs, 0.2)
