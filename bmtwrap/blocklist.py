"""TransformerBlockList: blocks applied one after another, hidden states threaded through."""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Iterator, Tuple, Union

import torch
from torch import nn

from .block import Block

__all__ = ["PipelineTransformerBlockList", "TransformerBlockList"]


class TransformerBlockList(nn.Module):
    """A list of :class:`Block` called in sequence (BMTrain's ``TransformerBlockList``).

    Calling ``blocks(*args, **kwargs)`` passes the first ``num_hidden`` positional arguments as
    hidden states: block ``i`` is called as ``block(*hidden, *rest, **kwargs)`` and must return
    ``num_hidden`` tensors (one tensor when ``num_hidden == 1``), which become the hidden states
    of block ``i + 1``. The other arguments reach every block unchanged. While block ``i``
    computes, block ``i + 1``'s parameters are gathered; in backward, block ``i - 1``'s.

    Args:
        modules: blocks, or plain modules (each is wrapped in a :class:`Block` with default
            options). The same block may appear more than once (weights shared across depth).
        num_hidden: how many leading arguments are hidden states.

    Returns (from a call): the last hidden state (``num_hidden == 1``) or a tuple of them;
    with ``return_hidden_states=True``, the block outputs followed by, for each hidden state, the
    inputs of every block stacked on a new first dimension (BMTrain's layout).

    Raises:
        TypeError: an element is not an ``nn.Module``.
        ValueError: a block already belongs to another list; ``num_hidden < 1``; fewer
            positional arguments than ``num_hidden``; a block returning the wrong count.

    Example::

        blocks = bmt.TransformerBlockList([bmt.Block(Layer()) for _ in range(24)])
        h = blocks(h, mask)                              # num_hidden=1
        h, hs = blocks(h, mask, return_hidden_states=True)
    """

    def __init__(self, modules: Iterable[nn.Module], num_hidden: int = 1) -> None:
        super().__init__()
        if num_hidden < 1:
            raise ValueError(f"num_hidden must be >= 1, got {num_hidden}")
        self.num_hidden = num_hidden
        modules = list(modules)
        for index, module in enumerate(modules):
            if not isinstance(module, nn.Module):
                raise TypeError(f"TransformerBlockList element {index} is a {type(module).__name__}, not an nn.Module")
            owner = module._owner_list() if isinstance(module, Block) and module._owner_list is not None else None
            if owner is not None:
                raise ValueError(
                    f"block {index} ({type(module._module).__name__}) already belongs to another TransformerBlockList; "
                    "a Block can be in one list only (to share weights, repeat it inside one list)"
                )
        if not modules:
            raise ValueError("TransformerBlockList needs at least one module")
        # Only now, with every element checked, are the blocks made and claimed.
        blocks = [m if isinstance(m, Block) else Block(m) for m in modules]
        for index, block in enumerate(blocks):
            block._owner_list = weakref.ref(self)
            self.add_module(str(index), block)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Block]:
        return iter(self._modules.values())

    def __getitem__(self, index: Union[int, str]) -> Block:
        if isinstance(index, int) and index < 0:
            index += len(self)
        return self._modules[str(index)]

    def forward(self, *args: Any, return_hidden_states: bool = False, **kwargs: Any) -> Any:
        """Call the blocks in sequence, threading the hidden states through them.

        Args:
            *args: the ``num_hidden`` hidden states, then arguments every block gets unchanged.
            return_hidden_states: also return the inputs of every block (BMTrain's layout).
            **kwargs: passed to every block unchanged.

        Returns:
            The last block's hidden state (``num_hidden == 1``) or a tuple of its ``num_hidden``
            hidden states. With ``return_hidden_states=True``: a tuple of everything the last block
            returned followed by, for each hidden state, the inputs of every block stacked on a
            new first dimension.

        Raises:
            ValueError: fewer positional arguments than ``num_hidden``; a block returning fewer
                than ``num_hidden`` values.
        """
        n = self.num_hidden
        if len(args) < n:
            raise ValueError(f"TransformerBlockList(num_hidden={n}) needs at least {n} positional arguments, got {len(args)}")
        hidden, rest = args[:n], args[n:]
        inputs = []
        for index, block in enumerate(self._modules.values()):
            if return_hidden_states:
                inputs.append(hidden)
            outputs = block(*hidden, *rest, **kwargs)
            hidden = outputs if isinstance(outputs, tuple) else (outputs,)
            if len(hidden) < n:
                raise ValueError(
                    f"block {index} returned {len(hidden)} value(s) but num_hidden={n}; "
                    "each block must return its hidden states first"
                )
            last: Tuple[Any, ...] = hidden
            hidden = hidden[:n]
        if return_hidden_states:
            stacked = tuple(torch.stack([step[i] for step in inputs], dim=0) for i in range(n))
            return tuple(last) + stacked
        return hidden[0] if n == 1 else tuple(hidden)


class PipelineTransformerBlockList(TransformerBlockList):
    """BMTrain's pipelined block list; here a :class:`TransformerBlockList` (pipeline size 1).

    BMTrain runs a ``PipelineTransformerBlockList`` as a plain block list when its pipeline size
    is 1, its default. bmtwrap has no pipeline parallelism (``init_distributed(pipe_size>1)``
    raises), so this is always that case: the blocks are sharded over all ranks and called in
    sequence.

    Args:
        modules: blocks or plain modules, as for :class:`TransformerBlockList`.
        num_hidden: how many leading arguments are hidden states.

    Raises:
        TypeError: an element is not an ``nn.Module``.
        ValueError: as :class:`TransformerBlockList`.

    Example::

        blocks = bmt.PipelineTransformerBlockList([bmt.Block(Layer()) for _ in range(24)])
    """

    def __init__(self, modules: Iterable[nn.Module], num_hidden: int = 1) -> None:
        super().__init__(modules, num_hidden=num_hidden)

