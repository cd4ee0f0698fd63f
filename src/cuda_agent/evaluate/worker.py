"""Entry point of the two evaluation processes (``python -m cuda_agent.evaluate.worker``).

``--role reference`` runs only the pristine task program: it writes the state
dict, times the baselines and holds the expected outputs, which never leave it.
``--role candidate`` imports the candidate's code and runs it on inputs it
regenerates from seeds it learns only at call time. Requests and replies are
JSON lines on private pipes; whatever the code under test prints goes to the
captured stdout/stderr instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

from cuda_agent.evaluate.compare import compare_outputs
from cuda_agent.evaluate.policy import TimingConfig
from cuda_agent.evaluate.timing import measure
from cuda_agent.evaluate.transfer import TransferError, manifest_devices, read_outputs, write_outputs
from cuda_agent.tasks.task import Task, TaskError, describe_inputs, exec_task_module


class CandidateFault(Exception):
    """The candidate broke a rule of the harness (not a Python error of its own)."""


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def pin_precision(allow_tf32: bool) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("high" if allow_tf32 else "highest")


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def make_inputs(module: types.ModuleType, seed: int, device: str, source: str) -> list[Any]:
    """``get_inputs()`` under ``seed``, created on ``device`` (fast for large inputs, and
    identical in both processes because both use the same generator on the same device)."""
    import torch

    seed_everything(seed)
    with torch.device(device):
        values = module.get_inputs()
    values = describe_inputs(values, source, "get_inputs")
    return [v.to(device) if isinstance(v, torch.Tensor) else v for v in values]


def init_inputs(module: types.ModuleType, seed: int, source: str) -> list[Any]:
    seed_everything(seed)
    values = module.get_init_inputs()
    if not isinstance(values, (list, tuple)):
        raise TaskError(f"{source}: get_init_inputs() must return a list, got {type(values).__name__}.")
    return list(values)


def fingerprint(values: list[Any]) -> list[Any]:
    """A cheap summary that tells whether both processes saw the same inputs."""
    import torch

    prints: list[Any] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            data = value.detach()
            as_float = data.double() if (data.is_floating_point() or not data.is_complex()) else data.abs().double()
            prints.append([list(data.shape), str(data.dtype), float(as_float.sum()), float((as_float * as_float).sum())])
        else:
            prints.append(repr(value))
    return prints


def leaf_devices(value: Any) -> list[str]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value.device.type]
    if isinstance(value, (list, tuple)):
        return [d for v in value for d in leaf_devices(v)]
    if isinstance(value, dict):
        return [d for v in value.values() for d in leaf_devices(v)]
    return []


class _Side:
    device = "cpu"
    task_module: types.ModuleType
    model: Any
    source = "task"

    def load_task(self, msg: dict[str, Any]) -> None:
        self.device = msg["device"]
        pin_precision(msg["allow_tf32"])
        task = Task(name=msg["task_name"], code=Path(msg["task_file"]).read_text(), source=msg["task_source"])
        self.source = task.source
        self.task_module = exec_task_module(task)
        self.init_args = init_inputs(self.task_module, msg["init_seed"], task.source)

    def inputs(self, seed: int) -> list[Any]:
        return make_inputs(self.task_module, seed, self.device, self.source)


class ReferenceSide(_Side):
    expected: Any = None

    def handle(self, op: str, msg: dict[str, Any]) -> dict[str, Any]:
        import torch

        if op == "load":
            self.load_task(msg)
            seed_everything(msg["init_seed"])
            model = self.task_module.Model(*self.init_args)
            if not isinstance(model, torch.nn.Module):
                raise TaskError(f"{self.source}: Model(...) is not a torch.nn.Module.")
            torch.save(model.state_dict(), msg["state_dict_path"])
            self.model = model.to(self.device).eval()
            info = {}
            if self.device == "cuda":
                info["gpu"] = torch.cuda.get_device_name()
            return {"parameters": sum(p.numel() for p in model.parameters())} | info
        if op == "baseline":
            return self.baseline(msg)
        if op == "expect":
            inputs = self.inputs(msg["seed"])
            with torch.no_grad():
                self.expected = self.model(*inputs)
            synchronize(self.device)
            return {"fingerprint": fingerprint(inputs)}
        if op == "compare":
            return {"reports": self.compare(msg)}
        raise ValueError(f"unknown request {op!r}")

    def compare(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        directory = Path(msg["dir"])
        expected, self.expected = self.expected, None
        try:
            claimed = manifest_devices(msg["manifest"])
            wanted = leaf_devices(expected)
            if claimed != wanted:
                return [{"path": "output", "ok": False, "reason": f"output devices {claimed} != expected {wanted}"}]
            try:
                actual = read_outputs(msg["manifest"], directory, self.device)
            except TransferError as exc:
                return [{"path": "output", "ok": False, "reason": f"unreadable output: {exc}"}]
            return compare_outputs(expected, actual, msg["atol"], msg["rtol"])
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def baseline(self, msg: dict[str, Any]) -> dict[str, Any]:
        import torch

        config = TimingConfig(**msg["timing"])
        inputs = self.inputs(msg["seed"])
        reply: dict[str, Any] = {}
        with torch.no_grad():
            reply["eager"] = measure(lambda: self.model(*inputs), self.device, config).to_dict()
            if msg.get("compile", True):
                start = time.perf_counter()
                try:
                    compiled = torch.compile(self.model)
                    compiled(*inputs)
                    synchronize(self.device)
                    reply["compile_seconds"] = time.perf_counter() - start
                    reply["compile"] = measure(lambda: compiled(*inputs), self.device, config).to_dict()
                except Exception as exc:
                    reply["compile_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        return reply


class CandidateSide(_Side):
    def handle(self, op: str, msg: dict[str, Any]) -> dict[str, Any]:
        import torch

        if op == "load":
            # The task program runs first, before any candidate code can touch torch.
            self.load_task(msg)
            modules = {name: load_extension(name, path) for name, path in msg["modules"].items()}
            install_inline_shim(modules)
            namespace = load_model_new(Path(msg["model_new_file"]))
            if not hasattr(namespace, "ModelNew"):
                raise CandidateFault("model_new.py defines no ModelNew")
            seed_everything(msg["init_seed"])
            self.model = namespace.ModelNew(*self.init_args)
            return {}
        if op == "weights":
            # A separate step so the candidate can load while the reference still builds Model.
            state = torch.load(msg["state_dict_path"], weights_only=True)
            try:
                self.model.load_state_dict(state, strict=True)
            except RuntimeError as exc:
                raise CandidateFault(f"state dict of Model does not load into ModelNew: {exc}") from None
            self.model = self.model.to(self.device).eval()
            return {}
        if op == "run":
            inputs = self.inputs(msg["seed"])
            prints = fingerprint(inputs)
            with torch.no_grad():
                output = self.model(*inputs)
            synchronize(self.device)
            try:
                manifest = write_outputs(output, Path(msg["dir"]))
            except TransferError as exc:
                raise CandidateFault(str(exc)) from None
            return {"fingerprint": prints, "manifest": manifest}
        if op == "time":
            inputs = self.inputs(msg["seed"])
            config = TimingConfig(**msg["timing"])
            with torch.no_grad():
                stats = measure(lambda: self.model(*inputs), self.device, config)
            return {"candidate": stats.to_dict()}
        raise ValueError(f"unknown request {op!r}")


def load_extension(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CandidateFault(f"cannot load the built extension {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def install_inline_shim(modules: dict[str, types.ModuleType]) -> None:
    """Answer ``load_inline(name=...)`` with the module we built from the same sources."""
    from torch.utils import cpp_extension

    def load_inline(name: str, *args: Any, **kwargs: Any) -> types.ModuleType:
        if name not in modules:
            raise CandidateFault(f"load_inline({name!r}) was not found when the sources were read statically")
        return modules[name]

    cpp_extension.load_inline = load_inline


def load_model_new(path: Path) -> types.ModuleType:
    module = types.ModuleType("model_new")
    module.__file__ = str(path)
    sys.modules["model_new"] = module
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)  # noqa: S102
    return module


def classify(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, MemoryError) or "OutOfMemoryError" in text or "out of memory" in text.lower() or "can't allocate memory" in text:
        return "out_of_memory"
    if isinstance(exc, TaskError):
        return "task"
    if isinstance(exc, CandidateFault):
        return "rule"
    return "exception"


def short_traceback(exc: BaseException, limit: int = 4000) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text if len(text) <= limit else "...\n" + text[-limit:]


def serve(side: _Side) -> None:
    requests = os.fdopen(int(os.environ["CUDA_AGENT_REQUEST_FD"]), "rb", buffering=0)
    replies = os.fdopen(int(os.environ["CUDA_AGENT_RESPONSE_FD"]), "wb", buffering=0)
    buffer = b""
    while True:
        while b"\n" not in buffer:
            chunk = requests.read(1 << 16)
            if not chunk:
                return
            buffer += chunk
        line, _, buffer = buffer.partition(b"\n")
        msg = json.loads(line)
        op = msg.pop("op")
        if op == "exit":
            replies.write(b'{"ok": true}\n')
            return
        started = time.perf_counter()
        try:
            reply = {"ok": True} | side.handle(op, msg)
        except BaseException as exc:  # noqa: BLE001 - everything the code under test raises is reported
            reply = {
                "ok": False,
                "kind": classify(exc),
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": short_traceback(exc),
            }
        reply["seconds"] = time.perf_counter() - started
        replies.write((json.dumps(reply) + "\n").encode())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--role", choices=("reference", "candidate"), required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    # Start-up work that involves no candidate code happens before the first
    # request, so it overlaps with the other process instead of adding to it.
    import torch

    if args.device == "cuda":
        torch.cuda.init()
    serve(ReferenceSide() if args.role == "reference" else CandidateSide())


if __name__ == "__main__":
    main()
