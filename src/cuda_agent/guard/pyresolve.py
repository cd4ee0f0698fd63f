"""How the check of a model_new.py (``guard.pycheck``) reads its names: as dotted paths.

Names resolve to dotted paths (``F.relu`` -> ``torch.nn.functional.relu``)
through imports, assignments anywhere in the file (flow-insensitive), literal
``getattr``, ``self.x = ...`` attributes and container contents. A path that
cannot be known starts with ``?``; local definitions and the extension get
bracketed roots (``<def:f>``, ``<class:C>``, ``<method:C.m>``, ``<ext>``).
Calls append ``()``, subscripts ``[]``; ``{c}`` marks "an element of this
container" (``nn.Sequential``, ``nn.ModuleList``, a list literal).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass, field

EXT = "<ext>"
CONTAINER = "{c}"
_TORCH_CONTAINERS = frozenset(
    {"torch.nn.Sequential", "torch.nn.ModuleList", "torch.nn.ModuleDict", "torch.nn.ParameterList",
     "torch.nn.ParameterDict"}
)
_LOAD_INLINE = "torch.utils.cpp_extension.load_inline"
# Calls that return (a wrapper of) their first argument's callable.
_WRAPPERS = frozenset({"functools.partial", "functools.partialmethod", "functools.wraps", "functools.lru_cache",
                       "functools.cache", "functools.update_wrapper", "?staticmethod", "?classmethod"})
_MAX_DEPTH = 24
_MAX_PATHS = 32


# -- paths ---------------------------------------------------------------------------


def is_torch(path: str) -> bool:
    return path == "torch" or path.startswith(("torch.", "torch(", "torch["))


def path_segments(path: str) -> list[str]:
    for ch in "()[]{}":
        path = path.replace(ch, ".")
    return [s for s in path.split(".") if s]


def path_tail(path: str) -> str:
    """What follows the last call or subscript: ``torch.empty().view`` -> ``.view``."""
    cut = max(path.rfind(")"), path.rfind("]"), path.rfind("}"))
    return path[cut + 1 :] if cut >= 0 else path


def matches(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith((prefix + ".", prefix + "(", prefix + "[", prefix + "{"))


def is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def torch_object(path: str) -> object | None:
    """The torch object a plain dotted path names, or None (private names are never looked up)."""
    import torch

    obj: object = torch
    for seg in path.split(".")[1:]:
        if seg.startswith("_") or not seg.isidentifier():
            return None
        try:
            obj = getattr(obj, seg)
        except Exception:  # lazy torch modules may raise anything; unknown is fine
            return None
    return obj


# -- what the file binds -------------------------------------------------------------


@dataclass
class _Class:
    name: str
    node: ast.ClassDef
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    attrs: dict[str, list[ast.expr]] = field(default_factory=lambda: defaultdict(list))


class Index:
    """Imports, top-level definitions and every assignment in the file, and the resolver."""

    def __init__(self, tree: ast.Module, extension_modules: set[str]):
        self.extension_modules = extension_modules
        self.imports: dict[str, str] = {}
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        self.classes: dict[str, _Class] = {}
        self.assigned: dict[str, list[ast.expr]] = defaultdict(list)
        self.lambdas: dict[int, ast.Lambda] = {}
        self._memo: dict[tuple[str, str | None], list[str]] = {}
        self._collect_imports(tree)
        self._collect_definitions(tree.body)
        self._collect_assignments(tree)

    # collection
    def module_path(self, dotted: str) -> str:
        root, _, rest = dotted.partition(".")
        if root in self.extension_modules:
            return EXT + ("." + rest if rest else "")
        return dotted

    def _collect_imports(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.imports[alias.asname] = self.module_path(alias.name)
                    else:
                        root = alias.name.split(".")[0]
                        self.imports[root] = self.module_path(root)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    if alias.name != "*":
                        self.imports[alias.asname or alias.name] = self.module_path(f"{node.module}.{alias.name}")

    def _collect_definitions(self, body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = self._class(node)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                # Definitions under `if`/`try` at module level are still module-level.
                for block in ("body", "orelse", "finalbody"):
                    self._collect_definitions(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    self._collect_definitions(handler.body)

    def _class(self, node: ast.ClassDef) -> _Class:
        info = _Class(node.name, node)
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                info.methods[item.name] = item
                self._collect_self_attrs(item, info)
            elif isinstance(item, ast.Assign):
                for target in item.targets:
                    if isinstance(target, ast.Name):
                        info.attrs[target.id].append(item.value)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value:
                info.attrs[item.target.id].append(item.value)
        return info

    def _collect_self_attrs(self, method: ast.FunctionDef | ast.AsyncFunctionDef, info: _Class) -> None:
        if not method.args.args:
            return
        me = method.args.args[0].arg

        def self_attr(target: ast.expr) -> str | None:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == me:
                return target.attr
            return None

        for node in ast.walk(method):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for t, v in _pairs(target, node.value):
                        if (name := self_attr(t)) is not None:
                            info.attrs[name].append(v)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                if (name := self_attr(node.target)) is not None:
                    info.attrs[name].append(node.value)
            elif isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name) and func.id == "setattr" and len(node.args) == 3:
                    obj, key, value = node.args
                    if isinstance(obj, ast.Name) and obj.id == me and literal(key) is not None:
                        info.attrs[literal(key)].append(value)
                elif isinstance(func, ast.Attribute) and (name := self_attr(func.value)) is not None:
                    for grown in _grown(func.attr, node):
                        info.attrs[name].append(grown)

    def _collect_assignments(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for t, v in _pairs(target, node.value):
                        if isinstance(t, ast.Name):
                            self.assigned[t.id].append(v)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name) and node.value:
                self.assigned[node.target.id].append(node.value)
            elif isinstance(node, ast.NamedExpr):
                self.assigned[node.target.id].append(node.value)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                for t, v in _loop_pairs(node.target, node.iter):
                    if isinstance(t, ast.Name):
                        self.assigned[t.id].append(v)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if isinstance(item.optional_vars, ast.Name):
                        self.assigned[item.optional_vars.id].append(item.context_expr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if isinstance(node.func.value, ast.Name):
                    for grown in _grown(node.func.attr, node):
                        self.assigned[node.func.value.id].append(grown)
            if isinstance(node, ast.Assign):
                # `ModelNew.forward = f` outside the class body still defines its forward.
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                        if target.value.id in self.classes:
                            self.classes[target.value.id].attrs[target.attr].append(node.value)

    # resolution
    def resolve(self, node: ast.AST, cls: str | None = None, depth: int = 0) -> list[str]:
        if depth > _MAX_DEPTH:
            return []
        paths = self._resolve(node, cls, depth)
        return list(dict.fromkeys(paths))[:_MAX_PATHS]

    def _resolve(self, node: ast.AST, cls: str | None, depth: int) -> list[str]:
        d = depth + 1
        if isinstance(node, ast.Name):
            return self._resolve_name(node.id, cls, d)
        if isinstance(node, ast.Attribute):
            return [p for base in self.resolve(node.value, cls, d) for p in self.member(base, node.attr, d)]
        if isinstance(node, ast.Call):
            return self._resolve_call(node, cls, d)
        if isinstance(node, ast.Subscript):
            return [p[: -len(CONTAINER)] if p.endswith(CONTAINER) else p + "[]" for p in self.resolve(node.value, cls, d)]
        if isinstance(node, ast.Lambda):
            self.lambdas[id(node)] = node
            return [f"<lambda:{id(node)}>"]
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return [self._element(p) for e in node.elts for p in self.resolve(e, cls, d)]
        if isinstance(node, ast.Dict):
            return [self._element(p) for v in node.values for p in self.resolve(v, cls, d)]
        if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            return [self._element(p) for p in self.resolve(node.elt, cls, d)]
        if isinstance(node, ast.DictComp):
            return [self._element(p) for p in self.resolve(node.value, cls, d)]
        if isinstance(node, ast.IfExp):
            return self.resolve(node.body, cls, d) + self.resolve(node.orelse, cls, d)
        if isinstance(node, ast.BoolOp):
            return [p for v in node.values for p in self.resolve(v, cls, d)]
        if isinstance(node, (ast.NamedExpr, ast.Starred, ast.Await)):
            return self.resolve(node.value, cls, d)
        return []

    @staticmethod
    def _element(path: str) -> str:
        return path if path.endswith(CONTAINER) else path + CONTAINER

    def _resolve_name(self, name: str, cls: str | None, depth: int) -> list[str]:
        if cls and name == "self":
            return [f"<self:{cls}>"]
        if name in self.imports:
            return [self.imports[name]]
        key = (name, cls)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = []  # in progress: a cycle resolves to nothing
        out = []
        if name in self.functions:
            out.append(f"<def:{name}>")
        if name in self.classes:
            out.append(f"<class:{name}>")
        for value in self.assigned.get(name, [])[:_MAX_PATHS]:
            out += self.resolve(value, cls, depth)
        result = list(dict.fromkeys(out)) or [f"?{name}"]
        self._memo[key] = result
        return result

    def _resolve_call(self, node: ast.Call, cls: str | None, depth: int) -> list[str]:
        func = node.func
        if isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) >= 2:
            attr = literal(node.args[1])
            if attr is None:
                return []
            return [p for base in self.resolve(node.args[0], cls, depth) for p in self.member(base, attr, depth)]
        if isinstance(func, ast.Name) and func.id == "super" and cls in self.classes:
            return [p + "()" for p in self.class_bases(cls, depth)]
        if isinstance(func, ast.Name) and func.id in ("enumerate", "iter", "reversed", "list", "tuple", "sorted"):
            return [p for arg in node.args[:1] for p in self.resolve(arg, cls, depth)]
        out = []
        for p in self.resolve(func, cls, depth):
            if p == _LOAD_INLINE:
                out.append(EXT)
            elif p in _WRAPPERS and node.args:
                out += self.resolve(node.args[0], cls, depth)  # partial(torch.relu) calls torch.relu
            elif p in _TORCH_CONTAINERS:
                out += [self._element(e) for arg in node.args for e in self.resolve(arg, cls, depth)]
            elif p.endswith(CONTAINER):
                out.append(p[: -len(CONTAINER)] + "()")
            else:
                out.append(p + "()")
        return out

    def class_bases(self, cls: str, depth: int) -> list[str]:
        return [p for base in self.classes[cls].node.bases for p in self.resolve(base, None, depth + 1)]

    def find_method(self, cls: str, name: str, depth: int = 0) -> str | None:
        """The local class (cls or a local base) that defines method ``name``."""
        if depth > 8 or cls not in self.classes:
            return None
        if name in self.classes[cls].methods:
            return cls
        for base in self.class_bases(cls, depth):
            if base.startswith("<class:") and base.endswith(">"):
                found = self.find_method(base[7:-1], name, depth + 1)
                if found:
                    return found
        return None

    def member(self, base: str, attr: str, depth: int) -> list[str]:
        instance = None
        if base.startswith("<self:") and base.endswith(">"):
            instance = base[6:-1]
        elif base.startswith("<class:") and base.endswith((">", ">()")):
            instance = base[7 : base.index(">")]
        if instance is not None and instance in self.classes:
            out = []
            owner = self.find_method(instance, attr)
            if owner:
                out.append(f"<method:{owner}.{attr}>")
            for value in self.classes[instance].attrs.get(attr, []):
                out += self.resolve(value, instance, depth + 1)
            return out or [f"?{instance}.{attr}"]
        if base.endswith(CONTAINER):
            return [f"?<container>.{attr}"]
        return [f"{base}.{attr}"]


def literal(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _pairs(target: ast.expr, value: ast.expr) -> list[tuple[ast.expr, ast.expr]]:
    """Assignment target/value pairs, unpacking ``a, b = x, y``."""
    if isinstance(target, (ast.Tuple, ast.List)):
        if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
            return [p for t, v in zip(target.elts, value.elts, strict=True) for p in _pairs(t, v)]
        return [(t, ast.Subscript(value=value, slice=ast.Constant(0), ctx=ast.Load())) for t in target.elts]
    return [(target, value)]


def _loop_pairs(target: ast.expr, iterable: ast.expr) -> list[tuple[ast.expr, ast.expr]]:
    """``for x in xs`` binds x to an element of xs; ``for i, x in enumerate(xs)`` too."""
    element = ast.Subscript(value=iterable, slice=ast.Constant(0), ctx=ast.Load())
    if isinstance(target, ast.Tuple) and isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name):
        if iterable.func.id == "enumerate" and len(target.elts) == 2 and iterable.args:
            return [(target.elts[1], ast.Subscript(value=iterable.args[0], slice=ast.Constant(0), ctx=ast.Load()))]
        if iterable.func.id == "zip" and len(target.elts) == len(iterable.args):
            return [(t, ast.Subscript(value=a, slice=ast.Constant(0), ctx=ast.Load()))
                    for t, a in zip(target.elts, iterable.args, strict=True)]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [(t, element) for t in target.elts]
    return [(target, element)]


def _grown(method: str, call: ast.Call) -> list[ast.expr]:
    """Values that ``xs.append(v)`` / ``extend`` / ``insert`` add to a container."""
    if method == "append" and call.args:
        return [ast.List(elts=[call.args[0]], ctx=ast.Load())]
    if method == "insert" and len(call.args) == 2:
        return [ast.List(elts=[call.args[1]], ctx=ast.Load())]
    if method in ("extend", "update") and call.args:
        return [call.args[0]]
    return []
