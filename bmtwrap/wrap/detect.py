"""Finding the modules that become blocks: repeated layers, or pieces of a large model by size.

Rules, in order:
1. A user policy: explicit layer classes (classes or class names), or a callable
   ``policy(qualified_name, module) -> bool``.
2. Repeated layers: a module whose class a Hugging Face model names in ``_no_split_modules``
   where the model holds at least two modules of that class (BERT and ViT name their embeddings
   there, which occur once and are no layer), or a module that is a ``GradientCheckpointingLayer``
   (HF's per-layer base class: a one-layer model keeps its layer as a block); and the children of
   an ``nn.ModuleList`` / ``nn.Sequential`` when at least two of them share a class and hold
   parameters. Children may differ in parameter shapes (T5's first block, dense-then-MoE stacks):
   each is its own block.
3. Nothing repeated: the model is cut by size, so that a large one still shards in pieces.
Nested candidates resolve to the outermost one (a decoder layer, not the experts inside it).
A block is a module that is called: containers without a forward of their own (``nn.ModuleList``,
``nn.ModuleDict``) are never chosen; their children are. A module that is chosen but then only
iterated, or whose parameters other code reads, still works: see [Note: parameters used outside
their block] in ``bmtwrap/engine/on_demand.py``.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, List, Optional, Sequence, Set, Tuple, Type, Union

from torch import nn

__all__ = ["LayerPolicy", "callable_module", "find_blocks"]

LayerPolicy = Union[Sequence[Union[str, Type[nn.Module]]], Callable[[str, nn.Module], bool]]

# A model cut by size aims at this many blocks: enough that one gathered block is a small part of
# the model, few enough that each collective is large.
SIZE_GROUPS = 8


def callable_module(module: nn.Module) -> bool:
    """Whether calling ``module`` runs a forward of its own (``nn.ModuleList``/``ModuleDict`` have none)."""
    return type(module).forward is not nn.Module.forward


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _outermost(named: List[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
    """Keep the candidates no other candidate contains, in their given order."""
    names = {n for n, _ in named}

    def nested(name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:i]) in names for i in range(1, len(parts)))

    return [(n, m) for n, m in named if not nested(n)]


def _hf_layer_classes(model: nn.Module) -> Set[str]:
    """The classes named in ``_no_split_modules`` of which the model holds at least two modules with parameters.

    ``_no_split_modules`` tells accelerate what not to cut across devices, which is not only the
    layers: a class that occurs once (BERT's and ViT's embeddings) would make a block that nothing
    repeats, gathered and released on its own for no saving over the root.
    """
    named: Set[str] = set()
    for module in model.modules():
        named.update(getattr(module, "_no_split_modules", None) or ())
    counts = Counter(type(m).__name__ for m in model.modules() if type(m).__name__ in named and _param_count(m) > 0)
    return {name for name, count in counts.items() if count >= 2}


def _is_checkpointing_layer(module: nn.Module) -> bool:
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__[1:])


def _repeated_children(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    found = []
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = [(f"{name}.{k}" if name else k, c) for k, c in container.named_children()]
        with_params = [(n, c) for n, c in children if _param_count(c) > 0 and callable_module(c)]
        classes = [type(c) for _, c in with_params]
        repeated = {cls for cls in classes if classes.count(cls) >= 2}
        found.extend((n, c) for n, c in with_params if type(c) in repeated)
    return found


def _by_size(model: nn.Module, target: int) -> List[Tuple[str, nn.Module]]:
    """Descend from the root; a module at most ``target`` parameters large becomes a block."""
    chosen: List[Tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            qualified = f"{name}.{child_name}" if name else child_name
            size = _param_count(child)
            if size == 0:
                continue
            leaf = not any(_param_count(g) for g in child.children())
            if (size <= target and callable_module(child)) or leaf:
                chosen.append((qualified, child))
            else:
                visit(qualified, child)

    visit("", model)
    return chosen


def _resolve_classes(model: nn.Module, classes: Sequence[Union[str, Type[nn.Module]]]) -> Set[str]:
    present = {type(m).__name__ for m in model.modules()}
    wanted = set()
    for cls in classes:
        name = cls if isinstance(cls, str) else getattr(cls, "__name__", None)
        if not isinstance(name, str):
            raise TypeError(f"layer classes must be classes or class names, got {cls!r}")
        if name not in present:
            raise ValueError(
                f"layer class {name!r} is not in this model; its module classes include "
                f"{sorted(present)[:12]}{' …' if len(present) > 12 else ''}"
            )
        wanted.add(name)
    return wanted


def _callable_only(named: List[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
    for name, module in named:
        if not callable_module(module):
            raise ValueError(
                f"layers chose '{name}' ({type(module).__name__}), which has no forward of its own: a block must be a "
                "module that is called; choose the layers inside it (their class, or a policy that picks them)"
            )
    return named


def find_blocks(model: nn.Module, policy: Optional[LayerPolicy] = None) -> Tuple[List[Tuple[str, nn.Module]], str]:
    """The modules to make blocks of, in module order, and which rule chose them.

    Raises:
        ValueError: ``policy`` names a class that is not in the model.
        TypeError: ``policy`` is neither a sequence of classes / names nor a callable.
    """
    named = [(n, m) for n, m in model.named_modules() if n]
    if callable(policy) and not isinstance(policy, type):
        return _callable_only(_outermost([(n, m) for n, m in named if policy(n, m)])), "policy"
    if policy is not None:
        if isinstance(policy, (str, type)):
            policy = [policy]
        if not isinstance(policy, Sequence):
            raise TypeError(f"layers must be a list of classes or class names, or a callable; got {type(policy).__name__}")
        wanted = _resolve_classes(model, policy)
        return _callable_only(_outermost([(n, m) for n, m in named if type(m).__name__ in wanted])), "classes"

    hinted = _hf_layer_classes(model)
    picked = [(n, m) for n, m in named
              if (type(m).__name__ in hinted or _is_checkpointing_layer(m)) and _param_count(m) > 0]
    picked += _repeated_children(model)
    if picked:
        unique = {id(m): (n, m) for n, m in reversed(picked)}
        ordered = [(n, m) for n, m in named if id(m) in unique]
        return _outermost(ordered), "repeated layers"
    total = _param_count(model)
    if total == 0:
        return [], "no parameters"
    return _by_size(model, max(1, total // SIZE_GROUPS)), "size"
