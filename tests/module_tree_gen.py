"""Random module trees for tests/test_module_trees.py: a spec, the model it describes, its batch and its loss.

A :class:`TreeSpec` is plain data (frozen dataclasses of ints, bools and strings), so hypothesis can
draw and shrink it, it goes to the workers as JSON (``dataclasses.asdict``, back by
:func:`spec_from_dict`), and it prints as the constructor call that rebuilds it, so a failing one
is pasted into a regression test as it is. Everything below is deterministic from
the spec: :func:`build` after ``torch.manual_seed(spec.seed)`` makes the same weights every time,
and :func:`batch` draws from its own generator seeded by ``spec.seed``.

The model (``TreeModel``), top to bottom::

    input        Embedding(VOCAB, C) of ids (B, T), or Linear(IN_DIM, C) of vectors (B, T, IN_DIM)
    mix          optional root Linear(C, C) applied before the stages and again after them (one module, two uses)
    outside uses "before": a layer's sub-module, parameter, its .shape or .data used by the model itself,
                 with autograd or under no_grad (see OutsideUse)
    stages       1-3 stages (a stage may run under no_grad), each reached through `depth` levels of modules:
                   depth 1: model.stage{i} is the container, iterated by the model's forward
                   depth 2: model.stage{i} is a Stage holding .layers, iterated by the Stage's forward
                   depth 3: model.stage{i} is a Wrapper (own gate parameter) around such a Stage
                 containers: ModuleList, Sequential (iterated, or called whole), ModuleDict,
                 a ModuleList of ModuleLists (iterated list by list, layer by layer), or one Layer;
                 first and last layer may share a module or a weight; some layers may be frozen
    again        optional: the first stage once more, registered a second time as model.again
    outside uses "after"
    aux          h + 0.1 * sum of the layers' auxiliary outputs (layers returning tuples or dicts)
    final norm   a LayerNorm, or (final_norm False) the same normalisation without parameters: the
                 head's input stays bounded, so SGD at lr 0.1 does not diverge (it did, without one, on
                 deep stacks of vectors: losses of 1e6 after three steps, where float32 rounding alone
                 exceeds any absolute limit)
    head         Linear(C, VOCAB), tied to the embedding (same Parameter) or a matmul with the
                 embedding's weight; Linear(C, OUT_DIM) for vectors

Shapes stay tiny (C in 4-12, B = 6 so that a batch splits evenly over 1, 2 or 3 ranks, T = 3). The
loss is a mean over the batch's samples (cross entropy over every token, or mean squared error), so
the mean of the ranks' losses on their equal shares is the whole batch's loss.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 11
IN_DIM, OUT_DIM = 5, 3
BATCH = 6  # divisible by world sizes 1, 2 and 3
SEQ = 3

NORMS = ("layer", "rms")
KWARGS = ("none", "float", "tensor")
RETURNS = ("tensor", "tuple", "dict")
CONTAINERS = ("list", "sequential", "dict", "nested", "single")
CALLS = ("loop", "reverse", "repeat", "whole", "alternate")
SHARES = ("none", "module", "weight")
FROZEN = ("none", "all", "norms", "first")
OUTSIDE_KINDS = ("mlp", "norm", "norm_weight", "unused", "weight_shape", "weight_data")
INPUTS = ("tokens", "vectors")
HEADS = ("linear", "tied", "matmul")

Batch = Dict[str, torch.Tensor]


# --- the spec ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerSpec:
    """The repeated layer: ``h + scale * gain * gate * experts(mlp(buffers(norm(h))))``.

    Attributes:
        norm: "layer" (``nn.LayerNorm``) or "rms" (:class:`RMSNorm`, which multiplies by its weight itself).
        hidden: the MLP's inner width.
        experts: 0, or how many :class:`Expert` modules a ModuleList inside the layer holds
            (repeated modules inside a repeated layer: detection keeps the outermost).
        buffers: a persistent ``scale`` and a non-persistent ``shift`` buffer, both used in forward.
        kwarg: what the caller passes by keyword: "none", "float" (``scale=``) or "tensor"
            (``gate=``, computed by the caller from ``h``, so it needs a gradient).
        returns: "tensor", "tuple" ``(h, aux)`` or "dict" ``{"hidden": h, "aux": aux}``; aux is (B, T, 1).
        gain: a 0-dim parameter ``gain`` (one element: at world size 3 two ranks hold none of it).
    """

    norm: str = "layer"
    hidden: int = 8
    experts: int = 0
    buffers: bool = False
    kwarg: str = "none"
    returns: str = "tensor"
    gain: bool = False


@dataclass(frozen=True)
class StageSpec:
    """A container of layers, how deep it sits and how it is called.

    Attributes:
        container: "list", "sequential", "dict" (``ModuleDict`` "l0", "l1", ...), "nested" (a
            ModuleList of ``n`` ModuleLists of ``n_inner`` layers each) or "single" (one Layer, no container).
        n: layers in the container (nested: inner lists); 1 for "single".
        n_inner: layers per inner list of "nested"; 1 otherwise.
        depth: 1-3, see the module docstring.
        call: the order the layers run: "loop" (module order), "reverse", "repeat" (module
            order, then the first layer once more), "whole" (a Sequential called as one module),
            or "alternate" (every other layer from the first: the others never run, so their
            parameters get no gradient).
        share: "module" (the last layer's ``mlp.up`` is the first layer's Linear), "weight" (the
            last layer's ``mlp.down.weight`` is the first layer's Parameter), or "none".
        frozen: "all" (every layer parameter), "norms" (each layer's norm), "first" (the first
            layer), or "none": ``requires_grad=False`` on those.
        no_grad: the stage runs under ``torch.no_grad()`` (a frozen feature extractor): its
            layers run forward in a training step but never backward.
    """

    layer: LayerSpec = LayerSpec()
    container: str = "list"
    n: int = 2
    n_inner: int = 1
    depth: int = 1
    call: str = "loop"
    share: str = "none"
    frozen: str = "none"
    no_grad: bool = False

    @property
    def n_layers(self) -> int:
        return self.n * self.n_inner


@dataclass(frozen=True)
class OutsideUse:
    """The model using a sub-module or parameter of one of its layers directly (not through the layer).

    Attributes:
        kind: "mlp" (``h + 0.5 * layer.mlp(h)``), "norm" (``h + layer.norm(h)``), "norm_weight"
            (``h * layer.norm.weight``), "unused" (``layer.mlp(h)`` computed and dropped: a
            forward that no backward reaches), "weight_shape" (``h[..., :layer.mlp.down.weight.shape[0]]``,
            all of h when the shape read is the full one) or "weight_data" (``h * layer.norm.weight.data``:
            the value, outside autograd).
        no_grad: the use runs under ``torch.no_grad()``, and what it adds to ``h`` is a constant
            (``h`` itself keeps its history).
        stage: which stage's layer.
        layer: "first" or "last" layer of that stage, in module order.
        at: "before" or "after" the stages run.
    """

    kind: str = "mlp"
    stage: int = 0
    layer: str = "first"
    at: str = "after"
    no_grad: bool = False


@dataclass(frozen=True)
class TreeSpec:
    """One model, its data and how it is wrapped.

    Attributes:
        seed: seeds the weights (``torch.manual_seed``) and the batch.
        dim: the width C of the residual stream.
        inputs: "tokens" (an embedding) or "vectors" (a Linear).
        head: "linear", "tied" (a Linear whose weight is the embedding's Parameter) or "matmul"
            (``h @ embed.weight.T``); the last two need "tokens".
        stages: the stages, run in order.
        outside: the model's direct uses of its layers' parts.
        mix: a root Linear used twice per forward.
        again: the first stage's module is registered a second time, as ``model.again``, and run
            again after the stages (one module under two names, as ALBERT shares its layers).
        final_norm: a root LayerNorm before the head (without: a normalisation without parameters).
        frozen_input: the embedding (or input Linear) frozen; needs head "linear".
        checkpoint, zero_level: ``bmtwrap.wrap``'s options.
    """

    stages: Tuple[StageSpec, ...] = (StageSpec(),)
    seed: int = 0
    dim: int = 8
    inputs: str = "tokens"
    head: str = "linear"
    outside: Tuple[OutsideUse, ...] = ()
    mix: bool = False
    again: bool = False
    final_norm: bool = False
    frozen_input: bool = False
    checkpoint: bool = True
    zero_level: int = 3


def _choice(name: str, value: Any, allowed: Tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def validate(spec: TreeSpec) -> None:
    """Raise ``ValueError`` naming the field of a spec that describes no model (the strategy draws
    only valid ones; hand-written regression specs go through this too)."""
    _choice("inputs", spec.inputs, INPUTS)
    _choice("head", spec.head, HEADS)
    if not 4 <= spec.dim <= 12:
        raise ValueError(f"dim must be in 4..12, got {spec.dim}")
    if spec.head != "linear" and spec.inputs != "tokens":
        raise ValueError(f"head {spec.head!r} ties to the embedding: it needs inputs 'tokens', got {spec.inputs!r}")
    if spec.frozen_input and spec.head != "linear":
        raise ValueError("frozen_input needs head 'linear' (a tied head would be frozen with the embedding)")
    if not 1 <= len(spec.stages) <= 3:
        raise ValueError(f"a tree has 1 to 3 stages, got {len(spec.stages)}")
    for stage in spec.stages:
        _validate_stage(stage)
    for use in spec.outside:
        _choice("outside kind", use.kind, OUTSIDE_KINDS)
        _choice("outside layer", use.layer, ("first", "last"))
        _choice("outside at", use.at, ("before", "after"))
        if not 0 <= use.stage < len(spec.stages):
            raise ValueError(f"an outside use names stage {use.stage}; the tree has {len(spec.stages)}")


def _validate_stage(stage: StageSpec) -> None:
    layer = stage.layer
    _choice("norm", layer.norm, NORMS)
    _choice("kwarg", layer.kwarg, KWARGS)
    _choice("returns", layer.returns, RETURNS)
    _choice("container", stage.container, CONTAINERS)
    _choice("call", stage.call, CALLS)
    _choice("share", stage.share, SHARES)
    _choice("frozen", stage.frozen, FROZEN)
    if not 4 <= layer.hidden <= 12 or layer.experts not in (0, 2, 3):
        raise ValueError(f"hidden must be in 4..12 and experts 0, 2 or 3; got {layer.hidden}, {layer.experts}")
    if not 1 <= stage.depth <= 3 or not 1 <= stage.n <= 3 or not 1 <= stage.n_inner <= 3:
        raise ValueError(f"depth, n and n_inner must be in 1..3, got {stage.depth}, {stage.n}, {stage.n_inner}")
    if stage.container != "nested" and stage.n_inner != 1:
        raise ValueError(f"n_inner is for container 'nested' only, got {stage.n_inner} with {stage.container!r}")
    if stage.container == "single" and stage.n != 1:
        raise ValueError(f"container 'single' holds one layer, got n={stage.n}")
    if stage.call == "whole" and (stage.container != "sequential" or layer.returns != "tensor" or layer.kwarg != "none"):
        raise ValueError("call 'whole' needs a Sequential of layers that take one tensor and return one")
    if stage.share != "none" and stage.n_layers < 2:
        raise ValueError(f"share {stage.share!r} needs two layers, the stage has {stage.n_layers}")


# --- the modules ------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _layer_norm(dim: int) -> nn.LayerNorm:
    norm = nn.LayerNorm(dim)
    with torch.no_grad():  # away from ones and zeros, so that a norm weight used as a scale matters
        norm.weight.add_(0.1 * torch.randn(dim))
        norm.bias.add_(0.1 * torch.randn(dim))
    return norm


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


class Layer(nn.Module):
    """See :class:`LayerSpec`."""

    def __init__(self, dim: int, spec: LayerSpec) -> None:
        super().__init__()
        self.returns = spec.returns
        self.norm = _layer_norm(dim) if spec.norm == "layer" else RMSNorm(dim)
        self.mlp = MLP(dim, spec.hidden)
        self.experts = nn.ModuleList([Expert(dim) for _ in range(spec.experts)]) if spec.experts else None
        self.gain = nn.Parameter(torch.tensor(0.9)) if spec.gain else None
        if spec.buffers:
            self.register_buffer("scale", 1 + 0.1 * torch.randn(dim))
            self.register_buffer("shift", 0.1 * torch.randn(dim), persistent=False)
        else:
            self.scale = self.shift = None

    def forward(self, h: torch.Tensor, *, scale: float = 1.0, gate: Optional[torch.Tensor] = None) -> Any:
        x = self.norm(h)  # (B, T, C)
        if self.scale is not None:
            x = x * self.scale + self.shift
        y = self.mlp(x)
        for expert in self.experts or ():
            y = y + 0.5 * expert(y)
        if gate is not None:
            y = y * gate  # gate: (B, T, 1)
        if self.gain is not None:
            y = y * self.gain
        h = h + scale * y
        aux = y.pow(2).mean(-1, keepdim=True)  # (B, T, 1)
        if self.returns == "tuple":
            return h, aux
        if self.returns == "dict":
            return {"hidden": h, "aux": aux}
        return h


def _container(dim: int, spec: StageSpec) -> nn.Module:
    def layers(count: int) -> List[Layer]:
        return [Layer(dim, spec.layer) for _ in range(count)]

    if spec.container == "list":
        return nn.ModuleList(layers(spec.n))
    if spec.container == "sequential":
        return nn.Sequential(*layers(spec.n))
    if spec.container == "dict":
        return nn.ModuleDict({f"l{i}": layer for i, layer in enumerate(layers(spec.n))})
    if spec.container == "nested":
        return nn.ModuleList([nn.ModuleList(layers(spec.n_inner)) for _ in range(spec.n)])
    return Layer(dim, spec.layer)


def layers_of(container: nn.Module) -> List[nn.Module]:
    """A container's layers in module order (a nested container's list by list)."""
    if isinstance(container, Layer):
        return [container]
    if isinstance(container, nn.ModuleDict):
        return list(container.values())
    if isinstance(container[0], nn.ModuleList):
        return [layer for inner in container for layer in inner]
    return list(container)


def _share_and_freeze(container: nn.Module, spec: StageSpec) -> None:
    layers = layers_of(container)
    first, last = layers[0], layers[-1]
    if spec.share == "module":
        last.mlp.up = first.mlp.up
    elif spec.share == "weight":
        last.mlp.down.weight = first.mlp.down.weight
    frozen: List[nn.Module] = {"none": [], "all": layers, "norms": [layer.norm for layer in layers],
                               "first": [first]}[spec.frozen]
    for module in frozen:
        module.requires_grad_(False)


def run_stage(container: nn.Module, spec: StageSpec, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Run a stage's layers on ``h`` (B, T, C) as its spec says; returns ``h`` and the summed aux (B, T, 1)."""
    aux = torch.zeros_like(h[..., :1])
    if spec.call == "whole":
        return container(h), aux
    layers = layers_of(container)
    order = {"loop": layers, "reverse": layers[::-1], "repeat": layers + layers[:1], "alternate": layers[::2]}[spec.call]
    for i, layer in enumerate(order):
        kwargs: Dict[str, Any] = {}
        if spec.layer.kwarg == "float":
            kwargs["scale"] = 0.5 + 0.25 * i
        elif spec.layer.kwarg == "tensor":
            kwargs["gate"] = torch.sigmoid(h.mean(-1, keepdim=True))  # (B, T, 1)
        out = layer(h, **kwargs)
        if spec.layer.returns == "tuple":
            h, extra = out
            aux = aux + extra
        elif spec.layer.returns == "dict":
            h, aux = out["hidden"], aux + out["aux"]
        else:
            h = out
    return h, aux


class Stage(nn.Module):
    """Holds a container as ``.layers`` and runs it (depth 2)."""

    def __init__(self, dim: int, spec: StageSpec) -> None:
        super().__init__()
        self.spec = spec
        self.layers = _container(dim, spec)

    def forward(self, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return run_stage(self.layers, self.spec, h)


class Wrapper(nn.Module):
    """A Stage one level further down, with a gate parameter of its own (depth 3)."""

    def __init__(self, dim: int, spec: StageSpec) -> None:
        super().__init__()
        self.inner = Stage(dim, spec)
        self.gate = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h, aux = self.inner(h)
        return h * self.gate, aux


def _stage_module(dim: int, spec: StageSpec) -> nn.Module:
    if spec.depth == 1:
        return _container(dim, spec)
    return Stage(dim, spec) if spec.depth == 2 else Wrapper(dim, spec)


def container_of(stage: nn.Module, spec: StageSpec) -> nn.Module:
    """The container under a stage module of the given depth."""
    return {1: lambda: stage, 2: lambda: stage.layers, 3: lambda: stage.inner.layers}[spec.depth]()


def _use(layer: Layer, kind: str, h: torch.Tensor) -> torch.Tensor:
    """``h`` after the model's direct use ``kind`` of ``layer``'s parts (see :class:`OutsideUse`)."""
    if kind == "mlp":
        return h + 0.5 * layer.mlp(h)
    if kind == "unused":
        layer.mlp(h)
        return h
    if kind == "norm":
        return h + layer.norm(h)
    if kind == "norm_weight":
        return h * layer.norm.weight
    if kind == "weight_shape":
        return h[..., :layer.mlp.down.weight.shape[0]]
    return h * layer.norm.weight.data


class TreeModel(nn.Module):
    """The model a :class:`TreeSpec` describes (see the module docstring)."""

    def __init__(self, spec: TreeSpec) -> None:
        super().__init__()
        validate(spec)
        self.spec = spec
        dim = spec.dim
        if spec.inputs == "tokens":
            self.embed = nn.Embedding(VOCAB, dim)
        else:
            self.inp = nn.Linear(IN_DIM, dim)
        self.mix = nn.Linear(dim, dim) if spec.mix else None
        for i, stage_spec in enumerate(spec.stages):
            stage = _stage_module(dim, stage_spec)
            _share_and_freeze(container_of(stage, stage_spec), stage_spec)
            self.add_module(f"stage{i}", stage)
        if spec.again:
            self.again = self.stage0
        self.norm = _layer_norm(dim) if spec.final_norm else None
        if spec.head != "matmul":
            self.head = nn.Linear(dim, VOCAB if spec.inputs == "tokens" else OUT_DIM, bias=spec.head == "linear")
        if spec.head == "tied":
            self.head.weight = self.embed.weight
        if spec.frozen_input:
            (self.embed if spec.inputs == "tokens" else self.inp).requires_grad_(False)

    def _layer(self, use: OutsideUse) -> Layer:
        stage_spec = self.spec.stages[use.stage]
        layers = layers_of(container_of(getattr(self, f"stage{use.stage}"), stage_spec))
        return layers[0] if use.layer == "first" else layers[-1]

    def _outside(self, h: torch.Tensor, at: str) -> torch.Tensor:
        for use in self.spec.outside:
            if use.at != at:
                continue
            if use.no_grad:
                with torch.no_grad():  # a constant, as a distillation target is; h keeps its history
                    delta = _use(self._layer(use), use.kind, h) - h
                h = h + delta
            else:
                h = _use(self._layer(use), use.kind, h)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.spec.inputs == "tokens" else self.inp(x)  # (B, T, C)
        if self.mix is not None:
            h = h + self.mix(h)
        h = self._outside(h, "before")
        aux = torch.zeros_like(h[..., :1])  # (B, T, 1)
        runs = [(getattr(self, f"stage{i}"), stage_spec) for i, stage_spec in enumerate(self.spec.stages)]
        if self.spec.again:
            runs.append((self.again, self.spec.stages[0]))
        for stage, stage_spec in runs:
            with torch.no_grad() if stage_spec.no_grad else contextlib.nullcontext():
                h, extra = run_stage(stage, stage_spec, h) if stage_spec.depth == 1 else stage(h)
            aux = aux + extra
        h = self._outside(h, "after")
        if self.mix is not None:
            h = h + self.mix(h)
        h = h + 0.1 * aux
        h = self.norm(h) if self.norm is not None else F.layer_norm(h, h.shape[-1:])
        if self.spec.head == "matmul":
            return h @ self.embed.weight.T  # (B, T, VOCAB)
        return self.head(h)  # (B, T, VOCAB or OUT_DIM)


def build(spec: TreeSpec) -> TreeModel:
    """The spec's model, with the weights ``torch.manual_seed(spec.seed)`` gives (the global RNG is reseeded)."""
    torch.manual_seed(spec.seed)
    return TreeModel(spec)


def batch(spec: TreeSpec) -> Batch:
    """The whole batch every step trains on: ``x`` and the target ``y``, samples first."""
    gen = torch.Generator().manual_seed(spec.seed)
    if spec.inputs == "tokens":
        return {"x": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
                "y": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)}
    return {"x": torch.randn(BATCH, SEQ, IN_DIM, generator=gen), "y": torch.randn(BATCH, SEQ, OUT_DIM, generator=gen)}


def share(data: Batch, rank: int, world: int) -> Batch:
    """The samples rank ``rank`` of ``world`` trains on."""
    size = BATCH // world
    return {k: v[rank * size:(rank + 1) * size] for k, v in data.items()}


def loss(model: nn.Module, data: Batch) -> torch.Tensor:
    """Mean over the samples: cross entropy over every token, or mean squared error."""
    out = model(data["x"])
    if data["y"].dtype == torch.long:
        return F.cross_entropy(out.reshape(-1, VOCAB), data["y"].reshape(-1))
    return F.mse_loss(out, data["y"])


def spec_from_dict(data: Dict[str, Any]) -> TreeSpec:
    """The spec ``dataclasses.asdict(spec)`` came from (after a JSON round trip: lists for tuples)."""
    stages = tuple(StageSpec(**{**stage, "layer": LayerSpec(**stage["layer"])}) for stage in data["stages"])
    outside = tuple(OutsideUse(**use) for use in data["outside"])
    return TreeSpec(**{**data, "stages": stages, "outside": outside})
