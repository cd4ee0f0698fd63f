"""Data flows one way through the packages: clients on top, the evaluation core below them, and
the building blocks (guard, sandbox, build, candidates, tasks) below that. A module may import
from its own layer or a lower one, never from a higher one. Function-level imports count too:
a late import hides a cycle from the interpreter, not from the design. Inside the evaluation core the worker
(what runs in the evaluation processes) and the protocol both ends share never import the evaluator's side."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import cuda_agent

PACKAGE = Path(cuda_agent.__file__).resolve().parent

CLIENTS = ("agent", "synth", "bench", "train", "service", "cli", "integrations")
CORE = ("evaluate",)
BASE = ("guard", "sandbox", "build", "candidates", "tasks")
NEUTRAL = ("paths", "jsonl", "tensors", "scratch")  # helpers that two layers share: they import no package of ours
LAYERS = CLIENTS + CORE + BASE + NEUTRAL
# What each layer must not import (packages that do not exist yet count, so a new one starts right).
FORBIDDEN = ({package: CORE + CLIENTS for package in BASE} | {package: CLIENTS for package in CORE}
             | {module: CLIENTS + CORE + BASE for module in NEUTRAL}
             # The RL-stack adapters are clients of the other clients: only the CLI may import them.
             | {package: ("integrations",) for package in CLIENTS if package not in ("cli", "integrations")})
# Inside the evaluation core, by where the code runs: the worker (inside the candidate's and the reference's
# processes) and the protocol both ends share never import the evaluator's side; the protocol imports no worker.
EVALUATE_PARTS = ("worker", "protocol")
EVALUATE_ALLOWED = {"worker": ("worker", "protocol"), "protocol": ("protocol",)}
MAX_LINES = 600  # a source file longer than this is split along a seam a reader can name
# Each RL library is imported by its adapter alone (cuda_agent.integrations.<stack>; verl by train.verl's loop).
STACKS = {"trl": "trl", "openenv": "openenv", "verifiers": "verifiers", "verl": "verl", "datasets": "trl"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module an ``import`` or ``from ... import`` anywhere in the file names, relative
    imports resolved; for ``from a import b`` both ``a`` and ``a.b`` (``b`` may be a module)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def _package_of(dotted: str) -> str | None:
    """``cuda_agent.evaluate.protocol.compare`` -> ``evaluate``; ``cuda_agent.cli`` -> ``cli``; else None."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "cuda_agent" else None


def layer_violations() -> list[str]:
    """One line per offending import statement: ``path:line: layer imports module``."""
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = _package_of(_module_name(path))
        forbidden = FORBIDDEN.get(own or "", ())
        reported: set[int] = set()
        for line, name in imported_modules(path):
            if _package_of(name) in forbidden and line not in reported:
                reported.add(line)
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {own} imports {name}")
    return problems


def _evaluate_part(dotted: str) -> str | None:
    """``cuda_agent.evaluate.worker.side`` -> ``worker``; any other ``cuda_agent.evaluate`` module -> ``evaluator``
    (the evaluator's side, the package's own ``__init__`` included); outside the evaluation core -> None."""
    parts = dotted.split(".")
    if parts[:2] != ["cuda_agent", "evaluate"]:
        return None
    return parts[2] if len(parts) > 2 and parts[2] in EVALUATE_PARTS else "evaluator"


def evaluate_part_violations(package: Path | None = None) -> list[str]:
    """One line per import in ``evaluate/worker`` or ``evaluate/protocol`` of a part of the evaluation core it may not
    import: ``path:line: part imports module``. ``from cuda_agent.evaluate.protocol import timing`` names the package
    ``cuda_agent.evaluate`` on the way: a part's own package path is not counted against it."""
    package = package or PACKAGE
    problems = []
    for part, allowed in EVALUATE_ALLOWED.items():
        for path in sorted((package / "evaluate" / part).rglob("*.py")):
            reported: set[int] = set()
            for line, name in imported_modules(path):
                if name in ("cuda_agent", "cuda_agent.evaluate") or line in reported:
                    continue
                if _evaluate_part(name) not in (None, *allowed):
                    reported.add(line)
                    problems.append(f"{path.relative_to(package.parent)}:{line}: {part} imports {name}")
    return problems


def test_every_package_and_module_is_in_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert packages | modules <= set(LAYERS), f"put {sorted((packages | modules) - set(LAYERS))} in a layer"


def test_no_module_imports_from_a_higher_layer():
    problems = layer_violations()
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


def test_the_worker_and_the_protocol_never_import_the_evaluators_side():
    problems = evaluate_part_violations()
    assert not problems, "imports against the evaluation core's parts:\n" + "\n".join(problems)


def test_the_part_check_sees_the_evaluators_side_and_the_worker(tmp_path, monkeypatch):
    evaluate = tmp_path / "cuda_agent" / "evaluate"
    for part in EVALUATE_PARTS:
        (evaluate / part).mkdir(parents=True)
        (evaluate / part / "__init__.py").write_text("")
    (evaluate / "worker" / "loop.py").write_text("from ..protocol import messages\nfrom .. import evaluator\n"
                                                 "from cuda_agent.evaluate.result import EvalResult\n")
    (evaluate / "protocol" / "timing.py").write_text("def f():\n    from cuda_agent.evaluate.worker.side import Side\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "cuda_agent")
    assert evaluate_part_violations() == [
        "cuda_agent/evaluate/worker/loop.py:2: worker imports cuda_agent.evaluate.evaluator",
        "cuda_agent/evaluate/worker/loop.py:3: worker imports cuda_agent.evaluate.result",
        "cuda_agent/evaluate/protocol/timing.py:2: protocol imports cuda_agent.evaluate.worker.side",
    ]


def started_modules() -> list[tuple[str, str]]:
    """(file, module) for every ``"-m", "cuda_agent..."`` pair in a list or tuple of the package: the modules it starts
    processes with, which no import names."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.List, ast.Tuple)):
                values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
                found += [(str(path.relative_to(PACKAGE.parent)), module) for flag, module in zip(values, values[1:])
                          if flag == "-m" and isinstance(module, str) and module.startswith("cuda_agent.")]
    return found


def test_evaluation_processes_start_worker_modules():
    started = started_modules()
    assert {module for _, module in started} >= {"cuda_agent.evaluate.worker.loop",
                                                  "cuda_agent.evaluate.worker.counters_target"}
    for path, module in started:
        assert (PACKAGE.parent / (module.replace(".", "/") + ".py")).exists(), f"{path} starts {module}: no such module"
        if module.startswith("cuda_agent.evaluate."):
            assert _evaluate_part(module) == "worker", f"{path} starts {module}, outside evaluate/worker"


def test_no_source_file_is_over_the_line_limit():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these along a seam (over {MAX_LINES} lines): {long}"


def test_the_check_sees_late_and_relative_imports(tmp_path, monkeypatch):
    guard = tmp_path / "cuda_agent" / "guard"
    guard.mkdir(parents=True)
    (guard / "__init__.py").write_text("")
    (guard / "late.py").write_text("def f():\n    from ..evaluate import compare\n    import cuda_agent.cli\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "cuda_agent")
    assert layer_violations() == [
        "cuda_agent/guard/late.py:2: guard imports cuda_agent.evaluate",
        "cuda_agent/guard/late.py:3: guard imports cuda_agent.cli",
    ]


def test_each_rl_library_is_imported_by_its_adapter_alone():
    problems = []
    for path in sorted((PACKAGE / "integrations").rglob("*.py")):
        for line, name in imported_modules(path):
            top = name.split(".")[0]
            if top in STACKS and path.stem != STACKS[top]:
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line}: imports {name}")
    assert not problems, "RL libraries outside their adapter:\n" + "\n".join(problems)
