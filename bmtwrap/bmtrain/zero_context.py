"""BMTrain's ``ZeroContext``: a block's parameters at full shape for the duration of a ``with``.

``with ZeroContext(block):`` gathers the block's group and shows every module inside the block its
full-shaped parameters (``block.linear.weight`` is the whole matrix), then hides and releases them
(unless the engine had them gathered already). The full views are detached copies' views: reading
them is the point; writes to them are not kept (BMTrain's context keeps none either). Use
:func:`bmtwrap.full_state_dict` or ``load_state_dict`` to read or set values for good.
BMTrain 0.2's name of it, ``CheckpointBlockContext``, is the same class.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Optional, Type

from .block import Block

__all__ = ["CheckpointBlockContext", "ZeroContext"]


class ZeroContext:
    """Show a :class:`~bmtwrap.Block`'s parameters at full shape inside a ``with`` (BMTrain's name).

    A collective: every rank enters it for the same block.

    Args:
        block: the block whose parameters to gather.
        ctx_dict: BMTrain's store for ZeRO-2 reuse between calls; must be ``None``.
        pipe: BMTrain's flag for its own pipeline internals; must be ``False`` (bmtwrap's pipeline gathers a
            stage's blocks by itself).

    Raises:
        TypeError: ``block`` is not a :class:`~bmtwrap.Block`.
        NotImplementedError: ``ctx_dict`` or ``pipe`` given.

    Example::

        with bmt.zero_context.ZeroContext(block):
            print(block.linear.weight.shape)   # the full shape
    """

    def __init__(self, block: Block, ctx_dict: Optional[dict] = None, pipe: bool = False) -> None:
        if not isinstance(block, Block):
            raise TypeError(f"ZeroContext expects a bmtwrap Block, got {type(block).__name__}")
        if ctx_dict is not None or pipe:
            raise NotImplementedError("ZeroContext's ctx_dict and pipe arguments belong to BMTrain's pipeline; "
                                      "bmtwrap gathers a block by itself")
        self.block = block
        self._release_after = False
        self._entered = False

    def enter(self, flag: int = 0, requires_grad: bool = False) -> None:
        """Gather the block and show full-shaped views of its parameters (``flag``, ``requires_grad``: BMTrain's,
        unused)."""
        assert not self._entered, "ZeroContext entered twice"
        group = self.block.runner.group
        self._release_after = not group.gathered
        group.ensure_gathered()
        group.swap_in([view.detach() for buffer in group.buffers for view in buffer.views()])
        self._entered = True

    def exit(self, flag: int = 0, backward: bool = False) -> None:
        """Show the sharded parameters again and release what :meth:`enter` gathered."""
        if not self._entered:
            return
        group = self.block.runner.group
        group.swap_out()
        if self._release_after:
            group.release()
        self._entered = False

    def __enter__(self) -> "ZeroContext":
        self.enter()
        return self

    def __exit__(self, kind: Optional[Type[BaseException]], error: Optional[BaseException],
                 trace: Optional[TracebackType]) -> Any:
        self.exit()
        return None


CheckpointBlockContext = ZeroContext
"""BMTrain 0.2's name of :class:`ZeroContext` (the same class)."""
