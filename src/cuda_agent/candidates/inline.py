"""KernelBench-style single files whose ``ModelNew`` builds sources with ``load_inline``.

The sources are recovered statically (string literals, module-level names,
concatenation, lists), so existing generations can be built by our builder and
their ``load_inline`` call answered with the prebuilt module at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from cuda_agent.paths import read_text
from cuda_agent.candidates.candidate import Candidate, CandidateError, Extension, check_model_new

_LOAD_INLINE_PARAMS = (
    "name",
    "cpp_sources",
    "cuda_sources",
    "functions",
    "extra_cflags",
    "extra_cuda_cflags",
    "extra_ldflags",
)
# What torch's load_inline prepends; kept so sources that rely on it compile unchanged.
_CPP_PRELUDE = "#include <torch/extension.h>\n"
_CUDA_PRELUDE = "#include <torch/types.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n"


class _Unresolvable(Exception):
    pass


def load_inline_file(path: str | Path) -> Candidate:
    path = Path(path)
    code = read_text(path, CandidateError)
    return candidate_from_inline_source(code, str(path))


def candidate_from_inline_source(code: str, origin: str) -> Candidate:
    check_model_new(code, origin)
    tree = ast.parse(code, filename=origin)
    constants = _module_constants(tree)
    extensions: list[Extension] = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and _is_load_inline(n.func)):
        args = _call_arguments(call, constants, origin)
        extensions.append(_extension_from_args(args, origin, call.lineno))
    names = [e.name for e in extensions]
    if len(set(names)) != len(names):
        raise CandidateError(f"{origin}: two load_inline calls share the module name; give each its own name.")
    return Candidate(model_new=code, extensions=tuple(extensions), kind="inline" if extensions else "python", origin=origin)


def _is_load_inline(func: ast.expr) -> bool:
    return (isinstance(func, ast.Name) and func.id == "load_inline") or (
        isinstance(func, ast.Attribute) and func.attr == "load_inline"
    )


def _module_constants(tree: ast.Module) -> dict[str, ast.expr]:
    constants: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            constants[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            constants[node.target.id] = node.value
    return constants


def _evaluate(node: ast.expr, constants: dict[str, ast.expr], depth: int = 0) -> Any:
    if depth > 50:
        raise _Unresolvable("definition too deeply nested")
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in constants:
            raise _Unresolvable(f"`{node.id}` is not a module-level constant")
        return _evaluate(constants[node.id], constants, depth + 1)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_evaluate(e, constants, depth + 1) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {
            _evaluate(k, constants, depth + 1): _evaluate(v, constants, depth + 1)
            for k, v in zip(node.keys, node.values)
            if k is not None
        }
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _evaluate(node.left, constants, depth + 1) + _evaluate(node.right, constants, depth + 1)
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue) and value.format_spec is None:
                parts.append(str(_evaluate(value.value, constants, depth + 1)))
            else:
                raise _Unresolvable("formatted string with a format spec")
        return "".join(parts)
    raise _Unresolvable(f"{type(node).__name__} expression")


def _call_arguments(call: ast.Call, constants: dict[str, ast.expr], origin: str) -> dict[str, Any]:
    args: dict[str, Any] = {}
    named = list(zip(_LOAD_INLINE_PARAMS, call.args))
    named += [(kw.arg, kw.value) for kw in call.keywords if kw.arg in _LOAD_INLINE_PARAMS]
    for key, node in named:
        try:
            args[key] = _evaluate(node, constants)
        except _Unresolvable as exc:
            raise CandidateError(
                f"{origin}:{call.lineno}: cannot read load_inline's `{key}` statically ({exc}); "
                "assign the sources to module-level string literals."
            ) from None
    if "name" not in args or not isinstance(args["name"], str) or not args["name"].isidentifier():
        raise CandidateError(f"{origin}:{call.lineno}: load_inline needs a `name` that is a Python identifier.")
    return args


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def _extension_from_args(args: dict[str, Any], origin: str, line: int) -> Extension:
    name = args["name"]
    cpp = _as_list(args.get("cpp_sources"))
    cuda = _as_list(args.get("cuda_sources"))
    functions = args.get("functions")
    if isinstance(functions, str):
        functions = [functions]
    sources: dict[str, str] = {}
    main = _CPP_PRELUDE + "\n".join(cpp)
    if functions:
        docs = functions if isinstance(functions, dict) else {f: f for f in functions}
        defs = "\n".join(f'  m.def("{f}", &{f}, "{doc}");' for f, doc in docs.items())
        main += f"\n\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{defs}\n}}\n"
    sources[f"{name}/main.cpp"] = main
    if cuda:
        sources[f"{name}/cuda.cu"] = _CUDA_PRELUDE + "\n".join(cuda)
    if not cpp and not cuda:
        raise CandidateError(f"{origin}:{line}: load_inline `{name}` has no sources.")
    return Extension(
        name=name,
        sources=sources,
        cflags=tuple(_as_list(args.get("extra_cflags"))),
        cuda_cflags=tuple(_as_list(args.get("extra_cuda_cflags"))),
        ldflags=tuple(_as_list(args.get("extra_ldflags"))),
    )
