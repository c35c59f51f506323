"""init_parameters on sharded DistributedParameters equals initialising each full tensor in one process.

The model mixes every placement init_parameters has to handle: DistributedParameters on the root
DistributedModule (lone shards), inside Blocks of a TransformerBlockList (re-laid into the blocks'
flat buffers, several dtypes and a frozen one per block), inside a plain child module, a tied one
registered twice, a 0-d one, an empty one, ones smaller than the world, and ones without an
init_method that keep their constructor data. Plain nn.Linear parameters inside the blocks are
not DistributedParameters: init_parameters leaves them as constructed.

The reference is written out by hand, not read from the model: ``torch.manual_seed(seed)``, then
in module order (pre-order, root first) and parameter registration order,
``t = torch.empty(shape, dtype); init_method(t)``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

import bmtwrap as bmt
from bmtwrap.engine.schedule import engine
from common import run

BUILD_SEED = 4321  # RNG state while the model is built (only the plain nn.Linear layers draw from it)
NUM_BLOCKS = 3
Init = Optional[Callable[[torch.Tensor], Any]]

# One entry per DistributedParameter, in the order init_parameters must visit them:
# (state-dict key inside its owner, shape, dtype, init_method, constructor data or None).
ROOT_SPECS: List[Tuple[str, Tuple[int, ...], torch.dtype, Init, Optional[torch.Tensor]]] = [
    ("embed", (50, 24), torch.float32, functools.partial(nn.init.normal_, std=0.02), None),
    ("scalar", (), torch.float32, nn.init.uniform_, None),  # 0-d
    ("gate", (1,), torch.float32, None, torch.full((1,), 0.75)),  # no init_method: keeps its data
    ("fp16", (3, 40), torch.float16, functools.partial(nn.init.uniform_, a=-2.0, b=2.0), None),
    ("empty", (0, 5), torch.float32, nn.init.normal_, None),  # no elements
    ("tiny", (2,), torch.float32, functools.partial(nn.init.normal_, mean=1.0), None),  # smaller than the world
]
INNER_SPECS = [
    ("w", (37, 29), torch.float32, nn.init.xavier_normal_, None),  # split over every rank
    ("b", (3,), torch.float32, functools.partial(nn.init.normal_, std=0.5), None),  # smaller than the world
    ("h", (33, 17), torch.bfloat16, nn.init.normal_, None),  # a second flat buffer in the block
    ("keep", (4, 5), torch.float32, None, torch.arange(20.0).reshape(4, 5) - 7),  # keeps its data
    ("one", (1,), torch.bfloat16, nn.init.ones_, None),
]
SUB_SPECS = [  # Inner.sub: a child module inside the block
    ("u", (5, 7), torch.float32, functools.partial(nn.init.uniform_, a=-1.0, b=1.0), None),
    ("frozen", (6, 6), torch.float32, functools.partial(nn.init.kaiming_uniform_, a=math.sqrt(5)), None),
]
HEAD_SPECS = [  # a plain child of the root (not a block); its weight is the root's embed, tied
    ("bias", (50,), torch.float32, nn.init.uniform_, None),
]


def _make(spec, requires_grad: bool = True) -> bmt.DistributedParameter:
    _, shape, dtype, init, data = spec
    value = data.to(dtype) if data is not None else torch.empty(shape, dtype=dtype)
    return bmt.DistributedParameter(value, requires_grad=requires_grad, init_method=init)


class Sub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for spec in SUB_SPECS:
            setattr(self, spec[0], _make(spec, requires_grad=spec[0] != "frozen"))


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for spec in INNER_SPECS:
            setattr(self, spec[0], _make(spec))
        self.sub = Sub()
        self.lin = nn.Linear(6, 6)  # plain parameters, drawn at construction


class Head(nn.Module):
    def __init__(self, tied: bmt.DistributedParameter) -> None:
        super().__init__()
        self.weight = tied  # registered a second time: initialised once, at its first place
        for spec in HEAD_SPECS:
            setattr(self, spec[0], _make(spec))


class Model(bmt.DistributedModule):
    def __init__(self, zero_level: int) -> None:
        super().__init__()
        for spec in ROOT_SPECS:
            setattr(self, spec[0], _make(spec))
        self.layers = bmt.TransformerBlockList([bmt.Block(Inner(), zero_level=zero_level) for _ in range(NUM_BLOCKS)])
        self.head = Head(self.embed)


def build(zero_level: int = 3) -> Model:
    torch.manual_seed(BUILD_SEED)
    return Model(zero_level)


def reference(seed: int) -> Dict[str, torch.Tensor]:
    """Every tensor of the model, initialised in one process with no bmtwrap involved."""

    def draw(spec) -> torch.Tensor:
        _, shape, dtype, init, data = spec
        if init is None:
            return data.to(dtype).clone()
        t = torch.empty(shape, dtype=dtype)
        init(t)
        return t

    # The plain Linear layers come from the build-time RNG, one per block, in construction order.
    torch.manual_seed(BUILD_SEED)
    linears = [nn.Linear(6, 6) for _ in range(NUM_BLOCKS)]

    torch.manual_seed(seed)
    out: Dict[str, torch.Tensor] = {}
    for spec in ROOT_SPECS:  # the root's own parameters come first (pre-order)
        out[spec[0]] = draw(spec)
    for i in range(NUM_BLOCKS):  # then layers -> Block i -> Inner -> its own, then Inner.sub
        for spec in INNER_SPECS:
            out[f"layers.{i}.{spec[0]}"] = draw(spec)
        for spec in SUB_SPECS:
            out[f"layers.{i}.sub.{spec[0]}"] = draw(spec)
        out[f"layers.{i}.lin.weight"] = linears[i].weight.detach().clone()
        out[f"layers.{i}.lin.bias"] = linears[i].bias.detach().clone()
    out["head.weight"] = out["embed"]  # tied: no draw of its own
    for spec in HEAD_SPECS:
        out[f"head.{spec[0]}"] = draw(spec)
    return out


def _local_pieces_match(model: nn.Module, ref: Dict[str, torch.Tensor]) -> Dict[str, bool]:
    """Whether every rank's own piece of each parameter equals its slice of the reference.

    Checks the shards directly, without the gather full_state_dict does; all-reduced over ranks.
    """
    eng = engine()
    names = list(model.state_dict(keep_vars=True).items())
    flags = []
    for name, param in names:
        buffer, index = eng.registry.buffer_of(eng.ctx, param)
        piece = buffer.layout.piece(index, eng.ctx.rank)
        expected = ref[name].reshape(-1)[piece.param_start : piece.param_end]
        flags.append(param.dim() == 1 and torch.equal(param.detach().cpu(), expected))
    agreed = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
    return {name: bool(ok) for (name, _), ok in zip(names, agreed.tolist())}


def _compare(model: nn.Module, seed: int) -> Dict[str, Any]:
    ref = reference(seed)
    local = _local_pieces_match(model, ref)
    full = bmt.full_state_dict(model)
    params: Dict[str, Any] = {}
    for key, expected in ref.items():
        got = full.get(key)
        entry: Dict[str, Any] = {"shape": list(expected.shape), "dtype": str(expected.dtype),
                                 "local_equal": local.get(key, False)}
        if got is None:
            entry.update(equal=False, max_abs=None, missing=True)
        else:
            got = got.cpu()
            same_kind = got.shape == expected.shape and got.dtype == expected.dtype
            entry["equal"] = bool(same_kind and torch.equal(got, expected))
            entry["got_shape"], entry["got_dtype"] = list(got.shape), str(got.dtype)
            entry["max_abs"] = ((got.double().reshape(-1) - expected.double().reshape(-1)).abs().max().item()
                                if same_kind and expected.numel() else 0.0)
        entry["drawn_nonzero"] = bool(expected.numel() == 0 or expected.abs().sum().item() > 0)
        params[key] = entry
    return {"keys": sorted(full), "ref_keys": sorted(ref), "params": params}


def init_once(seed: int, zero_level: int = 3) -> Dict[str, Any]:
    model = build(zero_level)
    torch.manual_seed(seed)
    bmt.init_parameters(model)
    return _compare(model, seed)


def init_twice(first: int, second: int) -> Dict[str, Any]:
    """A second init_parameters (after a gather of the first values) overwrites every piece."""
    model = build()
    torch.manual_seed(first)
    bmt.init_parameters(model)
    bmt.full_state_dict(model)
    torch.manual_seed(second)
    bmt.init_parameters(model)
    return _compare(model, second)


CASES = {
    "seed_0": lambda: init_once(0),
    "seed_1234_zero2": lambda: init_once(1234, zero_level=2),
    "reinit_7_after_99": lambda: init_twice(99, 7),
}

if __name__ == "__main__":
    run(CASES)
