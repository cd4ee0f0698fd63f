"""Triton candidates: a ``model_new.py`` whose ``ModelNew.forward`` launches ``@triton.jit`` kernels, with no
C++ extension. Which language a candidate is in is declared (``language=``) or read from its source here."""

from __future__ import annotations

import ast

from cuda_agent.candidates.candidate import Candidate, CandidateError, check_model_new

LANGUAGES = ("cuda", "triton")
# Decorators that make a function a Triton kernel (``triton.autotune`` and ``triton.heuristics`` wrap one).
KERNEL_DECORATORS = frozenset({"jit", "autotune", "heuristics"})
TRITON_COMPILE_NOTE = ("a Triton candidate's kernels compile in eval's build stage, on the task's shapes (on the CPU "
                       "backend Triton's interpreter runs them): its static checks pass")


def check_language(language: str | None) -> str | None:
    """``language`` when it is None (detect it) or one of LANGUAGES; a CandidateError naming the choices otherwise."""
    if language is not None and language not in LANGUAGES:
        raise CandidateError(f"unknown candidate language {language!r}; use one of {', '.join(LANGUAGES)} "
                             "(or leave it out to detect it).")
    return language


def _triton_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Local names bound to the ``triton`` module, and to its kernel decorators (``from triton import jit``)."""
    modules: set[str] = set()
    decorators: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "triton":
                    modules.add(alias.asname or "triton")
        elif isinstance(node, ast.ImportFrom) and node.module == "triton" and not node.level:
            for alias in node.names:
                if alias.name in KERNEL_DECORATORS:
                    decorators.add(alias.asname or alias.name)
    return modules, decorators


def _is_kernel_decorator(node: ast.expr, modules: set[str], decorators: set[str]) -> bool:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id in decorators
    return (isinstance(node, ast.Attribute) and node.attr in KERNEL_DECORATORS
            and isinstance(node.value, ast.Name) and node.value.id in modules)


def kernel_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    """Module-level functions decorated as Triton kernels (``@triton.jit``, ``@triton.autotune(...)``, ...)."""
    modules, decorators = _triton_names(tree)
    return [node for node in tree.body if isinstance(node, ast.FunctionDef)
            and any(_is_kernel_decorator(d, modules, decorators) for d in node.decorator_list)]


def triton_kernels(source: str) -> list[str]:
    """The names of the Triton kernels ``source`` defines at module level (none where it does not parse)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [node.name for node in kernel_functions(tree)]


def triton_candidate(model_new: str, origin: str) -> Candidate:
    """A Triton candidate from the text of its ``model_new.py``; a CandidateError, one line, where the text does not
    parse, has no ``ModelNew`` or defines no Triton kernel."""
    check_model_new(model_new, origin)
    if not triton_kernels(model_new):
        raise CandidateError(f"{origin}: declared a Triton candidate but defines no @triton.jit kernel at module "
                             "level; decorate the kernel ModelNew.forward launches with @triton.jit.")
    return Candidate(model_new=model_new, extensions=(), kind="triton", origin=origin, language="triton")
