"""Memory both evaluation processes map, so a candidate's outputs reach the reference without files.

The reference creates it (a sealed ``memfd``, sized from its own expected output) and sends the
descriptor over a Unix socket; the candidate maps the same pages and copies its outputs in; the
reference snapshots them before comparing. On a GPU both mappings are page-locked
(``cudaHostRegister``), so the copies run at DMA speed: a 1 GiB output costs about two 20-40 ms
copies instead of a file written and read back. Sealing keeps the candidate from shrinking the
memory under the reference's mapping (which would crash the trusted process).
"""

from __future__ import annotations

import fcntl
import mmap
import os
from typing import Any

ALIGN = 256  # every tensor starts at a multiple of this: any dtype's view lines up


class SharedError(RuntimeError):
    pass


def packed_size(nbytes: list[int]) -> int:
    """Bytes for tensors of these sizes laid out one after another, each aligned."""
    return sum(aligned(n) for n in nbytes)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class SharedBuffer:
    """``nbytes`` of shared memory as a flat uint8 tensor (``host``), page-locked on a GPU machine."""

    def __init__(self, fd: int, nbytes: int, device: str):
        import torch

        self.fd, self.nbytes, self.device = fd, nbytes, device
        self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.host = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = False
        if device == "cuda":
            # Registration pins the pages (faulting them in): seconds for tens of GB, so only
            # when the copies it speeds up are on the device.
            status = torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), nbytes, 0)
            self.pinned = int(status) == 0

    @classmethod
    def create(cls, nbytes: int, device: str) -> "SharedBuffer":
        if nbytes <= 0:
            raise SharedError("a shared buffer needs at least one byte")
        fd = os.memfd_create("cuda-agent-outputs", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            return cls(fd, nbytes, device)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, nbytes: int, device: str) -> "SharedBuffer":
        """Map a buffer the other process created; refuses one that could shrink under us."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            os.close(fd)
            raise SharedError(f"the handed-over descriptor is not a sealed memfd ({exc})") from None
        if not seals & fcntl.F_SEAL_SHRINK or os.fstat(fd).st_size < nbytes:
            os.close(fd)
            raise SharedError("the handed-over memory is not sealed against shrinking, or smaller than announced")
        return cls(fd, nbytes, device)

    def view(self, offset: int, nbytes: int) -> Any:
        """The bytes at ``offset``; an error (never an out-of-bounds view) for a bad range."""
        if not isinstance(offset, int) or offset < 0 or offset % ALIGN or offset + nbytes > self.nbytes:
            raise SharedError(f"bytes {offset}..{offset}+{nbytes} are outside the shared buffer of {self.nbytes}")
        return self.host[offset:offset + nbytes]

    def close(self) -> None:
        import torch

        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
            self.pinned = False
        self.host = None
        try:
            self._map.close()
        except BufferError:  # a tensor still views it: the mapping goes with the process
            pass
        os.close(self.fd)
