"""The operator catalog: what the composers may put into a task, crawled from the installed libraries.

Crawling reads every public ``torch.nn`` module class, ``torch.nn.functional``
function and tensor function of ``torch``, and (when ``transformers`` is
installed) the norm, activation, MLP and rotary-embedding classes of a set of
model families. Signatures come from ``inspect`` or, for builtins, from the
ATen schema. Constraints that no signature states (which input ranks work,
whether the op keeps the shape, whether it is random) are found by probing:
each operator is built with arguments from ``synth.arguments`` and called on
small tensors of rank 1 to 5; an operator that never runs stays in the catalog
as unusable, with the reason. The catalog is JSON: ``Catalog.save``/``load``,
and ``default_catalog()`` caches one per installed torch version.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import inspect
import json
import random
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

__all__ = ["CATALOG_FORMAT", "PROBE_SHAPES", "TRANSFORMERS_FAMILIES", "Param", "Operator", "Catalog", "default_catalog",
           "build_catalog", "crawl_torch", "crawl_transformers", "probe"]

CATALOG_FORMAT = 1
PROBE_SHAPES = {1: (64,), 2: (4, 32), 3: (2, 8, 24), 4: (2, 8, 12, 12), 5: (2, 8, 6, 6, 6)}

# Modules that cannot be one step of a tensor -> tensor chain, and why; everything else is probed.
_MODULE_SKIP = {
    "Module": "base class", "Sequential": "container", "ModuleList": "container", "ModuleDict": "container",
    "ParameterList": "container", "ParameterDict": "container", "Container": "container",
    "Identity": "no computation", "SyncBatchNorm": "needs a process group",
    "MultiheadAttention": "returns a tuple", "Transformer": "composite model", "TransformerEncoder": "composite model",
    "TransformerDecoder": "composite model", "TransformerEncoderLayer": "composite model",
    "TransformerDecoderLayer": "composite model", "RNN": "returns a tuple", "LSTM": "returns a tuple",
    "GRU": "returns a tuple", "RNNBase": "base class", "RNNCellBase": "base class", "RNNCell": "needs a hidden state",
    "LSTMCell": "needs a hidden state", "GRUCell": "needs a hidden state", "Embedding": "needs integer indices",
    "EmbeddingBag": "needs integer indices", "AdaptiveLogSoftmaxWithLoss": "needs targets",
    "MaxUnpool1d": "needs pooling indices", "MaxUnpool2d": "needs pooling indices", "MaxUnpool3d": "needs pooling indices",
}
# Tensor functions of ``torch`` that are not tensor -> tensor computations (factories, I/O, predicates).
_TORCH_SKIP_PREFIXES = ("is_", "set_", "get_", "from_", "as_", "empty", "zeros", "ones", "full", "rand", "normal",
                        "eye", "arange", "range", "linspace", "logspace", "tensor", "load", "save", "manual_seed",
                        "use_", "compile", "vmap", "cond", "fork", "wait", "sparse", "quantize", "fake_", "native_",
                        "can_", "result_type", "promote_types", "broadcast_", "chain_", "block_diag", "cartesian_",
                        "meshgrid", "stack", "cat", "concat", "hstack", "vstack", "dstack", "column_stack",
                        "split", "chunk", "unbind", "tensor_split", "hsplit", "vsplit", "dsplit", "nonzero",
                        "unique", "where", "sym_", "numel", "typename", "dequantize", "align_", "clone",
                        "detach", "resize", "q_", "fbgemm", "mkldnn", "cudnn", "miopen", "batch_norm_",
                        "layer_norm", "group_norm", "instance_norm", "embedding", "ctc_", "nuclear_",
                        "bernoulli", "multinomial", "poisson", "histogram", "bincount", "bucketize", "searchsorted")
_FUNCTIONAL_SKIP = ("dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d",
                    "embedding", "embedding_bag", "one_hot", "grid_sample", "affine_grid", "ctc_loss",
                    "multi_head_attention_forward", "scaled_dot_product_attention", "fold", "unfold", "pad",
                    "interpolate", "upsample", "upsample_nearest", "upsample_bilinear", "max_unpool1d",
                    "max_unpool2d", "max_unpool3d", "batch_norm", "instance_norm", "group_norm", "layer_norm",
                    "rms_norm", "local_response_norm", "linear", "bilinear", "conv1d", "conv2d", "conv3d",
                    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc", "prelu")
# transformers families whose layer classes are crawled (importing all of transformers takes minutes).
TRANSFORMERS_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2", "gpt_neox",
                         "t5", "bert", "mixtral", "olmo", "falcon", "mpt", "opt")
_TRANSFORMERS_SUFFIXES = ("RMSNorm", "LayerNorm", "MLP", "RotaryEmbedding", "Attention")


@dataclass(frozen=True)
class Param:
    name: str
    annotation: str = ""
    default: Any = None  # JSON-able default; ``required`` says whether there is one
    required: bool = False

    @property
    def tensor_operand(self) -> bool:
        """A required tensor argument after the input: a function's second (third, ...) operand."""
        return self.required and ("Tensor" in self.annotation or self.name in ("other", "target", "x2", "input2"))


@dataclass
class Operator:
    """One catalog entry. ``name`` is how the task code spells it: ``nn.Conv2d``, ``F.gelu``, ``torch.diag``,
    ``transformers:llama.LlamaRMSNorm``."""

    name: str
    kind: str  # "module" | "function"
    source: str  # "torch" | "transformers"
    params: list[Param] = field(default_factory=list)
    arity: int = 1  # tensor inputs of forward / the call
    ranks: list[int] = field(default_factory=list)  # input ranks the probe ran
    keeps_shape: dict[str, bool] = field(default_factory=dict)  # rank -> output shape == input shape
    stochastic: bool = False  # two calls on the same input differed
    usable: bool = False
    reason: str = ""  # why not usable
    import_path: str = ""  # transformers: the module to import the class from

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Operator":
        data = dict(data)
        data["params"] = [Param(**p) for p in data.get("params", [])]
        return cls(**data)

    @property
    def family(self) -> str:
        """What kind of work it is, for the composers' sampling: conv, norm, pool, linear, ... ."""
        tail = self.name.rsplit(".", 1)[-1].lower()
        for family, keys in _FAMILIES:
            if any(key in tail for key in keys):
                return family
        return "elementwise" if all(self.keeps_shape.values()) and self.keeps_shape else "other"


_FAMILIES = (
    ("conv", ("conv",)), ("norm", ("norm",)), ("pool", ("pool",)), ("linear", ("linear", "bilinear", "mlp")),
    ("softmax", ("softmax", "softmin")), ("attention", ("attention",)), ("rotary", ("rotary",)),
)


@dataclass
class Catalog:
    operators: list[Operator]
    versions: dict[str, str] = field(default_factory=dict)

    def usable(self, source: str | None = None) -> list[Operator]:
        return [op for op in self.operators if op.usable and (source is None or op.source == source)]

    def get(self, name: str) -> Operator:
        for op in self.operators:
            if op.name == name:
                return op
        raise KeyError(f"{name!r} is not in the operator catalog")

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"format": CATALOG_FORMAT, "versions": self.versions,
                   "operators": [op.to_dict() for op in self.operators]}
        path.write_text(json.dumps(payload, indent=1, default=repr))

    @classmethod
    def load(cls, path: Path) -> "Catalog":
        try:
            payload = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a readable operator catalog ({exc}); rebuild it with "
                             "`cuda-agent catalog --out FILE`.") from None
        if payload.get("format") != CATALOG_FORMAT:
            raise ValueError(f"{path}: catalog format {payload.get('format')} is not {CATALOG_FORMAT}; rebuild it "
                             "with `cuda-agent catalog --out FILE`.")
        return cls([Operator.from_dict(op) for op in payload["operators"]], payload.get("versions", {}))

    def summary(self) -> str:
        lines = [f"{len(self.operators)} operators, {len(self.usable())} usable "
                 f"({', '.join(f'{k} {v}' for k, v in self.versions.items())})"]
        by_source: dict[str, list[Operator]] = {}
        for op in self.usable():
            by_source.setdefault(op.source, []).append(op)
        for source, ops in sorted(by_source.items()):
            stochastic = sum(op.stochastic for op in ops)
            lines.append(f"  {source}: {len(ops)} usable ({stochastic} stochastic)")
        return "\n".join(lines)


def default_catalog(transformers: bool = True, refresh: bool = False) -> Catalog:
    """The catalog of the installed libraries, built once per version set and cached."""
    from cuda_agent.paths import cache_root

    versions = _versions(transformers)
    tag = "-".join(f"{k}{v}" for k, v in sorted(versions.items())).replace("+", "_")
    path = cache_root() / "synth" / f"catalog-{CATALOG_FORMAT}-{tag}.json"
    if path.exists() and not refresh:
        try:
            return Catalog.load(path)
        except ValueError:
            pass
    catalog = build_catalog(transformers=transformers)
    catalog.save(path)
    return catalog


def build_catalog(transformers: bool = True, progress: Callable[[str], None] | None = None) -> Catalog:
    """Crawl and probe (a few seconds for torch; transformers adds its imports)."""
    ops = crawl_torch()
    if transformers and _versions(True).get("transformers"):
        ops += crawl_transformers()
    # Probing prints (transformers logs every config it builds): keep it off the user's terminal.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()), _quiet_transformers():
        warnings.simplefilter("ignore")
        for op in ops:
            if progress:
                progress(op.name)
            if not op.reason:
                probe(op)
    return Catalog(ops, _versions(transformers))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    try:
        from transformers.utils import logging as tf_logging
    except ImportError:
        yield
        return
    level = tf_logging.get_verbosity()
    tf_logging.set_verbosity_error()
    try:
        yield
    finally:
        tf_logging.set_verbosity(level)


def _versions(transformers: bool) -> dict[str, str]:
    import torch

    versions = {"torch": torch.__version__}
    if transformers:
        try:
            import transformers as tf

            versions["transformers"] = tf.__version__
        except ImportError:
            pass
    return versions


# -- crawling -------------------------------------------------------------------------------------

def crawl_torch() -> list[Operator]:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    ops: list[Operator] = []
    for name in sorted(dir(nn)):
        obj = getattr(nn, name)
        if not (isinstance(obj, type) and issubclass(obj, nn.Module)) or name.startswith("_"):
            continue
        op = Operator(f"nn.{name}", "module", "torch")
        if name in _MODULE_SKIP:
            op.reason = _MODULE_SKIP[name]
        elif name.startswith("Lazy") or name.endswith("Loss") or "Quant" in name:
            op.reason = "lazy module" if name.startswith("Lazy") else "loss (needs targets)" if name.endswith("Loss") \
                else "quantization stub"
        else:
            op.params = _python_params(obj.__init__)
            op.arity = _forward_arity(obj)
        ops.append(op)
    for name in sorted(dir(F)):
        obj = getattr(F, name)
        if name.startswith("_") or not callable(obj) or isinstance(obj, type) or name.endswith("_"):
            continue
        if getattr(obj, "__module__", "") in ("typing", "warnings") or name in ("Callable", "Optional"):
            continue
        op = Operator(f"F.{name}", "function", "torch")
        if name in _FUNCTIONAL_SKIP or name.endswith("loss") or "dropout" in name:
            op.reason = "covered by its module or needs extra structure" if "dropout" not in name else "stochastic"
            op.stochastic = "dropout" in name
        else:
            op.params, op.arity = _function_params(obj, name)
        ops.append(op)
    for name in sorted(dir(torch)):
        obj = getattr(torch, name)
        if name.startswith("_") or name.endswith("_") or isinstance(obj, type) or not callable(obj):
            continue
        if name.startswith(_TORCH_SKIP_PREFIXES) or not _has_schema(name):
            continue
        op = Operator(f"torch.{name}", "function", "torch")
        op.params, op.arity = _function_params(obj, name)
        ops.append(op)
    return ops


def crawl_transformers() -> list[Operator]:
    ops: list[Operator] = []
    activations = importlib.import_module("transformers.activations")
    for name in sorted(dir(activations)):
        obj = getattr(activations, name)
        if isinstance(obj, type) and obj.__module__ == activations.__name__ and hasattr(obj, "forward"):
            op = Operator(f"transformers:activations.{name}", "module", "transformers",
                          import_path="transformers.activations")
            op.params = _python_params(obj.__init__)
            op.arity = _forward_arity(obj)
            ops.append(op)
    for family in TRANSFORMERS_FAMILIES:
        path = f"transformers.models.{family}.modeling_{family}"
        try:
            module = importlib.import_module(path)
        except Exception:  # noqa: BLE001 - a family this transformers lacks, or one that needs extras
            continue
        for name in sorted(dir(module)):
            obj = getattr(module, name)
            if not (isinstance(obj, type) and obj.__module__ == path and name.endswith(_TRANSFORMERS_SUFFIXES)):
                continue
            op = Operator(f"transformers:{family}.{name}", "module", "transformers", import_path=path)
            op.params = _python_params(obj.__init__)
            op.arity = _forward_arity(obj)
            ops.append(op)
    return ops


def _python_params(fn: Callable[..., Any]) -> list[Param]:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    params = []
    for p in signature.parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        annotation = "" if p.annotation is p.empty else (p.annotation if isinstance(p.annotation, str)
                                                           else getattr(p.annotation, "__name__", str(p.annotation)))
        default = None if p.default is p.empty else _jsonable(p.default)
        params.append(Param(p.name, str(annotation), default, p.default is p.empty))
    return params


def _forward_arity(cls: type) -> int:
    try:
        signature = inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return 1
    required = [p for p in signature.parameters.values()
                if p.name != "self" and p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return max(1, len(required))


def _function_params(fn: Callable[..., Any], name: str) -> tuple[list[Param], int]:
    """Parameters after the first tensor; the arity counts required tensor parameters."""
    params = _python_params(fn)
    if not params:
        params = _schema_params(name)
    if not params:
        return [], 1
    rest = params[1:]
    arity = 1 + sum(1 for p in rest if p.tensor_operand)
    return rest, arity


def _has_schema(name: str) -> bool:
    import torch

    schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}")
    return any(s.arguments and str(s.arguments[0].type) == "Tensor" and str(s.returns[0].type) == "Tensor"
               for s in schemas if len(s.returns) == 1)


def _schema_params(name: str) -> list[Param]:
    import torch

    for schema in torch._C._jit_get_schemas_for_operator(f"aten::{name}"):
        if "out" in schema.overload_name or not schema.arguments or str(schema.arguments[0].type) != "Tensor":
            continue
        return [Param(a.name, str(a.type), _jsonable(a.default_value) if a.has_default_value() else None,
                      not a.has_default_value()) for a in schema.arguments]
    return []


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    return repr(value)


# -- probing --------------------------------------------------------------------------------------

def probe(op: Operator, ranks: Iterable[int] = (1, 2, 3, 4, 5)) -> Operator:
    """Find the input ranks ``op`` runs on, whether it keeps the shape, and whether it is random."""
    import torch

    from cuda_agent.synth.arguments import ArgumentError, instantiate, resolve_arguments

    errors: list[str] = []
    for rank in ranks:
        shape = PROBE_SHAPES[rank]
        rng = random.Random(rank)
        try:
            kwargs = resolve_arguments(op, shape, rng, sizes=(8, 16))
            call, params = instantiate(op, kwargs, shape)
            x = torch.randn(shape)
            others = [torch.randn(p) for p in params]
            torch.manual_seed(0)
            with torch.no_grad():
                out = call(x, *others)
        except ArgumentError as exc:
            errors.append(f"rank {rank}: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - the probe's whole point is to find what fails
            errors.append(f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
            continue
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.numel() == 0:
            errors.append(f"rank {rank}: returns {type(out).__name__ if not isinstance(out, torch.Tensor) else out.dtype}")
            continue
        op.ranks.append(rank)
        op.keeps_shape[str(rank)] = tuple(out.shape) == tuple(shape)
        if len(op.ranks) == 1:
            torch.manual_seed(1)
            with torch.no_grad():
                again = call(x, *others)
            op.stochastic = not bool(((out == again) | (out.isnan() & again.isnan())).all())
    op.usable = bool(op.ranks)
    op.reason = "" if op.usable else "; ".join(errors[:2]) or "never ran"
    return op
