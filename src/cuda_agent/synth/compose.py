"""The programmatic composer: operator chains from the catalog, written out as KernelBench programs.

Candidate ``index`` of a run with ``seed`` is a pure function of both (its own
``random.Random``), so a run is reproducible and a resumed run composes exactly
what it would have. Shapes and arguments are resolved by running each step on
``meta`` tensors at full size: the shape checks torch does, with no
computation; the execution filters then run the program for real.
"""

from __future__ import annotations

import random
import re
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from cuda_agent.synth.arguments import CONFIG_KEY, ArgumentError, instantiate, resolve_arguments
from cuda_agent.synth.catalog import Catalog, Operator

# Share of tasks by operator count in CUDA-Agent-Ops-6K (the paper); "transformers" rows are standalone.
PAPER_OP_COUNTS = {"1": 3.40, "2": 83.77, "3": 7.62, "4": 2.80, "5": 1.23, "transformers": 1.18}
# How often each kind of work starts or joins a chain: the catalog has hundreds of elementwise
# functions and a handful of convolutions, and tasks worth a kernel mix both.
FAMILY_WEIGHTS = {"conv": 4.0, "linear": 3.0, "norm": 2.0, "pool": 1.5, "softmax": 1.5, "elementwise": 2.0,
                  "other": 1.0, "attention": 1.0, "rotary": 1.0}
# Names of the input's dimensions by rank: the module-level constants of the generated program.
_ROLE_NAMES = {1: ("n",), 2: ("batch_size", "features"), 3: ("batch_size", "channels", "length"),
               4: ("batch_size", "channels", "height", "width"), 5: ("batch_size", "channels", "depth", "height", "width")}
# Constructor arguments passed through ``get_init_inputs`` (KernelBench style); the rest are literals.
_INIT_ARGS = ("in_channels", "out_channels", "in_features", "out_features", "num_features", "num_channels",
              "num_groups", "kernel_size", "normalized_shape", "hidden_size")


class ComposeError(RuntimeError):
    """The composer could not make a program for this index."""


@dataclass(frozen=True)
class SizeProfile:
    """Input sizes per rank as (low, high) ranges, and a cap on any tensor's elements (weights included)."""

    name: str
    dims: dict[int, tuple[tuple[int, int], ...]]
    widths: tuple[int, ...]  # output channels / features
    max_elements: int

    @classmethod
    def for_device(cls, device: str) -> "SizeProfile":
        if device == "cuda":
            return cls("cuda", {
                1: ((1 << 22, 1 << 26),),
                2: ((512, 8192), (512, 8192)),
                3: ((16, 128), (32, 256), (256, 4096)),
                4: ((16, 128), (16, 128), (32, 256), (32, 256)),
                5: ((4, 32), (8, 64), (8, 32), (32, 128), (32, 128)),
            }, (64, 128, 256, 512), 1 << 28)
        return cls("cpu", {
            1: ((1 << 14, 1 << 17),),
            2: ((16, 128), (64, 512)),
            3: ((4, 16), (8, 32), (64, 256)),
            4: ((2, 8), (4, 16), (16, 48), (16, 48)),
            5: ((2, 4), (4, 8), (4, 12), (8, 24), (8, 24)),
        }, (8, 16, 32), 1 << 21)

    def shape(self, rank: int, rng: random.Random) -> tuple[int, ...]:
        dims = []
        for low, high in self.dims[rank]:
            value = int(round(2 ** rng.uniform(low.bit_length() - 1, high.bit_length() - 1)))
            dims.append(max(low, min(high, value // 8 * 8 if value >= 16 else value)))
        if rank >= 4:  # square images, as in most KernelBench tasks
            dims[-1] = dims[-2]
        return tuple(dims)


@dataclass
class Step:
    op: str
    kwargs: dict[str, Any]
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    operand: str | None = None  # "input" | "param": where a two-input op's other tensor comes from
    operand_shape: tuple[int, ...] | None = None


@dataclass
class Program:
    """A composed candidate task and what made it."""

    id: str
    code: str
    ops: list[str]
    data_source: str
    composer: str
    seed: int
    index: int
    input_shapes: list[list[int]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sample_op_count(rng: random.Random, transformers: bool) -> str:
    counts = {k: v for k, v in PAPER_OP_COUNTS.items() if transformers or k != "transformers"}
    return rng.choices(list(counts), weights=list(counts.values()))[0]


class ProgramComposer:
    """Samples operator chains and resolves them; no model needed."""

    name = "program"

    def __init__(self, catalog: Catalog, profile: SizeProfile, seed: int = 0, max_tries: int = 40):
        self.catalog = catalog
        self.profile = profile
        self.seed = seed
        self.max_tries = max_tries
        self._torch_ops = [op for op in catalog.usable("torch")]
        self._transformers_ops = catalog.usable("transformers")
        if not self._torch_ops:
            raise ValueError("the operator catalog has no usable torch operator; rebuild it (`cuda-agent catalog`).")
        self._by_family: dict[str, list[Operator]] = {}
        for op in self._torch_ops:
            self._by_family.setdefault(op.family, []).append(op)

    def compose(self, index: int) -> Program:
        rng = random.Random(f"{self.seed}:{index}")
        count = sample_op_count(rng, bool(self._transformers_ops))
        last_error = "no attempt"
        for _ in range(self.max_tries):
            try:
                if count == "transformers":
                    steps = self._chain(rng, 1, pool=self._transformers_ops)
                    source = "transformers"
                else:
                    steps = self._chain(rng, int(count))
                    source = f"torch#{count}"
            except ComposeError as exc:
                last_error = str(exc)
                continue
            code = render(steps, self.catalog)
            return Program(id=program_id(self.name, self.seed, index), code=code, ops=[s.op for s in steps],
                           data_source=source, composer=self.name, seed=self.seed, index=index,
                           input_shapes=input_shapes(steps), steps=[_step_dict(s) for s in steps])
        raise ComposeError(f"no valid chain after {self.max_tries} tries (last: {last_error})")

    def _pick(self, rng: random.Random, rank: int | None, pool: list[Operator] | None) -> Operator:
        if pool is not None:
            candidates = [op for op in pool if rank is None or rank in op.ranks]
        else:
            families = [f for f, ops in self._by_family.items() if any(rank is None or rank in op.ranks for op in ops)]
            if not families:
                raise ComposeError(f"no operator takes a rank-{rank} input")
            family = rng.choices(families, weights=[FAMILY_WEIGHTS.get(f, 1.0) for f in families])[0]
            candidates = [op for op in self._by_family[family] if rank is None or rank in op.ranks]
        if not candidates:
            raise ComposeError(f"no operator takes a rank-{rank} input")
        return rng.choice(candidates)

    def _chain(self, rng: random.Random, length: int, pool: list[Operator] | None = None) -> list[Step]:
        first = self._pick(rng, None, pool)
        ranks = [r for r in first.ranks if r in self.profile.dims]
        if not ranks:
            raise ComposeError(f"{first.name} runs on no rank the size profile has")
        # Image-like inputs for image operators, as KernelBench does.
        rank = max(ranks) if first.family in ("conv", "pool", "norm") and 4 in ranks and rng.random() < 0.7 else rng.choice(ranks)
        shape = self.profile.shape(rank, rng)
        steps: list[Step] = []
        op = first
        for position in range(length):
            if position:
                op = self._pick(rng, len(shape), pool)
            step = self._resolve(op, shape, rng)
            steps.append(step)
            shape = step.out_shape
            if position < length - 1 and len(shape) == 0:
                raise ComposeError(f"{op.name} reduces to a scalar before the chain ends")
        if any(s.op == steps[0].op for s in steps[1:]) and len(steps) == 2:
            raise ComposeError("the same operator twice")
        return steps

    def _resolve(self, op: Operator, shape: tuple[int, ...], rng: random.Random) -> Step:
        import torch

        try:
            kwargs = resolve_arguments(op, shape, rng, sizes=self.profile.widths)
        except ArgumentError as exc:
            raise ComposeError(str(exc)) from None
        operand = operand_shape = None
        try:
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                call, others = instantiate(op, kwargs, shape)
                if others:
                    operand = "param" if rng.random() < 0.5 else "input"
                    operand_shape = _broadcast_shape(shape, rng) if operand == "param" and op.kind == "function" else shape
                    extra = [torch.empty(operand_shape)]
                else:
                    extra = []
                out = call(torch.empty(shape), *extra)
        except Exception as exc:  # noqa: BLE001 - any failure means this choice does not fit
            raise ComposeError(f"{op.name} at {list(shape)}: {type(exc).__name__}: {str(exc)[:100]}") from None
        # The cap holds for weights too: nn.Bilinear on a rank-1 input of 21672 made an 8x21672x21672 weight
        # (15 GB) whose initialisation alone took a CPU screening process two minutes, and its rescaled
        # retry as long again, for a program no GPU could hold either.
        if isinstance(call, torch.nn.Module):
            biggest = max((t.numel() for t in (*call.parameters(), *call.buffers())), default=0)
            if biggest > self.profile.max_elements:
                raise ComposeError(f"{op.name} at {list(shape)}: a {biggest}-element weight is outside the size profile")
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise ComposeError(f"{op.name} does not return a floating tensor")
        if out.numel() > self.profile.max_elements or out.numel() == 0:
            raise ComposeError(f"{op.name} output {list(out.shape)} is outside the size profile")
        return Step(op.name, kwargs, tuple(shape), tuple(out.shape), operand, operand_shape)


def _broadcast_shape(shape: tuple[int, ...], rng: random.Random) -> tuple[int, ...]:
    """A learned per-channel (or per-feature) operand, as KernelBench's bias/scale parameters."""
    if len(shape) >= 3 and rng.random() < 0.7:
        return (shape[1],) + (1,) * (len(shape) - 2)
    return (shape[-1],)


def program_id(composer: str, seed: int, index: int) -> str:
    return f"{composer}-{seed}-{index:06d}"


def input_shapes(steps: list[Step]) -> list[list[int]]:
    shapes = [list(steps[0].in_shape)]
    shapes += [list(s.operand_shape or s.in_shape) for s in steps if s.operand == "input"]
    return shapes


def _step_dict(step: Step) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(step).items()}


# -- rendering ------------------------------------------------------------------------------------

def _literal(value: Any) -> str:
    if isinstance(value, dict) and CONFIG_KEY in value:
        fields = ", ".join(f"{k}={_literal(v)}" for k, v in value.items() if k != CONFIG_KEY)
        return f"AutoConfig.for_model({value[CONFIG_KEY]!r}, {fields})"
    if isinstance(value, tuple):
        value = list(value)
    return repr(value)


def _attr_name(op: str, taken: set[str]) -> str:
    base = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", op.rsplit(".", 1)[-1]).lower().strip("_")
    name, n = base or "op", 2
    while name in taken:
        name, n = f"{base}{n}", n + 1
    taken.add(name)
    return name


def _dims(shape: tuple[int, ...], lead: int, lead_name: str) -> str:
    """An extra input's sizes, its batch dimension by name so that ``rescale`` changes it too."""
    dims = [str(d) for d in shape]
    if len(shape) > 1 and shape[0] == lead:
        dims[0] = lead_name
    return ", ".join(dims)


def rescale(program: Program, lead: int) -> Program:
    """The same program with its leading input size (the batch) set to ``lead``."""
    name = _ROLE_NAMES[len(program.input_shapes[0])][0]
    code, found = re.subn(rf"^{name} = \d+$", f"{name} = {lead}", program.code, count=1, flags=re.M)
    if not found:
        raise ComposeError(f"{program.id}: no `{name} = N` line to rescale")
    shapes = [[lead, *s[1:]] if s and s[0] == program.input_shapes[0][0] else s for s in program.input_shapes]
    return Program(**(program.to_dict() | {"code": code, "input_shapes": shapes}))


def render(steps: list[Step], catalog: Catalog) -> str:
    """KernelBench-format source: sizes as module-level constants, sized constructor arguments
    through ``get_init_inputs``."""
    rank = len(steps[0].in_shape)
    roles = list(_ROLE_NAMES[rank])
    constants: list[tuple[str, Any]] = list(zip(roles, steps[0].in_shape))
    init_params: list[str] = []
    init_lines: list[str] = []
    forward_lines: list[str] = []
    forward_args = ["x"]
    extra_inputs: list[tuple[int, ...]] = []
    taken = set(roles) | {"x", "self"}
    imports: set[str] = set()
    for i, step in enumerate(steps):
        op = catalog.get(step.op)
        if op.source == "transformers":
            cls = op.name.rsplit(".", 1)[-1]
            imports.add(f"from {op.import_path} import {cls}")
            if any(isinstance(v, dict) and CONFIG_KEY in v for v in step.kwargs.values()):
                imports.add("from transformers import AutoConfig")
            callee = cls
        else:
            callee = op.name
        args: list[str] = []
        for key, value in step.kwargs.items():
            if op.kind == "module" and key in _INIT_ARGS:
                name = key if key not in taken else _attr_name(f"{key}_{i + 1}", taken)
                taken.add(name)
                init_params.append(name)
                constants.append((name, value))
                args.append(f"{key}={name}")
            else:
                args.append(f"{key}={_literal(value)}")
        operand = ""
        if step.operand == "param":
            pname = _attr_name(f"weight_{i + 1}" if op.kind == "module" else f"bias_{i + 1}", taken)
            init_lines.append(f"self.{pname} = nn.Parameter(torch.randn({_literal(step.operand_shape)}))")
            operand = f", self.{pname}"
        elif step.operand == "input":
            arg = _attr_name(f"y{i + 1}", taken)
            forward_args.append(arg)
            extra_inputs.append(step.operand_shape or step.in_shape)
            operand = f", {arg}"
        if op.kind == "module":
            attr = _attr_name(op.name.rsplit(".", 1)[-1], taken)
            init_lines.append(f"self.{attr} = {callee}({', '.join(args)})")
            forward_lines.append(f"x = self.{attr}(x{operand})")
        else:
            forward_lines.append(f"x = {callee}(x{operand}{''.join(', ' + a for a in args)})")
    chain = " -> ".join(s.op for s in steps)
    header = ["import torch", "import torch.nn as nn", "import torch.nn.functional as F", *sorted(imports)]
    body = [
        *header, "", "",
        "class Model(nn.Module):",
        f'    """{chain}"""',
        "",
        f"    def __init__(self{''.join(', ' + p for p in init_params)}):",
        "        super().__init__()",
        *(f"        {line}" for line in init_lines),
        "",
        f"    def forward(self, {', '.join(forward_args)}):",
        *(f"        {line}" for line in forward_lines),
        "        return x",
        "", "",
        *(f"{name} = {_literal(value)}" for name, value in constants),
        "", "",
        "def get_inputs():",
        f"    return [torch.randn({', '.join(roles)})"
        + "".join(f", torch.randn({_dims(s, steps[0].in_shape[0], roles[0])})" for s in extra_inputs) + "]",
        "", "",
        "def get_init_inputs():",
        f"    return [{', '.join(init_params)}]",
        "",
    ]
    return "\n".join(body)
