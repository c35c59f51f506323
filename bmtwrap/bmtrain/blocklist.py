"""TransformerBlockList: blocks applied one after another, hidden states threaded through.

Its pipelined subclass, ``PipelineTransformerBlockList``, is in ``pipeline.py``.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Iterable, Iterator, List, Set, Union

import torch
from torch import nn

from .block import Block, BlockSharingError

__all__ = ["TransformerBlockList"]


def _make_blocks(modules: Iterable[nn.Module], list_name: str, *, pipe: bool) -> List[Block]:
    """Blocks for a block list's elements, with BMTrain's rules (checked before anything is built or claimed)."""
    modules = list(modules)
    if not modules:
        raise ValueError(f"{list_name} needs at least one module")
    seen: Set[int] = set()
    for index, module in enumerate(modules):
        if not isinstance(module, nn.Module):
            raise TypeError(f"{list_name} element {index} is a {type(module).__name__}, not an nn.Module")
        if not isinstance(module, Block):
            continue
        owner = module._owner_list() if module._owner_list is not None else None
        if owner is not None:
            raise ValueError(
                f"block {index} ({type(module._module).__name__}) already belongs to another {type(owner).__name__}; "
                "a Block can be in one list only"
            )
        if id(module) in seen:
            raise BlockSharingError(
                f"block {index} ({type(module._module).__name__}) is given twice to one {list_name}; to share "
                "weights across depth, list the plain module twice (each place gets its own Block over the same "
                "parameters)"
            )
        seen.add(id(module))
    blocks: List[Block] = []
    first_of: Dict[int, Block] = {}  # id(plain module) -> its first block in this list
    for module in modules:
        if isinstance(module, Block):
            blocks.append(module)
        elif id(module) in first_of:
            blocks.append(first_of[id(module)]._sharing())
        else:
            first_of[id(module)] = Block(module, mode="PIPE" if pipe else "BLOCK")
            blocks.append(first_of[id(module)])
    return blocks


class TransformerBlockList(nn.Module):
    """A list of :class:`Block` called in sequence (BMTrain's ``TransformerBlockList``).

    Calling ``blocks(*args, **kwargs)`` passes the first ``num_hidden`` positional arguments as
    hidden states: block ``i`` is called as ``block(*outputs, *rest, **kwargs)``, where
    ``outputs`` is everything block ``i - 1`` returned (a tensor counts as one value; the first
    block gets the hidden states) and ``rest`` the other positional arguments, as in BMTrain.
    While block ``i`` computes, block ``i + 1``'s parameters are gathered; in backward, block
    ``i - 1``'s.

    Args:
        modules: blocks, or plain modules (each is wrapped in a :class:`Block` with default
            options). A plain module listed more than once gets one block per place, all over
            the same parameters (weights shared across depth).
        num_hidden: how many leading arguments are hidden states.

    Returns (from a call): the last block's first output (``num_hidden == 1``) or a tuple of its
    first ``num_hidden`` outputs; with ``return_hidden_states=True``, everything the last block
    returned followed by, for each hidden state, the inputs of every block stacked on a new first
    dimension (BMTrain's layout).

    Raises:
        TypeError: an element is not an ``nn.Module``.
        ValueError: a block already belongs to another list; ``num_hidden < 1``; no modules;
            fewer positional arguments than ``num_hidden``; a block returning fewer values.
        BlockSharingError: the same ``Block`` object given twice (a ``ValueError`` that is also
            the ``AssertionError`` BMTrain raises).

    Example::

        blocks = bmt.TransformerBlockList([bmt.Block(Layer()) for _ in range(24)])
        h = blocks(h, mask)                              # num_hidden=1
        h, hs = blocks(h, mask, return_hidden_states=True)
    """

    _pipeline = False  # the pipeline list (pipeline.py) builds its blocks from plain modules with mode="PIPE"

    def __init__(self, modules: Iterable[nn.Module], num_hidden: int = 1) -> None:
        super().__init__()
        if num_hidden < 1:
            raise ValueError(f"num_hidden must be >= 1, got {num_hidden}")
        self.num_hidden = num_hidden
        # Only once every element is checked are the blocks made and claimed.
        blocks = _make_blocks(modules, type(self).__name__, pipe=self._pipeline)
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
            The last block's first output (``num_hidden == 1``) or a tuple of its first
            ``num_hidden`` outputs. With ``return_hidden_states=True``: a tuple of everything the
            last block returned followed by, for each hidden state, the inputs of every block
            stacked on a new first dimension.

        Raises:
            ValueError: fewer positional arguments than ``num_hidden``; a block returning fewer
                than ``num_hidden`` values.
        """
        n = self.num_hidden
        if len(args) < n:
            raise ValueError(f"{type(self).__name__}(num_hidden={n}) needs at least {n} positional arguments, "
                             f"got {len(args)}")
        outputs, rest = tuple(args[:n]), args[n:]
        inputs = []
        for index, block in enumerate(self._modules.values()):
            if return_hidden_states:
                inputs.append(outputs[:n])
            returned = block(*outputs, *rest, **kwargs)
            outputs = returned if isinstance(returned, tuple) else (returned,)
            if len(outputs) < n:
                raise ValueError(
                    f"block {index} returned {len(outputs)} value(s) but num_hidden={n}; "
                    "each block must return its hidden states first"
                )
        if return_hidden_states:
            stacked = tuple(torch.stack([step[i] for step in inputs], dim=0) for i in range(n))
            return outputs + stacked
        return outputs[0] if n == 1 else outputs[:n]
