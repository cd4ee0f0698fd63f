"""The model_new.py check, on the Python AST.

Names are resolved to dotted paths (``F.relu`` -> ``torch.nn.functional.relu``)
through imports, assignments anywhere in the file (flow-insensitive), literal
``getattr``, ``self.x = ...`` attributes and container contents. A path that
cannot be known starts with ``?``; local definitions and the extension get
bracketed roots (``<def:f>``, ``<class:C>``, ``<method:C.m>``, ``<ext>``).
Calls append ``()``, subscripts ``[]``; ``{c}`` marks "an element of this
container" (``nn.Sequential``, ``nn.ModuleList``, a list literal).

Operators on tensors (``x + y``, ``x @ w``, ``abs(x)``) cannot be typed
statically and are not reported here: the runtime guard, which intercepts torch
dispatch while forward runs, is what catches them.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass, field

from cuda_agent.guard import names as N
from cuda_agent.guard.policy import CodePolicy, Violation
from cuda_agent.guard.tritoncheck import check_kernels, kernel_functions, triton_api_problem

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
# Registrations whose callable runs inside forward.
_HOOKS = frozenset({"register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
                    "register_full_backward_pre_hook", "register_hook", "register_module_forward_hook",
                    "register_module_forward_pre_hook"})
_LOCAL_ROOTS = ("?", "<self:", "<class:", "<def:", "<lambda:", "<method:")
_MAX_DEPTH = 24
_MAX_PATHS = 32


def check_python(source: str, filename: str, policy: CodePolicy, triton: bool = False) -> list[Violation]:
    """``triton``: the file is a Triton candidate's, which may import Triton's kernel-writing API and whose kernel
    bodies are checked too (``guard.tritoncheck``)."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        return [Violation("syntax", filename, exc.lineno, f"does not parse: {exc.msg}")]
    return _Checker(tree, filename, policy, triton).run()


# -- paths ---------------------------------------------------------------------------


def is_torch(path: str) -> bool:
    return path == "torch" or path.startswith(("torch.", "torch(", "torch["))


def _segments(path: str) -> list[str]:
    for ch in "()[]{}":
        path = path.replace(ch, ".")
    return [s for s in path.split(".") if s]


def _tail(path: str) -> str:
    """What follows the last call or subscript: ``torch.empty().view`` -> ``.view``."""
    cut = max(path.rfind(")"), path.rfind("]"), path.rfind("}"))
    return path[cut + 1 :] if cut >= 0 else path


def _matches(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith((prefix + ".", prefix + "(", prefix + "[", prefix + "{"))


def _is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _torch_object(path: str) -> object | None:
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


class _Index:
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
                    if isinstance(obj, ast.Name) and obj.id == me and _literal(key) is not None:
                        info.attrs[_literal(key)].append(value)
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
            attr = _literal(node.args[1])
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


def _literal(node: ast.expr) -> str | None:
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


# -- the checks ------------------------------------------------------------------------


class _Checker:
    def __init__(self, tree: ast.Module, filename: str, policy: CodePolicy, triton: bool = False):
        self.tree = tree
        self.filename = filename
        self.policy = policy
        self.triton = triton
        self.kernels = {fn.name for fn in kernel_functions(tree)} if triton else set()
        self.extension_modules = {N.WORKSPACE_EXTENSION} | _load_inline_names(tree)
        self.index = _Index(tree, self.extension_modules)
        self.parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        self.violations: list[Violation] = []

    def run(self) -> list[Violation]:
        self._check_imports()
        self._check_everywhere()
        self._check_forward()
        if self.triton:
            self.violations += check_kernels(self.tree, self.filename)
        return self.violations

    def report(self, rule: str, node: ast.AST | None, message: str) -> None:
        if rule == "stream" and self.policy.allow_streams:
            return
        self.violations.append(Violation(rule, self.filename, getattr(node, "lineno", None), message))

    # imports
    def _check_imports(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self._check_module(alias.name, None, node)
            elif isinstance(node, ast.ImportFrom):
                if node.level or not node.module:
                    self.report("forbidden-import", node, "relative import: a candidate is one file plus its extension")
                    continue
                for alias in node.names:
                    if alias.name == "*":
                        self.report("dynamic-access", node, f"`from {node.module} import *` hides which names are used")
                    else:
                        self._check_module(node.module, f"{node.module}.{alias.name}", node)

    def _check_module(self, module: str, full: str | None, node: ast.AST) -> None:
        root = module.split(".")[0]
        if root in self.extension_modules:
            return
        if root == "cuda_agent":
            self.report("forbidden-import", node, f"import of {module}: the harness is not the candidate's to use")
        elif root in N.ALLOWED_IMPORT_ROOTS or (self.triton and root == "triton"):
            self._classify_path(self.index.module_path(full or module), node)
        else:
            rule = N.IMPORT_RULES.get(root, "forbidden-import")
            self.report(rule, node, f"import of {module}: not needed by a candidate ({_IMPORT_REASONS[rule]})")

    # rules that hold anywhere in the file
    def _check_everywhere(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name):
                self._check_name(node)
            elif isinstance(node, ast.Attribute):
                self._check_attribute(node)
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                self._check_store(node, node.value, "item")
            elif isinstance(node, ast.Call):
                self._check_builtin_call(node)
            elif isinstance(node, ast.ClassDef):
                self._check_class(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name in ("__torch_function__", "__torch_dispatch__"):
                    self.report("tensor-subclass", node, f"defines {node.name}, which intercepts torch calls")

    def _check_name(self, node: ast.Name) -> None:
        if not isinstance(node.ctx, ast.Load):
            return
        name = node.id
        if name in N.DYNAMIC_BUILTINS:
            self.report("dynamic-access", node, f"`{name}` runs or reaches code by name")
        elif name in N.FILE_BUILTINS:
            self.report("syscall", node, f"`{name}` reads or writes files")
        elif name in N.ATTRIBUTE_BUILTINS and not self._is_call_func(node):
            self.report("dynamic-access", node, f"`{name}` used as a value hides which attribute it reaches")
        elif _is_dunder(name) and name not in N.ALLOWED_DUNDERS:
            self.report("dynamic-access", node, f"`{name}` reaches interpreter internals")

    def _check_attribute(self, node: ast.Attribute) -> None:
        attr = node.attr
        if attr in N.FRAME_ATTRIBUTES:
            self.report("frame-access", node, f"`.{attr}` walks frames or the heap")
        if _is_dunder(attr) and attr not in N.ALLOWED_DUNDERS:
            self.report("dynamic-access", node, f"`.{attr}` reaches interpreter internals")
        value = node.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "type":
            if attr not in N.ALLOWED_DUNDERS:
                self.report("dynamic-access", node, f"`type(...).{attr}` looks the attribute up past the instance")
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self._check_store(node, value, f"attribute .{attr}")
        if self._is_outermost(node):
            for path in self.index.resolve(node, self._enclosing_class(node)):
                self._classify_path(path, node)

    def _check_store(self, node: ast.AST, base: ast.expr, what: str) -> None:
        for path in self.index.resolve(base, self._enclosing_class(node)):
            if self._is_module_object(path):
                self.report("monkeypatch", node, f"assigns or deletes {what} of {_shown(path)}")
                return

    def _check_builtin_call(self, node: ast.Call) -> None:
        func = node.func
        if not isinstance(func, ast.Name):
            return
        if func.id in N.ATTRIBUTE_BUILTINS:
            key = node.args[1] if len(node.args) >= 2 else None
            if key is None or _literal(key) is None:
                self.report("dynamic-access", node, f"`{func.id}` with a computed attribute name")
            if func.id in ("setattr", "delattr") and node.args:
                self._check_store(node, node.args[0], f"attribute {_literal(key) if key is not None else '?'}")
        elif func.id == "type" and len(node.args) == 3:
            self.report("dynamic-access", node, "type() with three arguments builds a class at run time")

    def _check_class(self, node: ast.ClassDef) -> None:
        import torch

        for base in node.bases:
            for path in self.index.resolve(base):
                obj = _torch_object(path) if is_torch(path) and "(" not in path else None
                if isinstance(obj, type) and issubclass(obj, torch.Tensor):
                    self.report("tensor-subclass", node, f"class {node.name} subclasses {path}")

    def _classify_path(self, path: str, node: ast.AST) -> None:
        """Rules that depend only on what a dotted path names (torch internals, os, sys)."""
        if is_torch(path):
            self._classify_torch(path, node)
        elif path == "os" or path.startswith("os."):
            self._classify_os(path, node)
        elif _matches(path, "sys.modules"):
            self.report("frame-access", node, "sys.modules reaches every loaded module")
        elif self.triton and _matches(path, "triton"):
            problem = triton_api_problem(path)
            if problem:
                self.report("triton-api", node, problem)

    def _classify_torch(self, path: str, node: ast.AST) -> None:
        segments = _segments(path)
        private = [s for s in segments if s.startswith("_") and not _is_dunder(s)]
        if private:
            self.report("dynamic-access", node, f"private torch API `{private[0]}` in {_shown(path)}")
        plain = path.split("(")[0].split("[")[0].split("{")[0]
        for prefix, rule in N.TORCH_PATH_RULES.items():
            if _matches(plain, prefix):
                self.report(rule, node, f"{prefix}: {_TORCH_RULE_REASONS[rule]}")
                return
        if len(segments) >= 2 and segments[-1].startswith("set_") and segments[:-1] in (["torch"], ["torch", "cuda"]):
            self.report("monkeypatch", node, f"{plain} changes global torch state")

    def _classify_os(self, path: str, node: ast.AST) -> None:
        plain = path.split("(")[0].split("[")[0]
        if plain in N.OS_ALLOWED or plain.startswith("os.path."):
            return
        name = plain.split(".")[1]
        if name in N.OS_SUBPROCESS:
            self.report("subprocess", node, f"{plain} runs or signals processes")
        else:
            self.report("forbidden-import", node, f"{plain}: a candidate may use os.path and read os.environ only")

    # forward
    def _check_forward(self) -> None:
        model = self.index.classes.get("ModelNew")
        if model is None:
            return
        used = self._used_classes()
        work: list[tuple[str | None, ast.AST]] = []
        for name in ["ModelNew", *sorted(used - {"ModelNew"})]:
            info = self.index.classes[name]
            work += [(name, info.methods[m]) for m in ("forward", "__call__") if m in info.methods]
            for entry in ("forward", "__call__"):
                # forward bound as an attribute: `forward = staticmethod(torch.relu)`, `self.forward = f`
                for value in info.attrs.get(entry, []):
                    for path in self.index.resolve(value, name):
                        self._forward_target(path, value, name, work, called=True)
        for node in ast.walk(self.tree):
            # Hooks run inside forward, wherever they are registered.
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _HOOKS:
                for arg in node.args[:1]:
                    for path in self.index.resolve(arg, self._enclosing_class(node)):
                        self._forward_target(path, arg, self._enclosing_class(node), work, called=True)
        seen: set[int] = set()
        while work:
            cls, fn = work.pop()
            if id(fn) in seen:
                continue
            seen.add(id(fn))
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    for path in self.index.resolve(node.func, cls):
                        self._forward_target(path, node, cls, work, called=True)
                elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
                    if not self._is_call_func(node) and self._is_outermost(node):
                        for path in self.index.resolve(node, cls):
                            self._forward_target(path, node, cls, work, called=False)

    def _used_classes(self) -> set[str]:
        """Local classes ModelNew can reach by name (through classes, functions, assignments)."""
        used: set[str] = set()
        pending = ["ModelNew"]
        visited: set[str] = set()
        while pending:
            name = pending.pop()
            if name in visited:
                continue
            visited.add(name)
            bodies: list[ast.AST] = []
            if name in self.index.classes:
                used.add(name)
                bodies.append(self.index.classes[name].node)
            if name in self.index.functions:
                bodies.append(self.index.functions[name])
            bodies += self.index.assigned.get(name, [])
            for body in bodies:
                pending += [n.id for n in ast.walk(body) if isinstance(n, ast.Name) and n.id not in visited]
        return used

    def _forward_target(self, path: str, node: ast.AST, cls: str | None, work: list, called: bool) -> None:
        if called and path.endswith(CONTAINER):
            path = path[: -len(CONTAINER)]  # calling an nn.Sequential calls its elements
        reach = self._reachable(path, called)
        if reach is not None:
            work.append(reach)
        elif is_torch(path):
            self._forward_torch(path, node, called)
        elif called:
            self._forward_method(path, node)

    def _reachable(self, path: str, called: bool) -> tuple[str | None, ast.AST] | None:
        """The local code a path runs when called (or passed on as a callback)."""
        index = self.index
        if path.startswith(("<def:", "<method:")) and path.endswith(">()"):
            path = path[:-2]  # what a local function returns may be called: look inside it
        if path.startswith("<def:") and path.endswith(">"):
            if path[5:-1] in self.kernels:
                return None  # a Triton kernel's body is Triton, not host Python: guard.tritoncheck reads it
            return (None, index.functions[path[5:-1]])
        if path.startswith("<lambda:") and path.endswith(">"):
            return (None, index.lambdas[int(path[8:-1])])
        if path.startswith("<method:") and path.endswith(">"):
            owner, _, method = path[8:-1].partition(".")
            return (owner, index.classes[owner].methods[method])
        if called and path.startswith("<class:"):
            name = path[7 : path.index(">")]
            suffix = path[path.index(">") + 1 :]
            for wanted in {"": ("__init__",), "()": ("forward", "__call__")}.get(suffix, ()):
                owner = index.find_method(name, wanted)
                if owner:
                    return (owner, index.classes[owner].methods[wanted])
        return None

    def _forward_torch(self, path: str, node: ast.AST, called: bool) -> None:
        plain = path.split("(")[0].split("[")[0].split("{")[0]
        if any(_matches(plain, prefix) for prefix in N.TORCH_PATH_RULES):
            return  # reported under its own rule
        segments = _segments(path)
        if segments and segments[-1] in self.policy.allowed_aten:
            return
        if path != plain:  # a call or subscript result: an nn.Module, a tensor, a compiled function
            tail = _tail(path)
            if not tail:
                if called:
                    self.report("torch-compute", node, f"calls {_shown(path)} in forward")
                elif self._torch_callable_value(path):
                    self.report("torch-compute", node, f"passes {_shown(path)} on in forward")
            elif called and tail.split(".")[-1] not in N.ALLOWED_OPS:
                self.report("torch-compute", node, f"`{tail}()` on {_shown(path[: -len(tail)])} in forward")
            return
        if called:
            allowed = path in N.TORCH_ALLOWED_CALLS or (
                path.startswith("torch.Tensor.") and segments[-1] in N.ALLOWED_OPS
            )
            if not allowed:
                self.report("torch-compute", node, f"{path}() in forward")
        elif self._torch_callable_value(path):
            self.report("torch-compute", node, f"{path} passed on in forward")

    def _torch_callable_value(self, path: str) -> bool:
        """Whether a torch value handed to other code would run torch when called."""
        import torch

        if path in N.TORCH_ALLOWED_CALLS:
            return False
        if path.endswith("()") and path.count("(") == 1:
            ctor = _torch_object(path[:-2])
            if isinstance(ctor, type):
                return issubclass(ctor, torch.nn.Module)
            return path[:-2] in ("torch.compile", "torch.jit.script", "torch.jit.trace")
        if "(" in path or "[" in path or "{" in path:
            return False
        obj = _torch_object(path)
        if isinstance(obj, type):
            return issubclass(obj, torch.nn.Module)
        return callable(obj)

    def _forward_method(self, path: str, node: ast.AST) -> None:
        """A method called on something that is not a known module: judge it by its name."""
        if path.startswith("?<container>"):
            return
        root = _segments(path)[0] if _segments(path) else ""
        result = "(" in path or "[" in path
        if not result and (root in self._imported_roots() or path.startswith("<")):
            return  # a function of an imported module (math.exp, cuda_extension.op) or a local name
        tail = _tail(path)
        if "." not in tail:
            return
        method = tail.split(".")[-1]
        if method in N.python_compute_methods() and method not in self.policy.allowed_aten:
            self.report("torch-compute", node, f"tensor method `.{method}()` in forward")

    # helpers
    def _imported_roots(self) -> set[str]:
        return {p.split(".")[0] for p in self.index.imports.values()}

    def _is_module_object(self, path: str) -> bool:
        """A module, or an attribute of one (torch.x, time.y, the extension), not an instance."""
        return not path.startswith(_LOCAL_ROOTS) and not any(c in path for c in "([{")

    def _is_call_func(self, node: ast.AST) -> bool:
        parent = self.parents.get(node)
        return isinstance(parent, ast.Call) and parent.func is node

    def _is_outermost(self, node: ast.AST) -> bool:
        parent = self.parents.get(node)
        return not (isinstance(parent, ast.Attribute) and parent.value is node)

    def _enclosing_class(self, node: ast.AST) -> str | None:
        """The class of the method a node sits in, so ``self`` resolves."""
        current = self.parents.get(node)
        function = None
        while current is not None:
            if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef)) and function is None:
                function = current
            if isinstance(current, ast.ClassDef):
                return current.name if function is not None and current.name in self.index.classes else None
            current = self.parents.get(current)
        return None


def _load_inline_names(tree: ast.Module) -> set[str]:
    """Module names given to load_inline(name=...), importable once built."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            callee = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if callee == "load_inline":
                for kw in node.keywords:
                    if kw.arg == "name" and _literal(kw.value):
                        found.add(_literal(kw.value))
                if node.args and _literal(node.args[0]):
                    found.add(_literal(node.args[0]))
    return found


def _shown(path: str) -> str:
    """A path as a reader would write it."""
    for marker, shown in ((EXT, "the extension"), (CONTAINER, "[i]")):
        path = path.replace(marker, shown)
    return path.lstrip("?")


_IMPORT_REASONS = {
    "thread": "threads and processes are the harness's",
    "subprocess": "it runs other programs",
    "ctypes": "it calls native code around the build",
    "frame-access": "it reaches frames, the heap or other modules",
    "dynamic-access": "it loads or runs code by name",
    "forbidden-import": "outside the allowed modules",
}
_TORCH_RULE_REASONS = {
    "stream": "work on another stream escapes the timer's stream",
    "thread": "deferred or parallel work outside the timed call",
    "native-load": "loads native code the build did not produce",
    "monkeypatch": "changes torch's global behaviour or random state",
    "syscall": "reads or writes files",
    "tensor-subclass": "intercepts torch calls",
}
