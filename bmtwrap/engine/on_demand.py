"""Gathering a block's parameters on demand, when code outside the block uses them during a forward.

[Note: parameters used outside their block]
A block's parameters are full only while the block runs. Models do not always keep to that:
a model may call a layer's sub-module itself (``self.layers[0].mlp(x)``), multiply by another
layer's weight (``h * self.layers[-1].norm.weight``), or iterate a container whose layers it
calls one by one. Outside its block such a parameter is this rank's 1-D piece, and torch would
fail deep inside (``weight of shape [0]``) or, worse, broadcast it silently.

So while a model's forward runs (from its outermost root's entry to its exit) the engine holds an
:class:`OnDemandGathers` torch-function mode. Every torch function and tensor method that
receives a sharded parameter of a block, outside that block's run, gets the parameter's full
view instead: the block's group is gathered (once per forward, like the root group: see [Note:
the root group] in runners.py), its views come from the group's ``unshard()`` so that gradients
flow back to its reduce-scatter, and the group is *lent*: pinned gathered until the backward
ends (or the forward ends, without autograd), counted as one more forward expecting gradients.
Inside a block's own run, its parameters are already full views and never reach the mode's work.
Views made without autograd (a use under ``torch.no_grad()``) are constants; a use with autograd
later in the same forward gets views of its own, and the group is lent again, counting that use.

Cost: one Python call per torch operation of the model's forward, looking its arguments (and one
level of lists) up by id among the sharded parameters the registry knows: about a microsecond against
the tens of microseconds an operation on real sizes takes; nothing in backward. The engine's own code
(gathers, views, hooks: about 80 torch calls and tensor attributes a block) is not the model's: while it
runs the mode is off the stack (:meth:`OnDemandGathers.engine_code`), so those calls pay nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode, _push_mode

from .group import ParamGroup, ParamRegistry

__all__ = ["OnDemandGathers"]

# Told of a group gathered on demand in this forward, before its views are made: pins it and
# counts the use (BlockRunner.lend). None for a group no block runs: it cannot be lent.
Lender = Callable[[ParamGroup], bool]


class OnDemandGathers(TorchFunctionMode):
    """The torch-function mode of one forward (see [Note: parameters used outside their block]).

    Args:
        registry: where sharded parameters are looked up.
        group_of: the group holding a sharded parameter's flat buffer.
        lend: pins a group for this forward and its backward; returns ``False`` for a group that
            cannot be lent (not a block's), which then raises.
    """

    def __init__(self, registry: ParamRegistry, group_of: Callable[[Any], Optional[ParamGroup]], lend: Lender) -> None:
        super().__init__()
        self._registry = registry
        self._group_of = group_of
        self._lend = lend
        # (id(sharded parameter), grad enabled) -> its full view in this forward. Views made without
        # autograd are constants: a use with autograd later in the forward needs views of its own.
        self._views: Dict[Tuple[int, bool], torch.Tensor] = {}
        # Groups lent in this forward, and whether with autograd (then kept until the backward ends).
        self.lent: Dict[int, Tuple[ParamGroup, bool]] = {}
        # > 0 while the engine's own code runs (it handles sharded parameters as pieces, on purpose).
        self.paused = 0
        self._off = 0  # engine_code calls that took the mode off the stack and are running
        self._ended = False  # the forward ended while the mode was off: it stays off

    @contextlib.contextmanager
    def pausing(self, paused: bool) -> Iterator[None]:
        """Pause the mode (engine code) or watch again (the model's code) inside the ``with``."""
        saved = self.paused
        self.paused = saved + 1 if paused else 0
        try:
            yield
        finally:
            self.paused = saved

    @contextlib.contextmanager
    def engine_code(self) -> Iterator[None]:
        """The engine's own code runs inside the ``with``: sharded parameters pass as they are. The mode leaves the
        torch-function stack meanwhile when it is on top of it, so that the engine's torch calls do not go through
        Python; under another mode it pauses instead."""
        if _get_current_function_mode() is not self:
            with self.pausing(True):
                yield
            return
        _pop_mode()
        self._off += 1
        try:
            yield
        finally:
            self._off -= 1
            if not self._ended:
                _push_mode(self)

    @contextlib.contextmanager
    def model_code(self) -> Iterator[None]:
        """The model's own code runs inside the ``with`` (within :meth:`engine_code`): the mode watches again, back on
        the stack if the engine's code took it off."""
        if not self._off or _get_current_function_mode() is self:
            with self.pausing(False):
                yield
            return
        _push_mode(self)
        try:
            with self.pausing(False):
                yield
        finally:
            _pop_mode()

    def end(self) -> None:
        """The forward is over: the mode leaves the stack (at once, or when the engine's code that took it off
        returns)."""
        if self._off:
            self._ended = True
        else:
            self.__exit__(None, None, None)

    def __torch_function__(self, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if not self.paused and (self._sharded_in(args) or self._sharded_in(kwargs.values())):
            args = tuple(self._full(a) for a in args)
            kwargs = {k: self._full(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _sharded_in(self, values: Any) -> bool:
        # Runs for every torch call of the forward: a lookup by id, no isinstance of nn.Parameter (whose
        # metaclass check is Python code, a few microseconds a call).
        lookup = self._registry.lookup
        for value in values:
            if isinstance(value, (list, tuple)):
                if any(lookup(v) is not None for v in value):
                    return True
            elif lookup(value) is not None:
                return True
        return False

    def _full(self, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(self._full(v) for v in value)
        if not isinstance(value, nn.Parameter) or self._registry.lookup(value) is None:
            return value
        key = (id(value), torch.is_grad_enabled())
        view = self._views.get(key)
        if view is None:
            self._gather_for(value)
            view = self._views[key]
        return view

    def _gather_for(self, param: nn.Parameter) -> None:
        found = self._registry.lookup(param)
        assert found is not None
        group = self._group_of(found[0])
        if group is None or not self._lend(group):
            raise RuntimeError(
                f"a parameter of {found[0].label} ('{found[0].slots[found[1]].name}') is used outside the module that "
                "gathers it, and bmtwrap cannot gather it there; pass this module to bmtwrap.wrap(layers=...) "
                "so that it becomes a block of its own, or keep the parameter out of the blocks"
            )
        grad = torch.is_grad_enabled()
        _, with_grad = self.lent.get(id(group), (group, False))
        self.lent[id(group)] = (group, with_grad or grad)
        self.paused += 1
        try:
            views = group.unshard()
        finally:
            self.paused -= 1
        for slot, view in zip(group.slots, views):
            self._views[(id(slot.param), grad)] = view
