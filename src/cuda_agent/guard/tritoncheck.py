"""What a Triton candidate's ``model_new.py`` may use of Triton, and what its kernels may compute with.

A Triton candidate writes kernels and launches them; Triton's compiler, runtime, driver, cache, knobs and
testing helpers are the harness's (they compile, tune and time), so a path under ``triton`` outside the
kernel-writing API is rule ``triton-api``. A kernel body computes with ``triton.language`` alone: under
Triton's interpreter (the CPU backend) a kernel body is plain Python that could call torch or anything
else it can name, so every name a body reads must be an argument, a local, ``triton``/``triton.language``,
a module constant or another kernel (rule ``triton-kernel``). Torch reached from ``forward`` around the
kernels is ``torch-compute``, as for any candidate (``guard.pycheck``).
"""

from __future__ import annotations

import ast
import builtins

from cuda_agent.candidates.triton import kernel_functions
from cuda_agent.guard.policy import Violation

# The kernel-writing API: decorators, launch helpers and the language itself.
TRITON_API = ("triton.jit", "triton.autotune", "triton.Config", "triton.heuristics", "triton.cdiv",
              "triton.next_power_of_2", "triton.language", "triton.constexpr")
# Builtins a kernel body may call (Triton's frontend understands these; the interpreter runs them as Python).
KERNEL_BUILTINS = frozenset({"range", "min", "max", "len", "int", "float", "bool", "isinstance", "tuple",
                             "print", "abs", "zip", "enumerate", "True", "False", "None"})
# What Triton's interpreter holds under a tensor (a numpy array of host values): host Python to compute with.
INTERPRETER_ATTRIBUTES = frozenset({"handle"})
# Statements Triton's compiler does not accept in a kernel; under the interpreter each would run host Python.
_FOREIGN = (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.Lambda, ast.FunctionDef,
            ast.AsyncFunctionDef, ast.ClassDef, ast.Try, ast.With, ast.AsyncWith, ast.Await, ast.Yield,
            ast.YieldFrom, ast.Delete)


def triton_api_problem(path: str) -> str | None:
    """Why a dotted path under ``triton`` is not the candidate's to use, or None where it is kernel-writing API."""
    plain = path.split("(")[0].split("[")[0].split("{")[0]
    if plain == "triton" or any(plain == p or plain.startswith(p + ".") for p in TRITON_API):
        return None
    return (f"{plain}: Triton's compiler, runtime, cache and knobs are the harness's (a candidate uses "
            f"{', '.join(p.split('.')[-1] for p in TRITON_API)})")


def _module_bindings(tree: ast.Module) -> dict[str, str]:
    """Module-level names a kernel may read: ``triton`` (imports of triton), ``kernel``, ``constant``."""
    bound: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "triton":
                    bound[(alias.asname or alias.name).split(".")[0]] = "triton"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "triton" and not node.level:
            for alias in node.names:
                bound[alias.asname or alias.name] = "triton"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _constant(node.value, bound):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    bound[target.id] = "constant"
    for node in kernel_functions(tree):
        bound[node.name] = "kernel"
    return bound


def _constant(node: ast.expr, bound: dict[str, str]) -> bool:
    """A literal, arithmetic on literals and constants, or ``tl.constexpr(...)`` of one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float, bool, str)) or node.value is None
    if isinstance(node, ast.UnaryOp):
        return _constant(node.operand, bound)
    if isinstance(node, ast.BinOp):
        return _constant(node.left, bound) and _constant(node.right, bound)
    if isinstance(node, ast.Name):
        return bound.get(node.id) == "constant"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "constexpr":
        root = node.func.value
        while isinstance(root, ast.Attribute):
            root = root.value
        return (isinstance(root, ast.Name) and bound.get(root.id) == "triton"
                and all(_constant(a, bound) for a in node.args) and not node.keywords)
    return False


def _local_names(fn: ast.FunctionDef) -> set[str]:
    args = fn.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def check_kernels(tree: ast.Module, filename: str) -> list[Violation]:
    """``triton-kernel`` for every name a kernel body reads that is not Triton's, its own or a constant, and every
    statement in a body that Triton's compiler would refuse (it would run as host Python under the interpreter)."""
    bound = _module_bindings(tree)
    found: list[Violation] = []
    for fn in kernel_functions(tree):
        local = _local_names(fn)
        for stmt in fn.body:
            for node in ast.walk(stmt):
                if isinstance(node, _FOREIGN):
                    found.append(Violation("triton-kernel", filename, node.lineno,
                                           f"kernel {fn.name}: {type(node).__name__.lower()} in a kernel body (a "
                                           "kernel computes with triton.language alone)"))
                elif isinstance(node, ast.Attribute) and node.attr in INTERPRETER_ATTRIBUTES:
                    found.append(Violation("triton-kernel", filename, node.lineno,
                                           f"kernel {fn.name} reads `.{node.attr}`: the interpreter's host values "
                                           "under a Triton tensor, which Triton's compiler does not have"))
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                    name = node.id
                    if name in local or bound.get(name) or (name in KERNEL_BUILTINS and hasattr(builtins, name)):
                        continue
                    found.append(Violation("triton-kernel", filename, node.lineno,
                                           f"kernel {fn.name} reads `{name}`, which is neither triton.language, an "
                                           "argument, a module constant nor another @triton.jit kernel"))
    return found
