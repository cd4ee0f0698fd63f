"""Structural AST similarity of two task programs' ``Model`` classes.

The paper drops a synthesised task whose ``Model`` is more than 0.9 similar to
any KernelBench program. The measure here:

1. Parse the program and take the ``class Model`` definition (the whole module
   when there is none).
2. Turn it into a token sequence by a pre-order walk of the AST. Each node gives
   its type (``Call``, ``BinOp``, ``Mult``, ``Return``, ...). Names and
   attributes that resolve to a torch API give the API's canonical name
   (``F.relu``, ``nn.functional.relu`` and ``torch.nn.functional.relu`` are one
   token), because which operators run is what a task is. Every other name
   (variables, ``self.conv``, arguments) gives a placeholder, and every constant
   gives only its type. Renaming variables or changing sizes and
   hyper-parameters therefore leaves the sequence unchanged.
3. Operator tokens (torch APIs, method names) count ``API_WEIGHT`` (3) times: with
   equal weights, a one-operator program is 0.95 similar to the same program with
   another operator (KernelBench's ReLU and Sigmoid), and 153 of KernelBench's 270
   programs have a neighbour above 0.9 inside KernelBench itself. With 3: ReLU vs
   Sigmoid 0.885, 121 of 270; the same program with one operator appended stays a
   near-duplicate (0.947 for a three-operator block).
4. Similarity is ``difflib.SequenceMatcher``'s ratio of the two sequences:
   2 * matching tokens / total tokens, in [0, 1]; 1 means the same structure.

The structure of ``forward`` and ``__init__`` dominates; ``get_inputs`` (shapes)
is deliberately outside, so two programs that differ only in sizes score 1.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

THRESHOLD = 0.9  # the paper's rule: a task above this is a near-duplicate
API_WEIGHT = 3  # repeats of each operator token (see the module docstring)

# Module aliases resolved before API names are compared.
_ALIASES = {"F": "torch.nn.functional", "nn": "torch.nn", "np": "numpy"}
_API_ROOTS = ("torch", "numpy", "math")


def structure_tokens(code: str) -> tuple[str, ...]:
    """The token sequence of the program's ``Model`` class (see the module docstring).
    Raises ``SyntaxError`` for code that does not parse."""
    tree = ast.parse(code)
    aliases = dict(_ALIASES) | _import_aliases(tree)
    model = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Model"), tree)
    weighted: list[str] = []
    for token in _tokens(model, aliases):
        weighted += [token] * (API_WEIGHT if token.startswith(("api:", "method:")) else 1)
    return tuple(weighted)


def similarity(a: str | tuple[str, ...], b: str | tuple[str, ...]) -> float:
    """Similarity in [0, 1] of two programs (source text or ``structure_tokens``)."""
    ta = structure_tokens(a) if isinstance(a, str) else a
    tb = structure_tokens(b) if isinstance(b, str) else b
    if not ta and not tb:
        return 1.0
    return difflib.SequenceMatcher(None, ta, tb, autojunk=False).ratio()


@dataclass(frozen=True)
class Match:
    score: float  # the highest similarity to any reference program
    closest: str | None  # the name of that program


class Decontaminator:
    """Scores programs against a fixed set of reference programs (KernelBench)."""

    def __init__(self, references: Iterable[tuple[str, str]], threshold: float = THRESHOLD):
        self.threshold = threshold
        self._refs: list[tuple[str, tuple[str, ...]]] = []
        for name, code in references:
            try:
                self._refs.append((name, structure_tokens(code)))
            except SyntaxError:
                continue  # a reference that does not parse cannot be near anything

    def add(self, name: str, code: str) -> None:
        """Score later programs against ``code`` too (near-duplicates inside a synthesised set)."""
        self._refs.append((name, structure_tokens(code)))

    def __len__(self) -> int:
        return len(self._refs)

    def match(self, code: str) -> Match:
        """The closest reference. SequenceMatcher's cheap upper bounds skip references that
        cannot beat the best score so far."""
        tokens = structure_tokens(code)
        best = Match(0.0, None)
        matcher = difflib.SequenceMatcher(None, autojunk=False)
        matcher.set_seq2(tokens)
        for name, ref in self._refs:
            matcher.set_seq1(ref)
            if matcher.real_quick_ratio() <= best.score or matcher.quick_ratio() <= best.score:
                continue
            score = matcher.ratio()
            if score > best.score:
                best = Match(score, name)
        return best

    def is_contaminated(self, code: str) -> bool:
        return self.match(code).score > self.threshold


def _import_aliases(tree: ast.AST) -> dict[str, str]:
    """``import torch.nn.functional as G`` -> {"G": "torch.nn.functional"}; ``from torch import nn`` likewise."""
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    found[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                found[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return found


def dotted_name(node: ast.AST) -> str | None:
    """``a.b.c`` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _api_name(node: ast.AST, aliases: dict[str, str]) -> str | None:
    dotted = dotted_name(node)
    if dotted is None:
        return None
    head, _, rest = dotted.partition(".")
    head = aliases.get(head, head)
    full = f"{head}.{rest}" if rest else head
    return full if full.split(".")[0] in _API_ROOTS else None


def _tokens(node: ast.AST, aliases: dict[str, str]) -> Iterator[str]:
    if isinstance(node, (ast.Name, ast.Attribute)):
        api = _api_name(node, aliases)
        if api is not None:
            yield f"api:{api}"
            return
        if isinstance(node, ast.Attribute):
            # self.conv(x) and x.relu(): the method name is the operator, the object is not.
            yield "Attribute"
            yield from _tokens(node.value, aliases)
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return
            yield f"method:{node.attr}"
            return
        yield "Name"
        return
    if isinstance(node, ast.Constant):
        yield f"const:{type(node.value).__name__}"
        return
    if isinstance(node, (ast.Expr, ast.Load, ast.Store, ast.Del)):
        yield from (t for child in ast.iter_child_nodes(node) for t in _tokens(child, aliases))
        return
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        yield type(node).__name__
        # Docstrings are prose, not structure.
        body = node.body[1:] if node.body and isinstance(node.body[0], ast.Expr) and isinstance(
            getattr(node.body[0], "value", None), ast.Constant) and isinstance(node.body[0].value.value, str) else node.body
        if isinstance(node, ast.FunctionDef):
            yield from _tokens(node.args, aliases)
        for child in body:
            yield from _tokens(child, aliases)
        return
    yield type(node).__name__
    for child in ast.iter_child_nodes(node):
        yield from _tokens(child, aliases)
