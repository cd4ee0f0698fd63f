"""Probe (issue 31): can a process the candidate cannot reach read the candidate's GPU output memory, across
the sandbox's namespaces? Two sandboxed processes (bubblewrap, --unshare-all): the exporter allocates a
tensor, the importer reads it. Tried: (1) a VMM allocation of the exporter's own (cuMemCreate, POSIX file
descriptor handle) passed as a descriptor through this process; (2) the same for memory torch's caching
allocator gave a tensor under expandable segments (cuMemRetainAllocationHandle on its address); (3) torch's
legacy CUDA IPC handle (cudaIpcGetMemHandle), known to need one PID namespace. Prints one line per way."""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

CHILD = r'''
import ctypes, json, os, socket, sys, array
import torch
role, fd = sys.argv[1], int(sys.argv[2])
sock = socket.socket(fileno=fd)
cu = ctypes.CDLL("libcuda.so.1")
u64 = ctypes.c_uint64
def check(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")
def send(obj, fds=()):
    sock.sendmsg([json.dumps(obj).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else [])
def recv():
    fds = array.array("i")
    msg, anc, _, _ = sock.recvmsg(1 << 16, socket.CMSG_LEN(16 * fds.itemsize))
    for level, kind, data in anc:
        fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return json.loads(msg), list(fds)
class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("compressionType", ctypes.c_ubyte),
                ("gpuDirectRDMACapable", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]
class Access(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]
torch.cuda.init(); torch.zeros(1, device="cuda")
if role == "export":
    results = {}
    # (1) own VMM allocation
    try:
        prop = Prop(); prop.type = 1; prop.requestedHandleTypes = 1; prop.location = Location(1, 0)
        gran = ctypes.c_size_t(); check(cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0), "granularity")
        size = gran.value; handle = u64()
        check(cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), u64(0)), "cuMemCreate")
        va = u64(); check(cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0), u64(0), u64(0)), "reserve")
        check(cu.cuMemMap(va, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, u64(0)), "map")
        acc = Access(Location(1, 0), 3); check(cu.cuMemSetAccess(va, ctypes.c_size_t(size), ctypes.byref(acc), ctypes.c_size_t(1)), "access")
        host = (ctypes.c_float * 1024)(*[i * 0.25 for i in range(1024)])
        check(cu.cuMemcpyHtoD_v2(va, host, ctypes.c_size_t(4096)), "htod")
        fd_out = ctypes.c_int(-1)
        check(cu.cuMemExportToShareableHandle(ctypes.byref(fd_out), handle, 1, u64(0)), "export")
        send({"way": "own-vmm", "size": size, "offset": 0, "n": 1024, "scale": 0.25}, [fd_out.value])
    except Exception as exc:
        send({"way": "own-vmm", "error": str(exc)})
    # (2) torch's expandable segment
    try:
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 0.5
        torch.cuda.synchronize()
        ptr = x.data_ptr(); handle = u64()
        check(cu.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)), "retain")
        base = u64(); size = ctypes.c_size_t()
        r = cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), u64(ptr))
        fd_out = ctypes.c_int(-1)
        check(cu.cuMemExportToShareableHandle(ctypes.byref(fd_out), handle, 1, u64(0)), "export")
        send({"way": "torch-expandable", "size": size.value, "offset": ptr - base.value, "range_result": r, "n": 1024, "scale": 0.5,
              "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}, [fd_out.value])
    except Exception as exc:
        send({"way": "torch-expandable", "error": str(exc), "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")})
    # (3) legacy IPC
    try:
        y = torch.arange(1024, device="cuda", dtype=torch.float32) * 2.0
        torch.cuda.synchronize()
        shared = y.untyped_storage()._share_cuda_()
        send({"way": "legacy-ipc", "handle": [v.hex() if isinstance(v, bytes) else v for v in shared], "n": 1024, "scale": 2.0})
    except Exception as exc:
        send({"way": "legacy-ipc", "error": str(exc)})
    recv()  # hold everything until the importer is done
else:
    for _ in range(3):
        info, fds = recv()
        out = {"way": info["way"]}
        try:
            if "error" in info:
                raise RuntimeError("exporter: " + info["error"])
            if info["way"] == "legacy-ipc":
                h = [bytes.fromhex(v) if isinstance(v, str) and i in (1, 3, 7) else v for i, v in enumerate(info["handle"])]
                storage = torch.UntypedStorage._new_shared_cuda(*h)
                t = torch.tensor([], dtype=torch.float32, device="cuda").set_(storage, 0, (info["n"],), (1,))
                values = t[:8].tolist()
            else:
                handle = u64()
                check(cu.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fds[0]), 1), "import")
                size = info["size"]; va = u64()
                check(cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0), u64(0), u64(0)), "reserve")
                check(cu.cuMemMap(va, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, u64(0)), "map")
                acc = Access(Location(1, 0), 3)
                check(cu.cuMemSetAccess(va, ctypes.c_size_t(size), ctypes.byref(acc), ctypes.c_size_t(1)), "access")
                host = (ctypes.c_float * 8)()
                check(cu.cuMemcpyDtoH_v2(host, u64(va.value + info["offset"]), ctypes.c_size_t(32)), "dtoh")
                values = list(host)
            out.update(ok=values == [i * info["scale"] for i in range(8)], values=values[:4])
        except Exception as exc:
            out.update(ok=False, error=str(exc)[:300])
        print(json.dumps(out), flush=True)
    send({"done": True})
'''


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from cuda_agent.sandbox import Limits, make_sandbox
    from cuda_agent.paths import PACKAGE_ROOT

    sandbox = make_sandbox("auto")
    home = Path(tempfile.mkdtemp())
    (home / "child.py").write_text(CHILD)
    procs, ours = [], []
    for role in ("export", "import"):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True") if role == "export" else dict(os.environ)
        procs.append(sandbox.spawn([sys.executable, str(home / "child.py"), role, str(theirs.fileno())], cwd=home, env=env,
                                   limits=Limits(timeout_s=120), gpu=True, pass_fds=(theirs.fileno(),), writable=[home],
                                   readable=[PACKAGE_ROOT]))
        theirs.close()
        ours.append(mine)
    export, imp = ours
    import array
    for _ in range(3):  # relayed through this process, as the evaluator would
        fds = array.array("i")
        msg, anc, _, _ = export.recvmsg(1 << 16, socket.CMSG_LEN(16 * fds.itemsize))
        for level, kind, data in anc:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        imp.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)] if len(fds) else [])
        for fd in fds:
            os.close(fd)
    imp.recv(1 << 16)
    export.send(b'{"done": true}')
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        print(out.decode(errors="replace")[-3000:])


if __name__ == "__main__":
    main()
